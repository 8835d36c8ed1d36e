"""What a weight route is, which one a run takes, and how one is built for a server.

One `WeightRoute` per way of moving the trainer's weights into a server
(`generation.weight_transfer`; docs/gpu.md "Weight transfer", docs/protocols.md):

- disk (disk.py): `save_pretrained` into the server's directory, in its dtype, then its reload;
- shared (shared.py, the built-in server on the trainer's device): handles to one flat buffer
  per dtype (CUDA IPC on a GPU, shared memory on CPU);
- nccl (nccl.py, vLLM or SGLang on its own GPU): the same buffers broadcast over NCCL.

Each backend class says which it takes (`ServerManager.weight_routes`). `auto` picks shared for
the built-in server on the trainer's device (the CPU default job included: its metrics are
bitwise those of the disk route, float32 in both), nccl for vLLM or SGLang with
`gpu.strategy=multi`, else disk. A LoRA adapter always syncs from disk (it is a few MB), as does
`generation.weight_sync=restart`. The fallback to disk and the write before a restart are the
syncer's (syncer.py).

A route is built per server (`make_fast_route(name, server)`, `DiskRoute(server, mode)`) and
holds nothing another server's route needs, so a fleet builds one set per server.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, cast

from grail.inference.process import ServerManager, SyncResult
from grail.inference.weights.nccl import NcclRoute, NcclServer
from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.shared import SharedRoute, TensorServer


class WeightRoute(Protocol):
    """One way of moving the trainer's weights into one server."""

    #: "disk", "shared" or "nccl": the iteration record's `weight_sync.transfer`
    name: str

    def send(self, weights: PolicyWeights, weight_version: str) -> SyncResult:
        """Give the server `weights`, labelled `weight_version`; what it did (seconds, the route,
        the disk route's restart fallback). Raises on any failure."""
        ...

    def close(self) -> None:
        """Let go of what the route holds (buffers, an NCCL group)."""
        ...


class FastRoute(WeightRoute, Protocol):
    """A route that leaves the server's directory older than what it serves."""

    def write_served(self, directory: Path) -> None:
        """Write the weights last sent into `directory` (before the server restarts from it)."""
        ...


@dataclass(frozen=True)
class RouteChoice:
    """The route a run takes, and why (for the log)."""

    name: str
    why: str


def resolve_route(
    requested: str,
    supported: tuple[str, ...],
    *,
    backend: str,
    strategy: str,
    same_device: bool,
    lora: bool,
    weight_sync: str,
) -> RouteChoice:
    """The route a run uses for `generation.weight_transfer=requested` with a backend that takes
    the routes `supported`. An explicit route the config validation let through is kept (one
    the backend does not take is a `ValueError`); `auto` picks what is possible (module
    docstring)."""
    if requested != "auto":
        if requested not in supported:
            raise ValueError(
                f"the {backend} server takes weight_transfer {' or '.join(map(repr, supported))}, "
                f"got {requested!r}"
            )
        return RouteChoice(requested, f"generation.weight_transfer={requested}")
    if lora:
        return RouteChoice("disk", "auto: a LoRA adapter syncs from disk")
    if weight_sync != "in_place":
        return RouteChoice("disk", f"auto: generation.weight_sync={weight_sync} loads from disk")
    if "shared" in supported:
        if same_device:
            return RouteChoice("shared", "auto: the built-in server shares the trainer's device")
        return RouteChoice(
            "disk", "auto: the built-in server is on another device than the trainer"
        )
    if "nccl" in supported:
        if strategy == "multi":
            return RouteChoice("nccl", f"auto: {backend} has its own GPU (gpu.strategy=multi)")
        return RouteChoice(
            "disk", f"auto: {backend} shares the trainer's GPU, which NCCL cannot connect"
        )
    return RouteChoice("disk", f"auto: {backend} syncs from disk only")


def make_fast_route(name: str, server: ServerManager) -> FastRoute:
    """The `name` route ("shared" or "nccl") to `server`, which must take it
    (`weight_routes`: the backend's methods the route calls are then there)."""
    if name not in server.weight_routes:
        raise ValueError(
            f"the {server.kind} server takes weight_transfer "
            f"{' or '.join(map(repr, server.weight_routes))}, got {name!r}"
        )
    if name == "shared":
        return SharedRoute(cast(TensorServer, server))
    if name == "nccl":
        return NcclRoute(cast(NcclServer, server))
    raise ValueError(f"{name!r} is not a fast weight route (shared or nccl)")
