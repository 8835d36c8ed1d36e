"""Optional metric loggers: TensorBoard and Weights & Biases, fed the records of `metrics/*.json`.

The JSON files stay the source of truth (schema-checked, read by `grail-report`); these loggers
are views of the same records for dashboards. `MetricLoggers.log(kind, record, step)` flattens a
record to scalar tags, `{"timings": {"train_s": 1.2}}` -> `train/timings/train_s`, drops what is
not a number (None, strings such as `environment` or `weight_sync.mode`) and the bookkeeping
fields `schema_version` and `iteration` (the step carries the iteration), and hands the rest to
each enabled backend. Booleans become 0/1 (`train/weight_sync/fell_back` plots how often an
in-place weight sync fell back to a restart). TensorBoard spells `@` in tags `_at_`
(`eval/pass_at_k/4`); W&B keeps the JSON keys (`eval/pass@k/4`).

Steps: log a record of iteration i at step i + 1, the number of policy updates done when that
iteration ends; the baseline eval (iteration -1) lands at 0, and an iteration's train and eval
records share a step. Steps must be >= 0 (TensorBoard expects non-negative steps).

Backends are imported only when enabled, and a missing package fails in `from_config`, at
startup, naming the key and the install command.

Resume: a rerun with `resume=true` logs to the same places.
- TensorBoard: events go to `run_dir/tensorboard/`; a resumed process adds a new event file there.
  The points a killed process wrote after the resume point are recomputed, and TensorBoard shows
  the new ones: a step logged again replaces that tag's points from that step on. The writer also
  opens (at the first `log` call) with `purge_step` = that call's step, which TensorBoard's
  Python loader (`--load_fast=false`) applies to every tag, even one the resumed run never logs
  again; the default fast loader applies only the per-tag rule.
- W&B: the run id is stored in `run_dir/wandb/run_id` and `wandb.init(id=..., resume="allow")`
  continues the same run. Points are plotted against the `step` key (`define_metric`), so a
  recomputed iteration is logged again rather than dropped by W&B's monotonic `_step` check.
"""

from __future__ import annotations

import importlib
import json
import numbers
import os
import re
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any, Literal, Protocol

from grail.core.config import LoggingConfig
from grail.core.errors import ConfigError
from grail.core.records import atomic_write_text

KINDS = ("train", "eval")
# Fields every record carries that are not metrics: the step says which iteration it is.
SKIPPED_KEYS = frozenset({"schema_version", "iteration"})
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = Path("wandb") / "run_id"
_TB_INVALID = re.compile(r"[^-/\w.]")  # what TensorBoard's reader rewrites to "_"


def flatten_scalars(record: Mapping[str, Any], prefix: str) -> dict[str, float]:
    """Scalar tags of a (nested) record: `prefix/key/subkey -> value`.

    None and non-numbers are skipped; bools become 0.0/1.0; NaN and inf are kept (a diverging
    loss is what a dashboard should show). Top-level `schema_version` and `iteration` are skipped.
    """
    tags: dict[str, float] = {}

    def visit(node: Mapping[str, Any], path: str, top: bool) -> None:
        for key, value in node.items():
            if top and key in SKIPPED_KEYS:
                continue
            tag = f"{path}/{key}"
            if isinstance(value, Mapping):
                visit(value, tag, top=False)
            elif isinstance(value, numbers.Real):  # bool is an Integral, hence Real
                tags[tag] = float(value)

    visit(record, prefix, top=True)
    return tags


def _import_backend(key: str, module: str, extra: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"logging.{key}=true needs the {module} package: uv sync --extra {extra} "
            f"(or pip install 'grail[{extra}]')"
        ) from e


class _Backend(Protocol):
    def log(self, tags: dict[str, float], step: int) -> None: ...

    def close(self, failed: bool) -> None: ...


def tensorboard_tag(tag: str) -> str:
    """TensorBoard allows only `[A-Za-z0-9_.-/]` in tags: `@` is spelled `_at_`
    (`eval/pass@k/4` -> `eval/pass_at_k/4`), any other character becomes `_`."""
    return _TB_INVALID.sub("_", tag.replace("@", "_at_"))


class TensorBoardBackend:
    """Scalars as TensorBoard event files in `log_dir`, written with tensorboardX (the event
    format TensorBoard reads, without TensorBoard's own server dependencies)."""

    def __init__(self, tensorboardx: ModuleType, log_dir: Path, config: dict[str, Any]) -> None:
        self._tbx = tensorboardx
        self.log_dir = log_dir
        self._config = config
        self._writer: Any = None

    def log(self, tags: dict[str, float], step: int) -> None:
        if self._writer is None:
            # Opened here, not in __init__: the first step this process logs is where a resumed
            # run restarts, and purge_step tells TensorBoard to drop the points the killed
            # process wrote from there on.
            self.log_dir.mkdir(parents=True, exist_ok=True)
            # tensorboardX names files events.out.tfevents.<seconds>.<host>, and TensorBoard reads
            # them in name order: without a suffix a process resumed within the same second would
            # truncate the killed one's file; nanoseconds keep the order, the pid the uniqueness.
            self._writer = self._tbx.SummaryWriter(
                logdir=str(self.log_dir),
                purge_step=step,
                filename_suffix=f".{time.time_ns()}.{os.getpid()}",
            )
            text = json.dumps(self._config, indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", f"```\n{text}\n```", global_step=step)
        for tag, value in tags.items():
            self._writer.add_scalar(tensorboard_tag(tag), value, global_step=step)
        # Once per iteration: cheap, and TensorBoard shows the run live and a kill loses nothing.
        self._writer.flush()

    def close(self, failed: bool) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class WandbBackend:
    """One W&B run per run directory; the id in `run_dir/wandb/run_id` makes a resume continue
    it. Mode (online, offline) and credentials come from the user's W&B setup (`wandb login`,
    WANDB_MODE, WANDB_API_KEY), as with any W&B script."""

    STEP_KEY = "step"

    def __init__(
        self, wandb: ModuleType, run_dir: Path, project: str, config: dict[str, Any]
    ) -> None:
        id_file = run_dir / WANDB_ID_FILE
        if id_file.is_file() and id_file.read_text().strip():
            run_id = id_file.read_text().strip()
        else:
            # W&B run ids allow [a-z0-9]; 16 hex digits do not collide across a project.
            run_id = secrets.token_hex(8)
            atomic_write_text(id_file, run_id + "\n")
        self.run_id = run_id
        self._run = wandb.init(
            project=project,
            name=run_dir.name,
            dir=str(run_dir),
            id=run_id,
            resume="allow",
            config=config,
            # A resumed run's config differs (resume=true at least); keep the newest values.
            allow_val_change=True,
        )
        self._run.define_metric(self.STEP_KEY)
        for kind in KINDS:
            self._run.define_metric(f"{kind}/*", step_metric=self.STEP_KEY)

    def log(self, tags: dict[str, float], step: int) -> None:
        self._run.log({self.STEP_KEY: step, **tags})

    def close(self, failed: bool) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None


class MetricLoggers:
    """The enabled metric backends behind one `log` call; a context manager that closes them.

    With nothing enabled, `log` and `close` do nothing, so the loop can call them
    unconditionally.
    """

    def __init__(self, backends: list[_Backend] | None = None) -> None:
        self._backends: list[_Backend] = list(backends or [])

    @classmethod
    def from_config(
        cls, logging_cfg: LoggingConfig, run_dir: Path, config: dict[str, Any]
    ) -> MetricLoggers:
        """Import and start the enabled backends; raises ConfigError naming the key when a
        backend's package is missing. `config` is the resolved run config (logged once)."""
        run_dir = Path(run_dir).absolute()
        tbx = wandb = None
        # Both imports before either backend starts: a missing package fails with nothing opened.
        if logging_cfg.tensorboard:
            tbx = _import_backend("tensorboard", "tensorboardX", "tensorboard")
        if logging_cfg.wandb:
            wandb = _import_backend("wandb", "wandb", "wandb")
        if logging_cfg.wandb and not logging_cfg.wandb_project.strip():
            raise ConfigError("logging.wandb_project must be a non-empty W&B project name")
        backends: list[_Backend] = []
        if tbx is not None:
            backends.append(TensorBoardBackend(tbx, run_dir / TENSORBOARD_DIR, config))
        if wandb is not None:
            backends.append(WandbBackend(wandb, run_dir, logging_cfg.wandb_project, config))
        return cls(backends)

    @property
    def enabled(self) -> bool:
        return bool(self._backends)

    def log(self, kind: Literal["train", "eval"], record: Mapping[str, Any], step: int) -> None:
        """Log one metrics record (a `train_iter_XXX.json` or `eval_*.json` record) at `step`."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {step!r}")
        if step < 0:
            raise ValueError(
                f"step must be >= 0, got {step}: log iteration i at step i + 1 "
                "(the baseline eval, iteration -1, at 0)"
            )
        if not self._backends:
            return
        tags = flatten_scalars(record, kind)
        for backend in self._backends:
            backend.log(tags, int(step))

    def close(self, *, failed: bool = False) -> None:
        """Flush and close every backend (a W&B run is marked failed when `failed`); closing
        twice is harmless. Every backend is closed even when one raises."""
        backends, self._backends = self._backends, []
        errors: list[BaseException] = []
        for backend in backends:
            try:
                backend.close(failed)
            except Exception as e:  # close the others before reporting
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> MetricLoggers:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close(failed=exc_type is not None)
