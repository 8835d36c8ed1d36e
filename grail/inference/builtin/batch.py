"""The rows the built-in engine decodes together (`Batch`): their KV cache, attention mask,
padding and positions, and how two batches become one when queued sequences join a running batch
(the shorter side's cache is left-padded to the longer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from grail.inference.builtin.sequences import _Sequence


@dataclass
class Batch:
    """The rows being decoded: row r feeds ``tokens[r]`` at position ``next_pos[r]`` next;
    ``pad_starts[r]`` left-padding positions precede its prompt in ``cache`` and ``mask``.
    A ``None`` row is an inert filler (see ``Engine.row_quantum``)."""

    rows: list[_Sequence | None]
    cache: DynamicCache
    mask: torch.Tensor
    pad_starts: list[int]
    next_pos: list[int]
    tokens: list[int]


def kv(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """A DynamicCache layer's keys and values. (transformers types a layer as possibly a
    linear-attention one, which has neither; the causal LMs served here use full attention.)"""
    return layer.keys, layer.values


class RoomyLayer(DynamicLayer):
    """A `DynamicLayer` that appends a step's keys and values into spare room after them instead
    of concatenating: `torch.cat` copied the whole cache every decode step, ~17% of the built-in
    server's time in benchmarks/episodes.py (py-spy, 32-token turns). `keys` and `values` are
    views of the first tokens of larger tensors, so not contiguous; the row-wise attention
    copies what it reads into contiguous tensors anyway, so it sees the same numbers."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        old_keys, old_values = self.keys, self.values
        if (
            not self.is_initialized
            or old_keys is None
            or old_values is None
            or not old_keys.numel()
        ):
            return super().update(key_states, value_states, *args, **kwargs)
        length, new = old_keys.shape[-2], key_states.shape[-2]
        room: tuple[torch.Tensor, torch.Tensor] | None = getattr(self, "_room", None)
        if (
            room is None
            or not (_starts(old_keys, room[0]) and _starts(old_values, room[1]))
            or length + new > room[0].shape[-2]
        ):  # first step, or the cache was replaced (rows selected, batches merged), or full
            size = length + new + max(32, (length + new) // 2)
            room = (_with_room(old_keys, size), _with_room(old_values, size))
            self._room = room
        keys, values = room
        keys[:, :, length : length + new] = key_states
        values[:, :, length : length + new] = value_states
        self.keys, self.values = keys[:, :, : length + new], values[:, :, : length + new]
        return self.keys, self.values


def _starts(view: torch.Tensor, whole: torch.Tensor) -> bool:
    """Whether `view` is `whole`'s first tokens (`whole[:, :, :n]`)."""
    return (
        view.data_ptr() == whole.data_ptr()
        and view.shape[:2] == whole.shape[:2]
        and view.stride() == whole.stride()
    )


def _with_room(tensor: torch.Tensor, size: int) -> torch.Tensor:
    out = tensor.new_empty((*tensor.shape[:2], size, tensor.shape[-1]))
    out[:, :, : tensor.shape[-2]] = tensor
    return out


def roomy(cache: DynamicCache) -> None:
    """Make the cache's plain layers `RoomyLayer`s (in place; sliding-window ones stay)."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = RoomyLayer


def left_pad(batch: Batch, extra: int) -> Batch:
    """The same rows with ``extra`` more (masked) padding positions on the left."""
    layers = [
        (F.pad(keys, (0, 0, extra, 0)), F.pad(values, (0, 0, extra, 0)))
        for keys, values in map(kv, batch.cache.layers)
    ]
    return Batch(
        rows=batch.rows,
        cache=DynamicCache(layers),
        mask=F.pad(batch.mask, (extra, 0)),
        pad_starts=[p + extra for p in batch.pad_starts],
        next_pos=batch.next_pos,
        tokens=batch.tokens,
    )


def merge(a: Batch, b: Batch) -> Batch:
    """One batch holding the rows of ``a`` then ``b``, left-padded to a common length."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    if a.mask.shape[1] < width:
        a = left_pad(a, width - a.mask.shape[1])
    if b.mask.shape[1] < width:
        b = left_pad(b, width - b.mask.shape[1])
    layers = [
        (torch.cat([ka, kb]), torch.cat([va, vb]))
        for (ka, va), (kb, vb) in zip(map(kv, a.cache.layers), map(kv, b.cache.layers), strict=True)
    ]
    return Batch(
        rows=a.rows + b.rows,
        cache=DynamicCache(layers),
        mask=torch.cat([a.mask, b.mask]),
        pad_starts=a.pad_starts + b.pad_starts,
        next_pos=a.next_pos + b.next_pos,
        tokens=a.tokens + b.tokens,
    )
