"""The built-in server's zero-copy weight update, ``POST /update_weights_from_tensor``.

Modelled on SGLang's route of the same name (``serialized_named_tensors``: base64 pickles of
tensors whose storage travels as a handle, never as data; ``load_format: flattened_bucket``: one
flat tensor per dtype with the entries that cut it): the trainer fills one buffer per dtype on
its device (grail/inference/weights/shared.py ``FlatWeights``) and sends handles to them, CUDA IPC
handles on a GPU, the path of the buffer's file in /dev/shm on CPU
(grail/inference/weights/shm_file.py). This server maps them and copies into its parameters,
between batches, exactly as the disk route:

- every bucket is unpickled and every tensor checked against the served model (names, shapes,
  each parameter covered) before anything is copied, so a refused update leaves the old weights
  serving (HTTP 400 naming the problem);
- the copy runs on the engine's worker once the running batch has drained (no batch mixes
  weights), and is complete (on CUDA, synchronized) before the answer, after which the trainer
  may overwrite its buffers;
- the pickles are read by an unpickler that resolves only the few globals a tensor handle needs
  (as SGLang's ``SafeUnpickler``), so a body cannot name any other callable; the API key gate
  (grail/core/http_api.py) is in front of it like every route;
- on CUDA the handle carries the trainer's device index as the trainer numbers its GPUs, while
  this server sees its GPU as cuda:0 (CUDA_VISIBLE_DEVICES): the index is replaced by ours, after
  checking that the trainer's GPU (``device_uuid``) is this server's.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import math
import pickle
from collections.abc import Callable
from typing import Any, Literal

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from grail.inference.builtin.weights import WeightUpdateError, check_tensors
from grail.inference.weights.shm_file import open_shared

ROUTE = "/update_weights_from_tensor"
_REDUCTIONS = "torch.multiprocessing.reductions"


class UpdateWeightsFromTensorRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    serialized_named_tensors: list[str] = Field(min_length=1, max_length=64)
    load_format: Literal["flattened_bucket"] = "flattened_bucket"
    weight_version: str | None = None
    #: the trainer's GPU (torch's device properties uuid); absent for CPU tensors
    device_uuid: str | None = None


class _HandleUnpickler(pickle.Unpickler):
    """Resolves only what a pickled tensor handle needs; a CUDA handle is rebuilt on
    `device_index` (this server's GPU) rather than the sender's index."""

    _ALLOWED = {
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch", "float32"),
        ("torch", "bfloat16"),
        ("torch", "float16"),
        ("torch", "int64"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        (_REDUCTIONS, "rebuild_tensor"),
        (_REDUCTIONS, "rebuild_typed_storage"),
    }

    def __init__(self, data: bytes, device_index: int | None) -> None:
        super().__init__(io.BytesIO(data))
        self.device_index = device_index

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (_REDUCTIONS, "rebuild_cuda_tensor"):
            if self.device_index is None:
                raise WeightUpdateError("a CUDA tensor handle sent to a server on CPU")
            return self._rebuild_cuda_tensor
        if (module, name) not in self._ALLOWED:
            raise WeightUpdateError(f"serialized_named_tensors names {module}.{name}: refused")
        return super().find_class(module, name)

    def _rebuild_cuda_tensor(self, *args: Any) -> torch.Tensor:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        parts = list(args)
        parts[6] = self.device_index  # storage_device: the sender's numbering, not ours
        return rebuild_cuda_tensor(*parts)


def decode_buckets(
    req: UpdateWeightsFromTensorRequest, device: torch.device
) -> dict[str, torch.Tensor]:
    """{name: tensor} viewing the trainer's buffers; raises `WeightUpdateError` on anything
    malformed (before any weight is touched)."""
    device_index = None
    if device.type == "cuda":
        device_index = device.index if device.index is not None else torch.cuda.current_device()
        ours = str(torch.cuda.get_device_properties(device_index).uuid)
        if req.device_uuid != ours:
            raise WeightUpdateError(
                f"the tensors are on GPU {req.device_uuid}, this server is on {ours}: the "
                "shared route needs the trainer and the server on one GPU"
            )
    tensors: dict[str, torch.Tensor] = {}
    for i, text in enumerate(req.serialized_named_tensors):
        try:
            data = base64.b64decode(text, validate=True)
            bucket = _HandleUnpickler(data, device_index).load()
        except WeightUpdateError:
            raise
        except (binascii.Error, ValueError) as exc:
            raise WeightUpdateError(f"serialized_named_tensors[{i}] is not base64: {exc}") from exc
        except Exception as exc:  # a truncated pickle, a segment that is gone, ...
            raise WeightUpdateError(
                f"cannot open serialized_named_tensors[{i}]: {type(exc).__name__}: {exc}"
            ) from exc
        tensors.update(_bucket_views(bucket, i, device))
    return tensors


def _bucket_views(bucket: Any, i: int, device: torch.device) -> dict[str, torch.Tensor]:
    where = f"serialized_named_tensors[{i}]"
    if isinstance(bucket, dict) and set(bucket) == {"file", "dtype", "numel", "entries"}:
        if device.type != "cpu":
            raise WeightUpdateError(f"{where}: a CPU buffer file for a {device} server")
        try:
            flat = open_shared(str(bucket["file"]), str(bucket["dtype"]), int(bucket["numel"]))
        except (OSError, ValueError, TypeError) as exc:
            raise WeightUpdateError(f"{where}: {exc}") from exc
    elif isinstance(bucket, dict) and set(bucket) == {"tensor", "entries"}:
        flat = bucket["tensor"]
    else:
        raise WeightUpdateError(
            f"{where} must hold {{'tensor', 'entries'}} or {{'file', 'dtype', 'numel', 'entries'}}"
        )
    entries = bucket["entries"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1:
        raise WeightUpdateError(f"{where}: 'tensor' must be a flat tensor")
    if flat.device.type != device.type:
        raise WeightUpdateError(f"{where}: a {flat.device.type} tensor for a {device} server")
    if not isinstance(entries, list):
        raise WeightUpdateError(f"{where}: 'entries' must be a list")
    views = {}
    for entry in entries:
        try:
            name, shape, offset, numel = entry
            shape = tuple(int(s) for s in shape)
            offset, numel = int(offset), int(numel)
            if offset < 0 or offset + numel > flat.numel() or numel != math.prod(shape):
                raise ValueError(f"[{offset}, {offset + numel}) of {flat.numel()}")
            if not isinstance(name, str) or name in views:
                raise ValueError("a name must be a string, and there once")
        except (TypeError, ValueError) as exc:
            raise WeightUpdateError(f"{where}: bad entry {entry!r}: {exc}") from exc
        views[name] = flat[offset : offset + numel].view(shape)
    return views


def add_tensor_route(
    app: FastAPI,
    engine: Any,
    log: Callable[[str], None],
) -> None:
    """Register ``POST /update_weights_from_tensor`` on `app` for `engine` (an `Engine`)."""
    from grail.inference.builtin.engine import EngineStopped

    @app.post(ROUTE)
    async def update_weights_from_tensor(req: UpdateWeightsFromTensorRequest) -> JSONResponse:
        def apply() -> str:
            tensors = decode_buckets(req, engine.device)
            check_tensors(tensors, engine.model, "the trainer's tensors")
            return engine.copy_weights(tensors, req.weight_version, "shared tensors")

        try:
            message = await asyncio.to_thread(apply)
        except WeightUpdateError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        except EngineStopped as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=503)
        log(message)
        return JSONResponse({"success": True, "message": message})
