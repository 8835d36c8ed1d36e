"""What a run leaves behind, and how it is named: metrics files, the summary, checkpoint names and
the override keys Hydra records. Below both `grail.train` (which writes these) and
`grail.study.runs` / `grail.report.cli` (which read them), so no import runs back up a layer; no
torch import here.

A run directory (Hydra's `outputs/DATE/TIME` or `multirun/DATE/TIME/N`):

    metrics/train_iter_XXX.json   one per iteration (schema: grail/schemas/train_iteration)
    metrics/eval_baseline.json    before any training;  metrics/eval_iter_XXX.json every interval
    checkpoints/iter_XXX/         save_pretrained dir + tokenizer + trainer_state.pt
                                  (+ rollout_source.json when pipelined; newest k kept)
    weights/                      what the inference server loads (initial weights, then each sync)
    logs/                         the inference server's log
    parts.json                    each part of the run (the start, each resume): when, how long
    prune_trial.json              with pruning on: the run's Optuna trial, and whether it was pruned
    summary.json                  written at the end (also for a failed run, with the error)
    .grail.lock                   the lock a running grail-train holds (its pid inside)

Every metrics file (and `summary.json`) validates against a JSON Schema in `grail/schemas/`, so
tools that read them (`grail-report`, dashboards) can rely on the fields. A write goes to a
temporary file in the same directory, is fsynced, then renamed over the target: a reader, or a run
killed at any moment, never sees a half-written file.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import logging
import os
import re
import tempfile
import time
import traceback
from collections.abc import Iterator
from datetime import datetime
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

from grail.core.disk import writing
from grail.core.errors import UserError

log = logging.getLogger(__name__)

METRICS_DIR = "metrics"
CHECKPOINTS_DIR = "checkpoints"
LOGS_DIR = "logs"
SUMMARY = "summary.json"
PARTS = "parts.json"
PRUNE_TRIAL = "prune_trial.json"  # written by grail/study/prune.py
LOCK_FILE = ".grail.lock"
_CHECKPOINT_NAME = re.compile(r"iter_(\d+)")  # fullmatch: `$` lets a newline end it
_MAX_MESSAGE = 4000  # characters of an error message kept in summary.json
_TRACEBACK_LINES = 40


# ---- names ----------------------------------------------------------------------------------


def iteration_name(iteration: int) -> str:
    """`iter_XXX`: the name of an iteration's checkpoint and the stem of its metrics files."""
    return f"iter_{iteration:03d}"


def checkpoint_iteration(name: str) -> int | None:
    """The iteration of a checkpoint directory named `iter_XXX`; None for any other name."""
    match = _CHECKPOINT_NAME.fullmatch(name)
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


# ---- the run lock -------------------------------------------------------------------------------


class RunDirLocked(UserError, RuntimeError):
    """Another process holds the run directory: two runs writing one directory would interleave
    their files (the config of one beside the metrics of the other)."""


# Run directories this process holds: run dir -> (lock file descriptor, nesting depth). flock
# locks belong to an open file, so a second open + flock in this same process would conflict
# with the first; nested holders (a run, then its summary) share one.
_held: dict[Path, tuple[int, int]] = {}


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock on `run_dir` (fcntl.flock on `.grail.lock` in it) for the block;
    RunDirLocked at once, naming the directory and the holder's pid, when another process holds
    it. The OS releases the lock when its holder dies, even by SIGKILL, so there is no stale lock
    to clean up; the file stays (removing it would let a third process lock a new file while the
    second still holds the old one). Nested calls in one process share the lock."""
    run_dir = Path(os.path.abspath(run_dir))  # one key per directory, as Hydra spells it
    if run_dir in _held:
        fd, depth = _held[run_dir]
        _held[run_dir] = (fd, depth + 1)
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        # Opened without O_TRUNC: until the lock is ours, the file names the holder.
        fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "pid unknown"
            os.close(fd)
            raise RunDirLocked(
                f"{run_dir} is in use by another grail-train ({holder}): two runs in one "
                "directory would mix their files. Wait for it to end, or give this run its own "
                "hydra.run.dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}, since {_now()}\n".encode())
        _held[run_dir] = (fd, 1)
    try:
        yield
    finally:
        fd, depth = _held.pop(run_dir)
        if depth > 1:
            _held[run_dir] = (fd, depth - 1)
        else:
            os.close(fd)  # closing the last descriptor of the file releases the lock


@contextlib.contextmanager
def held_for_the_ranks(run_dir: Path) -> Iterator[None]:
    """Rank 0 of a multi-process run (grail/train/distributed.py) writes into `run_dir` under the
    lock grail-train's process, which launched the ranks and outlives them, holds: `run_lock`
    inside this block takes that lock as held. An open of the lock file that takes no lock of its
    own (closing it releases nothing: flock belongs to the holder's open file)."""
    key = Path(os.path.abspath(run_dir))
    fd = os.open(key / LOCK_FILE, os.O_RDONLY)
    _held[key] = (fd, 1)
    try:
        yield
    finally:
        _held.pop(key, None)
        os.close(fd)


def _now() -> str:
    """Local time with its UTC offset, to the second."""
    return datetime.now().astimezone().isoformat(timespec="seconds")


# ---- metrics files --------------------------------------------------------------------------

SCHEMA_VERSION = 1
SCHEMAS = ("train_iteration", "eval", "summary")


@cache
def load_schema(name: str) -> dict[str, Any]:
    if name not in SCHEMAS:
        raise ValueError(f"unknown metrics schema {name!r}; known: {', '.join(SCHEMAS)}")
    text = resources.files("grail.schemas").joinpath(f"{name}.schema.json").read_text()
    return json.loads(text)


@cache
def _validator(name: str) -> Any:
    """The schema's validator, built once: `jsonschema.validate` checks the schema itself again at
    every call, 32 ms of the 32.5 ms it took per train record (a validator's own check: 0.45 ms),
    i.e. seconds of every run's wall time."""
    schema = load_schema(name)
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def validate_metrics(record: dict[str, Any], schema: str) -> None:
    """Raise jsonschema.ValidationError (naming the field) when `record` breaks the schema: the
    same error `jsonschema.validate` raises (the best match among the errors)."""
    error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(record))
    if error is not None:
        raise error


def _file_mode() -> int:
    mask = os.umask(0o022)  # the only way to read the umask is to set it
    os.umask(mask)
    return 0o666 & ~mask


# What open() gives a new file under this process's umask (read once: changing it mid-run would
# be the user's own doing). mkstemp and safetensors' writer make files 0600 whatever the umask,
# which left a run's weights, manifest and metrics unreadable to the group beside 0644 siblings.
FILE_MODE = _file_mode()
# A file that holds a key (the service's endpoint.json, a config with a key in it): owner-only
# whatever the umask, which would otherwise let the group or everyone read it.
SECRET_FILE_MODE = 0o600


def follow_umask(path: Path) -> None:
    """Give `path` (a file, or every file under a directory) the mode the umask gives new
    files."""
    for file in path.rglob("*") if path.is_dir() else [path]:
        if file.is_file() and not file.is_symlink():
            os.chmod(file, FILE_MODE)


def atomic_write_text(path: Path, text: str, *, mode: int | None = None) -> None:
    """Write `text` to `path` through a temporary file, fsynced and renamed over it: `path`
    holds the old text or the new, never part of either. A full disk raises a `DiskFullError`
    naming `path`, the old file intact.

    `mode`: the file's permission bits whatever the umask (`SECRET_FILE_MODE` for a file that
    holds a key); None: what the umask gives new files (`FILE_MODE`), as for any other output."""
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        # mkstemp makes the file 0600: the mode is set before the text is in it, so a key is
        # never readable by others, not even for a moment.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, FILE_MODE if mode is None else mode)
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


# ---- parts of a run -----------------------------------------------------------------------------


def read_parts(run_dir: Path) -> list[dict[str, Any]]:
    """The parts parts.json records (oldest first); [] when there is none (a run written before
    parts were recorded, or one that has not started)."""
    data = read_json(Path(run_dir) / PARTS)
    parts = data.get("parts") if data is not None else None
    if not isinstance(parts, list):
        return []
    return [
        p for p in parts if isinstance(p, dict) and isinstance(p.get("wall_time_s"), int | float)
    ]


class RunPart:
    """One part of a run (its start, or a resume), recorded in parts.json after the parts before
    it: when it started, its wall time so far, the iterations it trained and the first of them.
    Saved as the part goes (`save`, every iteration), so a part killed by SIGKILL still counts up
    to its last save. `resume`: what a resume records beside (its command-line `overrides`, and
    the config keys it `changed`, each {"from", "to"}: applied from `first_iteration` on)."""

    def __init__(
        self, run_dir: Path, first_iteration: int = 0, resume: dict[str, Any] | None = None
    ) -> None:
        self.path = Path(run_dir) / PARTS
        self.earlier = read_parts(run_dir)
        self.started = _now()
        self.t0 = time.perf_counter()
        self.iterations = 0
        self.first_iteration = first_iteration
        self.resume = resume or {}
        self.save()

    @property
    def wall_time_s(self) -> float:
        return time.perf_counter() - self.t0

    def save(self, iterations: int = 0) -> None:
        """Record the wall time so far, and `iterations` more iterations trained."""
        self.iterations += iterations
        part = {
            "started": self.started,
            "wall_time_s": self.wall_time_s,
            "iterations": self.iterations,
            "first_iteration": self.first_iteration,
            **self.resume,
        }
        atomic_write_text(self.path, json.dumps({"parts": [*self.earlier, part]}, indent=2) + "\n")


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
    """summary.json of a run from the files it wrote: iterations, baseline, final and best eval,
    tokens, and time: `wall_time_s` is the sum of the run's parts (parts.json, listed as `parts`),
    or the caller's `wall_time_s` for a run that recorded none (one that failed before its loop
    started, or one written before parts were recorded). One place for completed and failed runs
    alike (and pruned ones)."""
    trains = metric_records(run_dir, "train")
    parts = read_parts(run_dir)
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
        "wall_time_s": max(0.0, sum(p["wall_time_s"] for p in parts) if parts else wall_time_s),
    }
    if parts:
        summary["parts"] = parts
    if environment is not None:
        summary["environment"] = environment
    if config is not None:
        summary["config"] = without_secrets(config)
        # What ran, as the iterations recorded it; before any, what the config asks for
        # (train.processes, else one per gpu.training_gpus: grail.core.placement).
        train, gpu = config.get("train") or {}, config.get("gpu") or {}
        asked = train.get("processes") or len(gpu.get("training_gpus") or ()) or 1
        asked *= train.get("nodes") or 1
        summary["trainer_processes"] = (
            trains[-1].get("trainer_processes", asked) if trains else asked
        )
    return summary


REDACTED = "<redacted>"


def without_secrets(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a run's config for records (summary.json, W&B, TensorBoard) without the values
    that authorise something: `service.api_key` and the `headers` of remote reward scorers. The
    config a user wrote (`.hydra/config.yaml`) keeps what they wrote: an `${oc.env:VAR}` there
    stays a reference, where the config resolved for a run holds the token itself."""
    config = copy.deepcopy(config)
    service = config.get("service")
    if isinstance(service, dict) and service.get("api_key") is not None:
        service["api_key"] = REDACTED
    rewards = (
        config.get("data", {}).get("rewards") if isinstance(config.get("data"), dict) else None
    )
    for entry in rewards if isinstance(rewards, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("headers"), dict):
            entry["headers"] = dict.fromkeys(entry["headers"], REDACTED)
    return config


def holds_secrets(config: object) -> bool:
    """Whether `config` (a run's config as a dict) holds a value `without_secrets` takes out: the
    files that record it as written (`.hydra/`) are then owner-only (`SECRET_FILE_MODE`)."""
    return isinstance(config, dict) and without_secrets(config) != config


def write_summary(
    run_dir: Path,
    wall_time_s: float,
    *,
    error: BaseException | None = None,
    pruned: dict[str, Any] | None = None,
    environment: str | None = None,
    config: dict[str, Any] | None = None,
    lr_rule: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write summary.json: "completed", "failed" with why when `error` is given, or "pruned" with
    when and why (`pruned`: iteration, value, metric, pruner, rung, best, seeds, p; see
    `read_pruned`); returns it. `lr_rule`: how train.lr_rule turned train.lr into the lr the run
    trained with (grail.models.lr_transfer.LrTransfer.record), for a run with a rule.

    Only while holding the run's lock: when another process runs in `run_dir` (a second
    grail-train that failed because of it, say), the summary belongs to that run and is not
    written; a warning says so."""
    status = "failed" if error is not None else "pruned" if pruned is not None else "completed"
    summary = run_summary(run_dir, status, wall_time_s, environment=environment, config=config)
    if lr_rule is not None:
        summary["lr_rule"] = lr_rule
    if pruned is not None and error is None:
        summary["pruned"] = pruned
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
    try:
        with run_lock(run_dir):
            write_metrics(run_dir / SUMMARY, summary, "summary")
    except RunDirLocked as exc:
        log.warning("summary.json not written: %s", exc)
    return summary


def read_pruned(run_dir: Path) -> dict[str, Any] | None:
    """Whether the run was pruned: {"iteration", "value", "metric", "pruner", "rung", "best",
    "seeds", "p"} from its `prune_trial.json` (written the moment the rule decided, before the
    checkpoint of that iteration is committed), or None."""
    record = read_json(Path(run_dir) / PRUNE_TRIAL)
    pruned = record.get("pruned") if record is not None else None
    return pruned if isinstance(pruned, dict) and isinstance(pruned.get("iteration"), int) else None
