"""Running user code (reward plugins) in threads that can be abandoned.

A Python thread cannot be stopped from outside. What can be done with one stuck in a plugin (a
deadlock, a lost network call, a C call that never returns) is to stop waiting for it, and to
make sure it cannot hold up the end of the process: both helpers here run the call in a *daemon*
thread, which the interpreter does not wait for at exit. `asyncio.to_thread` and
`concurrent.futures` pools are not used for such calls: their worker threads are joined when the
interpreter exits, so one stuck call keeps the process alive after Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceeded(Exception):
    """The call did not end within its deadline; its thread was left running (abandoned)."""


def _start(fn: Callable[..., T], args: tuple[Any, ...], name: str) -> concurrent.futures.Future[T]:
    """`fn(*args)` in a new daemon thread; its outcome in the returned future."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_running_or_notify_cancel()  # never cancelled: it runs from the start

    def target() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


def call_with_deadline(
    fn: Callable[..., T], *args: Any, timeout_s: float, name: str = "grail-call"
) -> T:
    """`fn(*args)` run in a daemon thread: its result or its exception, or `DeadlineExceeded`
    after `timeout_s` seconds, leaving the thread running (it can neither be stopped nor keep
    the process alive). An interrupt (Ctrl-C) while waiting propagates at once."""
    future = _start(fn, args, name)
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    if not done:
        raise DeadlineExceeded(f"no result within {timeout_s:g} s")
    return future.result()


async def in_daemon_thread(fn: Callable[..., T], *args: Any, name: str = "grail-call") -> T:
    """`await asyncio.to_thread(fn, *args)`, but in a daemon thread of its own: cancelling the
    await abandons the thread, which then never holds up the interpreter's exit."""
    loop = asyncio.get_running_loop()
    waiter: asyncio.Future[T] = loop.create_future()

    def settle(outcome: concurrent.futures.Future[T]) -> None:
        if waiter.done():  # the await was cancelled: nobody wants the outcome any more
            return
        exc = outcome.exception()
        if exc is not None:
            waiter.set_exception(exc)
        else:
            waiter.set_result(outcome.result())

    def report(outcome: concurrent.futures.Future[T]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed while the thread ran
            loop.call_soon_threadsafe(settle, outcome)

    _start(fn, args, name).add_done_callback(report)
    return await waiter


_Outcome = concurrent.futures.Future[Any]


class DaemonWorkers:
    """`in_daemon_thread` for many short calls: daemon threads that stay and take calls from a
    queue, so a call does not pay a thread's start. Starting a thread waits until it runs, which
    on a busy 2-core machine cost ~1.7 ms a call: 4.3 s of a batch of 2,560 environment steps
    that took 5.2 s in all (benchmarks/episodes.py). A call that never returns keeps its worker;
    a new one starts whenever every worker is busy, so the others are never held up by it."""

    def __init__(self, name: str = "grail-worker") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._calls: list[
            tuple[Callable[..., Any], tuple[Any, ...], concurrent.futures.Future[Any]]
        ]
        self._calls = []
        self._ready = threading.Condition(self._lock)
        self._idle = 0

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in one of the workers; cancelling the await abandons the call."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, args, future))
            if self._idle:
                self._ready.notify()
            else:
                threading.Thread(target=self._work, name=self.name, daemon=True).start()
        return await asyncio.wrap_future(future)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._calls:
                    self._idle += 1
                    self._ready.wait()
                    self._idle -= 1
                fn, args, future = self._calls.pop(0)
            if not future.set_running_or_notify_cancel():
                continue  # the caller stopped waiting before it ran
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
