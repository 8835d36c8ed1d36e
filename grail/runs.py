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
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grail.sweep import RunRecord
from grail.train.metrics import SCHEMA_VERSION, write_metrics

log = logging.getLogger(__name__)

SUMMARY = "summary.json"
ATTEMPTS = "attempts.jsonl"  # one line per attempt of a sweep job: when, what it did, its overrides
_RUN_MARKERS = (".hydra", "metrics", SUMMARY)
_CHECKPOINT = re.compile(r"^iter_\d+$")
_MAX_MESSAGE = 4000  # characters of an error message kept in summary.json
_TRACEBACK_LINES = 40


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


def read_json(path: Path) -> dict[str, Any] | None:
    """A JSON object, or None (with a warning) when the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("skipping unreadable %s: %s", path, exc)
        return None
    if not isinstance(data, dict):
        log.warning("skipping %s: not a JSON object", path)
        return None
    return data


def read_overrides(run_dir: Path) -> list[str]:
    """The command-line overrides Hydra recorded for the run (`.hydra/overrides.yaml`)."""
    path = run_dir / ".hydra" / "overrides.yaml"
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return []
    return [str(o) for o in data] if isinstance(data, list) else []


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


# Overrides that say how a run was launched, not what it computes: never part of a run's label.
_LAUNCH_KEYS = frozenset({"resume"})


def distinguishing_overrides(per_run: list[list[str]]) -> list[list[str]]:
    """Each run's overrides reduced to those that tell it apart from the other runs: a key whose
    value is the same in every run (the sweep's fixed settings) says nothing in a legend. With one
    run, all its overrides."""
    cleaned = [[o for o in run if _override_key(o) not in _LAUNCH_KEYS] for run in per_run]
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


def metric_records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """`kind` = "train" (train_iter_XXX.json) or "eval" (eval_baseline.json + eval_iter_XXX.json),
    sorted by iteration (the baseline eval is iteration -1). Unreadable files are skipped."""
    patterns = {"train": ("train_iter_*.json",), "eval": ("eval_baseline.json", "eval_iter_*.json")}
    if kind not in patterns:
        raise ValueError(f"kind must be 'train' or 'eval', got {kind!r}")
    records = []
    for pattern in patterns[kind]:
        for path in (run_dir / "metrics").glob(pattern):
            record = read_json(path)
            if record is not None and isinstance(record.get("iteration"), int):
                records.append(record)
    return sorted(records, key=lambda r: r["iteration"])


def has_checkpoint(run_dir: Path) -> bool:
    checkpoints = run_dir / "checkpoints"
    return checkpoints.is_dir() and any(_CHECKPOINT.match(p.name) for p in checkpoints.iterdir())


def has_progress(run_dir: Path) -> bool:
    metrics = run_dir / "metrics"
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
    """The facts `grail.sweep.decide` needs about an earlier attempt in `run_dir`."""
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
    """How a run stands: "done", "failed" or "incomplete" (no summary yet: running or killed)."""

    path: Path
    status: str
    error: str | None = None


def run_status(run_dir: Path) -> RunStatus:
    summary = read_json(run_dir / SUMMARY)
    if summary is None:
        return RunStatus(run_dir, "incomplete")
    if summary.get("status") == "completed":
        return RunStatus(run_dir, "done")
    error = summary.get("error") or {}
    message = f"{error.get('type', 'error')}: {error.get('message', '(no message)')}"
    return RunStatus(run_dir, "failed", message)


# ---- the summary of a failed run ----------------------------------------------------------------


def _brief(record: dict[str, Any] | None) -> dict[str, Any] | None:
    if record is None:
        return None
    keys = ("iteration", "success_rate", "reward_mean", "pass@k", "mean@k", "best@k")
    return {k: record[k] for k in keys if k in record}


def run_summary(
    run_dir: Path,
    status: str,
    wall_time_s: float,
    *,
    environment: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """summary.json of a run from the metrics files it wrote: iterations, baseline, final and
    best eval, tokens and time. One place for completed and failed runs alike."""
    trains = metric_records(run_dir, "train")
    evals = metric_records(run_dir, "eval")
    trained = [e for e in evals if e["iteration"] >= 0]
    baseline = next((e for e in evals if e["iteration"] == -1), None)
    summary: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "status": status,
        "iterations": len(trains),
        "baseline_eval": _brief(baseline),
        "final_eval": _brief(trained[-1] if trained else None),
        "best_eval": _brief(max(trained, key=lambda e: e["success_rate"]) if trained else None),
        "tokens": {
            "prompt": sum(t.get("tokens", {}).get("prompt", 0) for t in trains),
            "completion": sum(t.get("tokens", {}).get("completion", 0) for t in trains),
        },
        "train_time_s": sum(t.get("timings", {}).get("iteration_s", 0.0) for t in trains),
        "wall_time_s": max(0.0, wall_time_s),
    }
    if environment is not None:
        summary["environment"] = environment
    if config is not None:
        summary["config"] = config
    return summary


def failure_summary(
    run_dir: Path,
    error: BaseException,
    wall_time_s: float,
    *,
    environment: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """summary.json of a run that raised `error`: what it got done, and why it failed."""
    tb = "".join(traceback.format_exception(error)).splitlines()[-_TRACEBACK_LINES:]
    message = str(error)
    if len(message) > _MAX_MESSAGE:
        message = message[: _MAX_MESSAGE // 2] + "\n[...]\n" + message[-_MAX_MESSAGE // 2 :]
    summary = run_summary(run_dir, "failed", wall_time_s, environment=environment, config=config)
    summary["error"] = {
        "type": type(error).__name__,
        "message": message,
        "traceback": "\n".join(tb),
    }
    return summary


def write_failure_summary(
    run_dir: Path,
    error: BaseException,
    wall_time_s: float,
    *,
    environment: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    summary = failure_summary(run_dir, error, wall_time_s, environment=environment, config=config)
    write_metrics(run_dir / SUMMARY, summary, "summary")
    return summary
