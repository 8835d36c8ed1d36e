"""A run's directory: one run at a time (a lock), a model directory that cannot load refused
before anything starts, every part of a run (start, resumes) in its wall time, and the end of a
run saying where its files are."""

from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.grail_process import alive, finish, servers_of, train_process, wait_for
from rich.console import Console

from grail.core.records import (
    RunDirLocked,
    RunPart,
    read_metrics,
    run_lock,
    validate_metrics,
    write_summary,
)
from grail.train.display import Display

# --- one run per directory ------------------------------------------------------------------------

_HOLD = "import sys, time; from grail.core.records import run_lock\nwith run_lock(sys.argv[1]):\n"
_HOLD += "    print('locked', flush=True)\n    time.sleep(120)\n"


def _hold_lock(run_dir: Path) -> subprocess.Popen[str]:
    """Another process holding `run_dir`'s lock (as a running grail-train does)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def test_a_run_directory_is_held_by_one_process_until_it_dies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = _hold_lock(tmp_path)
    try:
        with pytest.raises(RunDirLocked) as err, run_lock(tmp_path):
            pass
        assert f"{tmp_path} is in use by another grail-train (pid {holder.pid} " in str(err.value)
        # A failed run's summary (the sweep's failure path) would say the running one failed.
        write_summary(tmp_path, 1.0, error=RuntimeError("x"))
        assert not (tmp_path / "summary.json").exists()
        assert "summary.json not written" in caplog.text
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock, nothing stale is left to clean up
        holder.wait()
    with run_lock(tmp_path), run_lock(tmp_path):  # one process may nest it (a run, its summary)
        write_summary(tmp_path, 1.0)
    assert read_metrics(tmp_path / "summary.json")["status"] == "completed"


def test_a_second_grail_train_into_a_running_runs_directory_fails_at_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "0"  # job 0 of the sweep below lands here too
    first = train_process(run_dir, "train.iterations=1000", "eval.enabled=false")
    try:
        wait_for(
            lambda: (
                (run_dir / "metrics" / "train_iter_000.json").exists() or first.poll() is not None
            ),
            240,
            "the first run's first iteration",
        )
        assert first.poll() is None, "the first run should still be running"
        second = train_process(run_dir, "train.iterations=2", "train.lr=0.5", "eval.enabled=false")
        out = finish(second, timeout=180)
        assert second.returncode != 0
        assert f"{run_dir} is in use by another grail-train (pid {first.pid} " in out, out[-3000:]
        assert "started builtin server" not in out
        # What the directory says about its run is the first run's, not the refused one's.
        assert "train.lr=0.5" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
        assert "lr: 0.5" not in (run_dir / ".hydra" / "config.yaml").read_text()

        # A sweep job into it is not run and writes nothing there (no "failed" summary, no
        # attempt, no overrides); the sweep ends non-zero, listing the run.
        sweep = train_process(tmp_path, "train.iterations=2", "train.lr=0.25", multirun=True)
        out = finish(sweep, timeout=180)
        assert sweep.returncode != 0
        assert (
            f"sweep job 0 not run: {run_dir} is in use by another grail-train (pid {first.pid} "
            in out
        ), out[-3000:]
        assert not (run_dir / "summary.json").exists()
        assert not (run_dir / "attempts.jsonl").exists()
        assert "train.lr=0.25" not in (run_dir / ".hydra" / "overrides.yaml").read_text()
        assert first.poll() is None, "the first run should be unharmed"
    finally:
        server_pids = servers_of(run_dir)
        first.send_signal(signal.SIGINT)
        finish(first, timeout=60)
        wait_for(lambda: not any(alive(p) for p in server_pids), 15, "the server to stop")


# --- a model directory that cannot load ------------------------------------------------------


def test_a_model_without_tokenizer_files_fails_before_anything_starts(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    for path in tiny_model_dir.iterdir():
        if path.name != "tokenizer.json":
            (model / path.name).write_bytes(path.read_bytes())
    run_dir = tmp_path / "run"
    proc = train_process(run_dir, f"model.train_id={model}", "train.iterations=2")
    out = finish(proc)
    assert proc.returncode != 0
    assert f"{model} has no tokenizer files" in out and "tokenizer.json" in out, out[-3000:]
    # Neither a server (its log) nor the weights it would load (with an empty tokenizer).
    assert not (run_dir / "logs").exists() and not (run_dir / "weights").exists()


# --- the parts of a run; the end of a run -------------------------------------------------------


def test_the_summary_adds_up_the_parts_of_a_run(tmp_path: Path) -> None:
    start = RunPart(tmp_path)
    start.save(iterations=3)  # then killed
    resume = RunPart(tmp_path)
    resume.save(iterations=2)
    parts = json.loads((tmp_path / "parts.json").read_text())["parts"]
    assert [p["iterations"] for p in parts] == [3, 2]
    summary = write_summary(tmp_path, 999.0)  # this attempt's own time: counted in its part
    validate_metrics(summary, "summary")
    assert summary["parts"] == parts
    assert summary["wall_time_s"] == pytest.approx(sum(p["wall_time_s"] for p in parts))
    # A run that recorded no parts (it failed before its loop started) keeps the caller's time.
    assert write_summary(tmp_path / "other", 12.5)["wall_time_s"] == 12.5


def test_the_end_of_a_run_says_where_its_files_are(tmp_path: Path) -> None:
    run_dir = tmp_path / ("a-long-directory-name-" * 4)  # printed whole, never wrapped
    for name in ("metrics", "checkpoints", "logs"):
        (run_dir / name).mkdir(parents=True)
    (run_dir / "grail-train.log").write_text("")
    RunPart(run_dir).save()
    summary = write_summary(run_dir, 0.0)
    out = io.StringIO()
    Display(Console(file=out, width=60)).summary(summary, run_dir)
    text = out.getvalue()
    assert f"run directory: {run_dir}\n" in text
    for name in ("summary.json", "metrics/", "checkpoints/", "logs/", "grail-train.log"):
        assert f"\n  {name} " in text, name
