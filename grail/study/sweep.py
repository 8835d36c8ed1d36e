"""Sweeps: how parallel runs share one machine, and what a rerun of a sweep does with each run.

Pure decisions, no I/O: `grail.train.cli` gathers the facts (job number, launcher, cores, GPUs, the
run directory's record) and applies the answers.

Sharing a machine. Hydra's basic sweeper hands the launcher one batch of `max_batch_size` jobs at
a time and waits for the whole batch, so batch b holds job numbers [b·P, b·P + P) with
P = max_batch_size, and `slot = job_num mod P` is unique among the runs alive at any moment:

    GPUs:  with G GPUs, slot s owns the window [s·w, s·w + w), w = G // P, and its run takes the
           first k of them, k = what the run needs (`RunShape`): its server GPUs first, then its
           training GPUs (one per rank, train.processes), or only the training GPUs when the
           server shares them (gpu.strategy=single). Windows of G // P rather than k keep runs
           of different shapes in one sweep (e.g. train.processes=1,2) apart.
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
from typing import Any

from grail.core.placement import GpuConfig, gpu_layout, split_cores
from grail.core.records import LAUNCH_KEYS, override_key

SUBMITIT_LOCAL = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"
SUBMITIT_SLURM = "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
# Without GPUs, at most this many runs at once by default: past it each run's share of the cores
# gets too small to be worth a second model copy in memory. Override: hydra.sweeper.max_batch_size.
MAX_DEFAULT_CPU_PARALLEL = 4


class SweepError(ValueError):
    """A sweep that cannot be laid out on this machine; the message says which setting to change."""


@dataclass(frozen=True)
class RunShape:
    """The GPUs one run needs: `server` for its server(s), `trainer` for its ranks (one each);
    `shared`: the server runs on the trainer's first GPUs (gpu.strategy=single), else on GPUs of
    its own."""

    server: int = 1
    trainer: int = 1
    shared: bool = True

    def __post_init__(self) -> None:
        if self.server < 1 or self.trainer < 1:
            raise SweepError(f"a run needs at least one server and one training GPU, got {self}")
        if self.shared and self.server > self.trainer:
            raise SweepError(f"a shared server needs no more GPUs than the trainer, got {self}")

    @property
    def gpus(self) -> int:
        return self.trainer if self.shared else self.server + self.trainer

    def describe(self) -> str:
        if self.shared:
            return f"{self.trainer} GPU(s) shared by server and trainer"
        return f"{self.server} server + {self.trainer} training GPU(s)"


def shape_of(strategy: str) -> RunShape:
    """The one-rank shapes: `single` shares one GPU between server and trainer, `multi` uses one
    each."""
    if strategy == "single":
        return RunShape(1, 1, shared=True)
    if strategy == "multi":
        return RunShape(1, 1, shared=False)
    raise SweepError(f"gpu.strategy={strategy!r} is not one of single, multi")


def run_shape(gpu: GpuConfig, processes: int | None, servers: int = 1) -> RunShape:
    """What a run of this config needs (`grail.core.placement.gpu_layout`): its server GPUs
    (one per server of a fleet of `servers`, generation.servers, unless they share) and one
    training GPU per rank, `processes` being train.processes (None: unset)."""
    layout = gpu_layout(gpu, processes, servers)
    return RunShape(len(layout.server), len(layout.trainer), shared=layout.shared)


def gpus_per_run(strategy: str) -> int:
    """GPUs one run of a one-rank trainer occupies (`shape_of`)."""
    return shape_of(strategy).gpus


def _pick_shape(strategy: str | None, shape: RunShape | None) -> RunShape:
    if shape is not None:
        return shape
    if strategy is None:
        raise SweepError("say what a run needs: a gpu.strategy or a RunShape")
    return shape_of(strategy)


def launcher_shares_machine(launcher_target: str | None) -> bool:
    """Whether the launcher starts several jobs at once on this machine."""
    return launcher_target == SUBMITIT_LOCAL


def default_parallel_runs(
    launcher_target: str | None,
    *,
    gpus: int,
    cpus: int,
    strategy: str | None = None,
    shape: RunShape | None = None,
) -> int | None:
    """How many runs the submitit local launcher starts at once (hydra.sweeper.max_batch_size);
    None for launchers that do not share this machine (batching would only make each batch wait
    for its slowest job). A run's needs: `shape`, or the one-rank shape of `strategy`.

    With G GPUs: G // k runs, each on its own k GPUs; on CPU: min(cores, MAX_DEFAULT_CPU_PARALLEL).
    """
    if not launcher_shares_machine(launcher_target):
        return None
    if gpus > 0:
        return max(1, gpus // _pick_shape(strategy, shape).gpus)
    return max(1, min(cpus, MAX_DEFAULT_CPU_PARALLEL))


@dataclass(frozen=True)
class Resources:
    """What one run of a sweep may use; the GPU tuples are empty on CPU."""

    slot: int
    parallel: int
    cores: int
    server_gpus: tuple[int, ...] = ()
    training_gpus: tuple[int, ...] = ()

    @property
    def server_gpu(self) -> int | None:
        """The (first) server GPU; None on CPU."""
        return self.server_gpus[0] if self.server_gpus else None

    @property
    def training_gpu(self) -> int | None:
        """Rank 0's GPU; None on CPU."""
        return self.training_gpus[0] if self.training_gpus else None


def assign_resources(
    job_num: int,
    parallel: int,
    *,
    gpus: int,
    cpus: int,
    strategy: str | None = None,
    shape: RunShape | None = None,
) -> Resources:
    """The share of this machine that job `job_num` gets when `parallel` runs share it; what the
    run needs is `shape` (see `run_shape`), or the one-rank shape of `strategy`.

    Raises SweepError when one run needs more GPUs than the machine has, or `parallel` runs more
    than it has, naming hydra.sweeper.max_batch_size (the knob that sets `parallel`).
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
    need = _pick_shape(strategy, shape)
    k = need.gpus
    if k > gpus:
        fix = "use gpu.strategy=single" if need.trainer == 1 else "use fewer train.processes"
        raise SweepError(
            f"{need.describe()} needs {k} GPUs per run, this machine has {gpus}: {fix}"
        )
    window = gpus // parallel
    if k > window:
        raise SweepError(
            f"{parallel} runs at once, each with {need.describe()}, need {parallel * k} GPUs, "
            f"this machine has {gpus}: set hydra.sweeper.max_batch_size={max(1, gpus // k)} "
            "or fewer"
        )
    first = slot * window
    server = tuple(range(first, first + need.server))
    trainer_first = first if need.shared else first + need.server
    return Resources(
        slot=slot,
        parallel=parallel,
        cores=cores,
        server_gpus=server,
        training_gpus=tuple(range(trainer_first, trainer_first + need.trainer)),
    )


# The config keys a sweep sets per run: each is left alone when the user set it, or set its
# side's other key (gpu.server_gpu and gpu.server_gpus name the same thing).
RESOURCE_KEYS = (
    "train.threads",
    "generation.server_threads",
    "gpu.server_gpu",
    "gpu.training_gpu",
    "gpu.server_gpus",
    "gpu.training_gpus",
)


def _side(key: str, ids: tuple[int, ...]) -> dict[str, Any]:
    """One side's GPUs as a config value: the scalar key for one GPU (as before the lists), the
    list key for several."""
    if not ids:
        return {}
    return {key: ids[0]} if len(ids) == 1 else {f"{key}s": list(ids)}


def resource_overrides(
    resources: Resources,
    explicit: set[str] | frozenset[str],
    *,
    pipelined: bool,
    servers: int = 1,
) -> dict[str, Any]:
    """Config values (dotted key -> an int, or a list of ints for a side of several GPUs) that put
    a run on its share, leaving alone every key the user set explicitly (`explicit`): an explicit
    choice always wins over the automatic one, and a side named by either of its keys is left
    whole. A run of a fleet of `servers` (`generation.servers`) splits its servers' threads
    between them (`generation.server_threads` is each server's)."""
    trainer_threads, server_threads = split_cores(resources.cores, pipelined=pipelined)
    values: dict[str, Any] = {
        "train.threads": trainer_threads,
        "generation.server_threads": max(1, server_threads // servers),
    }
    for key, ids in (
        ("gpu.server_gpu", resources.server_gpus),
        ("gpu.training_gpu", resources.training_gpus),
    ):
        if not {key, f"{key}s"} & explicit:
            values.update(_side(key, ids))
    return {k: v for k, v in values.items() if k not in explicit}


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
