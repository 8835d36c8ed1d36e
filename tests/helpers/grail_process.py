"""grail-train as a subprocess, and the processes it leaves: what the end-to-end tests share
(tests/test_train_loop.py, test_run_safety.py, test_rollout_reuse.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from grail.inference.os_process import process_alive as alive
from helpers.forked import popen
from helpers.run_dirs import TINY_RUN

SMALL = [
    *TINY_RUN,
    "eval.interval=2",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last_k=2",
]


def train_process(
    run_dir: Path, *overrides: str, multirun: bool = False, **kwargs: object
) -> subprocess.Popen[str]:
    """grail-train into `run_dir`; with `multirun`, a sweep (`-m`) into the sweep dir `run_dir`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    where = ["-m", f"hydra.sweep.dir={run_dir}"] if multirun else [f"hydra.run.dir={run_dir}"]
    return popen(
        [sys.executable, "-m", "grail.train.cli", *where, *SMALL, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **kwargs,  # type: ignore[arg-type]
    )


def finish(proc: subprocess.Popen[str], timeout: float = 300) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"grail-train did not finish in {timeout}s:\n{out[-3000:]}")
    return out


def servers_of(run_dir: Path) -> list[int]:
    """Live processes whose command line names the run directory (its inference server)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        pid = int(cmdline.parent.name)
        mentions_run = any(str(run_dir).encode() in a for a in args)
        is_server = b"grail.inference.builtin.server" in b" ".join(args)
        if pid != os.getpid() and mentions_run and is_server and alive(pid):
            found.append(pid)
    return found


def wait_for(predicate: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")
