"""Weight transfer: how a sync hands the inference server the trainer's new weights.

Three routes (`generation.weight_transfer`; docs/gpu.md "Weight transfer", docs/protocols.md):

- disk: `save_pretrained` into the directory the server serves, in the server's dtype (bf16
  when it serves bf16: the float32 master copy would double the bytes written and read), then
  the backend's in-place reload from disk (`ServerManager.sync_weights`);
- shared (built-in server on the trainer's device): the weights are copied, in the server's
  dtype, into one flat buffer per dtype on the trainer's device (`FlatWeights`), which the server
  opens through `torch.multiprocessing.reductions` handles (CUDA IPC on a GPU, the "file_system"
  shared-memory strategy on CPU) and copies from, between batches;
- nccl (vLLM or SGLang on its own GPU, `gpu.strategy=multi`): the same flat buffer is broadcast
  tensor by tensor from the trainer (rank 0) to the server's workers (grail/inference/backends/
  nccl.py).

`auto` picks shared for the built-in server on the trainer's device (the CPU default job
included: its metrics are bitwise those of the disk route, float32 in both), nccl for vLLM or
SGLang with `gpu.strategy=multi`, else disk. A LoRA adapter always syncs from disk (it is a few
MB), as does `generation.weight_sync=restart`.

Disk is the fallback of every fast route: any failure (a refusal, a timeout, a server that
died) is logged with its reason and counted (`SyncResult.transfer_fallbacks`, the iteration
record's `weight_sync`), and the sync goes on from disk. After `MAX_FAILURES_IN_A_ROW` failures in
a row the run stops trying the fast route.

A fast route leaves the server's directory older than what it serves, so a restart (recovery
from a crash, or the disk route's own restart fallback) would bring back old weights: the
transfer registers `ServerManager.write_weights`, which `restart()` calls first, to write the
weights last sent (kept in `FlatWeights` until the next sync) into that directory.
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from grail.inference.process import ServerManager, SyncResult, WeightSyncError

if TYPE_CHECKING:
    from grail.core.config import Config

logger = logging.getLogger(__name__)

#: failures of a fast route in a row after which a run syncs from disk only
MAX_FAILURES_IN_A_ROW = 3
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_route(
    requested: str,
    *,
    backend: str,
    strategy: str,
    same_device: bool,
    lora: bool,
    weight_sync: str,
) -> tuple[str, str]:
    """The route a run uses for `generation.weight_transfer=requested`, and why (for the log).
    An explicit route the config validation let through is kept; `auto` picks what is
    possible (module docstring)."""
    if requested != "auto":
        return requested, f"generation.weight_transfer={requested}"
    if lora:
        return "disk", "auto: a LoRA adapter syncs from disk"
    if weight_sync != "in_place":
        return "disk", f"auto: generation.weight_sync={weight_sync} loads from disk"
    if backend == "builtin":
        if same_device:
            return "shared", "auto: the built-in server shares the trainer's device"
        return "disk", "auto: the built-in server is on another device than the trainer"
    if strategy == "multi":
        return "nccl", f"auto: {backend} has its own GPU (gpu.strategy=multi)"
    return "disk", f"auto: {backend} shares the trainer's GPU, which NCCL cannot connect"


def route_from_config(cfg: Config, cuda_available: bool) -> tuple[str, str]:
    """`resolve_route` for a run: the server is on the trainer's device when both are on CPU,
    or on one CUDA index (`gpu.strategy=single`, `gpu_placement`)."""
    from grail.core.placement import gpu_placement

    server_gpu, trainer_gpu = gpu_placement(cfg.gpu)
    return resolve_route(
        cfg.generation.weight_transfer,
        backend=cfg.generation.backend,
        strategy=cfg.gpu.strategy,
        same_device=not cuda_available or server_gpu == trainer_gpu,
        lora=cfg.model.lora.enabled,
        weight_sync=cfg.generation.weight_sync,
    )


class PolicyWeights:
    """The trainer's weights as a sync sends them. Callable as `save(directory)` (the master
    dtype), so a rollout source that only writes a directory can take it as its `save`."""

    def __init__(self, model: torch.nn.Module, *, lora: bool = False) -> None:
        self.model = model
        self.lora = lora

    def __call__(self, directory: Path) -> None:
        self.save(directory)

    def save(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        """`save_pretrained` into `directory`: the whole model in `dtype` (None: as trained), or
        under LoRA the adapter alone (peft's format, as trained)."""
        if self.lora or dtype is None or dtype == self.master_dtype:
            self.model.save_pretrained(directory, safe_serialization=True)
        else:
            self.model.save_pretrained(
                directory, safe_serialization=True, state_dict=self.state_dict(dtype)
            )

    @property
    def master_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def state_dict(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The state dict with floating tensors in `dtype`; tensors that share storage (tied
        embeddings) stay shared, so `save_pretrained` drops the same duplicates it always does."""
        converted: dict[tuple[int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        out = {}
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in converted:
                target = dtype if tensor.is_floating_point() else tensor.dtype
                converted[key] = tensor.detach().to(target)
            out[name] = converted[key]
        return out

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor of the state dict once (one name per storage: a tied lm_head is the
        embedding), in state-dict order, detached, in the master dtype."""
        seen: set[tuple[int, torch.dtype, tuple[int, ...]]] = set()
        out = []
        for name, tensor in self.model.state_dict().items():
            key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                out.append((name, tensor.detach()))
        return out


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in its flat buffer."""

    name: str
    shape: tuple[int, ...]
    offset: int  # in elements
    numel: int


class FlatWeights:
    """The weights in the server's dtype, one flat buffer per dtype on the trainer's device,
    made once and refilled at each sync. The shared route hands the server handles to these
    buffers, the nccl route broadcasts their views; until the next sync they hold exactly the
    weights the server serves (what a restart must write to disk first: `write_dir`).

    On CPU the buffers live in shared memory (torch's "file_system" strategy: a named segment
    another process maps by name; the default "file_descriptor" strategy passes descriptors
    over a socket between related processes only)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.entries: dict[torch.dtype, list[Entry]] = {}
        self._layout: list[tuple[str, torch.dtype, tuple[int, ...]]] | None = None

    def fill(self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype) -> None:
        """Copy `named` into the buffers, floating tensors converted to `dtype`. The buffers
        are made (again) only when the names, dtypes or shapes change."""
        layout = [
            (name, dtype if t.is_floating_point() else t.dtype, tuple(t.shape)) for name, t in named
        ]
        if layout != self._layout:
            self._allocate(layout)
        with torch.no_grad():
            for (_, tensor), view in zip(named, self.views(), strict=True):
                view[1].copy_(tensor.reshape(view[1].shape))
        if self.device.type == "cuda":
            # The server reads after our answer-less handle exchange: the copies must be done.
            torch.cuda.current_stream(self.device).synchronize()

    def _allocate(self, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.buffers.clear()
        self.entries = {}
        for name, dtype, shape in layout:
            entries = self.entries.setdefault(dtype, [])
            offset = entries[-1].offset + entries[-1].numel if entries else 0
            entries.append(Entry(name, shape, offset, math.prod(shape)))
        for dtype, entries in self.entries.items():
            total = entries[-1].offset + entries[-1].numel
            buffer = torch.empty(total, dtype=dtype, device=self.device)
            if self.device.type == "cpu":
                with sharing_strategy("file_system"):
                    buffer.share_memory_()
            self.buffers[dtype] = buffer
        self._layout = layout

    def views(self) -> Iterator[tuple[Entry, torch.Tensor]]:
        """(entry, view of its buffer) for every tensor, in the order `fill` was given them."""
        assert self._layout is not None, "fill() first"
        cursors = dict.fromkeys(self.entries, 0)
        for _name, dtype, _shape in self._layout:
            entry = self.entries[dtype][cursors[dtype]]
            cursors[dtype] += 1
            flat = self.buffers[dtype][entry.offset : entry.offset + entry.numel]
            yield entry, flat.view(entry.shape)

    def named_views(self) -> list[tuple[str, torch.Tensor]]:
        return [(entry.name, view) for entry, view in self.views()]

    def serialized(self) -> list[str]:
        """One base64 string per buffer: a pickle (torch's `ForkingPickler` reductions:
        `reduce_tensor`) of {"tensor": buffer, "entries": [[name, shape, offset, numel]...]}.
        The tensor pickles as a handle (CUDA IPC, or a shared-memory segment's name), never as
        its data. The server unpickles it with an allow-list (grail/inference/builtin/
        tensor_update.py)."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

        out = []
        with sharing_strategy("file_system"):
            for dtype, buffer in self.buffers.items():
                entries = [[e.name, list(e.shape), e.offset, e.numel] for e in self.entries[dtype]]
                stream = io.BytesIO()
                ForkingPickler(stream).dump({"tensor": buffer, "entries": entries})
                out.append(base64.b64encode(stream.getvalue()).decode("ascii"))
        return out

    def device_uuid(self) -> str | None:
        """The trainer GPU's UUID (the server checks it is its own), None on CPU."""
        if self.device.type != "cuda":
            return None
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def write_dir(self, directory: Path) -> None:
        """Write the buffers' weights as `directory`/model.safetensors, replacing the weights
        there (shards and their index included); config and tokenizer files stay."""
        tensors = {name: view.detach().to("cpu").clone() for name, view in self.named_views()}
        tmp = directory / "model.safetensors.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        # Written in full before the old files go: a crash in between leaves weights to load.
        for old in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        os.replace(tmp, directory / "model.safetensors")


@contextlib.contextmanager
def sharing_strategy(strategy: str) -> Iterator[None]:
    """torch.multiprocessing's sharing strategy set to `strategy` for the block (it is process
    wide; the trainer's other uses keep the default)."""
    import torch.multiprocessing as mp

    previous = mp.get_sharing_strategy()
    mp.set_sharing_strategy(strategy)
    try:
        yield
    finally:
        mp.set_sharing_strategy(previous)


class WeightTransfer:
    """Syncs through the run's route, falling back to disk (module docstring). One per server;
    drive it from one thread (the trainer's)."""

    def __init__(self, server: ServerManager, route: str, why: str = "") -> None:
        if route not in ("disk", "shared", "nccl"):
            raise ValueError(f"weight transfer route must be disk, shared or nccl, got {route!r}")
        self.server = server
        self.route = route
        self.fallbacks = 0  # fast-route failures so far (each fell back to disk)
        self._in_a_row = 0
        self._flat: FlatWeights | None = None
        if route != "disk":
            logger.info("weight transfer: %s (%s), disk as the fallback", route, why or route)

    @property
    def active_route(self) -> str:
        """The route the next full-model sync tries first."""
        return "disk" if self._in_a_row >= MAX_FAILURES_IN_A_ROW else self.route

    def served_dtype(self) -> torch.dtype | None:
        name = self.server.served_dtype()
        return None if name is None else DTYPES[name]

    def sync(
        self,
        weights: PolicyWeights | Callable[[Path], None],
        directory: Path,
        mode: str,
        weight_version: str,
    ) -> SyncResult:
        """Give the server `weights`: through the fast route when there is one, else (or when
        it fails) written to `directory` and reloaded by `ServerManager.sync_weights`."""
        adapter = self.server.is_adapter_sync(directory)
        route = self.active_route
        reason = None
        t0 = time.perf_counter()
        fast = isinstance(weights, PolicyWeights) and not adapter and mode == "in_place"
        if fast and route != "disk":
            assert isinstance(weights, PolicyWeights)
            try:
                self._fast(route, weights, weight_version)
            except Exception as exc:  # any failure: the disk route still works
                reason = f"{type(exc).__name__}: {exc}"
                self._failed(route, reason)
            else:
                self._in_a_row = 0
                # The directory is now older than the served weights: a restart writes them.
                self.server.write_weights = self._write_served
                return SyncResult(
                    time.perf_counter() - t0,
                    "in_place",
                    fell_back=False,
                    transfer=route,
                    transfer_fallbacks=self.fallbacks,
                )
        if isinstance(weights, PolicyWeights):
            weights.save(directory, None if adapter else self.served_dtype())
        else:
            weights(directory)
        if not adapter:
            self.server.write_weights = None  # the directory holds the newest weights again
        result = self.server.sync_weights(directory, mode, weight_version=weight_version)  # type: ignore[arg-type]
        return replace(
            result,
            seconds=time.perf_counter() - t0,
            transfer="disk",
            transfer_fallback_reason=reason,
            transfer_fallbacks=self.fallbacks,
        )

    def _failed(self, route: str, reason: str) -> None:
        self.fallbacks += 1
        self._in_a_row += 1
        logger.warning(
            "%s weight transfer failed, syncing from disk instead (%d in a row): %s",
            route,
            self._in_a_row,
            reason,
        )
        if self._in_a_row == MAX_FAILURES_IN_A_ROW:
            logger.warning(
                "%s weight transfer failed %d times in a row: this run syncs from disk from now on",
                route,
                MAX_FAILURES_IN_A_ROW,
            )

    def _fast(self, route: str, weights: PolicyWeights, weight_version: str) -> None:
        dtype = self.served_dtype() or weights.master_dtype
        device = next(weights.model.parameters()).device
        if self._flat is None or self._flat.device != device:
            self._flat = FlatWeights(device)
        self._flat.fill(weights.named_tensors(), dtype)
        if route == "shared":
            update = getattr(self.server, "update_weights_from_tensor", None)
            if update is None:
                raise WeightSyncError(f"the {self.server.kind} server has no shared-memory route")
            update(self._flat, weight_version)
        else:
            update = getattr(self.server, "update_weights_nccl", None)
            if update is None:
                raise WeightSyncError(f"the {self.server.kind} server has no NCCL route")
            update(self._flat, weight_version)

    def _write_served(self) -> None:
        assert self._flat is not None
        directory = self.server.model_path
        logger.info("writing the served weights to %s before the server restarts", directory)
        self._flat.write_dir(directory)

    def close(self) -> None:
        """Drop the buffers and the server's NCCL group (if any)."""
        close = getattr(self.server, "close_weight_transfer", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()
        self._flat = None


def payload_for(flat: FlatWeights, weight_version: str) -> dict[str, Any]:
    """The JSON body of the built-in server's POST /update_weights_from_tensor."""
    body: dict[str, Any] = {
        "serialized_named_tensors": flat.serialized(),
        "load_format": "flattened_bucket",
        "weight_version": weight_version,
    }
    uuid = flat.device_uuid()
    if uuid is not None:
        body["device_uuid"] = uuid
    return body
