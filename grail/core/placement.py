"""Where a run's parts execute: the cores each side gets, and which GPU each uses."""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from grail.core.choices import GpuStrategy
from grail.core.errors import ConfigError
from grail.core.reproducible import REPRODUCIBLE_THREADS


def visible_gpus() -> int:
    """GPUs this process can see (honours CUDA_VISIBLE_DEVICES)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0  # hidden on purpose; answers without importing torch
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def forks_its_servers(backend: str, urls: Sequence[str]) -> bool:
    """Whether a run's servers (`generation.backend`, `generation.urls`) are built-in CPU ones,
    which its zygote forks (grail/inference/zygote.py): on a machine with a GPU the trainer has
    touched the CUDA driver (device counting does), which a forked child cannot use, and vLLM
    and SGLang are other programs."""
    return backend == "builtin" and not urls and visible_gpus() == 0


def available_cores() -> int:
    """Cores this process may run on: its CPU affinity (what SLURM or taskset grant), which can
    be far fewer than `os.cpu_count()` (the whole node)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def split_cores(cores: int, *, pipelined: bool, server_scales: bool = False) -> tuple[int, int]:
    """(trainer, server) torch threads on CPU for a run that has `cores` cores to itself.

    Pipelined, where both compute at once, each side gets half (both on all cores was measured up
    to 15x slower: each side's OpenMP threads wait at barriers for a core the other side holds).
    In sync mode generation and training take turns, so the trainer gets all of them, and so does
    the server when its model is large enough for threads to pay (`server_scales`,
    `decode_scales`); a small model's server keeps half. Measured with the built-in engine's
    decode of 8 prompts x 8 samples x 32 tokens (docs/benchmarks.md, "CPU threads"): 2 threads
    instead of 1 took 0.85 s instead of 1.13 s with a hidden-384 6-layer model, 0.295 s instead
    of 0.316 s with hidden 192 and 4 layers, but 0.113 s instead of 0.093 s with the tiny one."""
    half = max(1, cores // 2)
    if pipelined:
        return half, half
    return cores, cores if server_scales else half


# Decode gains from a second thread from about this many transformer-body parameters on (see
# `split_cores`: 2.2M gained 7%, the tiny model's 0.12M lost 20%).
DECODE_SCALES_FROM_PARAMS = 1_000_000


def body_parameters(model_dir: str | os.PathLike[str]) -> int | None:
    """The transformer body's parameter count from a model directory's config.json (attention
    and MLP weights of every layer; embeddings and norms left out), or None where it does not
    say (no such file, another architecture's keys)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        intermediate = int(config.get("intermediate_size") or 4 * hidden)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    return layers * (attention + 3 * hidden * intermediate)


def decode_scales(model_dir: str | os.PathLike[str] | None) -> bool:
    """Whether the built-in server's decode of this model runs faster on more threads."""
    params = None if model_dir is None else body_parameters(model_dir)
    return params is not None and params >= DECODE_SCALES_FROM_PARAMS


def prefer_passive_openmp(env: MutableMapping[str, str]) -> None:
    """OMP_WAIT_POLICY=PASSIVE in `env` unless it says otherwise; it must be set before torch
    (its OpenMP runtime) loads, so for the trainer at the entrypoint and for the server in its
    environment. OpenMP threads otherwise spin at every barrier, waiting for a thread that lost
    its core: beside one busy process per core the default job's iteration went from 0.64 s to
    2.99 s (4.6x); passive, 0.49 s to 1.12 s (2.3x), idle no slower
    (`benchmarks/under_load.py --rounds 2`, 2 cores; docs/benchmarks.md)."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def gpu_placement(gpu: GpuConfig, servers: int = 1) -> tuple[int, int]:
    """(server, trainer) CUDA indices of a one-process trainer: the first GPU of each side of
    `gpu_layout`. Unset, `single` puts both on the other's GPU (GPU 0 when neither is set),
    `multi` gives them GPUs 0 and 1 (whichever the other does not have)."""
    layout = gpu_layout(gpu, servers=servers)
    return layout.server[0], layout.trainer[0]


def cpu_threads(
    trainer_threads: int | None,
    server_threads: int | None,
    *,
    pipelined: bool,
    reproducible: bool = False,
    model_dir: str | os.PathLike[str] | None = None,
) -> tuple[int, int]:
    """The run's (trainer, server) threads on CPU: `train.threads` and
    `generation.server_threads` where set, else `split_cores` of this process's cores, the
    server's share by its model (`decode_scales` of `model_dir`); with `reproducible`, else
    `REPRODUCIBLE_THREADS` each,
    whatever the machine has (reductions split by thread, so a count that follows the cores would
    make the numbers follow them too)."""
    if reproducible:
        trainer, server = REPRODUCIBLE_THREADS, REPRODUCIBLE_THREADS
    else:
        trainer, server = split_cores(
            available_cores(), pipelined=pipelined, server_scales=decode_scales(model_dir)
        )
    return trainer_threads or trainer, server_threads or server


@dataclass
class GpuConfig:
    """Which CUDA indices (as this process sees them) the server and the trainer use.

    One side is named by its scalar key (one GPU) or its list key (several: one per trainer
    process, `train.processes`), never both. Sides left unset are placed by the strategy:
    `single` shares the server's GPU with the trainer (rank 0's), `multi` gives each side GPUs of
    its own, the lowest the other side does not hold. With both sides named, the lists say it
    all: the server shares the trainer's GPUs when its GPUs are among them (what `single` means;
    `multi` refuses it), and has its own when the lists are apart (`gpu_layout`)."""

    strategy: GpuStrategy = (
        GpuStrategy.single
    )  # single: server and trainer share a device | multi: one GPU each
    # CUDA indices as this process sees them; None: see `gpu_layout` (0, or 0 and 1 for multi)
    server_gpu: int | None = None
    training_gpu: int | None = None
    # The same as lists, e.g. training_gpus=[1,2,3] server_gpus=[0]: one trainer rank per GPU
    server_gpus: list[int] | None = None
    training_gpus: list[int] | None = None


@dataclass(frozen=True)
class GpuLayout:
    """Where each side runs: `trainer[r]` is rank r's GPU, `server` the servers' GPUs."""

    server: tuple[int, ...]
    trainer: tuple[int, ...]

    @property
    def shared(self) -> bool:
        """Whether the server runs on the trainer's GPUs (`gpu.strategy=single`)."""
        return bool(set(self.server) & set(self.trainer))

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU the run uses, once each."""
        return tuple(sorted({*self.server, *self.trainer}))


def _show(ids: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def _named(gpu: GpuConfig, side: str) -> tuple[str, list[int]] | None:
    """(`key=value` as the user wrote it, GPUs) of one side (`server` or `training`), or None
    when neither its scalar nor its list key is set."""
    scalar_key, list_key = f"gpu.{side}_gpu", f"gpu.{side}_gpus"
    scalar, many = getattr(gpu, f"{side}_gpu"), getattr(gpu, f"{side}_gpus")
    if scalar is not None and many is not None:
        raise ConfigError(
            f"{scalar_key}={scalar} and {list_key}={_show(list(many))} both name the {side} "
            "GPUs: set one of them"
        )
    if scalar is not None:
        if scalar < 0:
            raise ConfigError(f"{scalar_key} must be >= 0 or null, got {scalar}")
        return f"{scalar_key}={scalar}", [int(scalar)]
    if many is None:
        return None
    ids = [int(i) for i in many]
    if not ids:
        raise ConfigError(f"{list_key}=[] names no GPU: name at least one, or leave it null")
    for i in ids:
        if i < 0:
            raise ConfigError(f"{list_key}={_show(ids)} holds {i}: GPU indices are >= 0")
        if ids.count(i) > 1:
            raise ConfigError(f"{list_key}={_show(ids)} names GPU {i} twice")
    return f"{list_key}={_show(ids)}", ids


def _lowest_free(taken: list[int] | tuple[int, ...], count: int) -> list[int]:
    """The `count` lowest indices not in `taken`."""
    free: list[int] = []
    i = 0
    while len(free) < count:
        if i not in taken:
            free.append(i)
        i += 1
    return free


def fleet_size(gpu: GpuConfig, servers: int) -> int:
    """How many inference servers a run starts: `generation.servers`, or, left at 1, one per
    GPU that `gpu.server_gpus` names (a list of server GPUs is a fleet)."""
    named = _named(gpu, "server")
    return len(named[1]) if servers == 1 and named is not None else servers


def gpu_layout(gpu: GpuConfig, processes: int | None = None, servers: int = 1) -> GpuLayout:
    """The run's GPUs by side, before any is checked against the machine (`trainer_devices`).

    `processes`: train.processes when the user set it, else None (then a named training list
    sets the count, else 1). `servers`: generation.servers; unnamed, a fleet's servers take a
    GPU each: `multi` the lowest ones, `single` the trainer's first ones (shared).

    Raises ConfigError, naming the key, for a list that is empty or names a GPU twice, a side
    named by both its keys, a training list whose length is not `processes`, and a server that
    shares some of the trainer's GPUs but not all of its own, or any with `gpu.strategy=multi`.
    Examples (strategy, set -> server, trainer):

        single, nothing, processes=2          -> (0,), (0, 1)
        multi, nothing, processes=3           -> (0,), (1, 2, 3)
        any, server_gpus=[0] training_gpus=[1,2,3] -> (0,), (1, 2, 3)
        single, training_gpus=[0,1]           -> (0,), (0, 1)   (rank 0 shares with the server)
        multi, nothing, servers=2, processes=2 -> (0, 1), (2, 3)
        single, nothing, servers=2, processes=2 -> (0, 1), (0, 1)
    """
    if servers < 1:
        raise ConfigError(f"generation.servers must be > 0, got {servers}")
    strategy = str(gpu.strategy)
    server = _named(gpu, "server")
    trainer = _named(gpu, "training")
    if processes is not None and processes < 1:
        raise ConfigError(f"train.processes must be >= 1, got {processes}")
    if trainer is not None and processes is not None and len(trainer[1]) != processes:
        raise ConfigError(
            f"{trainer[0]} names {len(trainer[1])} GPU(s) but train.processes={processes}: "
            "one training GPU per process"
        )
    n = processes if processes is not None else (len(trainer[1]) if trainer else 1)
    if server is not None and trainer is not None:
        s, t = server[1], trainer[1]
        both = sorted(set(s) & set(t))
        if both and strategy == "multi":
            raise ConfigError(
                f"gpu.strategy=multi needs {server[0]} apart from {trainer[0]} (GPU {both[0]} is "
                "in both); use gpu.strategy=single to share one GPU"
            )
        if both and not set(s) <= set(t):
            raise ConfigError(
                f"{server[0]} shares only some of its GPUs with {trainer[0]}: give the server "
                "GPUs of its own (lists apart) or only training GPUs (shared)"
            )
        return GpuLayout(tuple(s), tuple(t))
    if strategy == "single":
        if trainer is not None:
            return GpuLayout(tuple(trainer[1][: min(servers, n)]), tuple(trainer[1]))
        s = server[1] if server is not None else list(range(min(servers, n)))
        if len(s) > n:
            raise ConfigError(
                f"gpu.strategy=single shares the server's GPUs with the trainer's: "
                f"{server[0] if server else 'the server'} needs train.processes >= {len(s)}"
            )
        return GpuLayout(tuple(s), (*s, *_lowest_free(s, n - len(s))))
    if trainer is not None:
        return GpuLayout(tuple(_lowest_free(trainer[1], servers)), tuple(trainer[1]))
    s = server[1] if server is not None else list(range(servers))
    return GpuLayout(tuple(s), tuple(_lowest_free(s, n)))


def _check_visible(gpu: GpuConfig, layout: GpuLayout, processes: int | None, visible: int) -> None:
    """Refuse a layout that names a GPU this process cannot see, naming the key that put it
    there. With no GPU visible the run is on CPU: the strategy and the scalar keys are ignored,
    as they always were, but a list names GPUs on purpose, so it is refused."""
    for side, ids in (("server", layout.server), ("training", layout.trainer)):
        named = _named(gpu, side)
        if visible <= 0:
            if getattr(gpu, f"{side}_gpus") is not None and named is not None:
                raise ConfigError(
                    f"{named[0]} names GPUs, but this process sees none (no CUDA, or "
                    "CUDA_VISIBLE_DEVICES hides them): leave it null to run on CPU"
                )
            continue
        missing = [i for i in ids if i >= visible]
        if missing:
            why = (
                named[0]
                if named is not None
                else (f"gpu.strategy={gpu.strategy} with train.processes={processes or 1}")
            )
            raise ConfigError(
                f"{why} puts the {side} on GPU {missing[0]}, but this process sees {visible} "
                f"GPU(s), 0-{visible - 1} (CUDA_VISIBLE_DEVICES renumbers them from 0)"
            )


def trainer_processes(gpu: GpuConfig, processes: int | None) -> int:
    """How many trainer ranks a run has: `train.processes`, or unset one per GPU of
    `gpu.training_gpus`, else 1."""
    return len(gpu_layout(gpu, processes).trainer)


def trainer_ranks(gpu: GpuConfig, processes: int | None, nodes: int) -> int:
    """How many trainer ranks a run has over all its nodes (`train.nodes`, each running
    `trainer_processes`): more than 1 is a sharded run."""
    return nodes * trainer_processes(gpu, processes)


def trainer_devices(
    gpu: GpuConfig, processes: int | None, visible: int, servers: int = 1
) -> list[int]:
    """CUDA index of each trainer rank (rank r on element r), checked against the `visible` GPUs
    this process sees; [] on a CPU machine (visible 0), where the ranks run on CPU. Raises
    ConfigError naming the key (see `gpu_layout`) before anything starts."""
    layout = gpu_layout(gpu, processes, servers)
    _check_visible(gpu, layout, processes, visible)
    return list(layout.trainer) if visible > 0 else []


def server_devices(
    gpu: GpuConfig, processes: int | None, visible: int, servers: int = 1
) -> list[int]:
    """CUDA indices of the inference server(s), as `trainer_devices` checks them; [] on CPU."""
    layout = gpu_layout(gpu, processes, servers)
    _check_visible(gpu, layout, processes, visible)
    return list(layout.server) if visible > 0 else []
