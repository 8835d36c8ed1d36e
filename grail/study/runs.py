"""Run directories as the record of a sweep: find runs, read what they wrote, say how they ended.

A run directory (Hydra's `outputs/DATE/TIME` or `multirun/DATE/TIME/N`) holds `.hydra/` (config
and overrides), `metrics/*.json`, `checkpoints/`, and `summary.json` once the run ended. That is
all `grail-report`, the end-of-sweep failure list and `resume=true` reruns need: no database, and
a sweep that is still running can be read at any moment, because every file is written atomically.

No torch or transformers import here, so `grail-report` answers in a second.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grail.core.records import (
    CHECKPOINTS_DIR,
    LAUNCH_KEYS,
    METRICS_DIR,
    SUMMARY,
    checkpoint_iteration,
    override_key,
    read_json,
)
from grail.study.sweep import RunRecord

log = logging.getLogger(__name__)

ATTEMPTS = "attempts.jsonl"  # one line per attempt of a sweep job: when, what it did, its overrides
_RUN_MARKERS = (".hydra", METRICS_DIR, SUMMARY)


def is_run_dir(path: Path) -> bool:
    return path.is_dir() and any((path / marker).exists() for marker in _RUN_MARKERS)


def natural_key(name: str | Path) -> list[Any]:
    """Sort key that puts "10" after "9" (sweep job directories are numbered)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(name))]


def find_runs(root: Path) -> list[Path]:
    """`root` itself when it is a run directory, else every run directory below it (hidden
    directories such as `.submitit/` skipped), in natural order."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a directory")
    if is_run_dir(root):
        return [root]
    found: list[Path] = []
    for child in root.iterdir():
        if child.is_dir() and not child.name.startswith("."):
            found.extend(find_runs(child))
    return sorted(found, key=natural_key)


def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for the run (`.hydra/overrides.yaml`)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def distinguishing_overrides(per_run: list[list[str]]) -> list[list[str]]:
    """Each run's overrides reduced to those that tell it apart from the other runs: a key whose
    value is the same in every run (the sweep's fixed settings) says nothing in a legend. With one
    run, all its overrides."""
    cleaned = [[o for o in run if override_key(o) not in LAUNCH_KEYS] for run in per_run]
    if len(cleaned) < 2:
        return cleaned
    shared = set.intersection(*(set(run) for run in cleaned))
    return [[o for o in run if o not in shared] for run in cleaned]


def read_config(run_dir: Path) -> dict[str, Any]:
    """The run's composed config (`.hydra/config.yaml`); {} when absent."""
    try:
        data = yaml.safe_load((run_dir / ".hydra" / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def has_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / CHECKPOINTS_DIR
    return checkpoints.is_dir() and any(
        checkpoint_iteration(p.name) is not None for p in checkpoints.iterdir()
    )


def has_progress(run_dir: Path) -> bool:
    metrics = run_dir / METRICS_DIR
    return (metrics.is_dir() and any(metrics.glob("*.json"))) or has_checkpoint(run_dir)


def read_attempts(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = (run_dir / ATTEMPTS).read_text().splitlines()
    except OSError:
        return []
    attempts = []
    for line in lines:
        try:
            attempts.append(json.loads(line))
        except ValueError:
            continue  # a line cut short by a kill
    return attempts


def append_attempt(run_dir: Path, action: str, overrides: list[str], job_num: int | None) -> None:
    """Record one attempt of a sweep job (append-only, so the history of reruns stays)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    line = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "action": action,
        "job_num": job_num,
        "overrides": overrides,
    }
    with open(run_dir / ATTEMPTS, "a") as f:
        f.write(json.dumps(line) + "\n")


def run_record(run_dir: Path) -> RunRecord:
    """The facts `grail.study.sweep.decide` needs about an earlier attempt in `run_dir`."""
    summary = read_json(run_dir / SUMMARY)
    attempts = read_attempts(run_dir)
    overrides = attempts[-1].get("overrides") if attempts else None
    return RunRecord(
        status=summary.get("status") if summary else None,
        has_progress=has_progress(run_dir),
        overrides=tuple(overrides) if isinstance(overrides, list) else None,
    )


@dataclass(frozen=True)
class RunStatus:
    """How a run stands: "done", "failed", "pruned" (stopped early by the pruner,
    grail/study/prune.py: finished, not failed) or "incomplete" (no summary yet: running or
    killed)."""

    path: Path
    status: str
    error: str | None = None


def run_status(run_dir: Path) -> RunStatus:
    summary = read_json(run_dir / SUMMARY)
    if summary is None:
        return RunStatus(run_dir, "incomplete")
    if summary.get("status") == "completed":
        return RunStatus(run_dir, "done")
    if summary.get("status") == "pruned":
        return RunStatus(run_dir, "pruned")
    error = summary.get("error") or {}
    message = f"{error.get('type', 'error')}: {error.get('message', '(no message)')}"
    return RunStatus(run_dir, "failed", message)
