"""The shared route, and the flat buffers both fast routes send from.

shared (the built-in server on the trainer's device): the weights are copied, in the server's
dtype, into one flat buffer per dtype on the trainer's device (`FlatWeights`), which the server
opens through CUDA IPC handles (`torch.multiprocessing.reductions`) on a GPU, or by the name of
its file in /dev/shm on CPU (shm_file.py), and copies from, between batches (`POST
/update_weights_from_tensor`, grail/inference/builtin/tensor_update.py). On CPU its metrics are
bitwise those of the disk route, float32 in both.

A fast route (this one, or nccl.py's) leaves the server's directory older than what it serves;
until the next sync its `FlatWeights` hold exactly the served weights, which the syncer has it
write there before a restart (`StagedRoute.write_served`).
"""

from __future__ import annotations

import base64
import contextlib
import io
import math
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import save_file

from grail.core.choices import WeightSyncMode
from grail.core.disk import writing
from grail.core.records import follow_umask
from grail.inference.process import SyncResult
from grail.inference.weights.policy import PolicyWeights, torch_dtype
from grail.inference.weights.shm_file import SharedFile, remove_stale


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

    On CPU the buffers are files in /dev/shm that the server maps by name (shm_file.py: no
    helper process, unlike torch's "file_system" strategy), unlinked by `close`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.entries: dict[torch.dtype, list[Entry]] = {}
        self._files: dict[torch.dtype, SharedFile] = {}
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
        self.close()
        self.entries = {}
        for name, dtype, shape in layout:
            entries = self.entries.setdefault(dtype, [])
            offset = entries[-1].offset + entries[-1].numel if entries else 0
            entries.append(Entry(name, shape, offset, math.prod(shape)))
        if self.device.type == "cpu":
            remove_stale()  # the files of trainers killed before they could unlink theirs
        for dtype, entries in self.entries.items():
            total = entries[-1].offset + entries[-1].numel
            if self.device.type == "cpu":
                self._files[dtype] = SharedFile(total, dtype)
                self.buffers[dtype] = self._files[dtype].tensor
            else:
                self.buffers[dtype] = torch.empty(total, dtype=dtype, device=self.device)
        self._layout = layout

    def close(self) -> None:
        """Drop the buffers and unlink their files (CPU); `fill` makes new ones."""
        for file in self._files.values():
            file.close()
        self._files.clear()
        self.buffers.clear()
        self._layout = None

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
        """One base64 string per buffer: a pickle of {"tensor": buffer, "entries": [[name,
        shape, offset, numel]...]} on a GPU (torch's `ForkingPickler` reductions: the tensor
        pickles as a CUDA IPC handle, never as its data), or of {"file": path, "dtype": name,
        "numel": n, "entries": ...} on CPU (plain values: the buffer's file, shm_file.py). The
        server unpickles it with an allow-list (grail/inference/builtin/tensor_update.py)."""
        from multiprocessing.reduction import ForkingPickler

        import torch.multiprocessing  # noqa: F401 - registers the tensor reductions

        out = []
        for dtype, buffer in self.buffers.items():
            entries = [[e.name, list(e.shape), e.offset, e.numel] for e in self.entries[dtype]]
            bucket: dict[str, Any]
            if dtype in self._files:
                file = self._files[dtype]
                name = str(dtype).removeprefix("torch.")
                bucket = {"file": str(file.path), "dtype": name, "numel": file.numel}
            else:
                bucket = {"tensor": buffer}
            stream = io.BytesIO()
            ForkingPickler(stream).dump({**bucket, "entries": entries})
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
        try:
            with writing(directory):
                save_file(tensors, str(tmp), metadata={"format": "pt"})
            follow_umask(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)  # a full disk: the old weights stay, whole
            raise
        # Written in full before the old files go: a crash in between leaves weights to load.
        for old in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        os.replace(tmp, directory / "model.safetensors")


def tensor_payload(flat: FlatWeights, weight_version: str) -> dict[str, Any]:
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


class StagingServer(Protocol):
    """What a fast route needs of every server it sends to."""

    def served_dtype(self) -> str | None: ...


class StagedRoute(ABC):
    """What the fast routes share: the trainer's weights staged in `FlatWeights` (made once per
    device, refilled at each sync) before they go to `server`, and written from there into the
    server's directory before a restart (`write_served`)."""

    name = ""

    def __init__(self, server: StagingServer) -> None:
        self.server = server
        self._flat: FlatWeights | None = None

    def stage(self, weights: PolicyWeights) -> FlatWeights:
        """`weights` copied into the buffers, in the server's dtype (or the master's when the
        server picks its own)."""
        dtype = torch_dtype(self.server.served_dtype()) or weights.master_dtype
        if self._flat is None or self._flat.device != weights.device:
            self._flat = FlatWeights(weights.device)
        self._flat.fill(weights.named_tensors(), dtype)
        return self._flat

    def send(self, weights: PolicyWeights, weight_version: str) -> SyncResult:
        """Stage `weights` and push them to the server (`push`, each route's own); seconds of
        both."""
        t0 = time.perf_counter()
        self.push(self.stage(weights), weight_version)
        return SyncResult(
            time.perf_counter() - t0, WeightSyncMode.in_place, fell_back=False, transfer=self.name
        )

    @abstractmethod
    def push(self, flat: FlatWeights, weight_version: str) -> None:
        """Hand the staged buffers to the server (the route's own request or broadcast)."""

    def write_served(self, directory: Path) -> None:
        """Write the weights last sent (what the server serves) into `directory`."""
        assert self._flat is not None, "nothing was sent"
        self._flat.write_dir(directory)

    def close(self) -> None:
        if self._flat is not None:
            self._flat.close()
        self._flat = None


class TensorServer(StagingServer, Protocol):
    """A server that takes handles to the trainer's tensors (`BuiltinServer`)."""

    def update_weights_from_tensor(self, body: dict[str, Any]) -> float: ...


class SharedRoute(StagedRoute):
    """Handles to the staged buffers, POSTed to a server on the trainer's device."""

    name = "shared"

    def __init__(self, server: TensorServer) -> None:
        super().__init__(server)
        self.server: TensorServer = server

    def push(self, flat: FlatWeights, weight_version: str) -> None:
        self.server.update_weights_from_tensor(tensor_payload(flat, weight_version))
