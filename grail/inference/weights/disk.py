"""The disk route: `save_pretrained` into the directory the server serves, in the server's dtype
(bf16 when it serves bf16: the float32 master copy would double the bytes written and read),
then the backend's reload from that directory (`ServerManager.sync_weights`: in place, with a
restart as its own fallback, or a restart). Every backend takes it; it is the fallback of the
fast routes (syncer.py), and the only route of a LoRA adapter (a few MB) and of
`generation.weight_sync=restart`."""

from __future__ import annotations

import time
from dataclasses import replace

from grail.core.choices import WeightSyncMode
from grail.inference.process import ServerManager, SyncResult
from grail.inference.weights.policy import PolicyWeights, Weights, torch_dtype


class DiskRoute:
    """Weights to `server` through its directory: the model's (`model_path`), or under LoRA the
    adapter's alone (`lora_dir`). Built per server, as every route is."""

    name = "disk"

    def __init__(
        self, server: ServerManager, mode: WeightSyncMode = WeightSyncMode.in_place
    ) -> None:
        self.server = server
        self.mode = mode
        self.directory = server.lora_dir or server.model_path
        #: whether a sync writes the LoRA adapter rather than the whole model
        self.adapter = server.is_adapter_sync(self.directory)

    def send(self, weights: Weights, weight_version: str) -> SyncResult:
        """Write `weights` into the directory (a `PolicyWeights` in the server's dtype, any other
        writer as it writes) and have the server load them. Raises `WeightSyncError` when
        neither the reload nor its restart fallback worked."""
        t0 = time.perf_counter()
        if isinstance(weights, PolicyWeights):
            dtype = None if self.adapter else torch_dtype(self.server.served_dtype())
            weights.save(self.directory, dtype)
        else:
            weights(self.directory)
        result = self.server.sync_weights(self.directory, self.mode, weight_version=weight_version)
        return replace(result, seconds=time.perf_counter() - t0, transfer=self.name)

    def close(self) -> None:
        pass  # nothing held: the directory stays, the server's restarts load from it
