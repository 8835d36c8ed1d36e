"""Remote reward scorers (grail/envs/rewards/remote.py) over real HTTP against local servers: a
scripted http.server scorer for each behaviour (chunks, concurrency, retries, errors), and the
example FastAPI scorer (examples/reward_server.py) in-process and as a real subprocess."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from grail.core.errors import ConfigError
from grail.envs import make_env
from grail.envs.rewards.base import RewardError
from grail.envs.rewards.plugins import (
    RewardFunctions,
    WeightedReward,
    load_reward_fn,
    score_completions,
)
from grail.envs.rewards.remote import RemoteOptions, RemoteReward
from grail.inference.completions import Completion, SamplingParams
from grail.rollouts.generation import RolloutGenerator

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import reward_server  # noqa: E402  (examples/ is not a package)

# What a scripted scorer answers to one request: (status, body bytes), after `delay_s`.
Reply = tuple[int, bytes]


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()


def _by_length(request: dict[str, Any]) -> Reply:
    """The default scorer: each completion's length, as a bare JSON list."""
    return 200, _json([float(len(c)) for c in request["completions"]])


@dataclass
class Scorer:
    """A scripted HTTP scorer: `reply(request_json, request_number)` decides each answer."""

    reply: Callable[[dict[str, Any], int], Reply] = lambda request, _: _by_length(request)
    delay_s: float = 0.0
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    url: str = ""


@pytest.fixture
def scorer() -> Iterator[Scorer]:
    state = Scorer()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as httpx uses it

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                number = len(state.requests)
                state.requests.append(body)
                state.headers.append({k.lower(): v for k, v in self.headers.items()})
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                time.sleep(state.delay_s)
                status, payload = state.reply(body, number)
            finally:
                with state.lock:
                    state.in_flight -= 1
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True  # a handler still sleeping (timeout test) never blocks the end
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _remote(url: str, backoff_s: float = 0.01, **options: Any) -> RemoteReward:
    """A scorer with short backoff, so that retry tests stay fast."""
    return RemoteReward(url, RemoteOptions(**options), backoff_s=backoff_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the success path ---------------------------------------------------------------------------


def test_a_url_spec_scores_the_batch_with_the_plugin_kwargs(scorer: Scorer) -> None:
    env = make_env("copy_digits")
    problems = [env.problem(s) for s in (0, 1)]
    extras = RewardFunctions.from_specs([scorer.url, {"fn": scorer.url, "name": "r2", "weight": 2}])
    assert [r.name for r in extras] == ["remote", "r2"]
    assert not scorer.requests  # building the config contacted nobody
    with extras:
        scores = score_completions(env, problems, ["ab", "abcd"], extras)
    assert [s.components["remote"] for s in scores] == [2.0, 4.0]
    plain = score_completions(env, problems, ["ab", "abcd"])
    assert [s.reward for s in scores] == pytest.approx(
        [p.reward + 3 * v for p, v in zip(plain, [2, 4], strict=True)]
    )
    first = scorer.requests[0]
    assert first == {
        "prompts": [p.prompt_messages[-1]["content"] for p in problems],
        "completions": ["ab", "abcd"],
        "answers": [p.answer for p in problems],
        "num_digits": [1, 1],  # every meta key, as a plugin gets it
    }
    assert scorer.headers[0]["content-type"] == "application/json"


def test_rewards_object_form_headers_and_the_bare_loader(scorer: Scorer) -> None:
    scorer.reply = lambda request, _: (200, _json({"rewards": [0.5] * len(request["prompts"])}))
    token = "Bearer s3cret-token"
    (reward,) = RewardFunctions.from_specs(
        [{"fn": scorer.url, "headers": {"Authorization": token}, "name": "judge"}]
    )
    with reward.fn as fn:  # type: ignore[attr-defined]
        assert fn(["p", "q"], ["a", "b"], answers=["x", "y"]) == [0.5, 0.5]
        assert "s3cret" not in repr(fn)
    assert scorer.headers[0]["authorization"] == token
    assert isinstance(load_reward_fn(scorer.url), RemoteReward)  # a bare URL: default options


def test_an_empty_batch_sends_nothing(scorer: Scorer) -> None:
    assert _remote(scorer.url)([], []) == []
    assert not scorer.requests


def test_chunks_are_posted_concurrently_within_max_concurrency(scorer: Scorer) -> None:
    scorer.delay_s = 0.15
    scorer.reply = lambda request, _: (200, _json([float(c) for c in request["completions"]]))
    fn = _remote(scorer.url, batch_size=3, max_concurrency=2)
    completions = [str(i) for i in range(10)]
    started = time.perf_counter()
    values = fn(["p"] * 10, completions, answers=list(range(10)), flag=True)
    elapsed = time.perf_counter() - started
    assert values == [float(i) for i in range(10)]  # put back in order
    assert sorted(len(r["completions"]) for r in scorer.requests) == [1, 3, 3, 3]
    # Per-sample lists are cut to the chunk; anything else goes whole.
    assert sorted(r["answers"][0] for r in scorer.requests) == [0, 3, 6, 9]
    assert all(r["flag"] is True for r in scorer.requests)
    assert scorer.max_in_flight == 2
    assert elapsed < 4 * 0.15  # concurrent: two rounds of two, not four in a row
    assert not [t for t in threading.enumerate() if t.name.startswith("grail-remote-reward")]
    fn.close()


def test_max_concurrency_bounds_concurrent_callers_too(scorer: Scorer) -> None:
    scorer.delay_s = 0.1
    fn = _remote(scorer.url, max_concurrency=1)
    threads = [threading.Thread(target=fn, args=(["p"], ["x"])) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert len(scorer.requests) == 3 and scorer.max_in_flight == 1


# --- retries ----------------------------------------------------------------------------------


def test_a_503_is_retried_until_it_passes(scorer: Scorer) -> None:
    scorer.reply = lambda request, n: (503, b"busy") if n < 2 else _by_length(request)
    assert _remote(scorer.url, max_retries=3)(["p"], ["abc"]) == [3.0]
    assert len(scorer.requests) == 3


def test_a_429_waits_the_default_backoff(scorer: Scorer) -> None:
    scorer.reply = lambda request, n: (429, b"slow down") if n == 0 else _by_length(request)
    (reward,) = RewardFunctions.from_specs([scorer.url])  # default backoff: 0.5 s first
    started = time.perf_counter()
    assert reward.fn(["p"], ["ab"]) == [2.0]
    assert time.perf_counter() - started >= 0.5
    assert len(scorer.requests) == 2


def test_a_5xx_after_the_retries_names_status_and_message(scorer: Scorer) -> None:
    scorer.reply = lambda request, n: (500, _json({"detail": "judge model crashed"}))
    message = (
        r"reward 'http://127.0.0.1:\d+/score': HTTP 500 Internal Server Error: judge model "
        r"crashed; gave up after 3 attempt\(s\) \(max_retries=2, timeout_s=30 each\)"
    )
    with pytest.raises(RewardError, match=message):
        _remote(scorer.url, max_retries=2)(["p"], ["a"])
    assert len(scorer.requests) == 3


def test_a_non_json_error_body_is_quoted_and_cut(scorer: Scorer) -> None:
    scorer.reply = lambda request, n: (502, b"upstream\n exploded " + b"x" * 500)
    with pytest.raises(RewardError, match=r"HTTP 502 Bad Gateway: upstream exploded x+…;") as info:
        _remote(scorer.url, max_retries=0)(["p"], ["a"])
    assert len(str(info.value)) < 400


def test_a_4xx_is_not_retried(scorer: Scorer) -> None:
    scorer.reply = lambda request, n: (400, _json({"error": {"message": "answers missing"}}))
    fn = _remote(scorer.url, headers={"Authorization": "Bearer s3cret"})
    with pytest.raises(
        RewardError, match=r"HTTP 400 Bad Request: answers missing \(a client error: not retried\)"
    ) as info:
        fn(["p"], ["a"])
    assert len(scorer.requests) == 1
    assert "s3cret" not in str(info.value)


def test_connection_refused_names_the_attempts() -> None:
    url = f"http://127.0.0.1:{_free_port()}/score"
    with pytest.raises(
        RewardError,
        match=r"could not reach the scorer \(ConnectError: .*\); gave up after 2 attempt\(s\) "
        r"\(max_retries=1, timeout_s=5 each\)",
    ):
        _remote(url, max_retries=1, timeout_s=5)(["p"], ["a"])


def test_a_timeout_names_the_timeout_and_attempts(scorer: Scorer) -> None:
    scorer.delay_s = 2.0
    with pytest.raises(
        RewardError,
        match=r"no answer within timeout_s=0.2 \(ReadTimeout\); gave up after 2 attempt\(s\)",
    ):
        _remote(scorer.url, max_retries=1, timeout_s=0.2)(["p"], ["a"])
    assert len(scorer.requests) == 2


def _trickler(interval_s: float) -> tuple[str, threading.Event]:
    """A scorer that answers 200 with headers at once, then its body one byte per `interval_s`
    (a stalled proxy, a slow-loris server): each wait for a byte is short, so no per-read
    timeout fires. Returns its URL and an event set once the client hung up on it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    hung_up = threading.Event()

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    request += conn.recv(65536)
                body = b"[" + b" " * 100_000 + b"1.0]"
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                try:
                    conn.sendall(head)
                    for i in range(len(body)):
                        conn.sendall(body[i : i + 1])
                        time.sleep(interval_s)
                except OSError:  # the client closed the connection
                    hung_up.set()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}/score", hung_up


def test_a_scorer_that_trickles_bytes_is_cut_off_at_the_deadline() -> None:
    url, hung_up = _trickler(0.05)  # a byte every 50 ms: far within the 1 s per-read timeout
    t0 = time.monotonic()
    with pytest.raises(
        RewardError,
        match=r"no complete answer within timeout_s=1 \(the scorer was still sending\); gave "
        r"up after 1 attempt",
    ):
        _remote(url, max_retries=0, timeout_s=1)(["p"], ["a"])
    assert time.monotonic() - t0 < 5  # its body alone would take 5000 s
    assert hung_up.wait(5), "the abandoned request's connection should be closed"


# --- what the scorer answers ------------------------------------------------------------------


def test_a_wrong_number_of_values_is_refused(scorer: Scorer) -> None:
    # Three values, except for a chunk that starts at "0" (the first of two chunks of 4).
    scorer.reply = lambda request, n: (
        200,
        _json([0.0] * (4 if request["completions"][0] == "0" else 3)),
    )
    with pytest.raises(RewardError, match="returned 3 values for 4 completions$"):
        _remote(scorer.url)(["p"] * 4, ["a"] * 4)
    with pytest.raises(
        RewardError, match=r"returned 3 values for 4 completions \(samples 4..7 of 8\)"
    ):
        _remote(scorer.url, batch_size=4)(["p"] * 8, [str(i) for i in range(8)])


def test_nan_is_refused_with_the_sample_index_in_the_batch(scorer: Scorer) -> None:
    # A JSON NaN token (Python's json writes one; strict JSON has none): chunk 2, its 2nd sample.
    scorer.reply = lambda request, n: (
        200,
        b"[0.0, NaN]" if request["completions"][0] == "2" else b"[0.0, 1.0]",
    )
    with pytest.raises(RewardError, match=r"\(sample 3\): value nan is not finite"):
        _remote(scorer.url, batch_size=2, max_concurrency=1)(["p"] * 4, ["0", "1", "2", "3"])


def test_a_non_number_is_refused_with_its_index(scorer: Scorer) -> None:
    scorer.reply = lambda request, n: (200, _json({"rewards": [1.0, "high"]}))
    with pytest.raises(RewardError, match=r"\(sample 1\): value 'high' is not a number"):
        _remote(scorer.url)(["p", "p"], ["a", "b"])


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html>oops</html>", r"answered HTTP 200 with invalid JSON \(.*\): '<html>oops</html>'"),
        (_json({"scores": [1.0]}), r"JSON object with keys \['scores'\]; expected a list"),
        (_json(1.0), "returned float, expected a list"),
    ],
)
def test_an_answer_that_is_not_values_is_refused(scorer: Scorer, body: bytes, message: str) -> None:
    scorer.reply = lambda request, n: (200, body)
    with pytest.raises(RewardError, match=message):
        _remote(scorer.url)(["p"], ["a"])


def test_a_kwarg_that_is_not_json_is_named(scorer: Scorer) -> None:
    with pytest.raises(RewardError, match="cannot send `meta_obj` to the scorer as JSON"):
        _remote(scorer.url)(["p"], ["a"], meta_obj=[object()])


def test_a_closed_scorer_refuses_to_score(scorer: Scorer) -> None:
    extras = RewardFunctions.from_specs([scorer.url, "correctness"])
    (remote, _) = extras
    assert remote.fn(["p"], ["a"]) == [1.0]
    extras.close()
    extras.close()  # idempotent
    with pytest.raises(RewardError, match="the scorer was closed"):
        remote.fn(["p"], ["a"])


# --- config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["ftp://host/score"], r"'ftp://host/score'.*must start with http:// or https://"),
        (["http:///score"], r"'http:///score': the URL has no host"),
        ([{"fn": "correctness", "batch_size": 5}], r"#0 \('correctness'\): 'batch_size' is only"),
        ([{"fn": "correctness", "timeout_s": 0}], r"#0 \('correctness'\): timeout_s must be a fin"),
        ([{"fn": "correctness", "timeout_s": float("inf")}], "timeout_s must be a finite number"),
        ([{"fn": "http://h/s", "max_concurrency": 0}], "max_concurrency must be an integer >= 1"),
        ([{"fn": "http://h/s", "batch_size": 2.5}], "batch_size must be an integer >= 1"),
        ([{"fn": "http://h/s", "timeout_s": 0}], "timeout_s must be a finite number > 0"),
        ([{"fn": "http://h/s", "max_retries": -1}], "max_retries must be an integer >= 0"),
        ([{"fn": "http://h/s", "retries": 1}], r"unknown key\(s\) \['retries'\]"),
        (["http://a/s", "http://b/s"], r"repeated: \['remote'\] \(set `name`\)"),
    ],
)
def test_config_errors_name_the_bad_thing(specs: list[Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RewardFunctions.from_specs(specs)


def test_a_header_error_does_not_show_its_value() -> None:
    with pytest.raises(ConfigError, match="header 'X-Key' does not") as info:
        RewardFunctions.from_specs([{"fn": "http://h/s", "headers": {"X-Key": 12345}}])
    assert "12345" not in str(info.value)


def test_options_are_read_and_nothing_is_contacted() -> None:
    url = f"http://127.0.0.1:{_free_port()}/score"  # nothing listens: must not matter here
    (reward,) = RewardFunctions.from_specs(
        [{"fn": url, "timeout_s": 2, "max_retries": 0, "max_concurrency": 3, "batch_size": 16}]
    )
    assert isinstance(reward.fn, RemoteReward) and reward.spec == url
    assert reward.fn.options == RemoteOptions(2.0, 0, 3, 16, {})


# --- whole-batch scoring in RolloutGenerator --------------------------------------------------


class _Tokenizer:
    def apply_chat_template(self, messages: list, **kwargs: Any) -> list[int]:
        return [1, 2, 3]


class _Client:
    """Completions "0".."n-1" per prompt, without a server."""

    async def complete_many(
        self, prompts: list, n: int, sampling: Any, seeds: list, on_done=None, spans=None
    ):
        return [[Completion([5], [-0.1], "stop", str(i)) for i in range(n)] for _ in prompts]


def test_generate_groups_scores_the_whole_batch_in_one_call_off_the_event_loop(
    scorer: Scorer,
) -> None:
    scorer.delay_s = 0.3
    env = make_env("copy_digits")
    calls: list[list[str]] = []

    def count(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append(list(completions))
        return [0.25 * len(c) for c in completions]

    extras = RewardFunctions(
        [
            WeightedReward("count", "tests:count", count, 0.5),
            WeightedReward("remote", scorer.url, RemoteReward(scorer.url), 1.0),
        ]
    )
    generator = RolloutGenerator(
        env, _Tokenizer(), _Client(), SamplingParams(max_tokens=2), extra_rewards=extras
    )

    async def run() -> tuple[list, int]:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        ticker = asyncio.create_task(tick())
        groups = await generator.generate_groups([4, 7, 9], replicas=3)
        ticker.cancel()
        return groups, ticks

    groups, ticks = asyncio.run(run())
    assert calls == [["0", "1", "2"] * 3] and len(scorer.requests) == 1  # one call per batch
    assert ticks >= 5  # the loop kept running while the scorer took 0.3 s
    scorer.delay_s = 0.0
    for group in groups:
        # The same values, bit for bit, as scoring each group alone.
        alone = score_completions(env, [group.problem] * 3, [s.text for s in group.samples], extras)
        assert [s.reward for s in group.samples] == [a.reward for a in alone]
        assert [s.components for s in group.samples] == [a.components for a in alone]
    extras.close()


# --- the example scorer -------------------------------------------------------------------------


@pytest.fixture
def example_url() -> Iterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(reward_server.create_app(), host="127.0.0.1", port=0, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "example scorer did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/score"
    finally:
        server.should_exit = True
        thread.join(5)


def test_the_example_scorer_mirrors_copy_digits_correct(example_url: str) -> None:
    env = make_env("copy_digits", num_digits=2)
    problems = [env.problem(s) for s in range(4)]
    answers = [p.answer for p in problems]
    completions = [answers[0], f" {answers[1]}\n", answers[2] + "<|im_end|>junk", answers[3] * 2]
    extras = RewardFunctions.from_specs([{"fn": example_url, "name": "remote_exact"}])
    with extras:
        scores = score_completions(env, problems, completions, extras)
    assert [s.components["remote_exact"] for s in scores] == [1.0, 1.0, 1.0, 0.0]
    assert all(s.components["remote_exact"] == s.components["correct"] for s in scores)


def test_the_example_scorer_refuses_a_malformed_batch_with_a_message(example_url: str) -> None:
    with pytest.raises(RewardError, match=r"HTTP 422 Unprocessable .*answers.*not retried"):
        _remote(example_url)(["p"], ["a"])  # no `answers`
    with pytest.raises(RewardError, match="2 answers: the lists must have one entry per sample"):
        _remote(example_url)(["p"], ["a"], answers=["1", "2"])


def test_the_example_scorer_runs_as_a_program() -> None:
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "reward_server.py"), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        lines: list[str] = []
        found: list[str] = []

        def read() -> None:  # in a thread, so that a silent process cannot hang the test
            for line in process.stderr:  # type: ignore[union-attr]
                lines.append(line)
                m = re.search(r"Uvicorn running on (http://\S+)", line)
                if m:
                    found.append(m.group(1))

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + 15
        while not found:
            assert process.poll() is None, "".join(lines)
            assert time.monotonic() < deadline, f"no 'running on' line: {''.join(lines)}"
            time.sleep(0.02)
        (reward,) = RewardFunctions.from_specs([f"{found[0]}/score"])
        with RewardFunctions([reward]):
            assert reward.fn(["Repeat: 42"] * 2, ["42", "4"], answers=["42", "42"]) == [1.0, 0.0]
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
