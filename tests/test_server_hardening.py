"""Security and availability of the built-in server (`grail-serve`), over real HTTP: the API key
on every route and the harness's own random key, request-size and work limits that answer at once
with the flag to change, an event loop that keeps answering /health while a large body arrives and
is parsed, and `--model tiny` (issue 13, points 1, 2, 3 and 16).

Two servers run for the module, started side by side: one started as `--model tiny` (batch size
16, `--max-request-tokens 65536`), one with the default limits of a small engine
(`--max-batch-size 4`) but a small queue (`--max-queued-seqs 8`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers import forked
from helpers.builtin_server import (
    API_KEY,
    AUTH,
    NAME,
    ServerProcess,
    require_batch_invariance,
    side_by_side,
)

from grail.core.config import Config, GenerationConfig
from grail.models.tiny import ensure_tiny_model, resolve_model
from grail.train.components import server_manager_from_config

JSON = {**AUTH, "Content-Type": "application/json"}
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
# /health must answer within this while a large request is received and parsed. Parsing a body
# at the limit holds Python's GIL for ~0.2 s on an idle core (JSON decoding runs in C, whichever
# thread runs it); the bound leaves room for a 2-core machine shared with other jobs.
HEALTH_BOUND_S = 2.0


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    small_queue = ("--max-batch-size", "4", "--max-queued-seqs", "8")
    with side_by_side(
        tmp_path_factory.mktemp("logs"),
        tiny=("tiny", ("--api-key", API_KEY, "--max-request-tokens", "65536")),
        small=(tiny_model_dir, ("--api-key", API_KEY, *small_queue)),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["tiny"]


def post(server: ServerProcess, body: Any, route: str = "/v1/completions", **kw: Any) -> Any:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    kw.setdefault("timeout", 30)
    return httpx.post(f"{server.url}{route}", content=content, headers=JSON, **kw)


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert error["code"] == status
    return error


def serves(server: ServerProcess) -> None:
    """The server still answers a small completion."""
    resp = post(server, {"prompt": [5, 6, 7], "max_tokens": 2, "seed": 0})
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 1, resp.text


def while_probing_health(server: ServerProcess, call: Callable[[], Any]) -> tuple[Any, float]:
    """Run `call` in a thread while polling /health; (its result, the slowest /health answer).
    A /health that does not answer within the bound fails at once (its timeout)."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = call()
        except BaseException as exc:  # re-raised below, in the test's thread
            result["error"] = exc

    worker = threading.Thread(target=run)
    worker.start()
    slowest = 0.0
    try:
        with httpx.Client(timeout=HEALTH_BOUND_S) as http:
            while worker.is_alive():
                t0 = time.perf_counter()
                assert http.get(f"{server.url}/health").status_code == 200
                slowest = max(slowest, time.perf_counter() - t0)
                time.sleep(0.02)
    finally:
        worker.join(120)
    if "error" in result:
        raise result["error"]
    return result["value"], slowest


# --------------------------------------------------------------------------- 1: the API key


def test_the_harness_starts_its_builtin_server_with_a_random_key_and_sends_it(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """grail-train's server (server_manager_from_config) gets a key of its own, different every
    run; the manager's control calls send it, requests without it are refused, and it is in no
    log and not on the server's command line, which `ps` shows every user of the machine (it
    was, as --api-key): it goes by the environment. (The rollout client sends it too:
    tests/test_server_rollouts.py runs on such servers.)"""
    cfg = Config(generation=GenerationConfig(server_threads=1))
    weights = tmp_path / "weights"
    shutil.copytree(tiny_model_dir, weights)
    server = server_manager_from_config(cfg, weights, tmp_path / "run", cuda_available=False)
    other = server_manager_from_config(cfg, weights, tmp_path / "other", cuda_available=False)
    key = server.api_key
    assert key and len(key) >= 32 and key != other.api_key
    with server:
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode()
        assert "grail.inference.builtin.server" in cmdline
        assert key not in cmdline and "--api-key" not in cmdline
        update = f"{server.root_url}/update_weights_from_disk"
        assert httpx.post(update, json={"model_path": str(weights)}).status_code == 401
        assert httpx.get(f"{server.base_url}/models").status_code == 401
        result = server.sync_weights(weights, fallback=False)
        assert (result.mode_used, result.fell_back) == ("in_place", False)
        headers = {"Authorization": f"Bearer {key}"}
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        resp = httpx.post(f"{server.base_url}/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
    log = server.log_path.read_text()
    assert "# command:" in log and key not in log


def test_without_a_key_grail_serve_refuses_a_network_address(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The finding: `grail-serve --host 0.0.0.0` without a key served every route to the network,
    and one POST /update_weights_from_disk replaced the weights with zeros. Now it refuses to
    start, in one line, before loading anything; a key (--api-key or $GRAIL_API_KEY), a loopback
    address or --insecure-no-api-key lets it start."""
    from grail.inference.builtin import server as serve

    monkeypatch.delenv("GRAIL_API_KEY", raising=False)
    for host in ("0.0.0.0", "::", "192.168.1.7", "myhost.example"):
        assert serve.main(["--model", "/no/such/model", "--host", host]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"refusing to serve on --host {host} without an API key" in err
        assert "GRAIL_API_KEY" in err and "--insecure-no-api-key" in err

    def refused(*argv: str) -> str | None:
        args = serve.parse_args(["--model", "tiny", *argv])
        return serve.check_exposure(args.host, serve.api_key(args), args.insecure_no_api_key)

    assert refused("--host", "0.0.0.0") is not None
    for host in ("127.0.0.1", "127.0.0.2", "localhost", "::1", "::ffff:127.0.0.1"):
        assert refused("--host", host) is None, host
    assert refused("--host", "0.0.0.0", "--api-key", "k") is None
    assert refused("--host", "0.0.0.0", "--insecure-no-api-key") is None
    monkeypatch.setenv("GRAIL_API_KEY", "from-env")
    assert serve.api_key(serve.parse_args(["--model", "tiny"])) == "from-env"
    assert serve.api_key(serve.parse_args(["--model", "tiny", "--api-key", "k"])) == "k"
    assert refused("--host", "0.0.0.0") is None
    monkeypatch.setenv("GRAIL_API_KEY", "")  # set but empty: no key
    assert refused("--host", "0.0.0.0") is not None
    assert serve.main(["--model", "/no/such/model", "--api-key", " "]) == 2
    assert capsys.readouterr().err == "grail-serve: --api-key must not be blank\n"


def test_without_a_key_the_weight_routes_answer_this_machine_only(
    tiny_model_dir: Path,
) -> None:
    """Whatever address a server without a key listens on (--insecure-no-api-key), a request
    from another machine to a weight route gets 403 and the weights stay; generation is open,
    and the same request from loopback, or from anywhere with a key, goes through."""
    from fastapi.testclient import TestClient

    from grail.inference.builtin.app import STATE_ROUTES, create_app
    from grail.inference.builtin.engine import Engine

    engine = Engine(tiny_model_dir)
    reload = {"model_path": str(tiny_model_dir), "weight_version": "new"}
    completion = {"prompt": [5, 6, 7], "max_tokens": 2}
    keyless, keyed = create_app(engine, NAME), create_app(engine, NAME, API_KEY)
    with TestClient(keyless, client=("10.1.2.3", 50000)) as remote:  # starts the engine
        for route in STATE_ROUTES:
            resp = remote.post(route, json=reload)
            assert resp.status_code == 403, resp.text
            assert "no API key" in resp.json()["error"]["message"]
        assert engine.weight_version != "new"
        assert remote.post("/v1/completions", json=completion).status_code == 200
        with_key = TestClient(keyed, client=("10.1.2.3", 50000))
        assert with_key.post(STATE_ROUTES[0], json=reload).status_code == 401
        resp = with_key.post(STATE_ROUTES[0], json=reload, headers=AUTH)
        assert resp.status_code == 200 and engine.weight_version == "new", resp.text
        local = TestClient(keyless, client=("127.0.0.1", 50000))
        resp = local.post(STATE_ROUTES[0], json={**reload, "weight_version": "local"})
        assert resp.status_code == 200 and engine.weight_version == "local", resp.text


# --------------------------------------------------------------------------- 2: body size, loop


def test_a_50mb_body_gets_413_before_it_is_read(server: ServerProcess) -> None:
    """With a Content-Length, and chunked (no length: counted while read). Before the limit, a
    50 MB text prompt held the event loop (tokenizing) for over a minute."""
    body = b'{"prompt": "' + b"a" * (50 * 2**20) + b'"}'
    t0 = time.perf_counter()
    resp = post(server, body, timeout=10)
    elapsed = time.perf_counter() - t0
    error = error_of(resp, 413)
    assert "--max-request-bytes" in error["message"]
    assert str(DEFAULT_MAX_REQUEST_BYTES) in error["message"]
    assert elapsed < 5, elapsed

    chunks = (body[i : i + 2**20] for i in range(0, len(body), 2**20))
    resp = httpx.post(f"{server.url}/v1/completions", content=chunks, headers=JSON, timeout=10)
    assert "--max-request-bytes" in error_of(resp, 413)["message"]
    serves(server)


def test_a_client_that_uploads_before_reading_gets_the_413_not_a_reset(
    server: ServerProcess,
) -> None:
    """urllib sends the whole body, then reads: an early 413 followed by the connection closing
    reached it as a connection reset (BrokenPipeError / ConnectionResetError) and no message."""
    body = b'{"prompt": "' + b"a" * (20 * 2**20) + b'"}'
    request = urllib.request.Request(
        f"{server.url}/v1/completions", data=body, headers=JSON, method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(request, timeout=30)
    assert answer.value.code == 413
    assert "--max-request-bytes" in json.loads(answer.value.read())["error"]["message"]
    serves(server)


def test_health_answers_while_large_bodies_arrive_and_are_parsed(server: ServerProcess) -> None:
    """Bodies under the limit that used to hold the event loop for tens of seconds: a million
    wrong elements (pydantic built an error for each, per branch of the prompt's union) and a
    5 MB text prompt (tokenized on the event loop); and a body that arrives slowly."""
    floats = json.dumps({"prompt": [1.5] * 1_000_000, "max_tokens": 1}).encode()
    assert 4 * 2**20 < len(floats) < DEFAULT_MAX_REQUEST_BYTES
    resp, slowest = while_probing_health(server, lambda: post(server, floats))
    assert error_of(resp, 400)["param"] == "prompt"
    assert slowest < HEALTH_BOUND_S

    text = json.dumps({"prompt": "Repeat: 7 " * 500_000, "max_tokens": 1}).encode()
    t0 = time.perf_counter()
    resp, slowest = while_probing_health(server, lambda: post(server, text))
    error = error_of(resp, 400)
    assert "prompt 0 has 5000000 characters" in error["message"] and "context" in error["message"]
    assert time.perf_counter() - t0 < 5 and slowest < HEALTH_BOUND_S

    ids = json.dumps({"prompt": [[7] * 500] * 200, "max_tokens": 1}).encode()

    def slowly() -> Iterator[bytes]:
        for i in range(0, len(ids), len(ids) // 20 + 1):
            time.sleep(0.05)
            yield ids[i : i + len(ids) // 20 + 1]

    resp, slowest = while_probing_health(
        server,
        lambda: httpx.post(f"{server.url}/v1/completions", content=slowly(), headers=JSON),
    )
    assert resp.status_code == 200 and len(resp.json()["choices"]) == 200
    assert slowest < HEALTH_BOUND_S
    serves(server)


# --------------------------------------------------------------------------- 3: work limits


def test_n_100000_is_refused_at_once_naming_the_limit(server: ServerProcess) -> None:
    t0 = time.perf_counter()
    resp = post(server, {"prompt": [5, 6, 7], "n": 100_000, "max_tokens": 16}, timeout=10)
    error = error_of(resp, 400)
    assert time.perf_counter() - t0 < 2
    assert error["param"] == "n" and "--max-n 1024" in error["message"]
    assert "n=100000" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "n": 100_000, "max_tokens": 2}
    error = error_of(post(server, chat, "/v1/chat/completions", timeout=10), 400)
    assert error["param"] == "n" and "--max-n" in error["message"]
    serves(server)


@pytest.mark.parametrize(
    ("name", "body", "says"),
    [
        ("small", {"prompt": [5, 6, 7], "n": 8, "max_tokens": 600}, "1 prompt(s) x n=8"),
        ("small", {"prompt": [[5], [6]], "n": 4, "max_tokens": 600}, "2 prompt(s) x n=4"),
        ("tiny", {"prompt": [5, 6, 7], "n": 100, "max_tokens": 1000}, "1 prompt(s) x n=100"),
    ],
    ids=["n x max_tokens", "prompts x n x max_tokens", "set by the flag"],
)
def test_tokens_one_request_may_generate_are_bounded(
    servers: dict[str, ServerProcess], name: str, body: dict[str, Any], says: str
) -> None:
    """The default is one full batch: --max-batch-size (4 on `small`) x the context (1024)."""
    limit = {"small": 4 * 1024, "tiny": 65536}[name]
    error = error_of(post(servers[name], body, timeout=10), 400)
    assert error["param"] == "max_tokens"
    assert says in error["message"] and f"--max-request-tokens {limit}" in error["message"]


def test_a_large_answer_is_built_off_the_event_loop_and_is_the_same(server: ServerProcess) -> None:
    """Over 16,384 tokens, the answer is built and encoded in a worker thread, choice by choice:
    /health keeps answering, and the samples are those two smaller requests (answered on the
    event loop) give: sample i of a request with seed s is seeded s + i."""
    require_batch_invariance(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 520, "ignore_eos": True, "logprobs": 5}
    big, slowest = while_probing_health(
        server, lambda: post(server, {**body, "n": 32, "seed": 0}, timeout=300)
    )
    assert big.status_code == 200 and slowest < HEALTH_BOUND_S
    halves = [post(server, {**body, "n": 16, "seed": s}, timeout=300) for s in (0, 16)]
    answer = big.json()
    assert (
        answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 32 * 520
    )
    assert [c["index"] for c in answer["choices"]] == list(range(32))
    split = [c for half in halves for c in half.json()["choices"]]
    for field in ("text", "logprobs", "finish_reason"):
        assert [c[field] for c in answer["choices"]] == [c[field] for c in split]


def test_queued_work_is_bounded(servers: dict[str, ServerProcess]) -> None:
    """--max-queued-seqs 8: a request of more sequences can never fit (400); one that does not
    fit beside the work in flight gets 503 (retry later), and succeeds once that work is done."""
    small = servers["small"]
    error = error_of(post(small, {"prompt": [[5], [6], [7]], "n": 3, "max_tokens": 2}), 400)
    assert error["param"] == "prompt" and "--max-queued-seqs 8" in error["message"]

    # 8 x 500 tokens: under the default --max-request-tokens, 4 (batch) x 1024 (context).
    long_body = {"prompt": [5, 6, 7], "n": 8, "max_tokens": 500, "ignore_eos": True}
    result: dict[str, httpx.Response] = {}

    def fill_the_queue() -> None:  # a probe that got in first makes it a 503: then again
        while (resp := post(small, long_body, timeout=300)).status_code == 503:
            time.sleep(0.05)
        result["long"] = resp

    worker = threading.Thread(target=fill_the_queue)
    worker.start()
    try:
        busy = None
        while busy is None and worker.is_alive():
            resp = post(small, {"prompt": [5, 6, 7], "max_tokens": 1})
            if resp.status_code == 503:
                busy = resp
            time.sleep(0.05)
        assert busy is not None, "the long request finished before a request found it queued"
        error = error_of(busy, 503)
        assert "--max-queued-seqs 8" in error["message"] and "retry" in error["message"]
    finally:
        worker.join(300)
    assert result["long"].status_code == 200 and len(result["long"].json()["choices"]) == 8
    serves(small)


def test_limit_flags_must_be_positive() -> None:
    from grail.inference.builtin.admission import Limits

    for field in ("max_request_bytes", "max_n", "max_request_tokens", "max_queued_seqs"):
        flag = "--" + field.replace("_", "-")
        with pytest.raises(ValueError, match=f"{flag} must be >= 1, got 0"):
            Limits.for_engine(4, 1024, **{field: 0})
    command = [sys.executable, "-m", "grail.inference.builtin.server", "--model", "tiny"]
    proc = subprocess.run(
        [*command, "--max-n", "-1"], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 2 and "--max-n: must be >= 1, got -1" in proc.stderr


# --------------------------------------------------------------------------- 16: --model tiny


def test_model_tiny_serves_the_offline_tiny_model(server: ServerProcess) -> None:
    """`--model tiny` means what grail-train's model.train_id=tiny means."""
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["root"] == str(ensure_tiny_model())
    serves(server)


def test_train_and_serve_resolve_model_names_in_one_place() -> None:
    from grail.train import trainer

    assert trainer.resolve_model is resolve_model
    assert resolve_model("tiny") == str(ensure_tiny_model())
    assert resolve_model("/models/mine") == "/models/mine"
    assert resolve_model("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_an_unknown_model_says_what_model_takes(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    command = [sys.executable, "-m", "grail.inference.builtin.server", "--model", str(missing)]
    # Forked from the test runner (helpers/forked.py): what it prints and its exit code are the
    # program's, without a new interpreter's imports.
    proc = forked.run(command, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert str(missing) in proc.stderr and "'tiny'" in proc.stderr
