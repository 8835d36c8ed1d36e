"""The rows the built-in engine decodes together (`Batch`): their KV cache, attention mask,
padding and positions, and how two batches become one when queued sequences join a running batch
(the shorter side's cache is left-padded to the longer)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

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
