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
- HTTP/1.1 written directly on asyncio streams, not the openai SDK or httpx: their per-request
  CPU cost was more than the built-in server's cost to answer (see "HTTP/1.1 over asyncio
  streams" below). No proxies: the servers are the harness's own. This client retries
  connection errors, timeouts and 5xx with capped exponential backoff and jitter, never 4xx (a
  bad request stays bad), and fails with a `GenerationError` that says what failed, how often,
  and the last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import ssl
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

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
    """The JSON body of one /v1/completions request: `complete` sends exactly these fields,
    plus the client's `extra_body`."""
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


def _decode_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        text = body[:200].decode("utf-8", "replace")
        raise MalformedResponseError(
            f"malformed completion response: body is not JSON: {text!r}", attempts=1
        ) from None


class HTTPStatusError(Exception):
    """A non-2xx answer: its status and the server's error message."""

    def __init__(self, status_code: int, message: str) -> None:
        super().__init__(f"HTTP {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class TransportError(Exception):
    """The connection failed: refused, reset, closed before the answer, or a garbled answer."""


class AttemptTimeout(TransportError):
    """One attempt (connect, send, wait for and read the whole answer) ran out of time."""


def _server_message(body: bytes, reason: str) -> str:
    """The message of an error answer: OpenAI's {"error": {"message"}}, FastAPI's {"detail"},
    or the start of the raw body."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            if data.get(key):
                value = data[key]
                if isinstance(value, dict) and value.get("message"):
                    return str(value["message"])
                return str(value)
    return body[:200].decode("utf-8", "replace") or reason


def _is_retriable(exc: BaseException) -> bool:
    if isinstance(exc, TransportError):
        return True
    return isinstance(exc, HTTPStatusError) and exc.status_code >= 500


# --------------------------------------------------------------------------------------------
# HTTP/1.1 over asyncio streams
#
# Why not httpx (or the openai SDK on top of it): measured on the harness's own pattern (16-64
# concurrent small requests per iteration, 2 cores), httpx spent ~1.2 ms of CPU per request
# (its connection pool rescans every connection, with a getpeername() each, for every queued
# request whenever a response completes; plus per-client SSL setup and anyio task groups), more
# than the built-in server needed to answer. One POST with a JSON body and a JSON answer needs
# little of HTTP: this costs ~0.2 ms per request.


class _Connection:
    """One HTTP/1.1 connection to the server."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @property
    def usable(self) -> bool:
        """Still open at both ends (the server closes idle keep-alive connections)."""
        return not self.reader.at_eof() and not self.writer.is_closing()

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):  # already reset by the peer: nothing left to close
            await self.writer.wait_closed()


@dataclass
class _Response:
    status: int
    reason: str
    body: bytes
    keep_alive: bool


class _NothingReceived(TransportError):
    """The connection ended before a single byte of the answer (a stale keep-alive one)."""


async def _read_response(reader: asyncio.StreamReader) -> _Response:
    """Read one HTTP/1.x response: status line, headers, then a body framed by Content-Length,
    chunked transfer encoding, or the end of the connection."""
    while True:
        line = await reader.readline()
        if not line:
            raise _NothingReceived("the server closed the connection without answering")
        parts = line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise TransportError(f"not an HTTP/1.x status line: {line[:100]!r}")
        status = int(parts[1])
        reason = parts[2].strip().decode("latin-1") if len(parts) > 2 else ""
        headers: dict[bytes, bytes] = {}
        while True:
            header = await reader.readline()
            if header in (b"\r\n", b"\n"):
                break
            if not header:
                raise TransportError("the connection closed inside the response headers")
            name, sep, value = header.partition(b":")
            if not sep:
                raise TransportError(f"malformed response header: {header[:100]!r}")
            key = name.strip().lower()
            value = value.strip()
            headers[key] = headers[key] + b", " + value if key in headers else value
        if status >= 200:  # 1xx (e.g. 100 Continue) precede the real answer
            break
    keep_alive = parts[0] == b"HTTP/1.1" and headers.get(b"connection", b"").lower() != b"close"
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        chunks = []
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise TransportError(f"malformed chunk size: {size_line[:100]!r}") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                break
            chunks.append(await reader.readexactly(size))
            await reader.readexactly(2)  # the CRLF after each chunk
        body = b"".join(chunks)
    elif b"content-length" in headers:
        try:
            length = int(headers[b"content-length"])
        except ValueError:
            raise TransportError(
                f"malformed Content-Length: {headers[b'content-length'][:50]!r}"
            ) from None
        body = await reader.readexactly(length)
    else:  # the body runs to the end of the connection
        body = await reader.read()
        keep_alive = False
    return _Response(status, reason, body, keep_alive)


# --------------------------------------------------------------------------------------------
# the client


@dataclass
class _LoopState:
    """What one event loop's requests share: the concurrency bound and, while a session is
    open, the idle keep-alive connections."""

    semaphore: asyncio.Semaphore
    sessions: int = 0
    idle: list[_Connection] = field(default_factory=list)
    in_flight: int = 0

    async def close_idle(self) -> None:
        idle, self.idle = self.idle, []
        for conn in idle:
            await conn.close()


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

    Connections: inside `async with client.session():` requests reuse keep-alive connections,
    closed when the block exits; outside a session every request opens its own connection
    ("Connection: close"), so that nothing stays open when the event loop ends. Usable from
    several event loops, in turn or at once (one `asyncio.run` per iteration, a generation thread
    beside the main one): each loop gets its own connections and concurrency bound.
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
        url = urllib.parse.urlsplit(self.base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base_url must be an http:// or https:// URL, got {base_url!r}")
        self._https = url.scheme == "https"
        self._host = url.hostname
        self._port = url.port or (443 if self._https else 80)
        lines = [
            f"POST {url.path}/completions HTTP/1.1",
            f"Host: {url.netloc.rpartition('@')[2]}",
            "Content-Type: application/json",
            "Accept: application/json",
            "User-Agent: grail",
        ]
        if api_key:
            if not api_key.isprintable():
                raise ValueError("api_key must be printable (no line breaks or control characters)")
            lines.append(f"Authorization: Bearer {api_key}")
        # Requests are these bytes, the body's length, a blank line and the body.
        self._head_keep_alive = "\r\n".join([*lines, "Content-Length: "]).encode()
        self._head_close = "\r\n".join([*lines, "Connection: close", "Content-Length: "]).encode()
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
        self._states: dict[asyncio.AbstractEventLoop, _LoopState] = {}
        self._states_lock = threading.Lock()
        self._ssl: ssl.SSLContext | None = None

    def __repr__(self) -> str:
        return f"CompletionClient(base_url={self.base_url!r}, model={self.model!r})"

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        with self._states_lock:
            state = self._states.get(loop)
            if state is None:
                for old in [old for old in self._states if old.is_closed()]:
                    del self._states[old]
                state = self._states[loop] = _LoopState(asyncio.Semaphore(self.max_concurrency))
            return state

    @contextlib.asynccontextmanager
    async def session(self) -> AsyncIterator[CompletionClient]:
        """Reuse connections (HTTP keep-alive) for the requests made inside the block; they are
        closed when the last open session of this event loop exits. Nests."""
        state = self._loop_state()
        state.sessions += 1
        try:
            yield self
        finally:
            state.sessions -= 1
            if state.sessions == 0:
                await state.close_idle()

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
        body = json.dumps(
            {**request_body(self.model, ids, n, sampling, seed), **self.extra_body}
        ).encode()
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
                        answer = await self._post(state, body)
                    finally:
                        state.in_flight -= 1
            except (TransportError, HTTPStatusError) as exc:
                if not _is_retriable(exc):
                    self.stats.failures += 1
                    assert isinstance(exc, HTTPStatusError)
                    raise GenerationError(
                        f"{what} was rejected with HTTP {exc.status_code} (not retried): "
                        f"{exc.message}",
                        attempts=attempt,
                        status_code=exc.status_code,
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
                return parse_completions(_decode_json(answer), n, self.backend)
            except MalformedResponseError as exc:
                self.stats.failures += 1
                raise MalformedResponseError(f"{what}: {exc}", attempts=attempt) from None

    async def _post(self, state: _LoopState, body: bytes) -> bytes:
        """One HTTP attempt, bounded by `timeout`: the body of a 2xx answer, else
        HTTPStatusError or TransportError."""
        try:
            async with asyncio.timeout(self.timeout):
                response = await self._exchange(state, body)
        except TimeoutError:
            raise AttemptTimeout(f"no complete answer within {self.timeout:g} s") from None
        if not 200 <= response.status < 300:
            raise HTTPStatusError(response.status, _server_message(response.body, response.reason))
        return response.body

    async def _exchange(self, state: _LoopState, body: bytes) -> _Response:
        keep_alive = state.sessions > 0
        head = self._head_keep_alive if keep_alive else self._head_close
        request = head + str(len(body)).encode() + b"\r\n\r\n" + body
        while True:
            conn = None
            while keep_alive and state.idle and conn is None:
                candidate = state.idle.pop()
                if candidate.usable:
                    conn = candidate
                else:
                    await candidate.close()
            reused = conn is not None
            if conn is None:
                conn = await self._connect()
            try:
                conn.writer.write(request)
                await conn.writer.drain()
                response = await _read_response(conn.reader)
            except _NothingReceived:
                await conn.close()
                if reused:  # the server had closed this idle connection: use a new one
                    continue
                raise
            except (OSError, EOFError, ValueError) as exc:  # ValueError: a header over 64 KiB
                await conn.close()
                if reused and isinstance(exc, ConnectionError):  # reset, broken pipe: stale
                    continue
                raise TransportError(f"{type(exc).__name__}: {exc}") from exc
            except BaseException:  # timeout, cancellation: the connection is in an unknown state
                conn.writer.close()
                raise
            if keep_alive and response.keep_alive and state.sessions > 0:
                state.idle.append(conn)
            else:
                await conn.close()
            return response

    async def _connect(self) -> _Connection:
        try:
            reader, writer = await asyncio.open_connection(
                self._host, self._port, ssl=self._ssl_context()
            )
        except OSError as exc:
            raise TransportError(
                f"cannot connect to {self._host}:{self._port}: {type(exc).__name__}: {exc}"
            ) from exc
        return _Connection(reader, writer)

    def _ssl_context(self) -> ssl.SSLContext | None:
        if not self._https:
            return None
        if self._ssl is None:
            self._ssl = ssl.create_default_context()
        return self._ssl

    def _describe(self, exc: Exception) -> str:
        if isinstance(exc, AttemptTimeout):
            return f"timed out after {self.timeout:g} s (the client's per-attempt timeout)"
        return str(exc)

    async def aclose(self) -> None:
        """Close the current event loop's idle connections (also those of an open session)."""
        with self._states_lock:
            state = self._states.pop(asyncio.get_running_loop(), None)
        if state is not None:
            await state.close_idle()

    async def __aenter__(self) -> CompletionClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
