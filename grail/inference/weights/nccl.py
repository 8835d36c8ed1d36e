"""The nccl route (vLLM or SGLang on its own GPU, `gpu.strategy=multi`): the trainer's weights,
staged in `FlatWeights` as for the shared route, are broadcast tensor by tensor from the trainer
(rank 0) to the server's workers.

Only the staging is here. The group and the broadcasts (grail/inference/backends/nccl.py) and
the HTTP sequence around them (`update_weights_nccl` in backends/vllm.py and backends/sglang.py)
stay with the backends: each is one server's own protocol (vLLM's pause / start / update /
finish / reset / resume, SGLang's begin / update / end), built on that backend's control helpers
and tied to its process (a restarted server has left the group, which `stop()` closes).
"""

from __future__ import annotations

import contextlib
from typing import Protocol

from grail.inference.weights.shared import FlatWeights, StagedRoute, StagingServer


class NcclServer(StagingServer, Protocol):
    """A server its workers receive NCCL broadcasts for (`GpuServer`: vLLM, SGLang)."""

    def update_weights_nccl(self, flat: FlatWeights, weight_version: str) -> float: ...

    def close_weight_transfer(self) -> None: ...


class NcclRoute(StagedRoute):
    """The staged buffers broadcast to the server's workers (its `update_weights_nccl`)."""

    name = "nccl"

    def __init__(self, server: NcclServer) -> None:
        super().__init__(server)
        self.server: NcclServer = server

    def push(self, flat: FlatWeights, weight_version: str) -> None:
        self.server.update_weights_nccl(flat, weight_version)

    def close(self) -> None:
        """Leave the NCCL group (this side) and drop the buffers."""
        with contextlib.suppress(Exception):
            self.server.close_weight_transfer()
        super().close()
