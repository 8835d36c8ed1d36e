"""Reading back what the metric loggers wrote: what the tests of the loggers share
(tests/test_loggers.py, test_train_loop.py)."""

from __future__ import annotations

from pathlib import Path

import pytest


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars as TensorBoard loads them: every event file in the directory, purges applied."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }
