"""The built-in engine's queue of work (`WorkQueue`): sequences waiting to be decoded, and control
jobs (weight copies) that run between batches. Callers put work from any thread; the engine's
worker takes it, and the decoders take more sequences from it whenever rows free up."""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

from grail.inference.builtin.sequences import EngineStopped, _Control, _Sequence


class WorkQueue:
    """Sequences and control jobs in arrival order; a control job is a barrier (sequences after
    it are not taken before it has run, so a weight update waits for the batch before it and
    precedes the requests after it)."""

    def __init__(self) -> None:
        self._items: collections.deque[_Sequence | _Control] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False

    @property
    def stopping(self) -> bool:
        """True once `stop` was called: the worker and the decoders wind down."""
        return self._stopping

    def put_sequences(self, seqs: Iterable[_Sequence]) -> None:
        """Queue ``seqs`` at once (the samples of one request are taken together when they fit)."""
        with self._cond:
            self._items.extend(seqs)
            self._cond.notify_all()

    def put_control(self, job: _Control) -> None:
        """Queue a control job; raises `EngineStopped` once the queue is stopping (nobody would
        run it)."""
        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._items.append(job)
            self._cond.notify_all()

    def stop(self) -> None:
        """Wake the worker and tell it to stop."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    def next_work(self, limit: int) -> _Control | list[_Sequence] | None:
        """Block until there is work: a control job, or the waiting sequences (up to
        ``limit``); None once stopping."""
        with self._cond:
            while not self._items and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            if isinstance(self._items[0], _Control):
                return self._items.popleft()  # type: ignore[return-value]
        return self.take(limit)

    def take(self, limit: int) -> list[_Sequence]:
        """Up to ``limit`` queued sequences in arrival order, never past a control job."""
        taken: list[_Sequence] = []
        with self._cond:
            while self._items and isinstance(self._items[0], _Sequence) and len(taken) < limit:
                taken.append(self._items.popleft())  # type: ignore[arg-type]
        return taken

    def fail_all(self, exc: BaseException) -> None:
        """Empty the queue, failing every waiting sequence and control job with ``exc``."""
        with self._cond:
            items = list(self._items)
            self._items.clear()
        for item in items:
            if not item.future.done():
                item.future.set_exception(exc)
