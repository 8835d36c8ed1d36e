"""Remote reward scorers: a reward function that is an HTTP endpoint (docs/rewards.md).

A `data.rewards` entry whose `fn` is an `http://` or `https://` URL becomes a `RemoteReward`, a
callable with the TRL reward signature `fn(prompts, completions, **kwargs) -> list[float]`, so
`RewardFunctions` and `score_completions` treat it like any plugin (same result checks, same
`RewardError`s named by the spec, here the URL).

One call POSTs the batch as JSON, the same per-sample lists a plugin gets as keyword arguments:

    {"prompts": [str, ...], "completions": [str, ...], "answers": [...], <meta key>: [...], ...}

and reads back one number per sample, either a JSON list `[0.0, 1.0, ...]` or
`{"rewards": [0.0, 1.0, ...]}`. With `batch_size` set, the batch is split into chunks of that many
samples, posted concurrently and put back together in order.

Options (keys of the entry, only for URL specs; defaults in `RemoteOptions`):
- timeout_s: each attempt's deadline: the whole answer must have arrived by then (a scorer that
  trickles bytes is cut off), and httpx's timeout for connecting, sending and each wait for
  response bytes.
- max_retries: more attempts after a 5xx, a 429, a connection error or a timeout, waiting
  0.5 s, 1 s, 2 s, ... (at most `MAX_BACKOFF_S`) between them; a 4xx is never retried (the
  request itself is wrong, and sending it again cannot help).
- max_concurrency: at most this many requests in flight to the scorer, whatever the callers.
- batch_size: samples per request (None: the whole batch in one request).
- headers: sent with every request (e.g. Authorization); never logged nor shown in an error.

Threads: one httpx.Client per scorer (created on first use, so building the config contacts
nothing and holds nothing), and a pool of at most `max_concurrency` threads that lives only for
the duration of one call with several chunks. `close()` releases the connections; a scorer that
is never closed leaves no thread behind, so it cannot delay the interpreter's exit.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import httpx

from grail.core.errors import ConfigError
from grail.envs.rewards.base import RewardError, check_reward_values, check_timeout

# Entry keys a URL spec may carry besides fn, weight and name (in the order docs list them).
REMOTE_OPTIONS = ("timeout_s", "max_retries", "max_concurrency", "batch_size", "headers")
BACKOFF_S = 0.5  # wait before the first retry; doubled before each next one
MAX_BACKOFF_S = 8.0  # longest wait between two attempts
_BODY_CHARS = 200  # how much of an error response's body a message quotes
# The one 4xx worth another attempt: the scorer is busy, the request is fine (also every 5xx).
_TOO_MANY_REQUESTS = 429


def is_remote_spec(spec: object) -> bool:
    """Whether a reward spec is meant as a URL (any `scheme://`; the scheme is checked later).

    A plugin spec `package.module:function` never contains "://", so nothing is ambiguous, and
    a mistyped scheme (`htp://`, `ftp://`) gets a URL error instead of an import error.
    """
    return isinstance(spec, str) and "://" in spec


def check_url(spec: str, where: str = "reward") -> str:
    """The stripped URL if it is http(s) with a host; a ConfigError naming it otherwise."""
    url = spec.strip()
    scheme = url.partition("://")[0]
    if scheme.lower() not in ("http", "https"):
        raise ConfigError(
            f"{where} {url!r}: a remote scorer's URL must start with http:// or https://, "
            f"not {scheme + '://'!r}"
        )
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, ValueError) as exc:
        raise ConfigError(f"{where} {url!r}: not a valid URL ({exc})") from None
    if not parsed.host:
        raise ConfigError(
            f"{where} {url!r}: the URL has no host (e.g. http://127.0.0.1:8123/score)"
        )
    return url


def _positive_int(where: str, key: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {key} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class RemoteOptions:
    """How one remote scorer is called; see the module docstring for what each option means."""

    timeout_s: float = 30.0
    max_retries: int = 3
    max_concurrency: int = 8
    batch_size: int | None = None
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)  # may hold secrets

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any], where: str) -> RemoteOptions:
        """Checked options from a reward entry's keys (a subset of REMOTE_OPTIONS); `where`
        starts each error message (e.g. "reward spec #1 ('http://…')")."""
        unknown = sorted(set(entry) - set(REMOTE_OPTIONS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown option(s) {unknown}; allowed: {', '.join(REMOTE_OPTIONS)}"
            )
        defaults = cls()
        timeout = check_timeout(where, entry.get("timeout_s", defaults.timeout_s))
        batch_size = entry.get("batch_size", defaults.batch_size)
        if batch_size is not None:
            batch_size = _positive_int(where, "batch_size", batch_size, 1)
        headers = entry.get("headers")
        if headers is None:
            headers = {}
        if not isinstance(headers, Mapping):
            raise ConfigError(
                f"{where}: headers must be a mapping of names to strings, "
                f"got {type(headers).__name__}"
            )
        for name, value in headers.items():
            # The value is not shown: headers carry credentials.
            if not isinstance(name, str) or not isinstance(value, str):
                raise ConfigError(
                    f"{where}: headers must map names to strings; header {name!r} does not"
                )
        return cls(
            timeout_s=timeout,
            max_retries=_positive_int(
                where, "max_retries", entry.get("max_retries", defaults.max_retries), 0
            ),
            max_concurrency=_positive_int(
                where, "max_concurrency", entry.get("max_concurrency", defaults.max_concurrency), 1
            ),
            batch_size=batch_size,
            headers=dict(headers),
        )


class _Failure(Exception):
    """One attempt failed in a way another attempt may fix (carries the message to report)."""


class RemoteReward:
    """A reward function computed by an HTTP scorer at `url` (TRL reward signature)."""

    def __init__(
        self,
        url: str,
        options: RemoteOptions | None = None,
        *,
        backoff_s: float = BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.url = check_url(url)
        self.spec = self.url  # errors are named by what the user wrote
        self.options = options or RemoteOptions()
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()
        # Bounds requests in flight across every caller (chunks, and concurrent batches alike).
        self._slots = threading.BoundedSemaphore(self.options.max_concurrency)
        # Set by close(): stops retry loops and wakes them from their backoff sleep.
        self._closed = threading.Event()

    @classmethod
    def from_options(
        cls, spec: str, options: Mapping[str, Any], where: str = "reward"
    ) -> RemoteReward:
        """From a reward entry's URL and its option keys, checked (ConfigErrors name the key)."""
        url = check_url(spec, where)
        return cls(url, RemoteOptions.from_entry(options, f"{where} ({url!r})"))

    def __repr__(self) -> str:
        # Not the options' headers: a repr can end up in a log.
        return f"RemoteReward({self.url!r})"

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the HTTP client (idempotent). Calls after this raise a RewardError."""
        self._closed.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._closed.is_set():
                raise RewardError(self.spec, "the scorer was closed; it cannot score any more")
            if self._client is None:
                n = self.options.max_concurrency
                self._client = httpx.Client(
                    timeout=self.options.timeout_s,
                    limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                    headers=dict(self.options.headers),
                )
            return self._client

    # -- scoring -------------------------------------------------------------------------------

    def __call__(self, prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(self.spec, f"{len(prompts)} prompts for {n} completions")
        if n == 0:
            return []  # nothing to ask the scorer
        size = self.options.batch_size or n
        chunks = [(start, min(start + size, n)) for start in range(0, n, size)]
        bodies = [self._body(prompts, completions, kwargs, a, b) for a, b in chunks]
        if len(chunks) == 1:
            return self._score_chunk(bodies[0], 0, n, n)
        # A pool for this call only: no thread outlives the call (so none can hold up exit).
        workers = min(self.options.max_concurrency, len(chunks))
        with concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="grail-remote-reward"
        ) as pool:
            futures = [
                pool.submit(self._score_chunk, body, a, b - a, n)
                for body, (a, b) in zip(bodies, chunks, strict=True)
            ]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            if any(f.done() and f.exception() is not None for f in futures):
                for f in futures:
                    f.cancel()  # chunks not started yet: no point asking for them any more
                concurrent.futures.wait(futures)  # the running ones end on their own
                # The failure of the first chunk in sample order, whichever failed first.
                failed = next(f for f in futures if not f.cancelled() and f.exception())
                raise failed.exception()  # type: ignore[misc]
            return [v for f in futures for v in f.result()]

    def _body(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        kwargs: Mapping[str, Any],
        start: int,
        stop: int,
    ) -> bytes:
        n = len(completions)
        payload: dict[str, Any] = {
            "prompts": list(prompts[start:stop]),
            "completions": list(completions[start:stop]),
        }
        for key, values in kwargs.items():
            # Per-sample lists are cut to the chunk; anything else goes whole to every chunk.
            per_sample = isinstance(values, list | tuple) and len(values) == n
            payload[key] = list(values[start:stop]) if per_sample else values
        try:
            # Strict JSON (no NaN tokens): a scorer in another language may not parse them.
            return json.dumps(payload, allow_nan=False).encode()
        except (TypeError, ValueError):
            for key, value in payload.items():
                try:
                    json.dumps(value, allow_nan=False)
                except (TypeError, ValueError) as exc:
                    raise RewardError(
                        self.spec, f"cannot send `{key}` to the scorer as JSON: {exc}"
                    ) from None
            raise

    def _score_chunk(self, body: bytes, offset: int, count: int, total: int) -> list[float]:
        """POST one chunk (retrying what may pass on a next attempt) and check its values."""
        where = f" (samples {offset}..{offset + count - 1} of {total})" if count < total else ""
        opts = self.options
        attempts = opts.max_retries + 1
        failure = ""
        for attempt in range(attempts):
            if attempt:
                delay = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
                if self._closed.wait(delay):
                    break
            try:
                response = self._post(body)
            except _Failure as exc:
                failure = str(exc)
                continue
            values = self._values(response)
            return check_reward_values(self.spec, values, count, offset=offset, where=where)
        if self._closed.is_set():
            raise RewardError(self.spec, f"the scorer was closed while scoring; last: {failure}")
        raise RewardError(
            self.spec,
            f"{failure}; gave up after {attempts} attempt(s) "
            f"(max_retries={opts.max_retries}, timeout_s={opts.timeout_s:g} each){where}",
        )

    def _post(self, body: bytes) -> httpx.Response:
        """One attempt: the response if it is a success, `_Failure` if it may pass on a retry,
        a RewardError if it cannot (a 4xx other than 429, a redirect)."""
        timeout = self.options.timeout_s
        try:
            with self._slots:
                response = self._exchange(body, time.monotonic() + timeout)
        except httpx.TimeoutException as exc:
            raise _Failure(
                f"no answer within timeout_s={timeout:g} ({type(exc).__name__})"
            ) from None
        except httpx.TransportError as exc:
            raise _Failure(f"could not reach the scorer ({type(exc).__name__}: {exc})") from None
        status = response.status_code
        if response.is_success:
            return response
        what = f"HTTP {status} {response.reason_phrase}: {_body_message(response)}".strip()
        if status == _TOO_MANY_REQUESTS or status >= 500:
            raise _Failure(what)
        if 400 <= status < 500:
            raise RewardError(self.spec, f"{what} (a client error: not retried)")
        raise RewardError(self.spec, f"{what} (expected a 2xx answer; redirects are not followed)")

    def _exchange(self, body: bytes, deadline: float) -> httpx.Response:
        """POST `body` and read the whole answer by `deadline` (time.monotonic), else `_Failure`.

        httpx's timeouts bound each wait for bytes, never the whole request: a scorer that sends
        a byte every second passes every one of them forever. So the answer is streamed and the
        deadline checked after each piece; past it the request is abandoned, its connection
        closed (it is not returned to the pool half-read) and its concurrency slot freed, in
        this thread. (A watchdog thread could not do that: httpx cannot cancel a request from
        another thread, only leave it running.) Each wait for bytes is still bounded by httpx's
        timeout (`timeout_s`), so an attempt ends within twice `timeout_s` at worst. The headers
        are read by httpx before the first piece: a scorer that trickles its *headers* is
        stopped by h11's limit on their size (16 KiB), not by the deadline."""
        client = self._http()
        with client.stream(
            "POST", self.url, content=body, headers={"content-type": "application/json"}
        ) as response:
            pieces = []
            for piece in response.iter_raw():
                pieces.append(piece)
                if time.monotonic() > deadline:
                    break
            if time.monotonic() > deadline:
                raise _Failure(
                    f"no complete answer within timeout_s={self.options.timeout_s:g} (the "
                    "scorer was still sending)"
                )
            # A response holding the raw bytes, decoded (gzip, ...) as a read one would be.
            return httpx.Response(
                response.status_code,
                headers=response.headers,
                content=b"".join(pieces),
                request=response.request,
                extensions=response.extensions,
            )

    def _values(self, response: httpx.Response) -> object:
        """The list of values in a success response (checked by the caller)."""
        try:
            data = response.json()
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise RewardError(
                self.spec,
                f"answered HTTP {response.status_code} with invalid JSON ({exc}): "
                f"{_snippet(response.text)!r}",
            ) from None
        if isinstance(data, dict):
            if "rewards" not in data:
                raise RewardError(
                    self.spec,
                    f"answered a JSON object with keys {sorted(data)[:10]}; expected a list of "
                    'numbers or {"rewards": [numbers]}',
                )
            return data["rewards"]
        return data


def _snippet(text: str) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= _BODY_CHARS else text[:_BODY_CHARS] + "…"


def _body_message(response: httpx.Response) -> str:
    """What an error response says: its JSON `detail`, `error` or `message` (FastAPI, OpenAI-style
    and common shapes), else the start of its text."""
    try:
        text = response.text
    except Exception:  # undecodable bytes: nothing better to quote
        return "(unreadable body)"
    try:
        data = json.loads(text)
    except ValueError:
        return _snippet(text) or "(empty body)"
    if isinstance(data, dict):
        for key in ("detail", "error", "message"):
            if key in data:
                value = data[key]
                if isinstance(value, dict) and isinstance(value.get("message"), str):
                    value = value["message"]  # {"error": {"message": ...}}
                return _snippet(value if isinstance(value, str) else json.dumps(value))
    return _snippet(text)
