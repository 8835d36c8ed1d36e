"""Async client for OpenAI-compatible completion servers (built-in, vLLM, SGLang), token ids in and
token ids + log-probabilities out, through the official `openai` SDK.

Why the client is this strict (see docs/protocols.md):
- Every sampling field is sent on every request. Servers silently fill unset fields from the
  model's generation_config.json, and `max_tokens` defaults to 16.
- Prompts go as token ids and the returned token ids are what we train on; text is only for
  scoring. So a response without `token_ids`, or with a log-probability list of another length, is
  an error, never an empty or misaligned completion. The body is read as raw JSON and checked by
  `parse_completions`, not trusted to the SDK's models (which check nothing and keep the
  non-OpenAI `token_ids` only as an untyped extra; reading the raw body is also cheaper, see
  `_request`).
- One request path for every backend. The answers differ in two details, handled by `backend`:
  vLLM and the built-in server send a -inf log-probability as -9999.0, SGLang as `null` (pydantic
  writes infinities as null); vLLM may end a sample with "repetition" (read as "stop"), SGLang can
  leave `finish_reason` null, which is an error here rather than a guess.

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
import json
import logging
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import openai

from grail.core.choices import BACKENDS, Backend

logger = logging.getLogger(__name__)

# vLLM sends -inf log-probabilities as this value (JSON has no infinity).
VLLM_NEG_INF = -9999.0
#: finish reasons a Completion carries: "stop" (EOS or a stop string), "length" (max_tokens or the
#: context length), "abort" (the server cancelled the request)
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
# Other spellings, per backend, of the same three reasons.
_FINISH_ALIASES: dict[str, dict[str, str]] = {
    "builtin": {},
    "vllm": {"repetition": "stop"},  # vLLM's opt-in repetition detector ended the sample
    "sglang": {},
}
# Log-probabilities are <= 0; a little slack for float round-off in the server.
_LOGPROB_SLACK = 1e-3
#: Status codes the SDK retries (besides connection errors and timeouts).
_RETRIED_STATUS = frozenset({408, 409, 429})
#: Fields the client sends itself; `extra_body` may not set them.
RESERVED_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "n",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "seed",
        "seeds",
        "logprobs",
        "return_token_ids",
    }
)


class GenerationError(RuntimeError):
    """A completion request failed for good (after the SDK's retries, or at once for 4xx and
    malformed answers). `attempts` is how many HTTP attempts were made (at most)."""

    def __init__(self, message: str, *, attempts: int, status_code: int | None = None) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.status_code = status_code


class MalformedResponseError(GenerationError):
    """The server answered 200 with a body that is not a valid completion response."""


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings, all of them sent explicitly on every request.

    top_k = -1 disables top-k. Log-probabilities match the trainer's log-softmax(logits / T) only
    with top_p = 1 and top_k = -1 (or a server that reports processed log-probabilities).
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise ValueError(f"max_tokens must be an int, got {self.max_tokens!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an int, got {self.top_k!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if isinstance(self.stop, str):  # a bare string would be sent as a list of characters
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")


@dataclass(frozen=True)
class Completion:
    """One sampled completion: the server's token ids, one behaviour log-probability per token
    (-inf where the server sent vLLM's -9999.0), why it stopped ("stop", "length", "abort"), and
    its text (for scoring only)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str


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


def _check_prompt(prompt_ids: Sequence[int], name: str = "prompt_ids") -> list[int]:
    ids = list(prompt_ids)
    if not ids:
        raise ValueError(f"{name} is empty")
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"{name}[{i}] = {tok!r} is not a non-negative int token id")
    return ids


def _check_seed(seed: object, name: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"{name} must be an int, got {seed!r}")
    return seed


def request_body(
    model: str,
    prompts: Sequence[Sequence[int]],
    n: int,
    sampling: SamplingParams,
    seeds: Sequence[int],
) -> dict[str, Any]:
    """The JSON body of one /v1/completions request for `prompts` (before the client's
    `extra_body`). One prompt goes as a flat token-id list with the standard `seed`; several go
    as a list of token-id lists with the built-in server's `seeds` extension, one per prompt
    (sample i of prompt j is sampled with seeds[j] + i)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompts[0]) if len(prompts) == 1 else [list(p) for p in prompts],
        "n": n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop": list(sampling.stop),
        "logprobs": 0,
        "return_token_ids": True,
    }
    if len(prompts) == 1:
        body["seed"] = seeds[0]
    else:
        body["seeds"] = list(seeds)
    return body


def parse_completions(
    data: Any, n: int, backend: Backend = Backend.builtin, *, prompts: int = 1
) -> list[Completion]:
    """Parse an OpenAI completion response into `prompts * n` Completions, ordered by choice
    index (prompt-major: choice p * n + i is sample i of prompt p).

    Each choice needs `token_ids` (ints), `logprobs.token_logprobs` (one number per token; -9999.0
    is read as -inf, and so is null from SGLang), `finish_reason` (one of FINISH_REASONS or a
    backend's alias for one) and `text`. Anything else raises MalformedResponseError. The ids are
    kept exactly as sent (EOS included when the sample stopped on it).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")

    def bad(what: str) -> MalformedResponseError:
        return MalformedResponseError(f"malformed completion response: {what}", attempts=1)

    total = prompts * n
    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise bad(f"no 'choices' list (keys: {sorted(data)})")
    if len(choices) != total:
        asked = f"n={n}" if prompts == 1 else f"{prompts} prompts x n={n} = {total}"
        raise bad(f"asked for {asked} completions, got {len(choices)} choices")
    by_index: dict[int, Completion] = {}
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise bad(f"choice {position} is not an object")
        index = choice.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < total:
            raise bad(f"choice {position} has index {index!r}, expected 0..{total - 1}")
        if index in by_index:
            raise bad(f"choice index {index} appears twice")
        by_index[index] = _parse_choice(choice, index, bad, backend)
    return [by_index[i] for i in range(total)]


def _parse_choice(
    choice: dict, index: int, bad: Callable[[str], Exception], backend: str
) -> Completion:
    where = f"choices[{index}]"
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise bad(
            f"{where} has no 'token_ids': the server ignored return_token_ids=true "
            "(vLLM needs >= 0.10.2; SGLang and the built-in server support it)"
        )
    if not isinstance(token_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in token_ids
    ):
        raise bad(f"{where}.token_ids is not a list of non-negative ints")
    if not token_ids:
        raise bad(f"{where} has no tokens")
    logprobs = choice.get("logprobs")
    token_logprobs = logprobs.get("token_logprobs") if isinstance(logprobs, dict) else None
    if not isinstance(token_logprobs, list):
        raise bad(f"{where} has no 'logprobs.token_logprobs' list (was logprobs=0 honoured?)")
    values: list[float] = []
    for j, value in enumerate(token_logprobs):
        if value is None and backend == "sglang":
            values.append(-math.inf)
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise bad(f"{where}.logprobs.token_logprobs[{j}] = {value!r} is not a number")
        value = float(value)
        if value == VLLM_NEG_INF:
            value = -math.inf
        elif math.isnan(value) or value > _LOGPROB_SLACK:
            raise bad(f"{where}.logprobs.token_logprobs[{j}] = {value} is not a log-probability")
        values.append(value)
    if len(values) != len(token_ids):
        raise bad(f"{where} has {len(token_ids)} token ids but {len(values)} log-probabilities")
    finish_reason = choice.get("finish_reason")
    if not isinstance(finish_reason, str):
        raise bad(f"{where}.finish_reason is {finish_reason!r}, expected one of {FINISH_REASONS}")
    finish_reason = _FINISH_ALIASES[backend].get(finish_reason, finish_reason)
    if finish_reason not in FINISH_REASONS:
        raise bad(f"{where}.finish_reason {finish_reason!r} is not one of {FINISH_REASONS}")
    text = choice.get("text")
    if not isinstance(text, str):
        raise bad(f"{where}.text is {text!r}, expected a string")
    return Completion(token_ids=token_ids, logprobs=values, finish_reason=finish_reason, text=text)


def _decode_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        text = body[:200].decode("utf-8", "replace")
        raise MalformedResponseError(
            f"malformed completion response: body is not JSON: {text!r}", attempts=1
        ) from None


def error_message(body: Any) -> str | None:
    """The server's own words in a JSON error answer: OpenAI's {"error": {"message"}},
    FastAPI's {"detail"}, SGLang's and the built-in server's {"message"}; None if it has none."""
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            value = body.get(key)
            if value:
                if isinstance(value, dict) and value.get("message"):
                    return str(value["message"])
                return str(value)
    return None


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
    ) -> list[list[Completion]]:
        """Sample `n` completions of each prompt; returns one list of n per prompt, in input
        order. Sample i of prompt j is sampled with seed `seeds[j] + i`, however the prompts are
        split into requests, so results do not depend on the backend's batching.

        The prompts go in consecutive chunks of `prompts_per_request(n)`, one request each, sent
        concurrently (at most `max_concurrency` at once). `on_done(k)` is called as each request
        completes, with k its number of prompts (a progress bar's advance). The first failure
        cancels the other requests and is raised: the liveness checker's error, a
        `GenerationError` (after the SDK's retries, or at once for a 4xx), or a
        `MalformedResponseError`.
        """
        ids = [_check_prompt(p, f"prompts[{j}]") for j, p in enumerate(prompts)]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if len(seeds) != len(ids):
            raise ValueError(f"got {len(ids)} prompts but {len(seeds)} seeds (one per prompt)")
        seeds = [_check_seed(s, f"seeds[{j}]") for j, s in enumerate(seeds)]
        self._bind_loop()
        if not ids:
            return []
        return await in_requests(
            len(ids),
            self.prompts_per_request(n),
            lambda start, stop: self._request(ids[start:stop], n, sampling, seeds[start:stop]),
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
        self, prompts: list[list[int]], n: int, sampling: SamplingParams, seeds: list[int]
    ) -> list[list[Completion]]:
        """One HTTP request for `prompts`: n completions of each, prompt-major."""
        body = request_body(self.model, prompts, n, sampling, seeds)
        kwargs: dict[str, Any] = {
            key: body.pop(key)
            for key in ("model", "prompt", "n", "max_tokens", "temperature", "top_p", "stop")
        }
        kwargs["logprobs"] = body.pop("logprobs")
        if "seed" in body:
            kwargs["seed"] = body.pop("seed")
        # What the SDK does not know (top_k, return_token_ids, seeds, backend extras).
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
                _decode_json(raw.http_response.content), n, self.backend, prompts=len(prompts)
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
