"""The default job, short, in-process: what the fleet and external-server tests compare against
(tests/test_fleet.py, tests/test_external_servers.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core.config import Config
from grail.train.cli import CONF_DIR
from grail.train.launch import preflight

# Three iterations (two syncs after the first batch), one server thread: servers started by hand
# or in a fleet then compute as the lone managed server does, on any machine (reductions split
# by thread).
SHORT_RUN = ["train.iterations=3", "generation.server_threads=1"]
# Record keys that hold times or where the samples were drawn, not results.
TIMED = {"tokens_per_s", "timings", "weight_sync", "fleet"}


def short_config(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=[*SHORT_RUN, *overrides])
    typed: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    preflight(typed)
    return typed


def train_records(run_dir: Path) -> list[dict[str, Any]]:
    paths = sorted((run_dir / "metrics").glob("train_iter_*.json"))
    return [json.loads(p.read_text()) for p in paths]


def one_iteration(run_dir: Path, *overrides: str) -> list[dict[str, Any]]:
    """One training iteration of 4 problems in-process with `overrides` (an environment's
    "a run trains on it" test), its train records, checked to be iteration 0's."""
    from grail.train.loop import run

    cfg = short_config(
        *overrides, "train.iterations=1", "data.problems_per_iteration=4", "eval.num_ids=4"
    )
    run(cfg, run_dir)
    records = train_records(run_dir)
    assert [r["iteration"] for r in records] == [0]
    return records


def results(run_dir: Path) -> list[dict[str, Any]]:
    """The run's train and eval records without their times (`TIMED`, and every `*_s` key)."""
    paths = sorted((run_dir / "metrics").glob("*_iter_*.json"))
    records = [json.loads(p.read_text()) for p in paths]
    return [{k: v for k, v in r.items() if k not in TIMED and k[-2:] != "_s"} for r in records]
