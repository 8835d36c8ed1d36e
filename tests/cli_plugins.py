"""Reward plugins for tests/test_cli.py, loaded as "tests.cli_plugins:NAME": `brevity`, named
like a component of copy_digits' score (the README's first plugin example), and plugins that
never return."""

from __future__ import annotations

import concurrent.futures
import os
import time
from pathlib import Path
from typing import Any


def brevity(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 / (1 + len(c)) for c in completions]


def _entered() -> None:
    # Tells the test the run is stuck in the plugin now (the file named by the variable).
    marker = os.environ.get("GRAIL_TEST_STUCK_MARKER")
    if marker:
        Path(marker).touch()


def never_returns(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """A plugin stuck for good (a deadlock, a lost network call): the run must not hang on it."""
    _entered()
    while True:
        time.sleep(3600)


def never_returns_in_a_pool(
    prompts: list[str], completions: list[str], **kwargs: Any
) -> list[float]:
    """Stuck in a thread pool of its own, whose worker the interpreter waits for at exit."""
    _entered()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    return pool.submit(time.sleep, 3600).result()  # type: ignore[return-value]
