"""What `resume=true` runs with: the run's own saved config, never the defaults.

A run directory records its config (`.hydra/config.yaml`: what the run uses, written when it
starts and when a resume changes an allowed key) and how it was launched (`.hydra/overrides.yaml`
and `.hydra/hydra.yaml`, written once, when it starts). A resume starts from that saved config and
compares each override of its own command line with it:

- a key in `RESUMABLE` may change: the new value applies from the first iteration the resume
  trains, and the part records it (parts.json and summary.json: `first_iteration`, `overrides`,
  `changed`);
- any other change is refused before anything loads, in one message listing each changed key as
  `key: old -> new` (grail-train exits 2);
- an override equal to the saved value, or a command line with none (`resume=true
  hydra.run.dir=RUN`), continues the run exactly as it was configured.

So the same command that started a run (or a sweep) resumes it, and so does the short one. No torch
import here: a refused resume answers at once.
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grail.core.config import Config
from grail.core.errors import ConfigError, UserError, first_line
from grail.core.records import (
    LAUNCH_KEYS,
    METRICS_DIR,
    SECRET_FILE_MODE,
    atomic_write_text,
    holds_secrets,
    override_key,
)

HYDRA_DIR = ".hydra"
CONFIG_FILE = "config.yaml"


class RunDirNotEmpty(UserError, FileExistsError):
    """A fresh run into a directory that already holds a run's metrics."""


def refuse_a_fresh_start_over_a_run(run_dir: Path) -> None:
    """A fresh start (no `resume=true`) refuses a directory that holds a run's metrics: raise
    RunDirNotEmpty naming it. grail-train asks before it writes anything there (`.hydra/` says
    how that run was configured: a resume and grail-report read it), the loop again for runs
    started in-process."""
    metrics_dir = run_dir / METRICS_DIR
    stale = sorted(metrics_dir.glob("*.json")) if metrics_dir.is_dir() else []
    if stale:
        raise RunDirNotEmpty(
            f"{run_dir} already holds the metrics of a run ({len(stale)} files in "
            f"{metrics_dir}); rerun with resume=true to continue it, or use a new hydra.run.dir"
        )


# The keys a resume may change (a key, or a section and every key under it). Each says how the run
# goes on, never what it computes: the metrics of the iterations a resume trains are the ones the
# run would have produced with its saved config.
RESUMABLE = (
    "train.iterations",  # how far to train (the schedule has warm-up only, no horizon)
    "logging",  # where metrics also go (TensorBoard, W&B)
    "checkpoint.save_interval",  # how often a checkpoint is kept on disk
    "checkpoint.keep_last_k",  # and how many
    "generation.request_timeout_s",  # how long to wait, before a batch fails
    "generation.start_timeout_s",  # for the server to start
    "generation.urls",  # servers the user runs, and the model to ask them for: each loads the
    "generation.url_model",  # run's weights before it serves
    "generation.servers",  # how many servers draw the samples, not what they draw (fleet.py)
    "service.wait_timeout_s",  # for a service's clients
    "train.threads",  # where the run computes: its share of the machine (a sweep sets these
    "generation.server_threads",  # per attempt)
    "gpu.server_gpu",
    "gpu.training_gpu",
    "gpu.server_gpus",  # which GPUs, not how many: a resume with another train.processes is the
    "gpu.training_gpus",  # checkpoint's to allow or refuse
    "train.node_rank",  # which machine this process is, and where node 0 is (a new SLURM job
    "train.rdzv_endpoint",  # gets other hosts)
)
# Not resumable, though they may look harmless: eval.* (the evaluations a run records, what a
# pruner and grail-report compare runs by), data.* and generation's sampling settings (what the
# policy trains on), model.* (what trains: a LoRA rank or a full run cannot change under a
# checkpoint) and train.* but iterations (the optimizer's and the loss's settings).
_UNSET = "<unset>"


def resumable(key: str) -> bool:
    return any(key == k or key.startswith(f"{k}.") for k in RESUMABLE)


@dataclass(frozen=True)
class Resume:
    """A resume's command line, checked against the run's saved config."""

    config: DictConfig  # the saved config with this resume's allowed changes: what it runs with
    saved: DictConfig  # the run's config as it stood
    changes: dict[str, tuple[Any, Any]]  # key -> (old, new): the allowed changes
    overrides: list[str]  # this resume's command-line overrides
    config_yaml: str  # `config`, as .hydra/config.yaml records it (interpolations unresolved)

    def record(self, run_dir: Path) -> None:
        """Write the config this resume trains with into `.hydra/config.yaml` (when it changed):
        the next resume continues from it. Called when the resume starts training."""
        if self.changes:
            mode = SECRET_FILE_MODE if holds_secrets(OmegaConf.to_container(self.config)) else None
            atomic_write_text(run_dir / HYDRA_DIR / CONFIG_FILE, self.config_yaml, mode=mode)

    def part(self) -> dict[str, Any]:
        """What parts.json records of this resume beside its times."""
        return {
            "overrides": list(self.overrides),
            "changed": {k: {"from": old, "to": new} for k, (old, new) in self.changes.items()},
        }


def saved_config(run_dir: Path) -> DictConfig | None:
    """The run's saved config (`.hydra/config.yaml`), typed by the schema; None when the directory
    holds none (a fresh start). A ConfigError when it cannot be read or no longer fits."""
    path = run_dir / HYDRA_DIR / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))
    except (OSError, yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(
            f"resume=true: the run's saved config {path} cannot be used ({first_line(exc)}); "
            "resume it with the grail version that started it, or start over in a new "
            "hydra.run.dir"
        ) from exc
    assert isinstance(merged, DictConfig)  # merged into the schema's mapping
    return merged


def no_run_message(run_dir: Path) -> str:
    """Why `resume=true` in `run_dir` has nothing to continue, and what to do instead."""
    where = run_dir.absolute()
    runs = sorted(p.parent.parent.name for p in where.glob(f"*/{HYDRA_DIR}/{CONFIG_FILE}"))
    hint = ""
    if runs:  # a sweep's directory, named where one of its runs was meant
        named = ", ".join(runs[:5]) + (", ..." if len(runs) > 5 else "")
        hint = (
            f"; it holds the runs of a sweep ({named}): resume one with "
            f"hydra.run.dir={where}/{runs[0]}, or the sweep with -m, its overrides and "
            f"hydra.sweep.dir={where}"
        )
    return (
        f"resume=true: {where} holds no run to resume (no {HYDRA_DIR}/{CONFIG_FILE} there){hint}; "
        "name the run's directory with hydra.run.dir=RUN_DIR, or drop resume=true to start a new "
        "run"
    )


def saved_choices(run_dir: Path) -> dict[str, Any]:
    """The config group choices the run was started with (`env`, `model`, ...), from
    `.hydra/hydra.yaml`; {} when unreadable."""
    try:
        data = yaml.safe_load((run_dir / HYDRA_DIR / "hydra.yaml").read_text())
        choices = data["hydra"]["runtime"]["choices"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return {}
    return dict(choices) if isinstance(choices, dict) else {}


def plain(value: Any) -> Any:
    """A config value as JSON can hold it (enums by name), for comparing and recording."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=False, enum_to_str=True)
    if isinstance(value, enum.Enum):
        return value.name
    return value


def show(value: Any) -> str:
    if value is _UNSET or isinstance(value, str):
        return str(value)
    return json.dumps(value)


def plan_resume(
    cfg: DictConfig,
    run_dir: Path,
    overrides: Sequence[str],
    choices: Mapping[str, Any],
    *,
    require_run: bool = False,
) -> Resume | None:
    """What a `resume=true` run in `run_dir` runs with: its saved config with the allowed changes
    of `overrides` (the command line's, composed into `cfg`; `choices`: the config group choices
    they made). None when nothing is saved there: a fresh start, which a sweep's job whose run
    never started makes; with `require_run` (a single run: `resume=true` names a run to continue,
    and a fresh one in a mistyped or default `hydra.run.dir` would pass for it) a ConfigError
    naming the directory instead. Raises ConfigError listing every refused change as
    `key: old -> new`."""
    saved = saved_config(run_dir)
    if saved is None:
        if require_run:
            raise ConfigError(no_run_message(run_dir))
        return None
    before_choices = saved_choices(run_dir)
    changes: dict[str, tuple[Any, Any]] = {}
    refused: list[str] = []
    for override in overrides:
        key = override_key(override)
        if key in LAUNCH_KEYS:
            continue
        if key in choices:  # a config group (env=, model=, generation=, +prune=): many keys
            old, new = before_choices.get(key, _UNSET), choices[key]
        else:
            old = plain(OmegaConf.select(saved, key, default=_UNSET))
            new = plain(OmegaConf.select(cfg, key, default=_UNSET))
        if old == new:
            continue
        # study_dir null in a sweep's run means "the sweep's directory": naming it is no change.
        if resumable(key) or (key == "study_dir" and old is None):
            changes[key] = (old, new)
        else:
            refused.append(f"{key}: {show(old)} -> {show(new)}")
    if refused:
        raise ConfigError(
            f"resume=true would change what the run in {run_dir} is ({'; '.join(refused)}): a "
            "resume continues the run with its saved config (.hydra/config.yaml), and may change "
            f"only {', '.join(RESUMABLE)}. Drop those overrides to resume it, or start a new run "
            "in a new hydra.run.dir"
        )
    config = copy.deepcopy(saved)
    for key in changes:
        OmegaConf.update(config, key, OmegaConf.select(cfg, key), merge=False)
    config.resume = cfg.resume
    return Resume(
        config=config,
        saved=saved,
        changes=changes,
        overrides=list(overrides),
        config_yaml=OmegaConf.to_yaml(config),
    )
