"""The futures of the Tinker protocol: every training and sampling request is queued, answered
at once with a ``request_id``, and run on a worker thread; the client then polls
``/api/v1/retrieve_future`` for the result.

- Two workers: the job thread runs training work (create, forward/backward, optimizer steps,
  saves, loads) one request at a time in arrival order; the sampler thread hands sampling
  requests to the engine as they come (grail/tinker/sampler.py: the engine batches them with
  what it is decoding), and their results come back from the engine's thread.
- The queues are bounded (``max_pending`` requests queued or running, both kinds together): past
  that a request is answered 429, which the SDK backs off from and sends again.
- A poll waits up to ``POLL_WAIT_S`` for the result (the SDK polls again at once on
  ``try_again``, so a short wait would spin), then answers ``{"type": "try_again"}``.
- A result is kept until ``RETAIN_S`` after its first retrieval (a client whose connection broke
  may ask again), or ``UNCLAIMED_S`` after it is ready when nobody asks, then dropped; an
  unknown ``request_id`` is a 404.
- A ``request_id`` is ``req-<start>-<n>``: ``<start>`` is random per server start, so a client
  that outlived a restart polls an id this server never issued (a 404), never the result of
  another client's request that happens to have the same number. Each request is bound to the
  training client (model_id) or sampling session it was made for, and to that client's session;
  a poll that names another one (``model_id`` / ``session_id`` in its body) is a 404 too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grail.tinker.errors import Busy, NotFound, UserFault
from grail.tinker.sampler import SampleJob, Sampler

log = logging.getLogger(__name__)

POLL_WAIT_S = 20.0  # under the SDK's 45 s read timeout on retrieve_future
RETAIN_S = 300.0
UNCLAIMED_S = 3600.0
STOP_TIMEOUT_S = 30.0


@dataclass
class Result:
    """A finished request: a JSON body, a protobuf body, or an error."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"


@dataclass
class _Entry:
    model: str  # the model_id or sampling session the request was made for
    session: str | None  # the SDK session that owns it, where known
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Result | None = None
    retrieved: bool = False


_STOP = object()


class Jobs:
    def __init__(self, sampler: Sampler, max_pending: int) -> None:
        self.sampler, self.max_pending = sampler, max_pending
        self.entries: dict[str, _Entry] = {}
        self._start = secrets.token_hex(6)  # this server start's part of every request_id
        self._ids = itertools.count(1)
        self._pending = 0
        self._lock = threading.Lock()
        self._train: queue.Queue[Any] = queue.Queue()
        self._sample: queue.Queue[Any] = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []

    # ---- lifetime (the app's lifespan) --------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for name, target in (
            ("tinker-train", self._train_worker),
            ("tinker-sample", self._sample_worker),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._train.put(_STOP)
        self._sample.put(_STOP)
        for thread in self._threads:
            thread.join(STOP_TIMEOUT_S)

    # ---- submitting (event loop) ----------------------------------------------------------------

    def _new(self, model: str, session: str | None) -> str:
        with self._lock:
            if self._pending >= self.max_pending:
                raise Busy(
                    f"{self._pending} requests are queued or running, this server's limit "
                    "(--max-pending); the client retries"
                )
            self._pending += 1
        request_id = f"req-{self._start}-{next(self._ids)}"
        self.entries[request_id] = _Entry(model, session)
        return request_id

    def submit(self, work: Callable[[], Result], model: str, session: str | None) -> str:
        """Queue training work for `model` (a model_id) of `session`; its Result (or the
        UserFault it raises) answers the future."""
        request_id = self._new(model, session)
        self._train.put((request_id, work))
        return request_id

    def run_later(self, work: Callable[[], object]) -> None:
        """Queue training work nobody waits for (it still runs in order with the rest)."""
        self._train.put((None, work))

    def submit_sample(self, job: SampleJob, model: str, session: str | None) -> str:
        request_id = self._new(model, session)
        self._sample.put((request_id, job))
        return request_id

    # ---- retrieving (event loop) ----------------------------------------------------------------

    async def retrieve(
        self, request_id: str, model: str | None = None, session: str | None = None
    ) -> Result | None:
        """The result, or None when it is not ready within POLL_WAIT_S. A `model` or `session`
        named by the poll must be the one the request was made for."""
        entry = self.entries.get(request_id)
        if entry is None:
            raise NotFound(
                f"unknown request_id {request_id!r}: not issued by this server since it started, "
                "or its result was dropped"
            )
        if (model is not None and model != entry.model) or (
            session is not None and entry.session is not None and session != entry.session
        ):
            raise NotFound(
                f"request_id {request_id!r} is not a request of model_id {model!r} / session "
                f"{session!r}"
            )
        try:
            await asyncio.wait_for(entry.done.wait(), POLL_WAIT_S)
        except TimeoutError:
            return None
        if not entry.retrieved:
            entry.retrieved = True
            asyncio.get_running_loop().call_later(RETAIN_S, self.entries.pop, request_id, None)
        return entry.result

    # ---- workers ----------------------------------------------------------------------------

    def _finish(self, request_id: str, result: Result) -> None:
        with self._lock:
            self._pending -= 1
        entry = self.entries[request_id]
        loop = self._loop
        assert loop is not None

        def set_result() -> None:
            entry.result = result
            entry.done.set()
            # A result nobody asks for (its client died) is dropped after UNCLAIMED_S.
            loop.call_later(UNCLAIMED_S, self._drop_unclaimed, request_id)

        with contextlib.suppress(RuntimeError):  # the server shut down: nobody will ask
            loop.call_soon_threadsafe(set_result)

    def _drop_unclaimed(self, request_id: str) -> None:
        entry = self.entries.get(request_id)
        if entry is not None and not entry.retrieved:
            del self.entries[request_id]

    def _train_worker(self) -> None:
        while (item := self._train.get()) is not _STOP:
            request_id, work = item
            result = _run(work)
            if request_id is not None:
                self._finish(request_id, result)

    def _sample_worker(self) -> None:
        while (item := self._sample.get()) is not _STOP:
            request_id, job = item

            def finish(outcome: bytes | Exception, request_id: str = request_id) -> None:
                if isinstance(outcome, bytes):
                    self._finish(request_id, Result(proto=outcome))
                else:
                    self._finish(request_id, _failure(outcome))

            try:
                self.sampler.serve(job, finish)
            except Exception as exc:  # never the thread's end: this request fails, alone
                finish(exc)


def _run(work: Callable[[], Result]) -> Result:
    try:
        return work()
    except Exception as exc:
        return _failure(exc)


def _failure(exc: Exception) -> Result:
    if isinstance(exc, UserFault):
        return Result(error=str(exc), category="user")
    log.error("request failed", exc_info=exc)
    return Result(error=f"internal error: {type(exc).__name__}: {exc}", category="server")
