"""The built-in OpenAI-compatible server (`grail-serve`), over real HTTP.

Two servers run for the whole module, started side by side: the main one on the tiny model
(with an API key), and a fresh one on a perturbed copy of it, to check that an in-place weight
update gives exactly what a server started on the new checkpoint gives. Both run CPU float32 with
one thread, where the engine is batch-invariant, so results are compared bitwise.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers.builtin_server import (
    API_KEY,
    AUTH,
    NAME,
    ServerProcess,
    require_batch_invariance,
    side_by_side,
)
from safetensors.torch import load_file, save_file

from grail.models.tiny import ensure_tiny_model


@pytest.fixture(scope="module")
def model_dir(request: pytest.FixtureRequest) -> Path:
    """The shared `tiny_model_dir` fixture where conftest provides it, else the cached build."""
    try:
        return request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        return ensure_tiny_model()


def _perturbed_copy(src: Path, dst: Path, scale: float, seed: int) -> Path:
    """A copy of `src` whose every weight got N(0, scale^2) noise."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noisy = {
        k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)
        for k, v in tensors.items()
    }
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def perturbed_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _perturbed_copy(model_dir, tmp_path_factory.mktemp("ckpt") / "perturbed", 0.05, 1)


@pytest.fixture(scope="module")
def servers(model_dir: Path, perturbed_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    logs = tmp_path_factory.mktemp("logs")
    # `fresh` ends in test_sigterm_shuts_the_server_down_cleanly: a new interpreter, whose own
    # exit (its threads included) that test checks.
    with side_by_side(
        logs,
        new_interpreters=("fresh",),
        main=(model_dir, ("--api-key", API_KEY)),
        fresh=(perturbed_dir, ()),
    ) as started:
        yield started


@pytest.fixture(scope="module")
def server(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["main"]


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def complete(client: openai.OpenAI, prompt: Any, **kw: Any) -> dict[str, Any]:
    """A completion with every sampling field explicit; returns the response as a dict."""
    extra = {"return_token_ids": True, "top_k": kw.pop("top_k", -1), **kw.pop("extra", {})}
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 1.0)
    kw.setdefault("top_p", 1.0)
    kw.setdefault("seed", 0)
    kw.setdefault("logprobs", 0)
    resp = client.completions.create(model=NAME, prompt=prompt, extra_body=extra, **kw)
    return resp.model_dump()


def samples(resp: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
    """(token ids, token logprobs) of each choice, in choice order."""
    return [(c["token_ids"], c["logprobs"]["token_logprobs"]) for c in resp["choices"]]


PROMPT_A = [5, 77, 301, 12, 260, 9]
PROMPT_B = [40, 41, 42]
PROMPT_C = list(range(100, 121))


# --------------------------------------------------------------------------- basics


def test_ready_line_models_and_health(server: ServerProcess) -> None:
    assert f"grail-serve ready: model '{NAME}' at {server.url}" in server.log()
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert models["object"] == "list"
    [card] = models["data"]
    assert card["id"] == NAME and card["object"] == "model"
    assert card["max_model_len"] == 1024
    assert card["weight_version"] == "default"
    assert isinstance(card["batch_invariant"], bool)


def test_completion_shape(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = "Solve this SAT problem: x1 or x2"
    resp = complete(client, prompt, n=2, max_tokens=6, logprobs=2, extra={"ignore_eos": True})
    assert resp["id"].startswith("cmpl-") and resp["object"] == "text_completion"
    assert resp["model"] == NAME and isinstance(resp["created"], int)
    prompt_ids = tokenizer(prompt)["input_ids"]
    assert [c["index"] for c in resp["choices"]] == [0, 1]
    for choice in resp["choices"]:
        ids = choice["token_ids"]
        assert len(ids) == 6 and choice["finish_reason"] == "length"
        assert choice["prompt_token_ids"] == prompt_ids
        assert choice["text"] == tokenizer.decode(ids, skip_special_tokens=True)
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:j]) for j in range(6)]
        for token, value, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True
        ):
            assert value < 0 and top[token] == value  # the sampled token leads its entry
            assert 2 <= len(top) <= 3  # plus the 2 best alternatives
    assert resp["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": 12,
        "total_tokens": len(prompt_ids) + 12,
        "completion_tokens_details": None,
        "prompt_tokens_details": None,
    }


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_a_transformers_forward(
    client: openai.OpenAI, hf_model: Any, temperature: float
) -> None:
    """token_logprobs = log_softmax(logits / T)[token] of the same weights, within 1e-4; greedy
    picks the argmax; the top alternatives are the best of that distribution."""
    resp = complete(
        client, PROMPT_A, n=2, max_tokens=10, temperature=temperature, logprobs=3, seed=4,
        extra={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    for choice in resp["choices"]:
        ids = choice["token_ids"]
        with torch.no_grad():
            logits = hf_model(torch.tensor([PROMPT_A + ids])).logits[0].float()
        steps = logits[len(PROMPT_A) - 1 : -1]
        ref = torch.log_softmax(steps / (temperature or 1.0), dim=-1)
        got = torch.tensor(choice["logprobs"]["token_logprobs"])
        assert torch.allclose(got, ref[torch.arange(len(ids)), ids], atol=1e-4)
        if temperature == 0.0:
            assert ids == steps.argmax(-1).tolist()
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids]
        for j, top in enumerate(choice["logprobs"]["top_logprobs"]):
            best = ref[j].topk(3)
            for token, value in zip(best.indices.tolist(), best.values.tolist(), strict=True):
                assert abs(top[f"token_id:{token}"] - value) < 1e-4


def test_top_k_and_top_p_filter_the_draw_not_the_logprobs(client: openai.OpenAI) -> None:
    """top-k / top-p restrict which tokens can be drawn; the reported logprobs stay those of the
    unfiltered distribution at the request's temperature."""
    kw = {"n": 3, "max_tokens": 8, "seed": 21, "logprobs": 2, "extra": {"ignore_eos": True}}
    greedy = samples(complete(client, PROMPT_C, temperature=0.0, **kw))
    assert samples(complete(client, PROMPT_C, temperature=1.0, top_k=1, **kw)) == greedy
    assert samples(complete(client, PROMPT_C, temperature=1.0, top_p=1e-4, **kw)) == greedy
    top2 = complete(
        client, PROMPT_C, temperature=1.0, top_k=2, n=4, max_tokens=8, seed=21, logprobs=2,
        extra={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    for choice in top2["choices"]:
        for token, top in zip(choice["token_ids"], choice["logprobs"]["top_logprobs"], strict=True):
            assert len(top) == 2 and f"token_id:{token}" in top  # drawn from the best two


def test_seed_determinism_and_sample_i_is_seed_plus_i(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    first = complete(client, PROMPT_A, n=3, seed=11)
    again = complete(client, PROMPT_A, n=3, seed=11)
    assert samples(first) == samples(again)
    require_batch_invariance(server)  # below, the same samples run in batches of other sizes
    singles = [samples(complete(client, PROMPT_A, n=1, seed=11 + i))[0] for i in range(3)]
    assert samples(first) == singles
    assert len({tuple(ids) for ids, _ in samples(first)}) > 1  # distinct seeds, distinct samples
    other = complete(client, PROMPT_A, n=3, seed=12)
    assert samples(other)[:2] == samples(first)[1:]
    # n above --max-batch-size 16 runs over several rounds; sample i is still seed + i.
    many = complete(client, PROMPT_A, n=20, seed=11, max_tokens=4)
    assert samples(many)[17] == samples(complete(client, PROMPT_A, n=1, seed=28, max_tokens=4))[0]


def test_batch_prompts_are_prompt_major_and_batch_invariant(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """Prompts of different lengths batched in one request, or sent concurrently, give bitwise
    the same tokens and logprobs as each prompt alone (CPU float32, batch-invariant engine)."""
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C]
    kw = {"n": 2, "seed": 5, "max_tokens": 12, "extra": {"ignore_eos": True}}
    alone = [samples(complete(client, p, **kw)) for p in prompts]
    batch = complete(client, prompts, **kw)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    for idx, choice in enumerate(batch["choices"]):
        assert choice["prompt_token_ids"] == prompts[idx // 2]
    require_batch_invariance(server)
    assert samples(batch) == [s for per_prompt in alone for s in per_prompt]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(complete, client, p, **kw) for p in prompts * 2]
        concurrent_results = [samples(f.result()) for f in futures]
    assert concurrent_results == alone * 2


def test_seeds_give_each_prompt_of_a_batch_the_samples_of_its_own_request(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """The `seeds` extension: prompt j of a multi-prompt request gets bitwise the token ids and
    logprobs a request for prompt j alone with seed=seeds[j] gets (sample i: seeds[j] + i)."""
    require_batch_invariance(server)
    prompts = [PROMPT_A, PROMPT_B, PROMPT_C, PROMPT_A]
    seeds = [11, 3, 2**31 - 2**16, 12]
    kw = {"n": 3, "max_tokens": 6}
    extra = {"ignore_eos": True, "seeds": seeds}
    batch = complete(client, prompts, seed=openai.NOT_GIVEN, extra=extra, **kw)
    kw["extra"] = {"ignore_eos": True}
    alone = [
        samples(complete(client, p, seed=s, **kw)) for p, s in zip(prompts, seeds, strict=True)
    ]
    assert samples(batch) == [s for per_prompt in alone for s in per_prompt]
    assert [c["prompt_token_ids"] for c in batch["choices"]] == [
        p for p in prompts for _ in range(3)
    ]
    # Prompt 3 (PROMPT_A with seed 12) shares prompt 0's samples 1.. (seed 11 + 1 = 12 + 0).
    assert samples(batch)[9:11] == samples(batch)[1:3]
    # A plain seed gives every prompt the same seed + i, as vLLM does.
    same = complete(client, [PROMPT_A, PROMPT_A], seed=11, **kw)
    assert samples(same)[:3] == samples(same)[3:] == alone[0]


def test_chat_completion_with_logprobs(client: openai.OpenAI, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Copy the digits 1 2 3"}]
    resp = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=7, temperature=1.0, top_p=1.0, seed=2, n=2,
        logprobs=True, top_logprobs=2, extra_body={"return_token_ids": True, "top_k": -1},
    ).model_dump()  # fmt: skip
    assert resp["object"] == "chat.completion" and resp["id"].startswith("chatcmpl-")
    prompt_ids = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    assert resp["prompt_token_ids"] == prompt_ids
    # The same prompt ids through /v1/completions give the same samples.
    plain = complete(client, prompt_ids, n=2, seed=2, max_tokens=7)
    for choice, (ids, lps) in zip(resp["choices"], samples(plain), strict=True):
        assert choice["message"]["role"] == "assistant"
        assert choice["token_ids"] == ids
        assert choice["message"]["content"] == tokenizer.decode(ids, skip_special_tokens=True)
        content = choice["logprobs"]["content"]
        assert [c["logprob"] for c in content] == lps
        for entry, token in zip(content, ids, strict=True):
            assert entry["token"] == tokenizer.decode([token])
            assert entry["bytes"] == list(entry["token"].encode())
            top = [t["logprob"] for t in entry["top_logprobs"]]
            assert len(top) == 2 and top == sorted(top, reverse=True) and top[0] >= entry["logprob"]


def test_stop_string_cuts_text_before_it(client: openai.OpenAI, tokenizer: Any) -> None:
    full = complete(client, PROMPT_B, max_tokens=24, seed=8, extra={"ignore_eos": True})
    ids = full["choices"][0]["token_ids"]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    # A piece of text added by one token that occurs nowhere before it.
    for j in range(2, len(ids)):
        before = tokenizer.decode(ids[:j], skip_special_tokens=True)
        piece = tokenizer.decode(ids[: j + 1], skip_special_tokens=True)[len(before) :]
        if piece.strip() and "\ufffd" not in piece and text.find(piece) == len(before):
            break
    else:
        pytest.fail(f"no usable stop string in {text!r}")
    resp = complete(
        client, PROMPT_B, max_tokens=24, seed=8, stop=["never-there", piece],
        extra={"ignore_eos": True},
    )  # fmt: skip
    choice = resp["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == piece
    assert choice["text"] == before
    assert choice["token_ids"] == ids[: j + 1]


def test_eos_is_kept_in_token_ids_with_finish_stop(client: openai.OpenAI, tokenizer: Any) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    resp = complete(client, PROMPT_B, n=64, max_tokens=96, seed=0, temperature=1.5)
    finishes = {c["finish_reason"] for c in resp["choices"]}
    assert finishes == {"stop", "length"}  # ~1/512 per token: both happen among 64 x 96 draws
    for choice in resp["choices"]:
        ids = choice["token_ids"]
        if choice["finish_reason"] == "stop":
            assert ids[-1] == eos and eos not in ids[:-1] and len(ids) <= 96
            assert choice["text"] == tokenizer.decode(ids[:-1], skip_special_tokens=True)
            assert "<|im_end|>" not in choice["text"]
        else:
            assert len(ids) == 96 and eos not in ids
    # A stop token id ends the sample on that token, reported as the stop reason.
    first = samples(complete(client, PROMPT_A, seed=3, max_tokens=5))[0][0][0]
    stopped = complete(client, PROMPT_A, seed=3, max_tokens=5, extra={"stop_token_ids": [first]})
    choice = stopped["choices"][0]
    assert choice["token_ids"] == [first] and choice["finish_reason"] == "stop"
    assert choice["stop_reason"] == first


def test_length_finish(client: openai.OpenAI) -> None:
    resp = complete(client, PROMPT_C, n=3, max_tokens=5, extra={"ignore_eos": True})
    assert [c["finish_reason"] for c in resp["choices"]] == ["length"] * 3
    assert all(len(c["token_ids"]) == 5 for c in resp["choices"])
    assert resp["usage"]["completion_tokens"] == 15


# --------------------------------------------------------------------------- errors


GOOD = {"model": NAME, "prompt": PROMPT_A, "max_tokens": 2, "temperature": 1.0, "seed": 0}
# Two prompts with the `seeds` extension (one seed per prompt) instead of `seed`.
SEEDS = {**{k: v for k, v in GOOD.items() if k != "seed"}, "prompt": [PROMPT_A, PROMPT_B]}

BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"prompt": [1, 2', 400, None),
    ("prompt wrong type", "/v1/completions", {**GOOD, "prompt": 5}, 400, "prompt"),
    ("empty text prompt", "/v1/completions", {**GOOD, "prompt": ""}, 400, "prompt"),
    ("empty id prompt", "/v1/completions", {**GOOD, "prompt": []}, 400, "prompt"),
    ("empty prompt in batch", "/v1/completions", {**GOOD, "prompt": [[1], []]}, 400, "prompt"),
    ("n < 1", "/v1/completions", {**GOOD, "n": 0}, 400, "n"),
    ("max_tokens < 1", "/v1/completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    ("beyond context", "/v1/completions", {**GOOD, "max_tokens": 1020}, 400, "max_tokens"),
    ("unknown model", "/v1/completions", {**GOOD, "model": "nope"}, 404, "model"),
    ("id >= vocab", "/v1/completions", {**GOOD, "prompt": [1, 512]}, 400, "prompt"),
    ("negative id", "/v1/completions", {**GOOD, "prompt": [[3], [-1]]}, 400, "prompt"),
    ("temperature < 0", "/v1/completions", {**GOOD, "temperature": -0.5}, 400, "temperature"),
    ("top_p = 0", "/v1/completions", {**GOOD, "top_p": 0.0}, 400, "top_p"),
    ("top_p > 1", "/v1/completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    ("top_k < -1", "/v1/completions", {**GOOD, "top_k": -3}, 400, "top_k"),
    ("logprobs > 20", "/v1/completions", {**GOOD, "logprobs": 21}, 400, "logprobs"),
    ("stream", "/v1/completions", {**GOOD, "stream": True}, 400, "stream"),
    ("echo", "/v1/completions", {**GOOD, "echo": True}, 400, "echo"),
    ("penalty", "/v1/completions", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("min_tokens", "/v1/completions", {**GOOD, "min_tokens": 2}, 400, "min_tokens"),
    ("stop id >= vocab", "/v1/completions", {**GOOD, "stop_token_ids": [600]}, 400, None),
    ("seed and seeds", "/v1/completions", {**GOOD, "seeds": [1]}, 400, "seeds"),
    ("too few seeds", "/v1/completions", {**SEEDS, "seeds": [1]}, 400, "seeds"),
    ("too many seeds", "/v1/completions", {**SEEDS, "seeds": [1, 2, 3]}, 400, "seeds"),
    ("seeds not ints", "/v1/completions", {**SEEDS, "seeds": [1, "x"]}, 400, "seeds.1"),
    ("spans per prompt", "/v1/completions", {**SEEDS, "sampled_spans": [[]]}, 400, "sampled_spans"),
    (
        "span past the prompt",
        "/v1/completions",
        {**GOOD, "sampled_spans": [[[1, len(PROMPT_A) + 1]]]},
        400,
        "sampled_spans",
    ),
    ("span at 0", "/v1/completions", {**GOOD, "sampled_spans": [[[0, 1]]]}, 400, "sampled_spans"),
    (
        "span of 3",
        "/v1/completions",
        {**GOOD, "sampled_spans": [[[1, 2, 3]]]},
        400,
        "sampled_spans",
    ),
    ("no messages", "/v1/chat/completions", {"model": NAME, "messages": []}, 400, "messages"),
    (
        "spans in chat",
        "/v1/chat/completions",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "sampled_spans": [[]]},
        400,
        "sampled_spans",
    ),
    (
        "seeds in chat",
        "/v1/chat/completions",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "seeds": [1]},
        400,
        "seeds",
    ),
    (
        "top_logprobs without logprobs",
        "/v1/chat/completions",
        {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        "top_logprobs",
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "nope", "messages": [{"role": "user", "content": "hi"}]},
        404,
        "model",
    ),
]


@pytest.mark.parametrize(
    ("route", "body", "status", "param"),
    [case[1:] for case in BAD_REQUESTS],
    ids=[case[0] for case in BAD_REQUESTS],
)
def test_bad_requests_get_openai_errors_and_server_keeps_serving(
    server: ServerProcess, route: str, body: Any, status: int, param: str | None
) -> None:
    headers = {**AUTH, "Content-Type": "application/json"}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(f"{server.url}{route}", content=content, headers=headers, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    ok = httpx.post(f"{server.url}/v1/completions", json=GOOD, headers=AUTH, timeout=30)
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) >= 0


def test_api_key_guards_every_route_but_health(server: ServerProcess) -> None:
    """Weight reloads, unknown routes and the (absent) API docs need the key as much as /v1/."""
    routes = [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/update_weights_from_disk"),
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/openapi.json"),
        ("GET", "/no-such-route"),
    ]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        for method, route in routes:
            resp = httpx.request(method, f"{server.url}{route}", json=GOOD, headers=headers)
            assert resp.status_code == 401, (method, route, headers, resp.text)
            assert resp.json()["error"]["code"] == 401
            assert "API key" in resp.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).status_code == 200
    for route in ("/docs", "/redoc", "/openapi.json"):  # off, not just guarded
        assert httpx.get(f"{server.url}{route}", headers=AUTH).status_code == 404


def test_health_and_new_requests_are_served_while_a_long_generation_runs(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """/health answers at once during a long generation; requests sent meanwhile join the running
    batch (one with a shorter, one with a longer context than it), finish first, and give bitwise
    their solo results, and the long generation's own results are unchanged by them."""
    long_kw = {"n": 12, "seed": 6, "max_tokens": 1000, "extra": {"ignore_eos": True}}
    short_kw = {"n": 2, "seed": 9, "max_tokens": 6, "extra": {"ignore_eos": True}}
    long_prompt = [(7 * i) % 500 + 3 for i in range(900)]
    alone_long = samples(complete(client, PROMPT_A, **long_kw))
    alone = [samples(complete(client, p, **short_kw)) for p in (PROMPT_C, long_prompt)]
    result: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: result.update(out=samples(complete(client, PROMPT_A, **long_kw)))
    )
    worker.start()
    try:
        time.sleep(0.3)  # the generation is under way
        latencies = []
        for _ in range(5):
            start = time.perf_counter()
            assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
            latencies.append(time.perf_counter() - start)
        joined = [samples(complete(client, p, **short_kw)) for p in (PROMPT_C, long_prompt)]
        assert worker.is_alive(), "the long generation ended before the probes"
        assert max(latencies) < 0.5, latencies
    finally:
        worker.join(300)
    require_batch_invariance(server)
    assert joined == alone
    assert result["out"] == alone_long


# --------------------------------------------------------------------------- weight updates


def _update(server: ServerProcess, path: Any, version: str | None = None) -> httpx.Response:
    body: dict[str, Any] = {"model_path": str(path)}
    if version is not None:
        body["weight_version"] = version
    headers = AUTH if server.api_key else {}
    return httpx.post(
        f"{server.url}/update_weights_from_disk", json=body, headers=headers, timeout=60
    )


def test_weight_update_in_place_equals_a_fresh_server(
    servers: dict[str, ServerProcess], client: openai.OpenAI, model_dir: Path, perturbed_dir: Path
) -> None:
    """The update changes the outputs to exactly those of a server started on the new weights;
    a generation in flight during the update finishes entirely on the old weights."""
    main, fresh = servers["main"], servers["fresh"]
    fresh_client = openai.OpenAI(base_url=f"{fresh.url}/v1", api_key="x", max_retries=0)
    kw = {"n": 2, "seed": 3, "max_tokens": 10, "extra": {"ignore_eos": True}}
    long_kw = {"n": 4, "seed": 13, "max_tokens": 600, "extra": {"ignore_eos": True}}
    before = samples(complete(client, [PROMPT_A, PROMPT_C], **kw))
    long_before = samples(complete(client, PROMPT_B, **long_kw))

    in_flight: dict[str, Any] = {}
    worker = threading.Thread(
        target=lambda: in_flight.update(out=samples(complete(client, PROMPT_B, **long_kw)))
    )
    worker.start()
    try:
        time.sleep(0.2)  # the long generation is under way
        resp = _update(main, perturbed_dir, "v1")
    finally:
        worker.join(120)
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
    assert in_flight["out"] == long_before  # no step of it ran on the new weights

    after = samples(complete(client, [PROMPT_A, PROMPT_C], **kw))
    assert after != before
    assert after == samples(complete(fresh_client, [PROMPT_A, PROMPT_C], **kw))
    models = httpx.get(f"{main.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["weight_version"] == "v1"

    resp = _update(main, model_dir, "v0")
    assert resp.status_code == 200 and resp.json()["success"] is True, resp.text
    assert samples(complete(client, [PROMPT_A, PROMPT_C], **kw)) == before


def _bad_checkpoint(kind: str, model_dir: Path, root: Path) -> Path:
    dst = root / kind
    if kind == "missing dir":
        return dst
    dst.mkdir()
    if kind == "no weights":
        shutil.copy(model_dir / "config.json", dst)
        return dst
    tensors = load_file(model_dir / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    if kind == "wrong shape":
        tensors[name] = tensors[name][:, :-1].contiguous()
    elif kind == "unknown tensor":
        tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    elif kind == "missing tensor":
        del tensors[name]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("missing dir", "not a directory"),
        ("no weights", "no *.safetensors"),
        ("wrong shape", "model.layers.0.mlp.up_proj.weight"),
        ("unknown tensor", "model.layers.9.extra.weight"),
        ("missing tensor", "model.layers.0.mlp.up_proj.weight"),
    ],
)
def test_bad_weight_update_is_refused_and_old_weights_keep_serving(
    server: ServerProcess,
    client: openai.OpenAI,
    model_dir: Path,
    tmp_path: Path,
    kind: str,
    says: str,
) -> None:
    before = samples(complete(client, PROMPT_A, seed=1))
    resp = _update(server, _bad_checkpoint(kind, model_dir, tmp_path))
    assert resp.status_code == 400
    assert resp.json()["success"] is False and says in resp.json()["message"]
    assert samples(complete(client, PROMPT_A, seed=1)) == before


def test_weight_update_without_the_key_is_refused_and_changes_nothing(
    server: ServerProcess, client: openai.OpenAI, perturbed_dir: Path
) -> None:
    before = samples(complete(client, PROMPT_A, seed=1))
    body = {"model_path": str(perturbed_dir), "weight_version": "evil"}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        url = f"{server.url}/update_weights_from_disk"
        resp = httpx.post(url, json=body, headers=headers, timeout=60)
        assert resp.status_code == 401, resp.text
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["weight_version"] != "evil"
    assert samples(complete(client, PROMPT_A, seed=1)) == before


def test_update_without_model_path_is_a_400(server: ServerProcess) -> None:
    resp = httpx.post(
        f"{server.url}/update_weights_from_disk", json={"weight_version": "x"}, headers=AUTH
    )
    assert resp.status_code == 400
    assert resp.json()["success"] is False and "model_path" in resp.json()["message"]


def test_sigterm_shuts_the_server_down_cleanly(servers: dict[str, ServerProcess]) -> None:
    fresh = servers["fresh"]  # its last use: the weight-update comparison runs before this
    fresh.proc.send_signal(signal.SIGTERM)
    returncode = fresh.proc.wait(15)
    assert returncode in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in fresh.log()


# --------------------------------------------------------------------------- waiting on the engine


def test_a_request_waits_for_all_its_samples_and_cancels_them_when_abandoned() -> None:
    """The handler wakes once all of a request's engine futures are done (set from the engine's
    thread); a handler that is cancelled cancels its futures, so the engine stops decoding them."""
    import asyncio

    from grail.inference.builtin.app import _all_done

    async def scenario() -> None:
        futures = [concurrent.futures.Future() for _ in range(5)]
        waiter = asyncio.ensure_future(_all_done(futures))
        threading.Thread(
            target=lambda: [f.set_result(i) for i, f in enumerate(futures[:4])]
        ).start()
        await asyncio.sleep(0.05)
        assert not waiter.done()  # one sample still decoding
        threading.Thread(target=lambda: futures[4].set_result(4)).start()
        await asyncio.wait_for(waiter, 5)

        abandoned = [concurrent.futures.Future() for _ in range(3)]
        waiter = asyncio.ensure_future(_all_done(abandoned))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert all(f.cancelled() for f in abandoned)

    asyncio.run(scenario())
