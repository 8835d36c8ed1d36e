"""The completion client (the openai SDK underneath) against real local HTTP servers: a scripted
one that misbehaves on cue, and the built-in server on the tiny model."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grail.core.config import GenerationConfig
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.client import CompletionClient
from grail.inference.completions import (
    VLLM_NEG_INF,
    Completion,
    GenerationError,
    MalformedResponseError,
    SamplingParams,
    parse_completions,
    request_body,
)
from grail.rollouts.generation import sampling_params

SAMPLING = SamplingParams(max_tokens=3, temperature=0.7, top_p=1.0, top_k=-1, stop=("\n\n",))
Action = str | Callable[[dict], tuple[int, object]]


def fake_choices(prompt: list[int], n: int, seed: int, length: int, first: int) -> list[dict]:
    """Sample i of `prompt` under `seed`: token ids [seed + i, prompt[-1], 1, 2, ...], so a test
    can read back which seed and prompt produced it."""
    choices = []
    for i in range(n):
        ids = [seed + i, prompt[-1], *range(1, length - 1)][:length]
        choices.append(
            {
                "index": first + i,
                "text": " ".join(map(str, ids)),
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.25 * (j + 1) for j in range(length)]},
                "finish_reason": "length",
            }
        )
    return choices


def ok_response(body: dict) -> dict:
    """A vLLM-shaped answer, prompt-major over a batch of prompts, with `seeds` (one per
    prompt, the built-in server's extension) or `seed` (every prompt the same, as vLLM)."""
    prompt = body["prompt"]
    prompts = prompt if isinstance(prompt[0], list) else [prompt]
    seeds = body.get("seeds") or [body["seed"]] * len(prompts)
    n = body["n"]
    choices = []
    for p, (ids, seed) in enumerate(zip(prompts, seeds, strict=True)):
        choices += fake_choices(ids, n, seed, body["max_tokens"], p * n)
    return {"id": "cmpl-1", "object": "text_completion", "model": body["model"], "choices": choices}


class ScriptedServer:
    """POST /v1/completions answered by a script of actions, one per request (then "ok").

    Actions: "ok"; "500"/"503" (server error); "400" (bad request with an OpenAI-style error
    body); "drop" (close the connection without answering); "ok-then-close" (answer, then close
    the connection as a server closes an idle keep-alive one); "hang:S" and "slow:S" (sleep S
    seconds, then stay silent or answer ok); or a callable body -> (status, payload), where a
    payload of type bytes is sent raw.
    """

    def __init__(self, actions: list[Action] | None = None) -> None:
        self.actions: list[Action] = list(actions or [])
        self.requests: list[dict] = []
        self.headers: list[dict[str, str]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(body)
                    outer.headers.append({k.lower(): v for k, v in self.headers.items()})
                    action = outer.actions.pop(0) if outer.actions else "ok"
                    outer.in_flight += 1
                    outer.max_in_flight = max(outer.max_in_flight, outer.in_flight)
                try:
                    outer.act(self, action, body)
                finally:
                    with outer.lock:
                        outer.in_flight -= 1

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, payload: object) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)

    def act(self, handler: BaseHTTPRequestHandler, action: Action, body: dict) -> None:
        if callable(action):
            self.send(handler, *action(body))
        elif action == "ok":
            self.send(handler, 200, ok_response(body))
        elif action in ("500", "503"):
            self.send(handler, int(action), {"error": {"message": f"engine hiccup {action}"}})
        elif action == "400":
            message = "This model's maximum context length is 32 tokens; you asked for 40"
            self.send(handler, 400, {"error": {"message": message, "type": "BadRequestError"}})
        elif action == "drop":
            handler.close_connection = True
        elif action == "ok-then-close":  # answer, then close the connection unannounced
            self.send(handler, 200, ok_response(body))
            handler.close_connection = True
        elif action.startswith("hang:"):
            time.sleep(float(action[5:]))
            handler.close_connection = True
        elif action.startswith("slow:"):
            time.sleep(float(action[5:]))
            self.send(handler, 200, ok_response(body))
        else:
            raise AssertionError(f"unknown action {action!r}")


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    scripted.thread.start()
    yield scripted
    scripted.httpd.shutdown()
    scripted.httpd.server_close()


def make_client(server: ScriptedServer, **kwargs) -> CompletionClient:
    kwargs.setdefault("max_retries", 2)
    kwargs.setdefault("timeout", 5.0)
    return CompletionClient(server.base_url, "tiny", **kwargs)


def run(client: CompletionClient, coro_fn: Callable[[CompletionClient], object]) -> object:
    """One event loop for the client's whole life, closed at the end, as the generation thread
    uses it."""

    async def main():
        try:
            return await coro_fn(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def complete(client: CompletionClient, **kwargs) -> list[Completion]:
    return run(
        client,
        lambda c: c.complete(
            kwargs.get("prompt_ids", [5, 6, 7]),
            kwargs.get("n", 2),
            kwargs.get("sampling", SAMPLING),
            kwargs.get("seed", 11),
        ),
    )


# ---- the request and its answer ----------------------------------------------------------------


def test_every_sampling_field_is_sent_explicitly(server: ScriptedServer) -> None:
    completions = complete(make_client(server))
    (sent,) = server.requests
    expected = request_body("tiny", [[5, 6, 7]], 2, SAMPLING, [11])
    assert sent == expected
    assert expected["prompt"] == [5, 6, 7]  # one prompt: a flat token-id list
    assert expected["top_k"] == -1 and expected["logprobs"] == 0 and expected["seed"] == 11
    assert expected["return_token_ids"] is True and expected["stop"] == ["\n\n"]
    assert completions == [
        Completion([11, 7, 1], [-0.25, -0.5, -0.75], "length", "11 7 1"),
        Completion([12, 7, 1], [-0.25, -0.5, -0.75], "length", "12 7 1"),
    ]


def test_api_key_goes_as_a_bearer_token_and_not_into_repr(server: ScriptedServer) -> None:
    client = make_client(server, api_key="sk-secret")
    assert "sk-secret" not in repr(client)
    complete(client)
    assert server.headers[0]["authorization"] == "Bearer sk-secret"


def test_choices_are_ordered_by_index_and_vllm_neg_inf_is_read_as_inf(
    server: ScriptedServer,
) -> None:
    def shuffled(body: dict) -> tuple[int, object]:
        payload = ok_response(body)
        payload["choices"].reverse()
        payload["choices"][0]["logprobs"]["token_logprobs"][1] = VLLM_NEG_INF
        return 200, payload

    server.actions = [shuffled]
    first, second = complete(make_client(server))
    assert first.token_ids == [11, 7, 1]
    assert second.token_ids == [12, 7, 1] and second.logprobs[1] == -math.inf


def test_sampling_params_from_the_generation_config() -> None:
    gen = GenerationConfig(max_new_tokens=5, temperature=0.5, top_p=0.9, top_k=7)
    assert sampling_params(gen) == SamplingParams(max_tokens=5, temperature=0.5, top_p=0.9, top_k=7)


# ---- many prompts ------------------------------------------------------------------------------


def seeds_used(groups: list[list[Completion]]) -> list[list[int]]:
    """The seed each sample was drawn with (the fake server's first token) per prompt."""
    return [[c.token_ids[0] for c in group] for group in groups]


def test_complete_many_batches_prompts_with_one_seed_each_on_the_builtin_server(
    server: ScriptedServer,
) -> None:
    prompts = [[1, 100 + j] for j in range(5)]
    seeds = [1000 * (j + 1) for j in range(5)]
    done: list[int] = []
    client = make_client(server, max_batch_sequences=7)  # 7 // n=3: two prompts per request
    groups = run(client, lambda c: c.complete_many(prompts, 3, SAMPLING, seeds, done.append))
    # In input order; prompt j's sample i was drawn with seeds[j] + i.
    assert seeds_used(groups) == [[s, s + 1, s + 2] for s in seeds]
    assert [[c.token_ids[1] for c in g] for g in groups] == [[100 + j] * 3 for j in range(5)]
    # Requests of at most 7 sequences: [2, 2, 1] prompts, the last one plain OpenAI.
    bodies = sorted(server.requests, key=lambda b: b.get("seeds", [b.get("seed")])[0])
    assert [b["prompt"] for b in bodies] == [prompts[0:2], prompts[2:4], prompts[4]]
    assert [b.get("seeds") for b in bodies] == [seeds[0:2], seeds[2:4], None]
    assert "seed" not in bodies[0] and bodies[2]["seed"] == seeds[4]
    assert sorted(done) == [1, 2, 2]
    assert (client.stats.requests, client.stats.prompts) == (3, 5)


def test_complete_many_sends_vllm_and_sglang_one_request_per_prompt(
    server: ScriptedServer,
) -> None:
    """They give every prompt of a request the same seed: one request each keeps seeds[j] + i."""
    prompts = [[1, 100 + j] for j in range(4)]
    seeds = [7, 70, 700, 7000]
    done: list[int] = []
    client = make_client(server, backend="vllm")
    groups = run(client, lambda c: c.complete_many(prompts, 2, SAMPLING, seeds, done.append))
    assert seeds_used(groups) == [[s, s + 1] for s in seeds]
    assert sorted((b["prompt"], b["seed"]) for b in server.requests) == list(
        zip(prompts, seeds, strict=True)
    )
    assert all("seeds" not in b for b in server.requests) and done == [1, 1, 1, 1]


@pytest.mark.parametrize("backend", ["builtin", "vllm"])
def test_sampled_spans_go_to_the_builtin_server_only(server: ScriptedServer, backend: str) -> None:
    """An episode's later turns carry the spans the policy sampled (the built-in server's
    prefix cache continues them); vLLM and SGLang cache prefixes without being told."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    spans = [[(1, 3)], []]
    client = make_client(server, backend=backend)
    run(client, lambda c: c.complete_many(prompts, 1, SAMPLING, [1, 2], spans=spans))
    sent = [b.get("sampled_spans") for b in server.requests]
    assert sent == ([[[[1, 3]], []]] if backend == "builtin" else [None, None])


def test_complete_many_sends_the_chunks_concurrently(server: ScriptedServer) -> None:
    server.actions = ["slow:0.3"] * 4
    client = make_client(server, max_batch_sequences=2)
    t0 = time.monotonic()
    groups = run(
        client, lambda c: c.complete_many([[1, j] for j in range(8)], 1, SAMPLING, [0] * 8)
    )
    assert len(groups) == 8 and time.monotonic() - t0 < 1.0
    assert server.max_in_flight == 4 and len(server.requests) == 4


def test_concurrency_bound_is_honoured(server: ScriptedServer) -> None:
    server.actions = ["slow:0.15"] * 10
    client = make_client(server, backend="vllm", max_concurrency=3)
    prompts = [[1, 2, i + 3] for i in range(10)]
    groups = run(client, lambda c: c.complete_many(prompts, 1, SAMPLING, list(range(10))))
    assert seeds_used(groups) == [[i] for i in range(10)]
    assert server.max_in_flight == 3  # never more, and the bound is actually used
    assert client.stats.peak_in_flight == 3


def test_the_first_failure_cancels_the_other_requests(server: ScriptedServer) -> None:
    server.actions = ["400", *["slow:2"] * 5]
    client = make_client(server, backend="vllm", max_concurrency=1)
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match="HTTP 400"):
        run(client, lambda c: c.complete_many([[1, j] for j in range(6)], 1, SAMPLING, [0] * 6))
    assert time.monotonic() - t0 < 1.5  # the queued requests were not sent after it


# ---- retries (the SDK's) and failures ----------------------------------------------------------


def test_server_errors_are_retried_until_success(server: ScriptedServer) -> None:
    server.actions = ["500", "503", "ok"]
    client = make_client(server)
    assert len(complete(client)) == 2
    assert len(server.requests) == 3
    assert (client.stats.requests, client.stats.retries, client.stats.failures) == (1, 2, 0)


def test_dropped_connections_are_retried(server: ScriptedServer) -> None:
    server.actions = ["drop", "ok"]
    assert len(complete(make_client(server))) == 2
    assert len(server.requests) == 2


def test_persistent_failure_gives_a_clear_error_after_the_retries(server: ScriptedServer) -> None:
    server.actions = ["500"] * 10
    client = make_client(server, max_retries=1)
    with pytest.raises(GenerationError) as info:
        complete(client)
    message = str(info.value)
    assert "failed after 2 attempt(s)" in message
    assert "HTTP 500: engine hiccup 500" in message
    assert "/v1/completions (1 prompt(s) of 3 tokens, n=2)" in message
    assert info.value.attempts == 2 and info.value.status_code == 500
    assert len(server.requests) == 2 and client.stats.failures == 1


def test_a_timeout_raises(server: ScriptedServer) -> None:
    server.actions = ["hang:2", "hang:2"]
    client = make_client(server, timeout=0.3, max_retries=0)
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match=r"1 attempt\(s\).*timed out after 0.3 s"):
        complete(client)
    assert time.monotonic() - t0 < 1.5  # a bounded attempt, not the server's sleep
    assert len(server.requests) == 1


def test_client_errors_are_not_retried_and_carry_the_servers_message(
    server: ScriptedServer,
) -> None:
    server.actions = ["400", "ok"]
    client = make_client(server)
    with pytest.raises(GenerationError) as info:
        complete(client)
    assert "HTTP 400 (not retried)" in str(info.value)
    assert "maximum context length is 32 tokens" in str(info.value)
    assert info.value.status_code == 400 and info.value.attempts == 1
    assert len(server.requests) == 1


def test_liveness_check_turns_a_dead_server_into_its_error(server: ScriptedServer) -> None:
    class Died(RuntimeError):
        pass

    def check_alive() -> None:
        raise Died("server died with exit code -9")

    server.actions = ["drop"] * 10
    client = make_client(server, liveness_check=check_alive, max_retries=1)
    with pytest.raises(Died):
        complete(client)
    assert len(server.requests) == 2  # checked once the SDK gave up


def test_liveness_check_is_not_asked_about_a_bad_request(server: ScriptedServer) -> None:
    def check_alive() -> None:
        raise AssertionError("a 400 says nothing about the server's health")

    server.actions = ["400"]
    with pytest.raises(GenerationError, match="HTTP 400"):
        complete(make_client(server, liveness_check=check_alive))


def test_connection_refused_is_reported_after_the_retries() -> None:
    client = CompletionClient("http://127.0.0.1:1/v1", "tiny", max_retries=0, timeout=2)
    with pytest.raises(GenerationError, match=r"failed after 1 attempt\(s\).*Connection error"):
        complete(client)


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["racing-the-close", "after-the-close"])
def test_a_connection_the_server_closed_is_replaced(server: ScriptedServer, pause: float) -> None:
    """Servers close idle keep-alive connections (uvicorn after 5 s): the next request is not an
    error, whether the close has reached the client before it sends or not."""
    server.actions = ["ok-then-close", "ok-then-close", "ok"]
    client = make_client(server)

    async def three(c: CompletionClient) -> None:
        for i in range(3):
            await c.complete([1, 2, i + 3], 1, SAMPLING, seed=i)
            await asyncio.sleep(pause)

    run(client, three)
    assert client.stats.failures == 0 and client.stats.requests == 3


# ---- malformed answers -------------------------------------------------------------------------


def _mutate(edit: Callable[[dict], object]) -> Callable[[dict], tuple[int, object]]:
    def action(body: dict) -> tuple[int, object]:
        payload = ok_response(body)
        edit(payload)
        return 200, payload

    return action


MALFORMED = {
    "no token_ids": (
        _mutate(lambda p: p["choices"][0].pop("token_ids")),
        "ignored return_token_ids",
    ),
    "length mismatch": (
        _mutate(lambda p: p["choices"][1]["logprobs"]["token_logprobs"].pop()),
        "choices[1] has 3 token ids but 2 log-probabilities",
    ),
    "wrong n": (_mutate(lambda p: p["choices"].pop()), "asked for n=2 completions, got 1"),
    "no logprobs": (
        _mutate(lambda p: p["choices"][0].update(logprobs=None)),
        "no 'logprobs.token_logprobs'",
    ),
    "null logprob": (
        _mutate(lambda p: p["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, None)),
        "token_logprobs[0] = None is not a number",
    ),
    "probability not logprob": (
        _mutate(lambda p: p["choices"][0]["logprobs"]["token_logprobs"].__setitem__(0, 0.7)),
        "0.7 is not a log-probability",
    ),
    "string ids": (
        _mutate(lambda p: p["choices"][0].update(token_ids=["8", "9", "10"])),
        "token_ids is not a list of non-negative ints",
    ),
    "no tokens": (
        _mutate(lambda p: p["choices"][0].update(token_ids=[], logprobs={"token_logprobs": []})),
        "choices[0] has no tokens",
    ),
    "duplicate index": (
        _mutate(lambda p: p["choices"][1].update(index=0)),
        "index 0 appears twice",
    ),
    "no choices": (lambda body: (200, {"error": "oops"}), "no 'choices' list"),
    "not json": (lambda body: (200, b"<html>proxy error</html>"), "body is not JSON"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_responses_are_errors_not_empty_completions(
    server: ScriptedServer, case: str
) -> None:
    action, expected = MALFORMED[case]
    server.actions = [action, "ok"]
    with pytest.raises(MalformedResponseError, match="malformed completion response") as info:
        complete(make_client(server))
    assert expected in str(info.value)
    assert len(server.requests) == 1  # a server bug is not retried


def test_a_batch_answer_with_too_few_choices_is_malformed(server: ScriptedServer) -> None:
    server.actions = [_mutate(lambda p: p["choices"].pop())]
    client = make_client(server)
    with pytest.raises(MalformedResponseError, match=r"asked for 2 prompts x n=2 = 4 completions"):
        run(client, lambda c: c.complete_many([[1], [2]], 2, SAMPLING, [0, 9]))


def test_parse_completions_rejects_non_objects() -> None:
    with pytest.raises(MalformedResponseError, match="expected a JSON object, got list"):
        parse_completions([], 1)


# ---- event loops and resources -----------------------------------------------------------------


def test_a_second_event_loop_is_refused(server: ScriptedServer) -> None:
    client = make_client(server)

    async def once() -> list[Completion]:
        return await client.complete([1, 2], 1, SAMPLING, seed=0)

    run(client, lambda c: once())
    with pytest.raises(RuntimeError, match="bound to the event loop of its first request"):
        asyncio.run(once())


def test_aclose_leaves_no_socket_open(server: ScriptedServer) -> None:
    # Garbage of earlier tests in this worker first (an in-process run's heap is frozen until it
    # ends, so what it left can wait for a later collection): only this client's leaks count.
    gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        client = make_client(server)

        async def several(c: CompletionClient) -> None:
            for i in range(3):
                await c.complete([1, 2], 1, SAMPLING, seed=i)
            await c.complete_many([[1, 2]] * 4, 1, SAMPLING, [0] * 4)

        run(client, several)
        del client
        gc.collect()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 4, "temperature": -1.0}, "temperature"),
        ({"max_tokens": 4, "top_p": 0.0}, "top_p"),
        ({"max_tokens": 4, "top_k": 0}, "top_k"),
        ({"max_tokens": 4, "stop": ("",)}, "stop"),
    ],
)
def test_bad_sampling_params_are_named(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_single_stop_string_is_one_stop_string() -> None:
    assert SamplingParams(max_tokens=4, stop="\n").stop == ("\n",)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("prompts", "n", "seeds", "field"),
    [
        ([[]], 1, [0], r"prompts\[0\] is empty"),
        ([[1], [1, -2]], 1, [0, 0], r"prompts\[1\]\[1\]"),
        ([[1, 2.0]], 1, [0], r"prompts\[0\]\[1\]"),
        ([[1]], 0, [0], "n must be"),
        ([[1]], 1, [None], r"seeds\[0\] must be an int"),
        ([[1], [2]], 1, [0], "2 prompts but 1 seeds"),
    ],
)
def test_bad_request_arguments_are_named(
    server: ScriptedServer, prompts: list, n: int, seeds: list, field: str
) -> None:
    client = make_client(server)
    with pytest.raises(ValueError, match=field):
        run(client, lambda c: c.complete_many(prompts, n, SAMPLING, seeds))
    assert server.requests == []


def test_extra_body_is_sent_with_every_request(server: ScriptedServer) -> None:
    complete(make_client(server, extra_body={"min_tokens": 2}))
    assert server.requests[0]["min_tokens"] == 2
    assert server.requests[0]["top_k"] == -1


@pytest.mark.parametrize("name", ["temperature", "seeds"])
def test_extra_body_cannot_override_the_clients_fields(name: str) -> None:
    with pytest.raises(ValueError, match=rf"extra_body must not set \['{name}'\]"):
        CompletionClient("http://127.0.0.1:1/v1", "tiny", extra_body={name: 0})


# ---- the built-in server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_server(tiny_server: BuiltinServer) -> str:
    """The base URL of `grail-serve` on the tiny model, served as "tiny" (conftest.py)."""
    return tiny_server.base_url


def test_complete_many_on_the_builtin_server_equals_one_request_per_prompt(
    builtin_server: str,
) -> None:
    """Batched into requests of several prompts with the `seeds` extension, every prompt gets
    bitwise the samples a request of its own with its seed gets (CPU: batch-invariant engine)."""
    prompts = [[5, 77, 301, 12], [40, 41, 42], list(range(100, 121)), [9], [3, 4]]
    seeds = [11, 12, 1000, 0, 2**31 - 2**16]
    sampling = SamplingParams(max_tokens=5, temperature=1.0)

    def client(**kw) -> CompletionClient:
        return CompletionClient(builtin_server, "tiny", **kw)

    batched = client(max_batch_sequences=6)  # 6 // n=3: two prompts per request
    many = run(batched, lambda c: c.complete_many(prompts, 3, sampling, seeds))
    assert batched.stats.requests == 3

    async def singles(c: CompletionClient) -> list[list[Completion]]:
        return [await c.complete(p, 3, sampling, s) for p, s in zip(prompts, seeds, strict=True)]

    assert many == run(client(), singles)
    assert len({tuple(c.token_ids) for group in many for c in group}) > 5
