"""The async completion client against a real local HTTP server that misbehaves on cue."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import random
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from grail.inference.client import (
    VLLM_NEG_INF,
    Completion,
    CompletionClient,
    GenerationError,
    MalformedResponseError,
    RetryPolicy,
    SamplingParams,
    parse_completions,
    request_body,
)

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.02)
SAMPLING = SamplingParams(max_tokens=3, temperature=0.7, top_p=1.0, top_k=-1, stop=("\n\n",))
Action = str | Callable[[dict], tuple[int, object]]


def ok_response(body: dict) -> dict:
    """A vLLM-shaped answer: choice i continues the prompt with ids last+1+i, ..."""
    last = body["prompt"][-1]
    length = body["max_tokens"]
    choices = []
    for i in range(body["n"]):
        ids = [last + 1 + i + j for j in range(length)]
        choices.append(
            {
                "index": i,
                "text": " ".join(map(str, ids)),
                "token_ids": ids,
                "logprobs": {"token_logprobs": [-0.25 * (j + 1) for j in range(length)]},
                "finish_reason": "length",
            }
        )
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
        self.peers: list[tuple[str, int]] = []  # the client end of each request's connection
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
                    outer.peers.append(self.client_address)
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
    kwargs.setdefault("retry", FAST_RETRY)
    kwargs.setdefault("timeout", 5.0)
    return CompletionClient(server.base_url, "tiny", **kwargs)


def run(coro):
    return asyncio.run(coro)


async def complete_and_close(client: CompletionClient, **kwargs) -> list[Completion]:
    try:
        return await client.complete(
            kwargs.get("prompt_ids", [5, 6, 7]),
            kwargs.get("n", 2),
            kwargs.get("sampling", SAMPLING),
            kwargs.get("seed", 11),
        )
    finally:
        await client.aclose()


# ---- the request and its answer ----------------------------------------------------------------


def test_every_sampling_field_is_sent_explicitly(server: ScriptedServer) -> None:
    completions = run(complete_and_close(make_client(server)))
    (sent,) = server.requests
    expected = request_body("tiny", [5, 6, 7], 2, SAMPLING, 11)
    assert sent == expected
    assert expected["top_k"] == -1 and expected["logprobs"] == 0 and expected["seed"] == 11
    assert expected["return_token_ids"] is True and expected["stop"] == ["\n\n"]
    assert completions == [
        Completion([8, 9, 10], [-0.25, -0.5, -0.75], "length", "8 9 10"),
        Completion([9, 10, 11], [-0.25, -0.5, -0.75], "length", "9 10 11"),
    ]


def test_choices_are_ordered_by_index_and_vllm_neg_inf_is_read_as_inf(
    server: ScriptedServer,
) -> None:
    def shuffled(body: dict) -> tuple[int, object]:
        payload = ok_response(body)
        payload["choices"].reverse()
        payload["choices"][0]["logprobs"]["token_logprobs"][1] = VLLM_NEG_INF
        return 200, payload

    server.actions = [shuffled]
    first, second = run(complete_and_close(make_client(server)))
    assert first.token_ids == [8, 9, 10]
    assert second.token_ids == [9, 10, 11] and second.logprobs[1] == -math.inf


# ---- retries -----------------------------------------------------------------------------------


def test_server_errors_are_retried_until_success(server: ScriptedServer) -> None:
    server.actions = ["500", "503", "ok"]
    client = make_client(server)
    completions = run(complete_and_close(client))
    assert len(completions) == 2
    assert len(server.requests) == 3
    assert (client.stats.requests, client.stats.attempts, client.stats.retries) == (1, 3, 2)
    assert client.stats.failures == 0


def test_dropped_connections_are_retried(server: ScriptedServer) -> None:
    server.actions = ["drop", "drop", "ok"]
    assert len(run(complete_and_close(make_client(server)))) == 2
    assert len(server.requests) == 3


def test_persistent_failure_gives_a_clear_error_after_max_attempts(server: ScriptedServer) -> None:
    server.actions = ["500"] * 10
    client = make_client(server, retry=RetryPolicy(max_attempts=3, initial_backoff=0.01))
    with pytest.raises(GenerationError) as info:
        run(complete_and_close(client))
    message = str(info.value)
    assert "failed after 3 attempt(s)" in message
    assert "HTTP 500: engine hiccup 500" in message
    assert "/v1/completions (n=2, 3 prompt tokens)" in message
    assert info.value.attempts == 3 and info.value.status_code == 500
    assert len(server.requests) == 3 and client.stats.failures == 1


def test_timeouts_are_retried_then_reported(server: ScriptedServer) -> None:
    server.actions = ["hang:2", "hang:2"]
    client = make_client(server, timeout=0.3, retry=RetryPolicy(2, 0.01, 0.01))
    t0 = time.monotonic()
    with pytest.raises(GenerationError, match=r"2 attempt\(s\).*timed out after 0.3 s"):
        run(complete_and_close(client))
    assert time.monotonic() - t0 < 1.5  # two bounded attempts, not two server sleeps
    assert len(server.requests) == 2


def test_client_errors_are_not_retried_and_carry_the_servers_message(
    server: ScriptedServer,
) -> None:
    server.actions = ["400", "ok"]
    client = make_client(server)
    with pytest.raises(GenerationError) as info:
        run(complete_and_close(client))
    assert "HTTP 400 (not retried)" in str(info.value)
    assert "maximum context length is 32 tokens" in str(info.value)
    assert info.value.status_code == 400 and info.value.attempts == 1
    assert len(server.requests) == 1


def test_liveness_check_stops_retrying_a_dead_server(server: ScriptedServer) -> None:
    class Died(RuntimeError):
        pass

    def check_alive() -> None:
        raise Died("server died with exit code -9")

    server.actions = ["drop"] * 10
    client = make_client(server, liveness_check=check_alive)
    with pytest.raises(Died):
        run(complete_and_close(client))
    assert len(server.requests) == 1


def test_backoff_doubles_up_to_the_cap_with_bounded_jitter() -> None:
    rng = random.Random(0)
    exact = RetryPolicy(max_attempts=10, initial_backoff=0.1, max_backoff=0.5, jitter=0.0)
    assert [exact.delay(k, rng) for k in range(1, 6)] == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5])
    jittered = RetryPolicy(max_attempts=10, initial_backoff=0.1, max_backoff=0.5, jitter=0.5)
    delays = [jittered.delay(3, rng) for _ in range(200)]
    assert all(0.2 <= d <= 0.4 for d in delays)
    assert max(delays) - min(delays) > 0.1  # actually spread out


def test_total_retry_wait_is_bounded(server: ScriptedServer) -> None:
    server.actions = ["500"] * 10
    policy = RetryPolicy(max_attempts=4, initial_backoff=0.1, max_backoff=0.15, jitter=0.5)
    t0 = time.monotonic()
    with pytest.raises(GenerationError):
        run(complete_and_close(make_client(server, retry=policy)))
    elapsed = time.monotonic() - t0
    # sleeps: min(0.15, 0.1 * 2**(k-1)) * U(0.5, 1) for k = 1..3 -> between 0.2 and 0.4 s
    assert 0.2 <= elapsed < 0.4 + 0.5


def test_retry_jitter_leaves_the_global_rng_alone(server: ScriptedServer) -> None:
    server.actions = ["500", "500", "ok"]
    random.seed(1234)
    state = random.getstate()
    run(complete_and_close(make_client(server)))
    assert random.getstate() == state


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
        run(complete_and_close(make_client(server)))
    assert expected in str(info.value)
    assert len(server.requests) == 1  # a server bug is not retried


def test_parse_completions_rejects_non_objects() -> None:
    with pytest.raises(MalformedResponseError, match="expected a JSON object, got list"):
        parse_completions([], 1)


# ---- concurrency and event loops ---------------------------------------------------------------


def test_concurrency_bound_is_honoured(server: ScriptedServer) -> None:
    server.actions = ["slow:0.15"] * 10
    client = make_client(server, max_concurrency=3)

    async def many() -> list[list[Completion]]:
        try:
            return await asyncio.gather(
                *(client.complete([1, 2, i + 3], 1, SAMPLING, seed=i) for i in range(10))
            )
        finally:
            await client.aclose()

    results = run(many())
    assert [r[0].token_ids[0] for r in results] == [i + 4 for i in range(10)]
    assert server.max_in_flight == 3  # never more, and the bound is actually used
    assert client.stats.peak_in_flight == 3


def test_client_works_across_event_loops_without_leaking_sockets(server: ScriptedServer) -> None:
    # The rollout generator runs one asyncio.run per iteration and never closes the client.
    client = make_client(server)

    async def once() -> list[Completion]:
        return await client.complete([1, 2], 1, SAMPLING, seed=0)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert run(once()) == run(once()) == run(once())
        gc.collect()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]


def test_a_session_reuses_connections_and_closes_them(server: ScriptedServer) -> None:
    """Inside session() requests share keep-alive connections (at most max_concurrency of them);
    outside one, each request has its own. Nothing is left open either way."""
    client = make_client(server, max_concurrency=3)

    async def in_session() -> None:
        async with client.session():
            for i in range(4):  # one after the other: one connection
                await client.complete([1, 2, i + 3], 1, SAMPLING, seed=i)
            await asyncio.gather(  # at most 3 at once: at most 3 connections
                *(client.complete([1, 2, i + 3], 1, SAMPLING, seed=i) for i in range(9))
            )

    async def outside() -> None:
        for i in range(4):
            await client.complete([1, 2, i + 3], 1, SAMPLING, seed=i)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run(in_session())
        assert len(set(server.peers[:4])) == 1
        assert len(set(server.peers)) <= 3
        server.peers.clear()
        run(outside())
        assert len(set(server.peers)) == 4
        gc.collect()
    leaks = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, [str(w.message) for w in leaks]


@pytest.mark.parametrize("pause", [0.0, 0.05], ids=["racing-the-close", "after-the-close"])
def test_a_connection_the_server_closed_is_replaced_without_a_retry(
    server: ScriptedServer, pause: float
) -> None:
    """Servers close idle keep-alive connections (uvicorn after 5 s): the next request on one
    goes out on a new connection, and is neither an error nor a retry, whether the close has
    reached the client before it sends or not."""
    server.actions = ["ok-then-close", "ok-then-close", "ok"]
    client = make_client(server)

    async def three() -> None:
        async with client.session():
            for i in range(3):
                await client.complete([1, 2, i + 3], 1, SAMPLING, seed=i)
                await asyncio.sleep(pause)

    run(three())
    assert len(server.requests) == 3 and len(set(server.peers)) == 3
    assert (client.stats.attempts, client.stats.retries, client.stats.failures) == (3, 0, 0)


def test_sessions_on_two_event_loops_at_once(server: ScriptedServer) -> None:
    """A generation thread and the main thread can use one client at the same time."""
    server.actions = ["slow:0.3"] * 8  # long enough that the two loops surely overlap
    client = make_client(server, max_concurrency=2)

    async def batch(offset: int) -> list[int]:
        async with client.session():
            results = await asyncio.gather(
                *(client.complete([1, offset + i], 1, SAMPLING, seed=i) for i in range(4))
            )
        return [r[0].token_ids[0] for r in results]

    other: list[list[int]] = []
    thread = threading.Thread(target=lambda: other.append(run(batch(100))))
    thread.start()
    mine = run(batch(200))
    thread.join(10)
    assert mine == [201 + i for i in range(4)] and other == [[101 + i for i in range(4)]]
    assert server.max_in_flight == 4  # each loop has its own bound of 2


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
    ("prompt_ids", "n", "seed", "field"),
    [
        ([], 1, 0, "prompt_ids is empty"),
        ([1, -2], 1, 0, r"prompt_ids\[1\]"),
        ([1, 2.0], 1, 0, r"prompt_ids\[1\]"),
        ([1], 0, 0, "n must be"),
        ([1], 1, None, "seed must be"),
    ],
)
def test_bad_request_arguments_are_named(
    server: ScriptedServer, prompt_ids: list, n: int, seed: object, field: str
) -> None:
    client = make_client(server)
    with pytest.raises(ValueError, match=field):
        run(client.complete(prompt_ids, n, SAMPLING, seed))  # type: ignore[arg-type]
    assert server.requests == []


def test_extra_body_is_sent_with_every_request(server: ScriptedServer) -> None:
    run(complete_and_close(make_client(server, extra_body={"min_tokens": 2})))
    assert server.requests[0]["min_tokens"] == 2
    assert server.requests[0]["top_k"] == -1


def test_extra_body_cannot_override_sampling_fields() -> None:
    with pytest.raises(ValueError, match=r"extra_body must not set \['temperature'\]"):
        CompletionClient("http://127.0.0.1:1/v1", "tiny", extra_body={"temperature": 0.0})


def test_client_does_not_print_its_api_key() -> None:
    client = CompletionClient("http://127.0.0.1:1/v1", "tiny", api_key="sk-secret")
    assert "sk-secret" not in repr(client)
