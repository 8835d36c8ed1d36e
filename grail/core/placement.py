"""Where a run's parts execute: the cores each side gets, and which GPU each uses."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from grail.core.choices import GpuStrategy
from grail.core.reproducible import REPRODUCIBLE_THREADS


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity (what SLURM or taskset grant), which can
    be far fewer than `os.cpu_count()` (the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def split_cores(cores: int, *, pipelined: bool) -> tuple[int, int]:
    """(trainer, server) torch threads on CPU for a run that has `cores` cores to itself.

    The trainer gets all of them in sync mode, where generation and training take turns, and half
    in pipelined mode, where both compute at once (both on all cores was measured up to 15x
    slower: each side's OpenMP threads wait at barriers for a core the other side holds). The
    server gets half either way, because while it generates its HTTP thread and the trainer's
    client are busy too. Measured on 2 cores with `benchmarks/under_load.py --hogs 0` (sync mode,
    OMP_WAIT_POLICY=PASSIVE, median iteration): 2 server threads instead of 1 took 0.86 s
    instead of 0.52 s with the tiny model and 5.28 s instead of 5.08 s with a 6-layer
    hidden-384 one (`model.train_id=` a `build_random_qwen2` directory)."""
    half = max(1, cores // 2)
    return (half if pipelined else cores), half


def prefer_passive_openmp(env: MutableMapping[str, str]) -> None:
    """OMP_WAIT_POLICY=PASSIVE in `env` unless it says otherwise; it must be set before torch
    (its OpenMP runtime) loads, so for the trainer at the entrypoint and for the server in its
    environment. OpenMP threads otherwise spin at every barrier, waiting for a thread that lost
    its core: beside one busy process per core the default job's iteration went from 0.64 s to
    2.99 s (4.6x); passive, 0.49 s to 1.12 s (2.3x), idle no slower
    (`benchmarks/under_load.py --rounds 2`, 2 cores; docs/benchmarks.md)."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def gpu_placement(gpu: GpuConfig) -> tuple[int, int]:
    """(server, trainer) CUDA indices: `gpu.server_gpu` and `gpu.training_gpu` where set. Unset,
    `single` puts both on the other's GPU (GPU 0 when neither is set), `multi` gives them GPUs 0
    and 1 (whichever the other does not have)."""
    server, trainer = gpu.server_gpu, gpu.training_gpu
    if gpu.strategy == "single":
        shared = next((g for g in (server, trainer) if g is not None), 0)
        return (shared if server is None else server), (shared if trainer is None else trainer)
    if server is None:
        server = 1 if trainer == 0 else 0
    return server, (1 if server == 0 else 0) if trainer is None else trainer


def cpu_threads(
    trainer_threads: int | None,
    server_threads: int | None,
    *,
    pipelined: bool,
    reproducible: bool = False,
) -> tuple[int, int]:
    """The run's (trainer, server) threads on CPU: `train.threads` and
    `generation.server_threads` where set, else `split_cores` of this process's cores; with
    `reproducible`, else `REPRODUCIBLE_THREADS` each, whatever the machine has (reductions split
    by thread, so a count that follows the cores would make the numbers follow them too)."""
    if reproducible:
        trainer, server = REPRODUCIBLE_THREADS, REPRODUCIBLE_THREADS
    else:
        trainer, server = split_cores(available_cores(), pipelined=pipelined)
    return trainer_threads or trainer, server_threads or server


@dataclass
class GpuConfig:
    strategy: GpuStrategy = (
        GpuStrategy.single
    )  # single: server and trainer share a device | multi: one GPU each
    # CUDA indices as this process sees them; None: see `gpu_placement` (0, or 0 and 1 for multi)
    server_gpu: int | None = None
    training_gpu: int | None = None
