"""Sweeps: how parallel runs share one machine, and what a rerun of a sweep does with each run.

Pure decisions, no I/O: `grail.train.cli` gathers the facts (job number, launcher, cores, GPUs, the
run directory's record) and applies the answers.

Sharing a machine. Hydra's basic sweeper hands the launcher one batch of `max_batch_size` jobs at
a time and waits for the whole batch, so batch b holds job numbers [b·P, b·P + P) with
P = max_batch_size, and `slot = job_num mod P` is unique among the runs alive at any moment:

    GPUs:  run in slot s takes GPUs [s·k, s·k + k), k = 1 (gpu.strategy=single) or 2 (multi)
    CPU:   the run's share is max(1, cores // P) cores, split between its trainer and its server
           as a lone run splits the whole machine (`grail.core.placement.split_cores`)

The race (grail/study/race_sweeper.py) keeps this without batches: it hands the launcher one job
at a time, as soon as a slot is free, numbered so that `job_num mod P` is that slot.

Launchers differ in who shares the machine: the basic launcher runs one job at a time (P = 1); the
submitit local launcher starts a whole batch at once on this machine (P = batch size); the SLURM
launcher gives every job its own allocation (P = 1 inside it, and the allocation's cores are the
process's CPU affinity, not `os.cpu_count()`).

Reruns. A sweep's run directories are its record: rerunning the same command with `resume=true`
and the same `hydra.sweep.dir` skips runs whose summary says completed or pruned (stopped early by
the pruner, grail/study/prune.py: finished, not to be continued), resumes runs that have progress
but no summary (killed, or still being written when the sweep stopped) from their newest
checkpoint, and reruns failed ones.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from grail.core.placement import split_cores
from grail.core.records import LAUNCH_KEYS, override_key

SUBMITIT_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
# Without GPUs, at most this many runs at once by default: past it each run's share of the cores
# gets too small to be worth a second model copy in memory. Override: hydra.sweeper.max_batch_size.
MAX_DEFAULT_CPU_PARALLEL = 4


class SweepError(ValueError):
    """A sweep that cannot be laid out on this machine; the message says which setting to change."""


def gpus_per_run(strategy: str) -> int:
    """GPUs one run occupies: `single` shares one GPU between server and trainer, `multi` uses
    one each."""
    if strategy == "single":
        return 1
    if strategy == "multi":
        return 2
    raise SweepError(f"gpu.strategy={strategy!r} is not one of single, multi")


def launcher_shares_machine(launcher_target: str | None) -> bool:
    """Whether the launcher starts several jobs at once on this machine."""
    return launcher_target == SUBMITIT_LOCAL


def default_parallel_runs(
    launcher_target: str | None, *, gpus: int, cpus: int, strategy: str
) -> int | None:
    """How many runs the submitit local launcher starts at once (hydra.sweeper.max_batch_size);
    None for launchers that do not share this machine (batching would only make each batch wait
    for its slowest job).

    With G GPUs: G // k runs, each on its own k GPUs; on CPU: min(cores, MAX_DEFAULT_CPU_PARALLEL).
    """
    if not launcher_shares_machine(launcher_target):
        return None
    if gpus > 0:
        return max(1, gpus // gpus_per_run(strategy))
    return max(1, min(cpus, MAX_DEFAULT_CPU_PARALLEL))


@dataclass(frozen=True)
class Resources:
    """What one run of a sweep may use. `server_gpu`/`training_gpu` are None on CPU."""

    slot: int
    parallel: int
    cores: int
    server_gpu: int | None = None
    training_gpu: int | None = None


def assign_resources(
    job_num: int, parallel: int, *, gpus: int, cpus: int, strategy: str
) -> Resources:
    """The share of this machine that job `job_num` gets when `parallel` runs share it.

    Raises SweepError when `parallel` runs need more GPUs than the machine has, naming
    hydra.sweeper.max_batch_size (the knob that sets `parallel`).
    """
    if job_num < 0:
        raise SweepError(f"job number must be >= 0, got {job_num}")
    if parallel < 1:
        raise SweepError(f"hydra.sweeper.max_batch_size must be >= 1, got {parallel}")
    if cpus < 1:
        raise SweepError(f"need at least one CPU core, got {cpus}")
    slot = job_num % parallel
    cores = max(1, cpus // parallel)
    if gpus <= 0:
        return Resources(slot=slot, parallel=parallel, cores=cores)
    k = gpus_per_run(strategy)
    if k > gpus:
        raise SweepError(
            f"gpu.strategy={strategy} needs {k} GPUs per run, this machine has {gpus}: "
            "use gpu.strategy=single"
        )
    if parallel * k > gpus:
        raise SweepError(
            f"{parallel} runs at once with gpu.strategy={strategy} need {parallel * k} GPUs, "
            f"this machine has {gpus}: set hydra.sweeper.max_batch_size={max(1, gpus // k)} "
            "or fewer"
        )
    first = slot * k
    return Resources(
        slot=slot,
        parallel=parallel,
        cores=cores,
        server_gpu=first,
        training_gpu=first + k - 1,
    )


def resource_overrides(
    resources: Resources, explicit: set[str] | frozenset[str], *, pipelined: bool
) -> dict[str, int]:
    """Config values (dotted key -> value) that put a run on its share, leaving alone every key the
    user set explicitly (`explicit`): an explicit choice always wins over the automatic one."""
    trainer_threads, server_threads = split_cores(resources.cores, pipelined=pipelined)
    values: dict[str, int | None] = {
        "train.threads": trainer_threads,
        "generation.server_threads": server_threads,
        "gpu.server_gpu": resources.server_gpu,
        "gpu.training_gpu": resources.training_gpu,
    }
    return {k: v for k, v in values.items() if v is not None and k not in explicit}


def explicit_keys(task_overrides: Sequence[str], keys: Sequence[str]) -> set[str]:
    """Which of `keys` the command line set (`key=...`, `+key=...`, `++key=...`)."""
    found = set()
    for override in task_overrides:
        name = override_key(override)
        if name in keys:
            found.add(name)
    return found


# ---- reruns ---------------------------------------------------------------------------------


class Action(enum.Enum):
    START = "start"  # nothing there yet: a fresh run
    SKIP = "skip"  # completed or pruned: nothing to do
    RESUME = "resume"  # progress but no summary: continue from the newest checkpoint
    RETRY = "retry"  # failed: run again (from its newest checkpoint, if any)


@dataclass(frozen=True)
class RunRecord:
    """What a run directory says about an earlier attempt (gathered by `grail.study.runs`)."""

    status: str | None  # summary.json's status ("completed" | "failed" | "pruned"); None: none
    has_progress: bool  # any metrics or checkpoints written
    overrides: tuple[str, ...] | None  # the overrides the directory was made with; None: unknown


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str


def _as_mapping(overrides: Sequence[str]) -> Mapping[str, str]:
    pairs = (o.split("=", 1) for o in overrides if "=" in o)
    return {override_key(k): v for k, v in pairs if override_key(k) not in LAUNCH_KEYS}


def decide(record: RunRecord, *, resume: bool, overrides: Sequence[str]) -> Decision:
    """What a (re)run of a sweep job does with its run directory.

    Without `resume` a job always starts over (a new sweep gets a fresh directory anyway). With it:
    completed or pruned → skip, failed → retry, progress without a summary → resume, nothing →
    start.

    Hydra numbers a sweep's jobs by the order of its parameter grid, so the same directory holds
    the same point only if the command is the same. A directory whose recorded overrides give a key
    a different value belongs to another point of another sweep: continuing it would mix two
    configurations in one run, so that raises SweepError. Keys added or dropped (e.g. a longer
    request timeout added for the rerun) are allowed.
    """
    if not resume:
        return Decision(Action.START, "resume=false")
    if record.overrides is not None:
        before, now = _as_mapping(record.overrides), _as_mapping(overrides)
        changed = sorted(k for k in before.keys() & now.keys() if before[k] != now[k])
        if changed:
            diff = ", ".join(f"{k}={before[k]} before, {k}={now[k]} now" for k in changed)
            raise SweepError(
                f"this run directory was made by a different sweep point ({diff}): the sweep's "
                "parameters or their order changed since the first attempt. Rerun the original "
                "command with resume=true, or start a new sweep (a new hydra.sweep.dir)"
            )
    if record.status == "completed":
        return Decision(Action.SKIP, "completed earlier")
    if record.status == "pruned":
        return Decision(Action.SKIP, "pruned earlier")
    if record.status == "failed":
        return Decision(Action.RETRY, "failed earlier")
    if record.status is not None:
        raise SweepError(f"summary.json has an unknown status {record.status!r}")
    if record.has_progress:
        return Decision(Action.RESUME, "interrupted earlier")
    return Decision(Action.START, "no earlier attempt")
