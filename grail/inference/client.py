"""Async client for OpenAI-compatible completion servers (built-in, vLLM, SGLang), token ids in and
token ids + log-probabilities out, through the official `openai` SDK.

Why the client is this strict (see docs/protocols.md):
- Every sampling field is sent on every request. Servers silently fill unset fields from the
  model's generation_config.json, and `max_tokens` defaults to 16.
- Prompts go as token ids and the returned token ids are what we train on. The body is read as
  raw JSON and checked by `parse_completions` (grail/inference/completions.py: the request and
  answer formats, pure), not trusted to the SDK's models (which check nothing and keep the
  non-OpenAI `token_ids` only as an untyped extra; reading the raw body is also cheaper, see
  `_request`).
- One request path for every backend; the answers' differences are handled by `backend`.

Batching. Per-request overhead (the SDK's HTTP stack costs ~1 ms of CPU per request) stays out of
the hot path by sending many prompts per request where the server allows it: `complete_many`
sends the built-in server chunks of prompts (a list of token-id lists, at most
`max_batch_sequences` sequences per request, so the engine sees the batches it would see from one
request per prompt) with one seed per prompt in the `seeds` extension field. vLLM and SGLang give
every prompt of a multi-prompt request the same seed, so they get one request per prompt.

Seeds: sample i of a prompt sent with seed s is sampled with seed s + i (vLLM's rule, which the
built-in server follows), in a batch or alone. SGLang samples from a request's seed only in its
deterministic mode, which the harness refuses (docs/protocols.md, "Seeds").

Retries are the SDK's: connection errors, timeouts, 408/409/429 and 5xx are retried
`max_retries` times with capped exponential backoff and jitter; other 4xx are not (a bad request
stays bad). A failure the SDK gave up on first asks `liveness_check` (a dead server raises its
ServerDiedError), then raises a `GenerationError` that says what failed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import openai

from grail.core.choices import BACKENDS, Backend
from grail.inference.completions import (
    RESERVED_FIELDS,
    Completion,
    GenerationError,
    MalformedResponseError,
    SamplingParams,
    check_prompt,
    check_seed,
    check_seed_count,
    decode_json,
    error_message,
    parse_completions,
    request_body,
)

logger = logging.getLogger(__name__)

#: Status codes the SDK retries (besides connection errors and timeouts).
_RETRIED_STATUS = frozenset({408, 409, 429})


@dataclass
class ClientStats:
    """Counters for metrics: HTTP requests that succeeded or failed for good (one per chunk of
    prompts, not counting the SDK's retries), prompts sent, retries the SDK made for requests
    that then succeeded, requests that failed for good, and the most requests in flight at once."""

    requests: int = 0
    prompts: int = 0
    retries: int = 0
    failures: int = 0
    peak_in_flight: int = 0


# --------------------------------------------------------------------------------------------
# request and response (pure)


def _server_message(exc: openai.APIStatusError) -> str:
    """What the server said: its error message, or the start of the raw body."""
    text = exc.response.text[:200] if exc.response is not None else ""
    return error_message(exc.body) or text or exc.message


# --------------------------------------------------------------------------------------------
# the client


async def in_requests(
    count: int,
    per_request: int,
    send: Callable[[int, int], Awaitable[list[list[Completion]]]],
    on_done: Callable[[int], None] | None = None,
) -> list[list[Completion]]:
    """Prompts 0..count-1 in consecutive chunks of `per_request`, `send(start, stop)` one
    request each, all at once; their groups in prompt order. `on_done(k)` as each request of k
    prompts completes. The first failure cancels the other requests and is raised."""
    results: list[list[Completion]] = [[] for _ in range(count)]

    async def one(start: int) -> None:
        stop = min(start + per_request, count)
        results[start:stop] = await send(start, stop)
        if on_done is not None:
            on_done(stop - start)

    tasks = [asyncio.ensure_future(one(start)) for start in range(0, count, per_request)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:  # a failure (or our cancellation): stop the other requests
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return results


class Completer(Protocol):
    """What generation asks of a completion client: `CompletionClient` (one server) or
    `grail.rollouts.fleet.FleetClient` (several)."""

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]: ...

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Callable[[int], None] | None = None,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> list[list[Completion]]: ...

    async def aclose(self) -> None: ...


class CompletionClient:
    """Completion client for one server and one served model, wrapping one `openai.AsyncOpenAI`.

    base_url: the server's OpenAI base URL (`ServerManager.base_url`, ".../v1").
    model: the served model name (`ServerManager.model_name`).
    backend: which server answers ("builtin", "vllm", "sglang"; `ServerManager.kind`): how many
        prompts go in one request (see `complete_many`) and the details in which the answers
        differ (see `parse_completions`).
    api_key: the server's key, if it has one.
    timeout: seconds for one HTTP attempt (the SDK's timeout: connect, and then the wait for the
        answer of a whole non-streamed generation).
    max_retries: the SDK's retries of connection errors, timeouts, 408/409/429 and 5xx (capped
        exponential backoff from 0.5 s, at most 8 s, with jitter); other 4xx are never retried.
    max_concurrency: requests in flight at once (asyncio.Semaphore; the SDK's retries happen
        inside one slot).
    max_batch_sequences: the built-in server gets requests of at most this many sequences
        (prompts x n, at least one prompt): its --max-batch-size (256 by default), so a request
        is one engine batch.
    liveness_check: called after a failure the SDK gave up on; `ServerManager.check_alive` fits,
        so a dead server raises ServerDiedError rather than a GenerationError.
    extra_body: backend-specific fields added to every request (not those the client sets).

    Use it from one event loop (the generation thread's): the SDK's connections belong to the
    loop of the first request, and another loop is refused. Close it with `await aclose()`.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        backend: Backend = Backend.builtin,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_retries: int = 3,
        max_concurrency: int = 64,
        max_batch_sequences: int = 256,
        liveness_check: Callable[[], None] | None = None,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be >= 1, got {max_batch_sequences}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        clash = RESERVED_FIELDS & set(extra_body or {})
        if clash:
            raise ValueError(
                f"extra_body must not set {sorted(clash)}: the client sends them itself"
            )
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.backend: Backend = backend
        self.timeout = float(timeout)
        self.max_retries = max_retries
        self.max_concurrency = max_concurrency
        self.max_batch_sequences = max_batch_sequences
        self.liveness_check = liveness_check
        self.extra_body = dict(extra_body or {})
        self.stats = ClientStats()
        self._openai = openai.AsyncOpenAI(
            base_url=self.base_url,
            api_key=api_key or "EMPTY",  # the SDK insists on one; a server without keys ignores it
            timeout=self.timeout,
            max_retries=max_retries,
            # No proxies from the environment: the servers are the harness's own, mostly local.
            http_client=openai.DefaultAsyncHttpxClient(trust_env=False),
        )
        self._create = self._openai.completions.with_raw_response.create
        self._semaphore = asyncio.Semaphore(max_concurrency)
        self._in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __repr__(self) -> str:
        return f"CompletionClient(base_url={self.base_url!r}, model={self.model!r})"

    def prompts_per_request(self, n: int) -> int:
        """How many prompts of `n` samples each one request carries: as many as fit in
        `max_batch_sequences` on the built-in server (at least one), one on vLLM and SGLang
        (which would give every prompt of a request the same seed)."""
        return max(1, self.max_batch_sequences // n) if self.backend == "builtin" else 1

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        """Sample `n` completions of one prompt; sample i is sampled with seed + i."""
        (completions,) = await self.complete_many([prompt_ids], n, sampling, [seed])
        return completions

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Callable[[int], None] | None = None,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> list[list[Completion]]:
        """Sample `n` completions of each prompt; returns one list of n per prompt, in input
        order. Sample i of prompt j is sampled with seed `seeds[j] + i`, however the prompts are
        split into requests, so results do not depend on the backend's batching. `spans`, one
        list per prompt: the [start, end) positions of its tokens the policy sampled (an
        episode's earlier turns); the built-in server continues them from its prefix cache
        (`request_body`), other servers are not sent them (their prefix caches need no hint).

        The prompts go in consecutive chunks of `prompts_per_request(n)`, one request each, sent
        concurrently (at most `max_concurrency` at once). `on_done(k)` is called as each request
        completes, with k its number of prompts (a progress bar's advance). The first failure
        cancels the other requests and is raised: the liveness checker's error, a
        `GenerationError` (after the SDK's retries, or at once for a 4xx), or a
        `MalformedResponseError`.
        """
        ids = [check_prompt(p, f"prompts[{j}]") for j, p in enumerate(prompts)]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        check_seed_count(ids, seeds)
        seeds = [check_seed(s, f"seeds[{j}]") for j, s in enumerate(seeds)]
        if spans is not None and len(spans) != len(ids):
            raise ValueError(f"got {len(ids)} prompts but {len(spans)} lists of spans")
        sampled = spans if self.backend == "builtin" else None
        self._bind_loop()
        if not ids:
            return []
        return await in_requests(
            len(ids),
            self.prompts_per_request(n),
            lambda start, stop: self._request(
                ids[start:stop],
                n,
                sampling,
                seeds[start:stop],
                None if sampled is None else sampled[start:stop],
            ),
            on_done,
        )

    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise RuntimeError(
                "CompletionClient is bound to the event loop of its first request (its "
                "connections and concurrency bound live there); use one client per event loop"
            )

    async def _request(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingParams,
        seeds: list[int],
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> list[list[Completion]]:
        """One HTTP request for `prompts`: n completions of each, prompt-major."""
        body = request_body(self.model, prompts, n, sampling, seeds, spans)
        kwargs: dict[str, Any] = {
            key: body.pop(key)
            for key in ("model", "prompt", "n", "max_tokens", "temperature", "top_p", "stop")
        }
        kwargs["logprobs"] = body.pop("logprobs")
        if "seed" in body:
            kwargs["seed"] = body.pop("seed")
        # What the SDK does not know (top_k, return_token_ids, seeds, sampled_spans, extras).
        kwargs["extra_body"] = {**body, **self.extra_body}
        error: openai.APIError | None
        async with self._semaphore:
            self._in_flight += 1
            self.stats.peak_in_flight = max(self.stats.peak_in_flight, self._in_flight)
            try:
                raw = await self._create(**kwargs)
            except openai.APIError as exc:
                error = exc
            else:
                error = None
            finally:
                self._in_flight -= 1
        self.stats.requests += 1
        self.stats.prompts += len(prompts)
        if error is not None:
            self.stats.failures += 1
            raise self._failure(self._what(prompts, n), error)
        self.stats.retries += raw.retries_taken
        # The raw body, checked by parse_completions: json.loads + parse_completions took 3.5 ms
        # for a 256-choice answer, the SDK's `raw.parse()` 12 ms before any check of ours.
        try:
            flat = parse_completions(
                decode_json(raw.http_response.content), n, self.backend, prompts=len(prompts)
            )
        except MalformedResponseError as exc:
            self.stats.failures += 1
            raise MalformedResponseError(
                f"{self._what(prompts, n)}: {exc}", attempts=raw.retries_taken + 1
            ) from None
        return [flat[p * n : (p + 1) * n] for p in range(len(prompts))]

    def _what(self, prompts: list[list[int]], n: int) -> str:
        """A failed request, for its error message."""
        lengths = sorted(map(len, prompts))
        tokens = f"{lengths[0]}" if lengths[0] == lengths[-1] else f"{lengths[0]}-{lengths[-1]}"
        return (
            f"POST {self.base_url}/completions ({len(prompts)} prompt(s) of {tokens} tokens, n={n})"
        )

    def _failure(self, what: str, exc: openai.APIError) -> BaseException:
        """The error to raise for a request the SDK gave up on: the liveness checker's if the
        server died, else a GenerationError that says what failed."""
        status = exc.status_code if isinstance(exc, openai.APIStatusError) else None
        retried = status is None or status >= 500 or status in _RETRIED_STATUS
        if retried and self.liveness_check is not None:
            try:
                self.liveness_check()
            except Exception as died:
                died.__cause__ = exc
                return died
        attempts = self.max_retries + 1 if retried else 1
        if isinstance(exc, openai.APIStatusError):
            message = _server_message(exc)
            if not retried:
                return GenerationError(
                    f"{what} was rejected with HTTP {status} (not retried): {message}",
                    attempts=1,
                    status_code=status,
                )
            last = f"HTTP {status}: {message}"
        elif isinstance(exc, openai.APITimeoutError):
            last = f"timed out after {self.timeout:g} s (the client's per-attempt timeout)"
        else:
            cause = exc.__cause__
            last = f"{exc.message} ({type(cause).__name__}: {cause})" if cause else exc.message
        error = GenerationError(
            f"{what} failed after {attempts} attempt(s); last error: {last}",
            attempts=attempts,
            status_code=status,
        )
        error.__cause__ = exc
        return error

    async def aclose(self) -> None:
        """Close the SDK's connections."""
        await self._openai.close()

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
