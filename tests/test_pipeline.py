"""Pipelined generation's building blocks: a background generation that can be waited for,
re-raises its failure in the caller, and stops promptly when cancelled (Ctrl-C mid-pipeline)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from grail.rollouts import RolloutBatch
from grail.train.pipeline import (
    CancellableRunner,
    GeneratedBatch,
    GenerationCancelled,
    Prefetch,
    overlap_s,
    timed_generation,
)


def test_overlap_of_intervals() -> None:
    assert overlap_s((0.0, 2.0), (1.0, 3.0)) == 1.0
    assert overlap_s((1.0, 3.0), (0.0, 2.0)) == 1.0
    assert overlap_s((0.0, 5.0), (1.0, 2.0)) == 1.0
    assert overlap_s((0.0, 1.0), (2.0, 3.0)) == 0.0


def test_prefetch_returns_the_generated_batch_with_its_version() -> None:
    batch = RolloutBatch(groups=[])
    prefetch = Prefetch(lambda runner: timed_generation(lambda: batch, policy_version=3))
    result = prefetch.result(timeout_s=10)
    assert result.batch is batch and result.policy_version == 3
    assert result.finished >= result.started and result.generation_s >= 0


def test_prefetch_reraises_the_generation_error_in_the_caller() -> None:
    def fail(runner: CancellableRunner) -> GeneratedBatch:
        raise RuntimeError("scoring failed for seed 7")

    with pytest.raises(RuntimeError, match="seed 7"):
        Prefetch(fail).result(timeout_s=10)


def test_cancel_stops_a_running_generation_promptly() -> None:
    started = threading.Event()

    async def endless() -> RolloutBatch:
        started.set()
        await asyncio.sleep(3600)
        raise AssertionError("not cancelled")

    prefetch = Prefetch(lambda runner: timed_generation(lambda: runner.run(endless()), 0))
    assert started.wait(10)
    t0 = time.monotonic()
    prefetch.cancel(timeout_s=10)
    assert time.monotonic() - t0 < 5
    with pytest.raises(GenerationCancelled):
        prefetch.result(timeout_s=1)


def test_a_cancelled_runner_refuses_the_next_attempt() -> None:
    """A retry after cancellation (call_with_recovery restarting a dead server) must not run."""
    runner = CancellableRunner()
    runner.cancel()
    ran = []

    async def attempt() -> None:
        ran.append(1)

    with pytest.raises(GenerationCancelled):
        runner.run(attempt())
    assert not ran


def test_result_times_out_instead_of_hanging() -> None:
    release = threading.Event()
    prefetch = Prefetch(
        lambda runner: timed_generation(lambda: (release.wait(30), RolloutBatch([]))[1], 0)
    )
    with pytest.raises(TimeoutError, match="still running"):
        prefetch.result(timeout_s=0.2)
    release.set()
    assert prefetch.result(timeout_s=10).policy_version == 0
