"""The rows the built-in engine decodes together (`Batch`): their KV cache, attention mask,
padding and positions, and how two batches become one when queued sequences join a running batch
(the shorter side's cache is left-padded to the longer)."""

from __future__ import annotations

from collections.abc import Sequence
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
    views of the first tokens of larger tensors (`_room`), so not contiguous; the row-wise
    attention reads them where they lie only where its start-up probe found that gives the
    numbers contiguous copies give (`invariance._attend_rows`)."""

    _room: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, length: int) -> RoomyLayer:
        """A layer holding the first `length` positions of `keys` and `values`, the rest room.
        (`DynamicCache(layers)` copied each layer once, by concatenating it to an empty
        tensor, and the next step copied it again to make room.)"""
        layer = cls()
        layer.lazy_initialization(keys, values)
        layer._room = (keys, values)
        layer.keys, layer.values = keys[:, :, :length], values[:, :, :length]
        return layer

    def _has_room(self) -> bool:
        room = self._room
        return (
            room is not None
            and self.keys is not None
            and self.values is not None
            and _starts(self.keys, room[0])
            and _starts(self.values, room[1])
        )

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
        if not self._has_room() or length + new > self._room[0].shape[-2]:  # type: ignore[index]
            # first step, or the cache was replaced (rows selected, batches merged), or full
            size = room_for(length + new)
            self._room = (_with_room(old_keys, size), _with_room(old_values, size))
        keys, values = self._room  # type: ignore[misc]
        keys[:, :, length : length + new] = key_states
        values[:, :, length : length + new] = value_states
        self.keys, self.values = keys[:, :, : length + new], values[:, :, : length + new]
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep rows `indices`, room and all: one copy (selecting the keys alone copied them,
        and the next step copied them again to make room)."""
        if not self._has_room():
            super().batch_select_indices(indices)
            return
        length = self.keys.shape[-2]  # type: ignore[union-attr]
        keys, values = self._room  # type: ignore[misc]
        self._room = (keys[indices], values[indices])
        self.keys, self.values = self._room[0][:, :, :length], self._room[1][:, :, :length]


def room_for(length: int) -> int:
    """Positions to allocate for a cache of `length` tokens that grows a token a step: half as
    many again, at least 32 more."""
    return length + max(32, length // 2)


def left_padded(
    blocks: Sequence[tuple[int | slice, torch.Tensor, torch.Tensor]],
    rows: int,
    width: int,
    room: int,
) -> RoomyLayer:
    """A layer of `rows` rows `width` positions long, with `room` more to grow: each block's
    keys and values (rows `where`: one row, or a slice of rows) written right-aligned, the
    padding before them zeros. One copy of each value (padding, stacking or concatenating and
    selecting copied them up to four times)."""
    _, first, _ = blocks[0]
    shape = (rows, first.shape[-3], width + room, first.shape[-1])
    keys, values = first.new_zeros(shape), first.new_zeros(shape)
    for where, k, v in blocks:
        keys[where, :, width - k.shape[-2] : width] = k
        values[where, :, width - v.shape[-2] : width] = v
    return RoomyLayer.over(keys, values, width)


def roomy_cache(layers: list[RoomyLayer]) -> DynamicCache:
    """A cache of these layers, as they are."""
    cache = DynamicCache()
    cache.layers = list(layers)
    return cache


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


def merge(a: Batch, b: Batch) -> Batch:
    """One batch holding the rows of ``a`` then ``b``, left-padded to a common length: each
    layer one copy, into a tensor with room to grow (`left_padded`)."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    rows, split = len(a.rows) + len(b.rows), len(a.rows)
    layers = [
        left_padded(
            [(slice(0, split), ka, va), (slice(split, None), kb, vb)],
            rows,
            width,
            room_for(width) - width,
        )
        for (ka, va), (kb, vb) in zip(map(kv, a.cache.layers), map(kv, b.cache.layers), strict=True)
    ]
    extra_a, extra_b = width - a.mask.shape[1], width - b.mask.shape[1]
    return Batch(
        rows=a.rows + b.rows,
        cache=roomy_cache(layers),
        mask=torch.cat([F.pad(a.mask, (extra_a, 0)), F.pad(b.mask, (extra_b, 0))]),
        pad_starts=[p + extra_a for p in a.pad_starts] + [p + extra_b for p in b.pad_starts],
        next_pos=a.next_pos + b.next_pos,
        tokens=a.tokens + b.tokens,
    )
