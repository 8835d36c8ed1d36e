"""Async client for OpenAI-compatible completion servers (built-in, vLLM, SGLang), token ids in and
token ids + log-probabilities out.

Why the client is this strict (see /work/shared/PROTOCOLS.md):
- Every sampling field is sent on every request. Servers silently fill unset fields from the
  model's generation_config.json, and `max_tokens` defaults to 16.
- Prompts go as token ids and the returned token ids are what we train on; text is only for
  scoring. So a response without `token_ids`, or with a log-probability list of another length, is
  an error, never an empty or misaligned completion.
- One request path for every backend. The answers differ in two details, handled by `backend`:
  vLLM and the built-in server send a -inf log-probability as -9999.0, SGLang as `null` (pydantic
  writes infinities as null); vLLM may end a sample with "repetition" (read as "stop"), SGLang can
  leave `finish_reason` null, which is an error here rather than a guess.
- The openai SDK's own retries are off (`max_retries=0`); this client retries connection errors,
  timeouts and 5xx with capped exponential backoff and jitter, never 4xx (a bad request stays bad),
  and fails with a `GenerationError` that says what failed, how often, and the last error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import openai

logger = logging.getLogger(__name__)

# vLLM sends -inf log-probabilities as this value (JSON has no infinity).
VLLM_NEG_INF = -9999.0
Backend = Literal["builtin", "vllm", "sglang"]
BACKENDS: tuple[str, ...] = ("builtin", "vllm", "sglang")
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


class GenerationError(RuntimeError):
    """A completion request failed for good (after retries, or at once for 4xx/malformed)."""

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


@dataclass(frozen=True)
class RetryPolicy:
    """Capped exponential backoff with jitter.

    Before attempt k+1 (k = 1, 2, ...) the client sleeps
        delay_k = min(max_backoff, initial_backoff * 2**(k-1)) * U(1 - jitter, 1)
    so no single sleep exceeds max_backoff and the total wait is at most
    sum_{k=1}^{max_attempts-1} min(max_backoff, initial_backoff * 2**(k-1)).
    Jitter spreads out the retries of many concurrent requests that failed together.
    """

    max_attempts: int = 5
    initial_backoff: float = 0.5
    max_backoff: float = 10.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError(
                "need 0 <= initial_backoff <= max_backoff, got "
                f"{self.initial_backoff} and {self.max_backoff}"
            )
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay(self, failed_attempts: int, rng: random.Random) -> float:
        base = min(self.max_backoff, self.initial_backoff * 2 ** (failed_attempts - 1))
        return base * rng.uniform(1 - self.jitter, 1)


@dataclass
class ClientStats:
    """Counters for metrics: requests made, HTTP attempts, retries, requests that failed, and
    the most requests that were in flight at once."""

    requests: int = 0
    attempts: int = 0
    retries: int = 0
    failures: int = 0
    peak_in_flight: int = 0


# --------------------------------------------------------------------------------------------
# request and response (pure)


def _check_prompt(prompt_ids: Sequence[int]) -> list[int]:
    ids = list(prompt_ids)
    if not ids:
        raise ValueError("prompt_ids is empty")
    for i, tok in enumerate(ids):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise ValueError(f"prompt_ids[{i}] = {tok!r} is not a non-negative int token id")
    return ids


def request_body(
    model: str, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
) -> dict[str, Any]:
    """The JSON body of one /v1/completions request (for reference and tests; `complete` sends
    exactly these fields, top_k and return_token_ids through the SDK's extra_body)."""
    return {
        "model": model,
        "prompt": list(prompt_ids),
        "n": n,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "stop": list(sampling.stop),
        "seed": seed,
        "logprobs": 0,
        "return_token_ids": True,
    }


def parse_completions(data: Any, n: int, backend: Backend = "builtin") -> list[Completion]:
    """Parse an OpenAI completion response into `n` Completions, ordered by choice index.

    Each choice needs `token_ids` (ints), `logprobs.token_logprobs` (one number per token; -9999.0
    is read as -inf, and so is null from SGLang), `finish_reason` (one of FINISH_REASONS or a
    backend's alias for one) and `text`. Anything else raises MalformedResponseError. The ids are
    kept exactly as sent (EOS included when the sample stopped on it).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")

    def bad(what: str) -> MalformedResponseError:
        return MalformedResponseError(f"malformed completion response: {what}", attempts=1)

    if not isinstance(data, dict):
        raise bad(f"expected a JSON object, got {type(data).__name__}")
    choices = data.get("choices")
    if not isinstance(choices, list):
        raise bad(f"no 'choices' list (keys: {sorted(data)})")
    if len(choices) != n:
        raise bad(f"asked for n={n} completions, got {len(choices)} choices")
    by_index: dict[int, Completion] = {}
    for position, choice in enumerate(choices):
        if not isinstance(choice, dict):
            raise bad(f"choice {position} is not an object")
        index = choice.get("index", position)
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
            raise bad(f"choice {position} has index {index!r}, expected 0..{n - 1}")
        if index in by_index:
            raise bad(f"choice index {index} appears twice")
        by_index[index] = _parse_choice(choice, index, bad, backend)
    return [by_index[i] for i in range(n)]


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


def _decode_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise MalformedResponseError(
            f"malformed completion response: body is not JSON: {text[:200]!r}", attempts=1
        ) from None


def _server_message(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        for key in ("message", "detail", "error"):
            if body.get(key):
                value = body[key]
                if isinstance(value, dict) and value.get("message"):
                    return str(value["message"])
                return str(value)
    return exc.message


def _is_retriable(exc: BaseException) -> bool:
    # APITimeoutError is a subclass of APIConnectionError.
    if isinstance(exc, openai.APIConnectionError):
        return True
    return isinstance(exc, openai.APIStatusError) and exc.status_code >= 500


# --------------------------------------------------------------------------------------------
# the client


@dataclass
class _LoopState:
    loop: asyncio.AbstractEventLoop
    client: openai.AsyncOpenAI
    semaphore: asyncio.Semaphore
    in_flight: int = 0


class CompletionClient:
    """Completion client for one server and one served model.

    base_url: the server's OpenAI base URL (`ServerManager.base_url`, ".../v1").
    timeout: seconds for one HTTP attempt (a whole non-streamed generation).
    max_concurrency: requests in flight at once (asyncio.Semaphore); sleeps between retries do
        not hold a slot.
    liveness_check: called after a retriable failure, before sleeping; `ServerManager.check_alive`
        fits, so a dead server raises ServerDiedError at once instead of after every retry.
    extra_body: backend-specific fields added to every request.
    backend: which server answers ("builtin", "vllm", "sglang"; `ServerManager.kind`), for the
        details in which their answers differ (see `parse_completions`).

    Usable from several event loops in turn (e.g. one `asyncio.run` per iteration): the HTTP
    client and semaphore are rebuilt when the running loop changes.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        timeout: float = 300.0,
        max_concurrency: int = 64,
        retry: RetryPolicy | None = None,
        liveness_check: Callable[[], None] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        backend: Backend = "builtin",
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        reserved = set(request_body("m", [0], 1, SamplingParams(max_tokens=1), 0))
        clash = reserved & set(extra_body or {})
        if clash:
            raise ValueError(
                f"extra_body must not set {sorted(clash)}: the client sends them itself"
            )
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._api_key = api_key
        self.timeout = float(timeout)
        self.max_concurrency = max_concurrency
        self.retry = retry or RetryPolicy()
        self.liveness_check = liveness_check
        self.extra_body = dict(extra_body or {})
        self.backend: Backend = backend
        self.stats = ClientStats()
        # Its own generator: jitter must not consume the global RNG that seeds experiments.
        self._rng = random.Random()
        self._state: _LoopState | None = None

    def __repr__(self) -> str:
        return f"CompletionClient(base_url={self.base_url!r}, model={self.model!r})"

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if self._state is None or self._state.loop is not loop:
            # One connection per request ("Connection: close"): a pooled keep-alive connection
            # belongs to the loop that opened it, and callers that run one asyncio.run per
            # iteration would leave one open socket per loop behind. A local TCP handshake costs
            # far less than a generation.
            client = openai.AsyncOpenAI(
                base_url=self.base_url,
                api_key=self._api_key or "EMPTY",
                timeout=self.timeout,
                max_retries=0,
                default_headers={"Connection": "close"},
            )
            self._state = _LoopState(loop, client, asyncio.Semaphore(self.max_concurrency))
        return self._state

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        """Sample `n` completions of `prompt_ids` (sample i uses seed + i on vLLM)."""
        ids = _check_prompt(prompt_ids)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be an int >= 1, got {n!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        state = self._loop_state()
        self.stats.requests += 1
        what = f"POST {self.base_url}/completions (n={n}, {len(ids)} prompt tokens)"
        t0 = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                async with state.semaphore:
                    state.in_flight += 1
                    self.stats.peak_in_flight = max(self.stats.peak_in_flight, state.in_flight)
                    try:
                        self.stats.attempts += 1
                        body = await self._post(state.client, ids, n, sampling, seed)
                    finally:
                        state.in_flight -= 1
            except openai.APIError as exc:
                if not _is_retriable(exc):
                    self.stats.failures += 1
                    status = getattr(exc, "status_code", None)
                    message = _server_message(exc) if status is not None else str(exc)
                    raise GenerationError(
                        f"{what} was rejected with HTTP {status} (not retried): {message}",
                        attempts=attempt,
                        status_code=status,
                    ) from exc
                error = self._describe(exc)
                if self.liveness_check is not None:
                    try:
                        self.liveness_check()
                    except Exception:
                        self.stats.failures += 1
                        raise
                if attempt >= self.retry.max_attempts:
                    self.stats.failures += 1
                    raise GenerationError(
                        f"{what} failed after {attempt} attempt(s) over "
                        f"{time.monotonic() - t0:.1f} s; last error: {error}",
                        attempts=attempt,
                        status_code=getattr(exc, "status_code", None),
                    ) from exc
                delay = self.retry.delay(attempt, self._rng)
                self.stats.retries += 1
                logger.warning(
                    "%s: attempt %d/%d failed (%s); retrying in %.2f s",
                    what,
                    attempt,
                    self.retry.max_attempts,
                    error,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            # A 200 with a bad body is a server bug, not a transient failure: no retry.
            try:
                return parse_completions(_decode_json(body), n, self.backend)
            except MalformedResponseError as exc:
                self.stats.failures += 1
                raise MalformedResponseError(f"{what}: {exc}", attempts=attempt) from None

    async def _post(
        self,
        client: openai.AsyncOpenAI,
        ids: list[int],
        n: int,
        sampling: SamplingParams,
        seed: int,
    ) -> str:
        raw = await client.completions.with_raw_response.create(
            model=self.model,
            prompt=ids,
            n=n,
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            stop=list(sampling.stop),
            seed=seed,
            logprobs=0,
            extra_body={**self.extra_body, "top_k": sampling.top_k, "return_token_ids": True},
        )
        return raw.text

    def _describe(self, exc: openai.APIError) -> str:
        if isinstance(exc, openai.APITimeoutError):
            return f"timed out after {self.timeout:g} s (the client's per-attempt timeout)"
        if isinstance(exc, openai.APIStatusError):
            return f"HTTP {exc.status_code}: {_server_message(exc)}"
        cause = exc.__cause__
        detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        return f"{type(exc).__name__}: {exc}{detail}"

    async def aclose(self) -> None:
        """Close the HTTP connections of the current event loop's client."""
        state, self._state = self._state, None
        if state is not None and state.loop is asyncio.get_running_loop():
            await state.client.close()

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
