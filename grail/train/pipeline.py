"""Pipelined generation: the next iteration's rollouts are generated while this one trains.

Synchronous mode alternates: the server generates, then the trainer trains while the server idles,
then the other way round. With `train.pipeline=true` the two overlap, one step off-policy:

    iteration i:   [ generate batch i+1 with weights v_i (server) ]
                   [ train on batch i  v_i -> v_{i+1}  (trainer)  ] wait, sync v_{i+1}, eval

Version v_k is the policy after k updates; the trainer holds v_i while it trains iteration i.
Batch i+1 is generated with v_i and trained at v_{i+1}, so its staleness is exactly 1 (batch 0,
generated before any training, has staleness 0). Staleness never exceeds 1 because the weight sync
waits for the running generation to finish: the server's weights never change under a batch.

The lag is corrected where the objective already corrects any trainer/server mismatch: the
truncated importance-sampling weight min(exp(log π_θ(o_t) − log π_behaviour(o_t)), tis_cap) in
grail.algo.grpo, with π_behaviour the log-probabilities the server returned for batch i+1 (under
v_i). Rollouts are deterministic for a fixed seed whatever the timing, since each request carries
its own sampling seed and the built-in server's batches are batch-invariant on CPU.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from grail.rollouts import RolloutBatch


@dataclass
class GeneratedBatch:
    """A rollout batch with where it came from: the policy version that sampled it and when."""

    batch: RolloutBatch
    policy_version: int  # optimizer updates applied to the weights that generated it
    generation_s: float
    started: float = 0.0  # time.perf_counter() interval, for overlap accounting
    finished: float = 0.0


def overlap_s(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of two [start, end] intervals (0 when they are disjoint)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class GenerationCancelled(Exception):
    """The background generation was cancelled (the run is stopping)."""


class CancellableRunner:
    """Runs coroutines to completion on a private event loop, and lets another thread cancel the
    one running. `call_with_recovery` retries on a dead server only, so a cancelled run (which
    raises `GenerationCancelled`) is never retried."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[Any] | None = None

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        with self._lock:
            if self._cancelled:
                coroutine.close()
                raise GenerationCancelled("generation cancelled before it started")
            loop = self._loop = asyncio.new_event_loop()
            task = self._task = loop.create_task(coroutine)
        try:
            return loop.run_until_complete(task)
        except asyncio.CancelledError:
            raise GenerationCancelled("generation cancelled") from None
        finally:
            with self._lock:
                self._loop = self._task = None
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            if self._loop is not None and self._task is not None:
                self._loop.call_soon_threadsafe(self._task.cancel)


class Prefetch:
    """One generation running in a background thread while the caller trains.

    `produce(runner)` does the generation, running its coroutines through `runner` so that
    `cancel()` can stop it from the main thread (Ctrl-C, a failed update) before the server is
    shut down under it. `result()` waits and re-raises whatever the generation raised.
    """

    def __init__(self, produce: Callable[[CancellableRunner], GeneratedBatch]) -> None:
        self._runner = CancellableRunner()
        self._value: GeneratedBatch | None = None
        self._error: BaseException | None = None

        def work() -> None:
            try:
                self._value = produce(self._runner)
            except BaseException as exc:  # handed to the main thread by result()
                self._error = exc

        self._thread = threading.Thread(target=work, name="grail-prefetch", daemon=True)
        self._thread.start()

    def result(self, timeout_s: float | None = None) -> GeneratedBatch:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"background generation still running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        assert self._value is not None
        return self._value

    def cancel(self, timeout_s: float = 30.0) -> None:
        """Stop the generation and wait (bounded) for its thread to end."""
        self._runner.cancel()
        self._thread.join(timeout_s)


def timed_generation(generate: Callable[[], RolloutBatch], policy_version: int) -> GeneratedBatch:
    """Run `generate` and stamp the batch with its policy version and timing."""
    started = time.perf_counter()
    batch = generate()
    finished = time.perf_counter()
    return GeneratedBatch(batch, policy_version, finished - started, started, finished)
