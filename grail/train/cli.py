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

Sweeps (`-m`) add three things around `run()` (see grail/study/sweep.py and docs/sweeps.md):
- a run that raises does not stop the sweep: its `summary.json` says "failed" and why, and
  `SweepOutcome` (a Hydra callback) lists the failed runs at the end and exits non-zero;
- runs that share this machine (hydra/launcher=local) get disjoint GPUs and a share of the cores;
- with `resume=true` a rerun skips completed runs, resumes interrupted ones, retries failed ones.
A single run (no `-m`) exits non-zero on failure: 2 for a configuration error (Hydra's own
included, reported by `main` as one line), 1 for another known user error (a full disk included:
one line naming the file, and the resume command) or an exception (with its traceback; either way
a run that got its directory writes summary.json with the error), 130 after Ctrl-C, 143 after
SIGTERM. With `resume=true` a run takes its saved config and refuses changes outside a short list
(grail/train/resume.py).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, cast

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, OverrideParseException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grail.core.choices import GpuStrategy
from grail.core.config import Config
from grail.core.errors import ConfigError, DiskFullError, UserError
from grail.core.nodes import NodePlan, node_plan
from grail.core.placement import (
    GpuConfig,
    available_cores,
    prefer_passive_openmp,
    trainer_devices,
    trainer_processes,
)
from grail.core.records import (
    SUMMARY,
    RunDirLocked,
    atomic_write_text,
    run_lock,
    write_summary,
)
from grail.core.reproducible import apply_reproducible_env
from grail.core.validate import validate
from grail.study.sweep import (
    RESOURCE_KEYS,
    Action,
    SweepError,
    assign_resources,
    decide,
    default_parallel_runs,
    explicit_keys,
    launcher_shares_machine,
    resource_overrides,
    run_shape,
)
from grail.train.reporting import (
    interrupt_exit_code,
    interrupt_message,
    interrupt_on_sigterm,
    log_files,
    report_run_error,
    resume_command,
)
from grail.train.reporting import report as _report
from grail.train.resume import Resume, plan_resume, saved_choices

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


def visible_gpus() -> int:
    """GPUs this process can see (honours CUDA_VISIBLE_DEVICES)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0  # hidden on purpose; answers without importing torch
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _parallel_resolver(
    launcher_target: str | None, strategy: str, processes: int | None = None
) -> int | None:
    # Only the local launcher asks for the GPU count (and so imports torch).
    if not launcher_shares_machine(launcher_target):
        return None
    shape = run_shape(GpuConfig(strategy=GpuStrategy(strategy)), processes)
    return default_parallel_runs(
        launcher_target, gpus=visible_gpus(), cpus=available_cores(), shape=shape
    )


# Used by conf/hydra/sweeper/grail_basic.yaml (max_batch_size) and conf/hydra/launcher/local.yaml
# (gpus_per_node): registered on import, before Hydra composes anything.
OmegaConf.register_new_resolver("grail_parallel", _parallel_resolver, replace=True)
OmegaConf.register_new_resolver("grail_gpus", visible_gpus, replace=True)


# How long the process may take to end once the run is over (failed or interrupted), before it
# ends without waiting for threads still running: a stuck thread cannot be stopped, and the
# interpreter would otherwise wait for it forever. The cleanup that matters (stopping the server,
# the resume hint) has happened by then; exiting normally takes well under a second.
EXIT_GRACE_S = 5.0


def sweep_resources(cfg: DictConfig, hydra_cfg: Any) -> dict[str, Any]:
    """Config values that give this sweep job its share of the machine (see grail/study/sweep.py),
    leaving out every field the user set."""
    target = OmegaConf.select(hydra_cfg, "launcher._target_", default=None)
    gpus = visible_gpus()
    if launcher_shares_machine(target):
        parallel = OmegaConf.select(hydra_cfg, "sweeper.max_batch_size", default=None)
        if parallel is None:
            log.warning(
                "hydra.sweeper.max_batch_size=null: every run of this sweep starts at once and "
                "grail cannot tell how many share this machine, so each uses all of it; set "
                "hydra.sweeper.max_batch_size to split GPUs and cores between them"
            )
            parallel = 1
    else:
        parallel = 1  # runs one at a time, or each in its own allocation (SLURM)
    resources = assign_resources(
        int(hydra_cfg.job.num),
        int(parallel),
        gpus=gpus,
        cpus=available_cores(),
        shape=run_shape(
            cast(GpuConfig, OmegaConf.to_object(cfg.gpu)),
            cfg.train.processes,
            int(cfg.generation.servers),
        ),
    )
    # The fields a sweep sets per run are None unless the user set them (in a YAML file or on
    # the command line), and what the user set is left alone.
    explicit = explicit_keys(list(hydra_cfg.overrides.task), RESOURCE_KEYS)
    explicit |= {key for key in RESOURCE_KEYS if OmegaConf.select(cfg, key) is not None}
    if cfg.reproducible:
        # Fixed thread counts, not this machine's share: the same seed gives the same numbers in a
        # sweep or alone, on any machine (grail/core/reproducible.py).
        explicit |= {"train.threads", "generation.server_threads"}
    return resource_overrides(
        resources, explicit, pipelined=bool(cfg.train.pipeline), servers=int(cfg.generation.servers)
    )


def _train(
    config: Config, run_dir: Path, resume: Resume | None = None, plan: NodePlan | None = None
) -> None:
    if config.reproducible:
        # Before torch's first tensor operation, when torch and MKL read them (the server child
        # gets them in its environment); setup_torch checks that torch took them.
        apply_reproducible_env(os.environ)
    # N ranks (on this node), this process their agent (distributed.py)
    plan = plan or NodePlan.single()
    if plan.nodes > 1 or trainer_processes(config.gpu, config.train.processes) > 1:
        from grail.train.distributed import launch

        files = log_files()
        try:
            launch(config, run_dir, resume, files[0].baseFilename if files else None, plan)
        except UserError as exc:  # a rank failed: rank 0 could not write summary.json
            _failed_summary(config, run_dir, exc)
            command = resume_command(run_dir.absolute())
            raise type(exc)(f"{exc}; to continue from the newest checkpoint: {command}") from exc
        return
    # Imported here so that `--help` and config errors answer before torch and transformers load.
    from grail.train.loop import run

    run(config, run_dir, resume)


def _failed_summary(config: Config, run_dir: Path, exc: BaseException) -> None:
    from grail.train.loop import config_record

    try:
        write_summary(
            run_dir,
            0.0,
            error=exc,
            environment=config.data.environment,
            config=config_record(config),
        )
    except OSError as unwritten:  # a full disk, say: the error that stopped the run matters
        log.warning("summary.json not written: %s", unwritten)


def preflight(config: Config, env_group: str | None = None) -> None:
    """Check what can be checked before anything loads or starts, raising a UserError that names
    the bad key: the schema and combinations (`validate`), the environment and its arguments,
    the reward plugins (imported) and their names against the environment's score components,
    and that model paths exist. `env_group`: the `env=` choice the config was composed with."""
    from grail.envs import ENVIRONMENTS, check_env_kwargs, env_factory
    from grail.envs.rewards.base import RewardError
    from grail.envs.rewards.plugins import RewardFunctions
    from grail.models.tiny import TINY_MODEL_NAME

    validate(config)
    # The GPUs named for the trainer ranks and the server exist on this machine.
    trainer_devices(config.gpu, config.train.processes, visible_gpus(), config.generation.servers)
    name = config.data.environment
    factory = env_factory(name)
    if env_group in ENVIRONMENTS and env_group != name:
        raise ConfigError(
            f"data.environment={name} but the config group env={env_group} set its arguments "
            f"(data.env_kwargs); choose the environment with env={name} instead"
        )
    check_env_kwargs(name, config.data.env_kwargs)
    rewards = RewardFunctions.from_specs(list(config.data.rewards))
    try:
        rewards.check_names(name, factory.components)
    except RewardError as exc:  # a name the config gave: a configuration error (exit 2)
        raise ConfigError(str(exc)) from exc
    for key in ("train_id", "ref_id"):
        model_id = getattr(config.model, key)
        if model_id is not None and model_id != TINY_MODEL_NAME:
            from grail.models.loading import check_hub_source, resolve_source

            try:
                check_hub_source(resolve_source(model_id))
            except OSError as exc:  # missing path, a file, a hub id the hub cannot give
                raise ConfigError(f"model.{key}: {exc}") from exc


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
        config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        preflight(config, _env_choice(hydra_cfg, run_dir, resume))
        _train(config, run_dir, resume, plan)
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


def _env_choice(hydra_cfg: Any, run_dir: Path, resume: Resume | None) -> str | None:
    """The `env=` choice the run's config was composed with: the saved one for a resume."""
    if resume is not None:
        env = saved_choices(run_dir).get("env")
        return str(env) if env is not None else None
    return hydra_cfg.runtime.choices.get("env")


def _sweep_job(
    cfg: DictConfig,
    run_dir: Path,
    hydra_cfg: Any,
    resume: Resume | None,
    plan: NodePlan | None = None,  # None: one node
) -> None:
    """One run of a sweep. Never raises for a failed run (that would stop the sweep): the failure
    goes into summary.json. KeyboardInterrupt and SIGTERM still stop everything, leaving the run
    incomplete for `resume=true` to continue."""
    from grail.study.runs import append_attempt, run_record

    overrides = [str(o) for o in hydra_cfg.overrides.task]
    job_num = int(hydra_cfg.job.num)
    # A sweep whose points moved between directories raises here (SweepError): every later job
    # would hit the same, so stopping the sweep with the reason is the useful answer.
    decision = decide(run_record(run_dir), resume=bool(cfg.resume), overrides=overrides)
    if decision.action is Action.SKIP:
        log.info("run %s: %s, skipping (resume=true)", run_dir, decision.reason)
        append_attempt(run_dir, decision.action.value, overrides, job_num)
        return
    if decision.action is Action.RETRY:
        # Until this attempt ends the run is incomplete, not failed: keep the old error beside.
        (run_dir / SUMMARY).replace(run_dir / "summary.failed.json")
    if decision.action is Action.START and run_record(run_dir).has_progress:
        log.warning(
            "run %s: starting over in a directory with an earlier attempt (resume=false); its "
            "files are overwritten. Add resume=true to continue it instead",
            run_dir,
        )
    log.info("run %s: %s (%s)", run_dir, decision.action.value, decision.reason)
    append_attempt(run_dir, decision.action.value, overrides, job_num)

    t0 = time.perf_counter()
    try:
        _sweep_settings(cfg, hydra_cfg)
        config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        preflight(config, _env_choice(hydra_cfg, run_dir, resume))
        _train(config, run_dir, resume, plan)
    except DiskFullError:
        raise  # every later run would hit it too: the sweep stops (train_job), resumable
    except Exception as exc:
        log.exception("run %s failed; the sweep goes on", run_dir)
        try:
            snapshot = OmegaConf.to_container(cfg, resolve=True)
        except Exception:
            snapshot = None
        write_summary(
            run_dir,
            time.perf_counter() - t0,
            error=exc,
            environment=OmegaConf.select(cfg, "data.environment", default=None),
            config=cast(dict[str, Any], snapshot) if isinstance(snapshot, dict) else None,
        )


def _sweep_settings(cfg: DictConfig, hydra_cfg: Any) -> None:
    """What a sweep sets in a run's config: its share of the machine, the study directory."""
    for key, value in sweep_resources(cfg, hydra_cfg).items():
        OmegaConf.update(cfg, key, value, merge=False)
        log.info("sweep job %d: %s=%s", int(hydra_cfg.job.num), key, value)
    if cfg.study_dir is None:  # the sweep is the study its runs share state in
        cfg.study_dir = str(Path(str(hydra_cfg.sweep.dir)).absolute())


def _other_node(
    cfg: DictConfig, run_dir: Path, hydra_cfg: Any, multirun: bool, plan: NodePlan
) -> None:
    """A node other than node 0 of a multi-node run (grail/core/nodes.py): it launches its ranks
    with the run's config and nothing else. Node 0 owns the run directory (its lock, `.hydra/`,
    the records and summary.json) and the log file there, so this process reads the directory
    only (a resume's saved config) and logs to its console; it ends as its ranks did: 0 when the
    run completed, else one line and 1 (node 0 says why), 130/143 after Ctrl-C/SIGTERM."""
    from grail.train.distributed import launch

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
            _sweep_settings(cfg, hydra_cfg)
        config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
        preflight(config, _env_choice(hydra_cfg, run_dir, resume))
        if config.reproducible:
            apply_reproducible_env(os.environ)
        launch(config, run_dir, resume, None, plan)
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
    starts: a resume keeps them (its own overrides and changes go into parts.json)."""
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    files = {
        "config.yaml": cfg,
        "hydra.yaml": OmegaConf.create({"hydra": hydra_cfg}),
        "overrides.yaml": hydra_cfg.overrides.task,
    }
    for name, node in files.items():
        atomic_write_text(hydra_dir / name, OmegaConf.to_yaml(node))


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
            resume = _plan_resume(cfg, run_dir, hydra_cfg, multirun)
            if resume is None:
                save_hydra_files(run_dir, cfg, hydra_cfg)
            else:
                cfg = resume.config
            if multirun:
                _sweep_job(cfg, run_dir, hydra_cfg, resume, plan)
            else:
                _single_run(cfg, run_dir, hydra_cfg, resume, plan)
    except RunDirLocked as exc:
        if not multirun:
            _report(str(exc), exc)
            sys.exit(1)
        # The directory belongs to the process running there: this job writes nothing into it (no
        # "failed" summary), and the sweep goes on; SweepOutcome lists the run if it never ends.
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


def _plan_resume(cfg: DictConfig, run_dir: Path, hydra_cfg: Any, multirun: bool) -> Resume | None:
    """With resume=true in a directory that holds a run's config: that config, with the allowed
    changes of this command line (grail/train/resume.py). A refused change ends a single run with
    one line (exit 2) and stops a sweep (`main` reports it), before anything is written."""
    if not cfg.resume:
        return None
    overrides = [str(o) for o in hydra_cfg.overrides.task]
    try:
        return plan_resume(cfg, run_dir, overrides, hydra_cfg.runtime.choices)
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
    if isinstance(exc, OverrideParseException):  # the grammar's complaint alone names nothing
        message = f"cannot parse the override {exc.override!r}: {lines[0] if lines else message}"
    cause = exc.__cause__
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


class SweepOutcome(Callback):
    """At the end of a sweep: list the runs that failed (and why) or never finished, and exit
    non-zero if there are any, so scripts and CI see a partly failed sweep as a failure. Runs the
    pruner stopped early (grail/study/prune.py) ended as asked: counted, never failures.

    Reads the run directories rather than Hydra's job returns, so it sees the same thing for every
    launcher, runs on SLURM nodes and runs skipped by a `resume=true` rerun included.
    """

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from rich.console import Console
        from rich.markup import escape

        from grail.study.runs import distinguishing_overrides, find_runs, read_overrides, run_status

        sweep_dir = Path(str(config.hydra.sweep.dir))
        runs = find_runs(sweep_dir) if sweep_dir.is_dir() else []
        labels = distinguishing_overrides([read_overrides(path) for path in runs])
        statuses = [run_status(path) for path in runs]
        n_pruned = sum(s.status == "pruned" for s in statuses)
        bad = [
            (s, " ".join(label))
            for s, label in zip(statuses, labels, strict=True)
            if s.status not in ("done", "pruned")
        ]
        console = Console(stderr=True, soft_wrap=True)  # paths stay whole, copyable
        pruned = f"{n_pruned} pruned early (prune.pruner)" if n_pruned else ""
        if not bad:
            if n_pruned:
                done = len(runs) - n_pruned
                console.print(
                    f"sweep {sweep_dir}: all {len(runs)} runs ended: {done} completed, {pruned}"
                )
            else:
                console.print(f"sweep {sweep_dir}: all {len(runs)} runs completed")
            return
        console.print(
            f"[bold red]sweep {sweep_dir}: {len(bad)} of {len(runs)} runs did not complete[/]"
            + (f" ({pruned}, not failures)" if n_pruned else "")
        )
        for s, label in bad:
            why = (s.error or "no summary.json: killed, timed out or still running").strip()
            first_line = why.splitlines()[0] if why else "(no message)"
            console.print(
                f"  {escape(s.path.name)} ({escape(label)}): [red]{s.status}[/] - "
                f"{escape(first_line)}"
            )
        console.print(
            f"details: grail-report {sweep_dir}; logs in each run's directory. To finish what "
            f"is missing, rerun the same command with resume=true hydra.sweep.dir={sweep_dir}"
        )
        # Hydra turns an exception from a callback into a warning; SystemExit is what gets through.
        sys.exit(1)


if __name__ == "__main__":
    main()
