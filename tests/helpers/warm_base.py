"""The warm base the LoRA, service and Tinker learning tests start from (tests/conftest.py): the
default job stopped just past the first checkpoint whose held-out success reaches a threshold."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers.forked import popen
from helpers.run_dirs import REPO

# An evaluation and a checkpoint every 4 iterations, all of them kept: the base can be any of them.
EVERY_4 = ["eval.interval=4", "checkpoint.save_interval=4", "checkpoint.keep_last_k=40"]


def successes(run_dir: Path) -> dict[int, float]:
    """Held-out success per evaluated iteration, so far."""
    found = {}
    for path in sorted((run_dir / "metrics").glob("eval_iter_*.json")):
        try:
            found[int(path.stem.rsplit("_", 1)[1])] = json.loads(path.read_text())["success_rate"]
        except (OSError, ValueError):  # not there yet: written atomically, but listed first
            continue
    return found


def first_reaching(run_dir: Path, threshold: float) -> int | None:
    return next((i for i, rate in successes(run_dir).items() if rate >= threshold), None)


def build_warm_base(run_dir: Path, threshold: float, timeout: float = 900) -> Path:
    """Run the default job into `run_dir` and stop it (Ctrl-C: a run's files are consistent at
    any moment) once the iteration after the first evaluation at `threshold` has its record, so
    that evaluation's checkpoint is complete; the whole job where none reaches it. Returns that
    checkpoint. Stopping early spares the ~50 iterations the tests never use."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "grail.train.cli", *EVERY_4, f"hydra.run.dir={run_dir}"]
    log = run_dir.with_suffix(".log")
    deadline = time.monotonic() + timeout
    with open(log, "w") as out:
        proc = popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                base = first_reaching(run_dir, threshold)
                if (
                    base is not None
                    and (run_dir / "metrics" / f"train_iter_{base + 1:03d}.json").exists()
                ):
                    proc.send_signal(signal.SIGINT)
                    proc.wait(timeout=120)
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    base = first_reaching(run_dir, threshold)
    assert base is not None, (
        f"the default job never reached held-out success {threshold}: {successes(run_dir)}; "
        f"its log: {log}"
    )
    assert successes(run_dir)[base] < 0.75, f"no base left room to learn: {successes(run_dir)}"
    checkpoint = run_dir / "checkpoints" / f"iter_{base:03d}"
    assert checkpoint.is_dir(), f"{checkpoint} was not written; the run's log: {log}"
    return checkpoint
