"""A full disk, told in one line: "no space left on device while writing PATH", for metrics, the
summary, checkpoints (torch.save's own error says nothing of the disk) and the server's weights,
with what was there before intact, and `grail-train` printing the command that resumes the run.

The disk is filled by simulation: a write that raises ENOSPC, or torch.save's error while
`shutil.disk_usage` reports no space left (a real small file system needs root to mount)."""

from __future__ import annotations

import errno
import logging
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import forked
from helpers.grail_process import SMALL, finish, servers_of
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core import disk
from grail.core.errors import DiskFullError, UserError
from grail.core.records import atomic_write_text, read_metrics, write_summary
from grail.train import checkpoint as checkpoint_module
from grail.train import cli, launch, sweep_job
from grail.train.checkpoint import (
    checkpoint_problems,
    commit_checkpoint,
    latest_checkpoint,
    stage_checkpoint,
)

# What torch.save raises when the disk fills under it (PyTorch 2.x's zip writer): no errno.
TORCH_FULL = "[enforce fail at inline_container.cc:664] . unexpected pos 147840 vs 147728"
# What safetensors raises (its own exception type, the OS error in its text).
SAFETENSORS_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


def _no_space(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _disk_is_full(monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda _path: usage._replace(free=0))


class _Saves:
    """Stands in for a model or tokenizer: save_pretrained(dir) writes a file, or `fails`."""

    def __init__(self, name: str, fails: Callable[[], None] | None = None) -> None:
        self.name, self.fails = name, fails

    def save_pretrained(self, path: Path, **_: object) -> None:
        (Path(path) / f"{self.name}.json").write_text("{}")
        if self.fails is not None:
            self.fails()


# --- metrics and the summary ----------------------------------------------------------------


def test_a_full_disk_while_writing_a_file_names_it_and_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "metrics" / "train_iter_001.json"
    atomic_write_text(path, "old")
    monkeypatch.setattr(os, "fsync", _no_space)
    with pytest.raises(DiskFullError) as info:
        atomic_write_text(path, "new")
    assert str(info.value) == f"no space left on device while writing {path}"
    assert isinstance(info.value, UserError) and info.value.errno == errno.ENOSPC
    assert path.read_text() == "old"
    assert [p.name for p in path.parent.iterdir()] == ["train_iter_001.json"]  # no temporary
    with pytest.raises(DiskFullError, match=f"while writing {tmp_path / 'summary.json'}$"):
        write_summary(tmp_path, 1.0)


def test_other_write_errors_pass_unchanged_even_on_a_nearly_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _disk_is_full(monkeypatch)

    def denied(*_args: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "fsync", denied)
    with pytest.raises(PermissionError) as info:
        atomic_write_text(tmp_path / "x.json", "x")
    assert not isinstance(info.value, DiskFullError)


# --- checkpoints ------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["torch.save", "safetensors", "tokenizer"])
def test_a_full_disk_while_staging_a_checkpoint_names_it_and_keeps_the_last_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    last = commit_checkpoint(stage_checkpoint(tmp_path, 0, _Saves("m"), _Saves("t"), {}))
    model, tokenizer = _Saves("m"), _Saves("t")
    if where == "torch.save":

        def torch_save(*_args: object, **_kwargs: object) -> None:
            raise RuntimeError(TORCH_FULL)

        monkeypatch.setattr(checkpoint_module.torch, "save", torch_save)
        _disk_is_full(monkeypatch)  # the only sign: nothing left on the disk
    elif where == "safetensors":

        def safetensors_full() -> None:
            raise Exception(SAFETENSORS_FULL)  # safetensors' SafetensorError is an Exception

        model = _Saves("m", safetensors_full)
    else:
        tokenizer = _Saves("t", _no_space)
    with pytest.raises(DiskFullError) as info:
        stage_checkpoint(tmp_path, 1, model, tokenizer, {})
    assert str(info.value) == f"no space left on device while writing {tmp_path / 'iter_001'}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_000"]  # nothing staged is left
    assert checkpoint_problems(last) == []
    ref = latest_checkpoint(tmp_path)
    assert ref is not None and ref.path == last


def test_torch_saves_own_error_is_kept_when_the_disk_has_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def torch_save(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(TORCH_FULL)

    monkeypatch.setattr(checkpoint_module.torch, "save", torch_save)
    with pytest.raises(RuntimeError, match="unexpected pos") as info:
        stage_checkpoint(tmp_path, 1, _Saves("m"), _Saves("t"), {})
    assert not isinstance(info.value, DiskFullError)  # not put down to the disk by mistake


# --- what grail-train prints ------------------------------------------------------------------

HYDRA = OmegaConf.create(
    {"overrides": {"task": ["train.lr=2e-3"]}, "runtime": {"choices": {"env": "copy_digits"}}}
)


def test_grail_train_says_it_in_one_line_with_the_resume_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "metrics" / "train_iter_001.json"

    def full(config: object, run_dir: Path, resume: object = None, plan: object = None) -> None:
        raise DiskFullError(path)

    monkeypatch.setattr(launch, "train", full)
    with initialize_config_dir(config_dir=cli.CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo")
    with pytest.raises(SystemExit) as info:
        cli._single_run(cfg, tmp_path, HYDRA, None)
    assert info.value.code == 1
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None
    command = cli.resume_command(tmp_path.absolute())
    assert errors[0].getMessage() == (
        f"no space left on device while writing {path}; free some space, then continue the "
        f"run: {command}"
    )


def test_in_a_sweep_a_full_disk_stops_the_sweep_and_leaves_the_run_to_resume(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "0"

    def full(config: object, run_dir: Path, resume: object = None, plan: object = None) -> None:
        raise DiskFullError(run_dir / "checkpoints" / "iter_000")

    monkeypatch.setattr(launch, "train", full)
    hydra_cfg = OmegaConf.create(
        {
            "launcher": {"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"},
            "sweeper": {"max_batch_size": None},
            "job": {"num": 0},
            "overrides": {"task": []},
            "sweep": {"dir": str(tmp_path)},
            "runtime": {"choices": {"env": "copy_digits"}},
        }
    )
    with initialize_config_dir(config_dir=cli.CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo")
    # Every later run would hit it too: not one failed run, but the end of the sweep ...
    with pytest.raises(DiskFullError):
        sweep_job.sweep_job(cfg, run_dir, hydra_cfg, None)
    # ... leaving the run incomplete, not failed: `resume=true` continues it.
    assert not (run_dir / "summary.json").exists()


# A grail-train whose disk fills during its second checkpoint, inside torch.save.
_FULL_AT_SECOND_CHECKPOINT = f"""
import shutil, sys, torch
from grail.train import cli
real_save, calls = torch.save, []
def save(obj, f, *args, **kwargs):
    calls.append(f)
    if len(calls) == 2:
        usage = shutil.disk_usage("/")
        shutil.disk_usage = lambda path: usage._replace(free=0)
        raise RuntimeError({TORCH_FULL!r})
    return real_save(obj, f, *args, **kwargs)
torch.save = save
sys.argv = ["grail-train", *sys.argv[1:]]
cli.main()
"""


def test_a_run_whose_disk_fills_in_a_checkpoint_stops_in_one_line_and_resumes(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    args = [*SMALL, "train.iterations=3", "eval.enabled=false", f"hydra.run.dir={run_dir}"]
    proc = forked.popen(  # the program forked from the runner: no new interpreter's imports
        [sys.executable, "-c", _FULL_AT_SECOND_CHECKPOINT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        program=True,
    )
    out = finish(proc)
    assert proc.returncode == 1, out[-3000:]
    assert "Traceback" not in out and "unexpected pos" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1, out[-3000:]
    checkpoints = run_dir / "checkpoints"
    assert f"no space left on device while writing {checkpoints / 'iter_001'}" in errors[0]
    assert servers_of(run_dir) == []
    # The last checkpoint is intact and nothing half-written is left beside it.
    assert sorted(p.name for p in checkpoints.iterdir()) == ["iter_000"]
    assert checkpoint_problems(checkpoints / "iter_000") == []
    # The command it prints continues the run (with space to write, this time).
    command = errors[0][errors[0].index("uv run grail-train") :]
    again = forked.run(
        [sys.executable, "-m", "grail.train.cli", *shlex.split(command)[3:]],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert read_metrics(run_dir / "summary.json")["iterations"] == 3
    assert checkpoint_problems(checkpoints / "iter_002") == []
