"""Files a run writes follow the umask, like every other program's: mkstemp and safetensors'
writer made the weights, manifests, metrics and .hydra/*.yaml 0600 while their siblings were
0644, so a group that could read the run directory could not read its results. A file that holds
a key is the exception: owner-only (0600) whatever the umask."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.run_dirs import REPO, TINY_RUN
from omegaconf import OmegaConf

from grail.core.config import Config
from grail.core.records import (
    FILE_MODE,
    SECRET_FILE_MODE,
    atomic_write_text,
    follow_umask,
    holds_secrets,
)
from grail.service.endpoint import write_endpoint
from grail.train.cli import save_hydra_files
from grail.train.resume import Resume


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


@pytest.fixture(params=[0o022, 0o077, 0o000], ids=lambda mask: f"umask{mask:03o}")
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The process's umask set to each value a user may have, restored afterwards."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def test_a_file_that_holds_a_key_is_owner_only_whatever_the_umask(
    tmp_path: Path, umask: int
) -> None:
    """Following the umask made RUN_DIR/service/endpoint.json 0644 (umask 022) or 0666 (000),
    its key readable by every user of the machine."""
    path = write_endpoint(tmp_path / "service", "http://127.0.0.1:1234", "sk-secret")
    assert json.loads(path.read_text()) == {"url": "http://127.0.0.1:1234", "api_key": "sk-secret"}
    assert oct(path.stat().st_mode & 0o777) == oct(SECRET_FILE_MODE) == "0o600"
    # Rewritten over a file that others could read, it is owner-only again.
    os.chmod(path, 0o644)
    write_endpoint(tmp_path / "service", "http://127.0.0.1:1235", "sk-other")
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    # Any other output still follows the umask (what the umask gave this process at start).
    atomic_write_text(tmp_path / "metrics.json", "{}\n")
    assert oct((tmp_path / "metrics.json").stat().st_mode & 0o777) == oct(FILE_MODE)


def test_a_run_s_config_that_holds_a_key_is_owner_only(tmp_path: Path, umask: int) -> None:
    """`.hydra/` records the config as given: `service.api_key=...` on the command line stands in
    config.yaml, overrides.yaml and hydra.yaml; so do a remote scorer's headers."""
    cfg = OmegaConf.structured(Config)
    cfg.service.api_key = "sk-mine"
    hydra = OmegaConf.create({"overrides": {"task": ["service.api_key=sk-mine"]}})
    save_hydra_files(tmp_path / "keyed", cfg, hydra)
    resume = Resume(cfg, cfg, {"train.iterations": (1, 2)}, [], OmegaConf.to_yaml(cfg))
    resume.record(tmp_path / "keyed")  # a resume rewrites config.yaml
    keyed = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "keyed").rglob("*.yaml")}
    assert "sk-mine" in (tmp_path / "keyed/.hydra/overrides.yaml").read_text()
    assert keyed == dict.fromkeys(("config.yaml", "hydra.yaml", "overrides.yaml"), "0o600")
    cfg.service.api_key = None
    save_hydra_files(tmp_path / "plain", cfg, OmegaConf.create({"overrides": {"task": []}}))
    assert {oct(p.stat().st_mode & 0o777) for p in (tmp_path / "plain").rglob("*.yaml")} == {
        oct(FILE_MODE)
    }
    headers = {"data": {"rewards": [{"url": "http://scorer", "headers": {"X-Key": "k"}}]}}
    assert holds_secrets(headers) and not holds_secrets({"data": {"rewards": [{"url": "u"}]}})
