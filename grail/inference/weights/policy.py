"""The trainer's weights as a weight sync sends them (`PolicyWeights`), whatever the route, and
the dtype the server computes in, which every route converts them to."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from grail.core.disk import writing
from grail.core.records import follow_umask

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class PretrainedModel(Protocol):
    """What a sync needs of the trained model: a transformers model, or a peft one under LoRA."""

    def save_pretrained(self, save_directory: Path, **kwargs: Any) -> None: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


class PolicyWeights:
    """The trainer's weights as a sync sends them. Callable as `save(directory)` (the master
    dtype), so a rollout source that only writes a directory can take it as its `save`."""

    def __init__(self, model: PretrainedModel, *, lora: bool = False) -> None:
        self.model = model
        self.lora = lora

    def __call__(self, directory: Path) -> None:
        self.save(directory)

    def save(self, directory: Path, dtype: torch.dtype | None = None) -> None:
        """`save_pretrained` into `directory`: the whole model in `dtype` (None: as trained), or
        under LoRA the adapter alone (peft's format, as trained)."""
        with writing(directory):  # a full disk: a DiskFullError naming the directory
            if self.lora or dtype is None or dtype == self.master_dtype:
                self.model.save_pretrained(directory, safe_serialization=True)
            else:
                self.model.save_pretrained(
                    directory, safe_serialization=True, state_dict=self.state_dict(dtype)
                )
        follow_umask(directory)

    @property
    def master_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

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


#: what a sync is given: the trainer's weights, or any callable that writes weights into a
#: directory (which only the disk route can send)
Weights = PolicyWeights | Callable[[Path], None]


def torch_dtype(name: str | None) -> torch.dtype | None:
    """A server's `served_dtype()` as a torch dtype; None (the server picks it from the
    checkpoint, `auto`) stays None."""
    return None if name is None else DTYPES[name]
