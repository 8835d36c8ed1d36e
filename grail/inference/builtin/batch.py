"""The rows the built-in engine decodes together (`Batch`): their KV cache, attention mask,
padding and positions, and how two batches become one when queued sequences join a running batch
(the shorter side's cache is left-padded to the longer)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
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


def room_for(length: int) -> int:
    """Positions to allocate for a cache of `length` tokens that grows a token a step: half as
    many again, at least 32 more."""
    return length + max(32, length // 2)


@dataclass(frozen=True)
class KVRow:
    """One sequence's keys and values where they lie: row `row` of per-layer tensors `layers`
    (keys and values, [rows, kv_heads, positions, head_dim] each), from position `start` to
    their end. Rows that lie side by side in the same tensors are copied together (`stacked`)."""

    layers: Sequence[tuple[torch.Tensor, torch.Tensor]]
    row: int
    start: int

    @property
    def length(self) -> int:
        return int(self.layers[0][0].shape[2]) - self.start


def batch_rows(batch: Batch) -> list[KVRow]:
    """Every row of `batch` as a `KVRow` (its tokens after its padding)."""
    layers = [kv(layer) for layer in batch.cache.layers]
    return [KVRow(layers, r, start) for r, start in enumerate(batch.pad_starts)]


def stacked(picks: Sequence[KVRow], room: int | None = None) -> tuple[list[RoomyLayer], int]:
    """The sequences `picks` as the rows of new per-layer tensors, right-aligned to the longest
    (`width` positions, returned with them), the padding before them zeros, with `room` more
    positions to grow (default `room_for`). Runs of picks that lie in consecutive rows of the
    same tensors from the same position, and one pick repeated, are copied as one block:
    copying rows one by one or by index took ~4x as long (a 256-row cache,
    benchmarks/episodes.py). One copy of each value; the room is left as allocated, since every
    step writes a position before anything reads it."""
    width = max(p.length for p in picks)
    room = room_for(width) - width if room is None else room
    # (the run's first pick, picks in it, repeated: the first pick `count` times)
    runs: list[tuple[KVRow, int, bool]] = []
    for pick in picks:
        if runs:
            first, count, repeated = runs[-1]
            same = pick.layers is first.layers and pick.start == first.start
            if same and pick.row == first.row and (count == 1 or repeated):
                runs[-1] = (first, count + 1, True)
                continue
            if same and not repeated and pick.row == first.row + count:
                runs[-1] = (first, count + 1, False)
                continue
        runs.append((pick, 1, False))
    out = []
    for layer in range(len(picks[0].layers)):
        like = picks[0].layers[layer][0]
        shape = (len(picks), like.shape[1], width + room, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        at = 0
        for first, count, repeated in runs:
            rows = slice(first.row, first.row + (1 if repeated else count))
            k, v = first.layers[layer]
            begin = width - first.length
            where = slice(at, at + count)
            if begin:
                keys[where, :, :begin] = 0
                values[where, :, :begin] = 0
            keys[where, :, begin:width] = k[rows, :, first.start :]
            values[where, :, begin:width] = v[rows, :, first.start :]
            at += count
        out.append(RoomyLayer.over(keys, values, width))
    return out, width


def assemble(picks: Sequence[tuple[Batch, int]]) -> Batch:
    """A batch whose row r is row `picks[r][1]` of batch `picks[r][0]` (rows of several
    batches, a row several times, rows dropped), left-padded to its longest row, each layer one
    tensor with room to grow (`stacked`). Every layer must be a plain one (not a sliding
    window's)."""
    rows: dict[int, list[KVRow]] = {}
    for b, _ in picks:
        if id(b) not in rows:
            rows[id(b)] = batch_rows(b)
    sequences = [rows[id(b)][r] for b, r in picks]
    layers, width = stacked(sequences)
    pad_starts = [width - sequence.length for sequence in sequences]
    device = picks[0][0].mask.device
    mask = torch.arange(width, device=device) >= torch.tensor(pad_starts, device=device)[:, None]
    return Batch(
        rows=[b.rows[r] for b, r in picks],
        cache=roomy_cache(layers),
        mask=mask.long(),
        pad_starts=pad_starts,
        next_pos=[b.next_pos[r] for b, r in picks],
        tokens=[b.tokens[r] for b, r in picks],
    )


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


def plain_layers(cache: DynamicCache) -> bool:
    """Whether every layer of `cache` is a plain one (`assemble` copies those; a sliding
    window's keeps its own row selection)."""
    return all(type(layer) in (DynamicLayer, RoomyLayer) for layer in cache.layers)


def roomy(cache: DynamicCache) -> None:
    """Make the cache's plain layers `RoomyLayer`s (in place; sliding-window ones stay)."""
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.__class__ = RoomyLayer


def merge(a: Batch, b: Batch) -> Batch:
    """One batch holding the rows of ``a`` then ``b``, left-padded to a common length
    (`assemble`)."""
    return assemble([(a, r) for r in range(len(a.rows))] + [(b, r) for r in range(len(b.rows))])
