"""`grail-train train.processes=2` on CPU: two gloo ranks under torch's elastic launcher, rank 0
driving (grail/train/distributed.py). End to end, each test a grail-train process in its own
session, so that every process it started (ranks, the inference server) can be found afterwards.

The iteration-0 comparison with the 1-process run holds before the update shards its micro-batches
over the ranks (each rank trains the whole batch, FSDP averages equal gradients) and after (the
normalisers are global): it is what both must keep.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from helpers import forked
from helpers.grail_process import SMALL, wait_for
from helpers.rank_runs import (
    COMPARED,
    FAULTY,
    TWO,
    assert_session_empty,
    error_lines,
    finish,
    grail_train,
    session_members,
    start_grail_train,
    train_record,
)
from safetensors.torch import load_file


def test_two_ranks_train_as_one_process_does(one_process_run: Path, tmp_path: Path) -> None:
    one, two = one_process_run, tmp_path / "two"  # only one's iteration 0 is compared
    code, out, _ = grail_train(two, "train.iterations=3", *TWO)
    assert code == 0, out[-3000:]
    assert "2 trainer process(es)" in out  # the display's summary

    first_one, first_two = train_record(one, 0), train_record(two, 0)
    for key in COMPARED:
        a, b = first_one[key], first_two[key]
        assert isinstance(a, float) and isinstance(b, float)
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (key, a, b)
    assert first_one["trainer_processes"] == 1 and first_two["trainer_processes"] == 2
    # It keeps learning: every iteration updates the policy, and the weights move.
    for iteration in range(3):
        grad_norm = train_record(two, iteration)["grad_norm"]
        assert isinstance(grad_norm, float) and grad_norm > 0
    checkpoints = two / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_001", "iter_002"]
    before = load_file(checkpoints / "iter_001" / "model.safetensors")
    after = load_file(checkpoints / "iter_002" / "model.safetensors")
    assert any(not before[k].equal(after[k]) for k in before)
    assert sorted(p.name for p in (checkpoints / "iter_002" / "optimizer").glob("*.distcp")) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trainer_processes"] == 2


def test_a_rank_that_raises_ends_the_run_and_resume_continues(tmp_path: Path) -> None:
    code, out, seconds = grail_train(tmp_path, *FAULTY, fault="1:raise:2")
    assert code == 1, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1, out[-3000:]
    assert "trainer rank 1" in errors[0] and "injected fault in rank 1's update 2" in errors[0]
    assert "resume=true" in errors[0]
    assert "Traceback" not in out  # in the log file, not on the console
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "trainer rank 1" in summary["error"]["message"]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["iter_000"]

    code, out, _ = grail_train(tmp_path, "resume=true")
    assert code == 0, out[-3000:]
    assert "resuming after iteration 0" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["iterations"] == 2


def test_a_rank_killed_by_sigkill_ends_the_run_within_a_minute(tmp_path: Path) -> None:
    code, out, _ = grail_train(tmp_path, *FAULTY, fault="1:kill:2")
    assert code == 1, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1, out[-3000:]
    assert "trainer rank 1" in errors[0] and "killed by SIGKILL" in errors[0], errors[0]
    # Rank 1 kills itself as iteration 1's update starts, right after iteration 0's line; the
    # agent notices, stops rank 0 (which stops the server) and the run ends with the error line.
    done = next(line for line in out.splitlines() if "iter 000:" in line)
    assert logged_at(errors[0]) - logged_at(done) < 60, (done, errors[0])
    assert (tmp_path / "checkpoints" / "iter_000").is_dir()


# The hang test's collective timeout, which every wait of its run before the hang must stay
# under: the longest, rank 1 waiting for its first command while rank 0 starts the server and
# generates iteration 0 (or in init_process_group while rank 0 prepares its zygote), took 1.7 s
# on an idle 2-core machine, 4.1 s beside test_episode_runs' five runs and 7.9 s beside three
# busy-looping processes. The test waits it out in full: 15 s keeps twice that worst case,
# where 20 s cost 5 s more.
HANG_TIMEOUT_S = 15


def test_a_rank_that_hangs_is_caught_by_the_collective_timeout(tmp_path: Path) -> None:
    # Rank 1 sleeps for good as its second update starts; rank 0 waits in the update's first
    # collective for train.collective_timeout_s, then the run ends naming the timeout.
    hang = ["train.iterations=2", "eval.enabled=false", "train.processes=2"]
    hang.append(f"train.collective_timeout_s={HANG_TIMEOUT_S}")
    code, out, seconds = grail_train(tmp_path, *hang, fault="1:hang:2", timeout=180)
    assert code == 1, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1, out[-3000:]
    waited = f"trainer rank 0 waited train.collective_timeout_s={HANG_TIMEOUT_S} s"
    assert waited in errors[0], errors[0]
    assert "a rank hung" in errors[0] and "resume=true" in errors[0], errors[0]
    done = next(line for line in out.splitlines() if "iter 000:" in line)
    waited_s = logged_at(errors[0]) - logged_at(done)
    assert HANG_TIMEOUT_S <= waited_s < HANG_TIMEOUT_S + 60, (done, errors[0])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "failed" and "collective_timeout_s" in summary["error"]["message"]


def logged_at(line: str) -> float:
    """The time of a log line (`[2026-11-26 03:53:02,050][...`), in seconds."""
    stamp = line[1 : line.index("]")]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_ctrl_c_stops_every_rank_and_prints_the_resume_command(tmp_path: Path) -> None:
    proc = forked.popen(
        [sys.executable, "-m", "grail.train.cli", f"hydra.run.dir={tmp_path}", *SMALL]
        + ["train.iterations=5", "eval.enabled=false", *TWO],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "iter 000:" in line:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process
            break
    try:
        rest, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("grail-train did not stop within 60 s of Ctrl-C")
    out = "".join(seen) + rest
    assert proc.returncode == 130, out[-3000:]
    assert_session_empty(proc.pid, out)
    errors = error_lines(out)
    assert len(errors) == 1 and "interrupted" in errors[0] and "resume=true" in errors[0], out


def test_ctrl_c_while_the_ranks_import_prints_one_line(tmp_path: Path) -> None:
    # The ranks are born with SIGINT blocked and take it once rank_main can turn it into a quiet
    # exit: a Ctrl-C that lands while they import (seconds: torch, transformers) is no traceback.
    proc = start_grail_train(tmp_path, "eval.enabled=false", *TWO)
    try:
        wait_for(lambda: len(ranks_of(proc.pid)) == 2, 120, "the two ranks to start")
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process
        code, out = finish(proc, 90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert code == 130, out[-3000:]
    errors = error_lines(out)
    assert len(errors) == 1 and "interrupted" in errors[0] and "resume=true" in errors[0], out


def ranks_of(sid: int) -> list[int]:
    """The trainer ranks (torch's spawned processes) among session `sid`'s processes."""
    ranks = []
    for pid in session_members(sid):
        with contextlib.suppress(OSError):
            if b"--multiprocessing-fork" in Path(f"/proc/{pid}/cmdline").read_bytes():
                ranks.append(pid)
    return ranks


def _failed_rank(tmp_path: Path, exitcode: int, raised: str | None) -> Any:
    """torch's record of rank 1 ending with `exitcode`, after writing `raised` to its error file
    as torch's error handler does (None: no error file, as when a signal kills the rank)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    error_file = tmp_path / "error.json"
    if raised is not None:
        info = {"py_callstack": f"Traceback (most recent call last):\n{raised}\n", "timestamp": "1"}
        error_file.write_text(json.dumps({"message": {"message": raised, "extraInfo": info}}))
    failure = ProcessFailure(local_rank=1, pid=4242, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("rank_main", {1: failure})


@pytest.mark.parametrize(
    ("exitcode", "raised", "cause"),
    [
        (1, "RuntimeError: boom", "RuntimeError: boom"),
        # Seen in CI: the rank raised, wrote its error, then aborted as gloo tore down.
        (-signal.SIGABRT, "RuntimeError: boom", "RuntimeError: boom"),
        (-signal.SIGKILL, None, "killed by SIGKILL"),
        (3, None, "exit code 3"),
    ],
)
def test_a_failed_rank_is_reported_by_the_exception_it_raised_else_by_how_it_ended(
    tmp_path: Path, exitcode: int, raised: str | None, cause: str
) -> None:
    from grail.train.distributed import RankFailed, raise_failure

    with pytest.raises(RankFailed) as caught:
        raise_failure(_failed_rank(tmp_path, exitcode, raised))
    assert str(caught.value) == f"trainer rank 1 (pid 4242) failed: {cause}"
