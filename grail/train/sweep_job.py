"""One job of a sweep (`grail-train -m`), and the sweep's end: what a sweep adds around a run
(grail/study/sweep.py decides, this module gathers the facts and acts; docs/sweeps.md):

- a run that raises does not stop the sweep: its `summary.json` says "failed" and why
  (`sweep_job`), and `SweepOutcome` (a Hydra callback) lists the failed runs at the end and exits
  non-zero;
- runs that share this machine (hydra/launcher=local) get disjoint GPUs and a share of the cores
  (`sweep_resources`; `parallel_runs`, the `grail_parallel` resolver of conf/hydra/sweeper/);
- with `resume=true` a rerun skips completed runs, resumes interrupted ones, retries failed ones.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, cast

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from grail.core.choices import GpuStrategy
from grail.core.errors import DiskFullError
from grail.core.nodes import NodePlan
from grail.core.placement import GpuConfig, available_cores
from grail.core.records import SUMMARY, write_summary
from grail.study.sweep import (
    RESOURCE_KEYS,
    Action,
    assign_resources,
    decide,
    default_parallel_runs,
    explicit_keys,
    launcher_shares_machine,
    resource_overrides,
    run_shape,
)
from grail.train import launch
from grail.train.resume import Resume

log = logging.getLogger("grail.train")


def parallel_runs(
    launcher_target: str | None, strategy: str, processes: int | None = None
) -> int | None:
    # Only the local launcher asks for the GPU count (and so imports torch).
    if not launcher_shares_machine(launcher_target):
        return None
    shape = run_shape(GpuConfig(strategy=GpuStrategy(strategy)), processes)
    return default_parallel_runs(
        launcher_target, gpus=launch.visible_gpus(), cpus=available_cores(), shape=shape
    )


def sweep_resources(cfg: DictConfig, hydra_cfg: Any) -> dict[str, Any]:
    """Config values that give this sweep job its share of the machine (see grail/study/sweep.py),
    leaving out every field the user set."""
    target = OmegaConf.select(hydra_cfg, "launcher._target_", default=None)
    gpus = launch.visible_gpus()
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


def sweep_job(
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
        sweep_settings(cfg, hydra_cfg)
        config = launch.checked_config(cfg, hydra_cfg, run_dir, resume)
        launch.train(config, run_dir, resume, plan)
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


def sweep_settings(cfg: DictConfig, hydra_cfg: Any) -> None:
    """What a sweep sets in a run's config: its share of the machine, the study directory."""
    for key, value in sweep_resources(cfg, hydra_cfg).items():
        OmegaConf.update(cfg, key, value, merge=False)
        log.info("sweep job %d: %s=%s", int(hydra_cfg.job.num), key, value)
    if cfg.study_dir is None:  # the sweep is the study its runs share state in
        cfg.study_dir = str(Path(str(hydra_cfg.sweep.dir)).absolute())


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
