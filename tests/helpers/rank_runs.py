"""grail-train runs with several trainer ranks, each in its own session so that every process it
started (ranks, the inference server) can be found afterwards: what tests/test_distributed_run.py
and tests/test_two_nodes.py share."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.forked import popen
from helpers.grail_process import SMALL

HELPERS = Path(__file__).resolve().parent
FAULT_HOOK = HELPERS / "rank_fault"  # sitecustomize: GRAIL_TEST_RANK_FAULT=RANK:ACTION:N
TWO = ["train.processes=2", "train.collective_timeout_s=120"]
FAULTY = ["train.iterations=2", "eval.enabled=false", *TWO]  # the fault tests: short runs
# Iteration 0's update, which N ranks must compute as one process does (up to float rounding).
COMPARED = ("loss_total", "loss_pg", "grad_norm", "entropy", "reward_mean", "success_rate")


def grail_train(
    run_dir: Path, *overrides: str, fault: str | None = None, timeout: float = 240
) -> tuple[int, str, float]:
    """Run grail-train in its own session to the end: exit code, output, seconds; fails the test
    if any process of its session is left behind."""
    t0 = time.monotonic()
    code, out = finish(start_grail_train(run_dir, *overrides, fault=fault), timeout)
    return code, out, time.monotonic() - t0


def members(group_or_session: int, *, session: bool = False) -> list[int]:
    """Live (not zombie) processes of a process group, or of a session."""
    field = 3 if session else 2  # /proc/PID/stat after the command: state, ppid, pgrp, session
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == group_or_session and fields[0] not in "ZX":
            found.append(int(stat.parent.name))
    return found


def session_members(sid: int) -> list[int]:
    return members(sid, session=True)


def assert_session_empty(sid: int, out: str) -> None:
    deadline = time.monotonic() + 10  # a process may take a moment to be reaped
    while (left := session_members(sid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left behind: {left}\n{out[-2000:]}"


def train_record(run_dir: Path, iteration: int) -> dict[str, object]:
    return json.loads((run_dir / "metrics" / f"train_iter_{iteration:03d}.json").read_text())


def error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if "[ERROR]" in line]


def start_grail_train(
    run_dir: Path, *overrides: str, fault: str | None = None
) -> subprocess.Popen[str]:
    """grail-train in its own session, its output piped (see `finish`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    hook: frozenset[str] = frozenset()
    if fault is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(FAULT_HOOK), env.get("PYTHONPATH")]))
        env["GRAIL_TEST_RANK_FAULT"] = fault
        # The hook patches grail.train.sharded, which only the ranks import (new interpreters
        # that torch spawns with grail-train's environment), never grail-train's own process:
        # a grail-train forked from the runner (without the hook) runs the same faulty ranks,
        # and saves the seconds of a new interpreter's imports.
        hook = frozenset({"PYTHONPATH", "GRAIL_TEST_RANK_FAULT"})
    return popen(
        [sys.executable, "-m", "grail.train.cli", f"hydra.run.dir={run_dir}", *SMALL, *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
        for_its_children=hook,
    )


def finish(proc: subprocess.Popen[str], timeout: float) -> tuple[int, str]:
    """Wait for `proc` to end (killing its session past `timeout`, which fails the test): its exit
    code and output; fails the test if any process of its session is left behind."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"grail-train did not finish in {timeout}s:\n{out[-3000:]}")
    assert_session_empty(proc.pid, out)
    return proc.returncode, out
