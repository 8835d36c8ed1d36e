"""`grail-train`: the Hydra entrypoint (also `scripts/offline_trainer/run_offline_grpo.py`).

The typed schema (`grail.core.config.Config`) is registered with Hydra's ConfigStore and named
first in `conf/offline_grpo.yaml`'s defaults, so an unknown key or a wrong type fails at
composition time naming the key; `preflight` then rejects what composition lets through (keys added
with `+`), impossible combinations, environment arguments, reward plugins and model paths before
anything loads or starts.

A single run reports a known user error (`grail.core.errors.UserError`: a bad config, a missing data
file, a plugin that cannot load, a run directory in use, ...) as one line and keeps the traceback
in the run's log file (Hydra's `RUN_DIR/<job>.log`); Ctrl-C and SIGTERM (what SLURM and `timeout`
send) stop the run the same way: the inference server is stopped and the command that resumes the
run is printed. Any other exception keeps its traceback. A process whose run has ended never waits
for a thread still stuck in user code (a reward plugin that never returns): past `EXIT_GRACE_S`
it ends without it (`main`).

What one run does before and as it starts is grail/train/launch.py (`preflight`, `train`); what
a sweep (`-m`) adds around it, grail/train/sweep_job.py.

A single run (no `-m`) exits non-zero on failure: 2 for a configuration error (Hydra's own
included, reported by `main` as one line), 1 for another known user error (a full disk included:
one line naming the file, and the resume command) or an exception (with its traceback; either way
a run that got its directory writes summary.json with the error), 130 after Ctrl-C, 143 after
SIGTERM. With `resume=true` a run takes its saved config and refuses changes outside a short list
(grail/train/resume.py), and a directory that holds no run to continue (exit 2, naming it).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from grail.core.config import Config
from grail.core.errors import ConfigError, DiskFullError, UserError
from grail.core.nodes import NodePlan, node_plan
from grail.core.placement import prefer_passive_openmp
from grail.core.records import (
    SECRET_FILE_MODE,
    RunDirLocked,
    atomic_write_text,
    holds_secrets,
    run_lock,
)
from grail.core.reproducible import apply_reproducible_env
from grail.core.validate import unknown_key_message
from grail.study.sweep import SweepError
from grail.train import launch, sweep_job
from grail.train.reporting import (
    interrupt_exit_code,
    interrupt_message,
    interrupt_on_sigterm,
    log_files,
    report_run_error,
    resume_command,
)
from grail.train.reporting import report as _report
from grail.train.resume import Resume, RunDirNotEmpty, plan_resume, refuse_a_fresh_start_over_a_run

ConfigStore.instance().store(name="offline_grpo_schema", node=Config)
# Before torch loads (this module imports it only inside the run): threads that sleep when they
# wait, so the run degrades gracefully on a machine other jobs share.
prefer_passive_openmp(os.environ)

_PACKAGED_CONF = Path(__file__).resolve().parents[1] / "conf"  # inside a built wheel
_SOURCE_CONF = Path(__file__).resolve().parents[2] / "conf"  # in a checkout (editable install)
CONF_DIR = str(_PACKAGED_CONF if _PACKAGED_CONF.is_dir() else _SOURCE_CONF)

log = logging.getLogger("grail.train")
# Hydra logs at INFO; one line per HTTP request from the OpenAI client's HTTP stack is noise.
for _noisy in ("httpx", "httpx2", "openai"):
    logging.getLogger(_noisy).setLevel(logging.WARNING)


# Used by conf/hydra/sweeper/grail_basic.yaml (max_batch_size) and conf/hydra/launcher/local.yaml
# (gpus_per_node): registered on import, before Hydra composes anything.
OmegaConf.register_new_resolver("grail_parallel", sweep_job.parallel_runs, replace=True)
OmegaConf.register_new_resolver("grail_gpus", launch.visible_gpus, replace=True)


# How long the process may take to end once the run is over (failed or interrupted), before it
# ends without waiting for threads still running: a stuck thread cannot be stopped, and the
# interpreter would otherwise wait for it forever. The cleanup that matters (stopping the server,
# the resume hint) has happened by then; exiting normally takes well under a second.
EXIT_GRACE_S = 5.0


def _single_run(
    cfg: DictConfig,
    run_dir: Path,
    hydra_cfg: Any,
    resume: Resume | None,
    plan: NodePlan | None = None,  # None: one node
) -> None:
    """One run. A failure after the run claimed its directory writes summary.json with its error
    (grail/train/loop.py); a configuration error (exit 2) writes nothing: nothing started."""
    try:
        config = launch.checked_config(cfg, hydra_cfg, run_dir, resume)
        launch.train(config, run_dir, resume, plan)
    except UserError as exc:
        code = report_run_error(exc, run_dir)
        assert code is not None
        sys.exit(code)
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (Terminated)
        # The run's files are consistent at any moment (see grail/train/loop.py): what was
        # checkpointed is kept, so the useful answer is how to continue, not where it stopped.
        command = resume_command(run_dir.absolute())
        _report(interrupt_message(exc), exc, f"; to continue from the newest checkpoint: {command}")
        sys.exit(interrupt_exit_code(exc))


def _other_node(
    cfg: DictConfig, run_dir: Path, hydra_cfg: Any, multirun: bool, plan: NodePlan
) -> None:
    """A node other than node 0 of a multi-node run (grail/core/nodes.py): it launches its ranks
    with the run's config and nothing else. Node 0 owns the run directory (its lock, `.hydra/`,
    the records and summary.json) and the log file there, so this process reads the directory
    only (a resume's saved config) and logs to its console; it ends as its ranks did: 0 when the
    run completed, else one line and 1 (node 0 says why), 130/143 after Ctrl-C/SIGTERM."""
    from grail.train.distributed import launch as launch_ranks

    root = logging.getLogger()
    for handler in log_files():  # Hydra opened RUN_DIR/<job>.log: node 0's
        root.removeHandler(handler)
        handler.close()
    log.info("node %d of %d: ranks meet node 0 at %s", plan.node_rank, plan.nodes, plan.endpoint)
    try:
        resume = _plan_resume(cfg, run_dir, hydra_cfg, multirun)
        if resume is not None:
            cfg = resume.config
        if multirun:
            sweep_job.sweep_settings(cfg, hydra_cfg)
        config = launch.checked_config(cfg, hydra_cfg, run_dir, resume)
        if config.reproducible:
            apply_reproducible_env(os.environ)
        launch_ranks(config, run_dir, resume, None, plan)
    except UserError as exc:
        code = report_run_error(exc, run_dir)
        sys.exit(1 if code is None else code)
    except KeyboardInterrupt as exc:
        _report(interrupt_message(exc), exc, "; node 0 prints the command that resumes the run")
        sys.exit(interrupt_exit_code(exc))


def save_hydra_files(run_dir: Path, cfg: DictConfig, hydra_cfg: Any) -> None:
    """What Hydra itself writes into `RUN_DIR/.hydra/` (config.yaml, hydra.yaml, overrides.yaml),
    written by us under the run's lock (`hydra.output_subdir: null` in conf/offline_grpo.yaml turns
    Hydra's own write off) and atomically: a second grail-train into a running run's directory
    must fail without touching the files that say how that run was configured. Only when a run
    starts: a resume keeps them (its own overrides and changes go into parts.json). Owner-only
    when the config holds a key (`service.api_key`, a scorer's headers), which then stands in
    all three (the overrides, as given on the command line, are in hydra.yaml too)."""
    hydra_dir = run_dir / ".hydra"
    mode = SECRET_FILE_MODE if holds_secrets(OmegaConf.to_container(cfg)) else None
    hydra_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "config.yaml": cfg,
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": hydra_cfg.overrides.task,
    }
    for name, node in files.items():
        atomic_write_text(hydra_dir / name, OmegaConf.to_yaml(node), mode=mode)


def train_job(cfg: DictConfig) -> None:
    """What `grail-train` does with a composed config: one run, or one job of a sweep (`-m`).
    Everything it does, from writing `.hydra/` on, happens holding the run directory's lock."""
    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    try:
        plan = node_plan(cfg.train.nodes, cfg.train.node_rank, cfg.train.rdzv_endpoint, os.environ)
    except ConfigError as exc:
        _report(f"invalid configuration: {exc}", exc)
        sys.exit(2)
    if not plan.drives:
        _other_node(cfg, run_dir, hydra_cfg, multirun, plan)
        return
    try:
        with run_lock(run_dir):
            # A sweep's job may find its run not started yet (a fresh start); another node
            # (_other_node) leaves the directory to node 0.
            resume = _plan_resume(cfg, run_dir, hydra_cfg, multirun, require_run=not multirun)
            if resume is None:
                if not cfg.resume:  # before .hydra/ is written over another run's
                    refuse_a_fresh_start_over_a_run(run_dir)
                save_hydra_files(run_dir, cfg, hydra_cfg)
            else:
                cfg = resume.config
            if multirun:
                sweep_job.sweep_job(cfg, run_dir, hydra_cfg, resume, plan)
            else:
                _single_run(cfg, run_dir, hydra_cfg, resume, plan)
    except (RunDirLocked, RunDirNotEmpty) as exc:
        if not multirun:
            _report(str(exc), exc)
            sys.exit(1)
        # The directory belongs to the process running there, or holds a run a fresh job must
        # not overwrite: this job writes nothing into it (no "failed" summary), and the sweep goes
        # on; SweepOutcome lists the run if it never ends.
        _report(f"sweep job {int(hydra_cfg.job.num)} not run: {exc}", exc)
    except DiskFullError as exc:  # writing .hydra/, or in a sweep (_single_run reports its own)
        if multirun:
            sweep_dir = Path(str(hydra_cfg.sweep.dir)).absolute()
            then = (
                "; free some space, then finish the sweep: rerun the same command with "
                f"resume=true hydra.sweep.dir={sweep_dir}"
            )
        else:
            command = resume_command(run_dir.absolute())
            then = f"; free some space, then continue the run: {command}"
        _report(str(exc), exc, then)
        sys.exit(1)
    except KeyboardInterrupt as exc:
        if not multirun:
            raise  # Ctrl-C during a single run is reported (with the resume command) by _single_run
        sweep_dir = Path(str(hydra_cfg.sweep.dir)).absolute()
        _report(
            interrupt_message(exc),
            exc,
            "; to finish the sweep, rerun the same command with resume=true "
            f"hydra.sweep.dir={sweep_dir}",
        )
        sys.exit(interrupt_exit_code(exc))


def _plan_resume(
    cfg: DictConfig, run_dir: Path, hydra_cfg: Any, multirun: bool, *, require_run: bool = False
) -> Resume | None:
    """With resume=true in a directory that holds a run's config: that config, with the allowed
    changes of this command line (grail/train/resume.py). A refused change ends a single run with
    one line (exit 2) and stops a sweep (`main` reports it), before anything is written; so does
    a directory without a run when `require_run` (a single run's node 0: it would start afresh
    where the user meant to continue)."""
    if not cfg.resume:
        return None
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    try:
        return plan_resume(
            cfg, run_dir, overrides, hydra_cfg.runtime.choices, require_run=require_run
        )
    except ConfigError as exc:
        if multirun:
            raise ConfigError(f"sweep job {int(hydra_cfg.job.num)}: {exc}") from exc
        _report(f"invalid configuration: {exc}", exc)
        sys.exit(2)


def end_within(grace_s: float, code: int) -> None:
    """Make sure the process ends within `grace_s` seconds with exit code `code`, even if a
    thread stuck in user code (a reward plugin in a C call or a sleep) holds up the interpreter's
    exit: a daemon thread that, should the process still be alive then, names the threads still
    running, flushes the logs and ends the process without waiting for them."""

    def end() -> None:
        time.sleep(grace_s)  # a daemon thread: a process that ends first never gets further
        main_thread, me = threading.main_thread(), threading.current_thread()
        stuck = [t.name for t in threading.enumerate() if t not in (main_thread, me)]
        log.warning(
            "the process did not end within %g s of its run; ending it without waiting for "
            "threads still running (%s)",
            grace_s,
            ", ".join(stuck) or "none",
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    threading.Thread(target=end, name="grail-exit", daemon=True).start()


# Hydra's message for an override of a key the config lacks (hydra/_internal/config_loader_impl.py)
_NOT_OVERRIDDEN = re.compile(r"Could not override '([^']+)'\.")


def hydra_error_line(exc: BaseException) -> str:
    """One line for an error Hydra raises while composing the config (a bad override, a value of
    the wrong type, a config group option that does not exist, a key missing its `+`)."""
    options = getattr(exc, "options", None)  # MissingConfigException: the group's options
    lines = []
    for line in str(exc).splitlines():
        if line.startswith(("Available options", "Config search path")):
            break
        if line.strip():
            lines.append(line.strip().removeprefix("In 'offline_grpo': "))
    message = " ".join(lines) or type(exc).__name__
    cause = exc.__cause__
    # "Could not override 'train.lrr'. To append to your config use +train.lrr=1e-3": advice
    # that preflight would then refuse (the key is not the schema's). Name the key it resembles.
    if (
        isinstance(cause, ConfigAttributeError | ConfigKeyError)
        and (override := _NOT_OVERRIDDEN.match(message))
        and (unknown := unknown_key_message(override[1])) is not None
    ):
        return unknown
    if isinstance(exc, OverrideParseException):  # the grammar's complaint alone names nothing
        message = f"cannot parse the override {exc.override!r}: {lines[0] if lines else message}"
    if isinstance(cause, OmegaConfBaseException) and str(cause):
        message += f" ({str(cause).splitlines()[0]})"
    if options:
        message += f"; the options are: {', '.join(map(str, options))}"
    return message


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="offline_grpo")
def _hydra_main(cfg: DictConfig) -> None:
    train_job(cfg)


def main() -> None:
    """`grail-train`. A run that failed or was stopped ends within `EXIT_GRACE_S` of its last
    line: the interpreter would otherwise wait at exit for any thread still running."""
    try:
        _hydra_with_our_errors()
    except SystemExit as exc:
        if exc.code not in (0, None):
            end_within(EXIT_GRACE_S, exc.code if isinstance(exc.code, int) else 1)
        raise
    except KeyboardInterrupt as exc:  # an interrupt outside the run (while Hydra starts)
        end_within(EXIT_GRACE_S, interrupt_exit_code(exc))
        raise
    except BaseException:
        end_within(EXIT_GRACE_S, 1)
        raise


def _hydra_with_our_errors() -> None:
    """Hydra's entry point, with its errors reported as ours: a configuration error, Hydra's own
    included, is one line and exit code 2. HYDRA_FULL_ERROR=1 makes Hydra raise instead of
    printing its multi-line error, so that we can; set it yourself to get Hydra's tracebacks as
    they are."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        _hydra_main()
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        _hydra_main()
    except (ConfigError, SweepError) as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        sys.exit(2)
    except (HydraException, OmegaConfBaseException) as exc:
        print(f"invalid configuration: {hydra_error_line(exc)}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
