"""Files a run writes follow the umask, like every other program's: mkstemp and safetensors'
writer made the weights, manifests, metrics and .hydra/*.yaml 0600 while their siblings were
0644, so a group that could read the run directory could not read its results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from helpers.run_dirs import REPO, TINY_RUN

from grail.core.records import follow_umask


def test_every_file_of_a_run_follows_the_umask(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "grail.train.cli", *TINY_RUN, "train.iterations=1",
         "eval.enabled=false", "checkpoint.save_interval=1", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: os.umask(0o027),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    modes = {
        str(path.relative_to(run_dir)): oct(path.stat().st_mode & 0o777)
        for path in run_dir.rglob("*")
        if path.is_file()
    }
    assert any(name.endswith("model.safetensors") for name in modes)
    assert any(name.endswith("manifest.json") for name in modes)
    assert {name: mode for name, mode in modes.items() if mode != "0o640"} == {}


def test_follow_umask_gives_a_directory_s_files_the_umask_mode(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    for name in ("a", "sub/b"):
        (tmp_path / name).write_text("x")
        os.chmod(tmp_path / name, 0o600)
    mask = os.umask(0o022)
    os.umask(mask)
    follow_umask(tmp_path)
    assert {oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*") if p.is_file()} == {
        oct(0o666 & ~mask)
    }
