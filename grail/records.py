"""What a run leaves behind, and how it is named: metrics files, the summary, checkpoint names and
the override keys Hydra records. Below both `grail.train` (which writes these) and `grail.runs` /
`grail.report` (which read them), so no import runs back up a layer; no torch import here.

A run directory (Hydra's `outputs/DATE/TIME` or `multirun/DATE/TIME/N`):

    metrics/train_iter_XXX.json   one per iteration (schema: grail/schemas/train_iteration)
    metrics/eval_baseline.json    before any training;  metrics/eval_iter_XXX.json every interval
    checkpoints/iter_XXX/         save_pretrained dir + tokenizer + trainer_state.pt (newest k kept)
    weights/                      what the inference server loads (initial weights, then each sync)
    logs/                         the inference server's log
    summary.json                  written at the end (also for a failed run, with the error)

Every metrics file (and `summary.json`) validates against a JSON Schema in `grail/schemas/`, so
tools that read them (`grail-report`, dashboards) can rely on the fields. A write goes to a
temporary file in the same directory, is fsynced, then renamed over the target: a reader, or a run
killed at any moment, never sees a half-written file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import traceback
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

log = logging.getLogger(__name__)

METRICS_DIR = "metrics"
CHECKPOINTS_DIR = "checkpoints"
SUMMARY = "summary.json"
_CHECKPOINT_NAME = re.compile(r"^iter_(\d+)$")
_MAX_MESSAGE = 4000  # characters of an error message kept in summary.json
_TRACEBACK_LINES = 40


# ---- names ----------------------------------------------------------------------------------


def iteration_name(iteration: int) -> str:
    """`iter_XXX`: the name of an iteration's checkpoint and the stem of its metrics files."""
    return f"iter_{iteration:03d}"


def checkpoint_iteration(name: str) -> int | None:
    """The iteration of a checkpoint directory named `iter_XXX`; None for any other name."""
    match = _CHECKPOINT_NAME.match(name)
    return int(match.group(1)) if match else None


def train_metrics_path(run_dir: Path, iteration: int) -> Path:
    return run_dir / METRICS_DIR / f"train_{iteration_name(iteration)}.json"


def eval_metrics_path(run_dir: Path, iteration: int) -> Path:
    """`eval_baseline.json` for the evaluation before training (iteration -1), else
    `eval_iter_XXX.json`."""
    name = "baseline" if iteration < 0 else iteration_name(iteration)
    return run_dir / METRICS_DIR / f"eval_{name}.json"


# Overrides that say how a run was launched, not what it computes: they may differ between attempts
# of one sweep job, and they never label a run.
LAUNCH_KEYS = frozenset({"resume"})


def override_key(override: str) -> str:
    """The config key of a Hydra override: `+a.b=1`, `++a.b=1`, `~a.b` and `a.b=1` -> `a.b`."""
    return override.split("=", 1)[0].lstrip("+~")


# ---- metrics files --------------------------------------------------------------------------

SCHEMA_VERSION = 1
SCHEMAS = ("train_iteration", "eval", "summary")


@cache
def load_schema(name: str) -> dict[str, Any]:
    if name not in SCHEMAS:
        raise ValueError(f"unknown metrics schema {name!r}; known: {', '.join(SCHEMAS)}")
    text = resources.files("grail.schemas").joinpath(f"{name}.schema.json").read_text()
    return json.loads(text)


def validate_metrics(record: dict[str, Any], schema: str) -> None:
    """Raise jsonschema.ValidationError (naming the field) when `record` breaks the schema."""
    jsonschema.validate(record, load_schema(schema))


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_metrics(path: Path, record: dict[str, Any], schema: str) -> None:
    """Validate, then write `record` as JSON atomically."""
    validate_metrics(record, schema)
    atomic_write_text(path, json.dumps(record, indent=2, sort_keys=True, allow_nan=False) + "\n")


def read_metrics(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


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


def metric_records(run_dir: Path, kind: str) -> list[dict[str, Any]]:
    """`kind` = "train" (train_iter_XXX.json) or "eval" (eval_baseline.json + eval_iter_XXX.json),
    sorted by iteration (the baseline eval is iteration -1). Unreadable files are skipped."""
    patterns = {"train": ("train_iter_*.json",), "eval": ("eval_baseline.json", "eval_iter_*.json")}
    if kind not in patterns:
        raise ValueError(f"kind must be 'train' or 'eval', got {kind!r}")
    records = []
    for pattern in patterns[kind]:
        for path in (run_dir / METRICS_DIR).glob(pattern):
            record = read_json(path)
            if record is not None and isinstance(record.get("iteration"), int):
                records.append(record)
    return sorted(records, key=lambda r: r["iteration"])


# ---- summary.json -------------------------------------------------------------------------------


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


def write_summary(
    run_dir: Path,
    wall_time_s: float,
    *,
    error: BaseException | None = None,
    environment: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write summary.json: "completed", or "failed" with why when `error` is given; returns it."""
    status = "completed" if error is None else "failed"
    summary = run_summary(run_dir, status, wall_time_s, environment=environment, config=config)
    if error is not None:
        tb = "".join(traceback.format_exception(error)).splitlines()[-_TRACEBACK_LINES:]
        message = str(error)
        if len(message) > _MAX_MESSAGE:
            message = message[: _MAX_MESSAGE // 2] + "\n[...]\n" + message[-_MAX_MESSAGE // 2 :]
        summary["error"] = {
            "type": type(error).__name__,
            "message": message,
            "traceback": "\n".join(tb),
        }
    write_metrics(run_dir / SUMMARY, summary, "summary")
    return summary
