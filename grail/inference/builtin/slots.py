"""The static decode path's device side: a preallocated KV cache with one row per sequence
(`SlotState`), the view of it a Hugging Face model writes to (`SlotCache`), the attention that
reads it, and one decode step (`decode_step`) that touches nothing but device tensors.

Layout. Row r of every buffer belongs to one sequence. Its key and value at position p sit in
slot p of its row (no padding: a prompt of length L fills slots 0..L-1 and the token at
position p writes slot p), so rows of any length share one fixed-shape step. A step attends over
the first ``window`` slots of each row with the mask ``slot <= position``; the host picks the
window (a multiple of `SLOT_QUANTUM` past every live row's position) and the number of rows (a
bucket), so the shapes, and hence a CUDA graph, stay fixed for many steps.

A step feeds every row its last token, samples the next one (`sampling.draw_rows`, with the
row's pre-drawn uniform), writes it, its logprob and the top alternatives into ring buffers at
``step`` (the step's index in the current chunk), and updates the row's position, count and
finished flag on the device: finished rows stop advancing and their ring entries are ignored.
The host reads the rings only between chunks (`static.StaticDecoder`).

Importing this module registers ``SLOT_ATTENTION`` with transformers: slot attention for decode
steps (``grail_slots=True``), plain SDPA (with transformers' own mask) for the prefill.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from grail.inference.builtin.invariance import head_layout
from grail.inference.builtin.sampling import draw_rows

SLOT_ATTENTION = "grail_slots"
SLOT_QUANTUM = 256  # slot capacity and attention windows are multiples of this


def _slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    grail_slots: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One query per row over its slots (``grail_slots``), else transformers' SDPA attention.

    Grouped-query attention without copying keys: the query heads that share a key head become
    that head's queries (``[B, H, 1, D] -> [B, KV, H / KV, D]``), which is what `repeat_kv` +
    SDPA compute (query head h reads key head h // (H / KV)) without reading the keys H / KV
    times. Returns ``[B, 1, H, D]`` like transformers' attention functions.
    """
    if not grail_slots:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, heads, q_len, dim = query.shape
    if q_len != 1:
        raise ValueError(f"slot attention decodes one token per row, got {q_len}")
    kv_heads = key.shape[1]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
    out = F.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), None


AttentionInterface.register(SLOT_ATTENTION, _slot_attention)
# The prefill goes through transformers' own mask creation: the SDPA mask, as for "sdpa".
AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)


@dataclass(frozen=True)
class Capacity:
    """Buffer sizes: rows, KV slots per row, pre-drawn uniforms per row, stop ids per row, top
    alternatives per step (0: none) and ring length (steps per chunk)."""

    rows: int
    slots: int
    draws: int
    stops: int
    top: int
    ring: int

    def covers(self, other: Capacity) -> bool:
        return all(getattr(self, f.name) >= getattr(other, f.name) for f in fields(self))

    def union(self, other: Capacity) -> Capacity:
        return Capacity(*(max(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)))


@dataclass
class SlotState:
    """The decode state on the device; row r of every per-row buffer is one sequence."""

    capacity: Capacity
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, slots, head_dim]
    values: list[torch.Tensor]
    tokens: torch.Tensor  # [rows] int64: the token the row feeds next
    pos: torch.Tensor  # [rows] int64: its position, i.e. the slot its key and value go to
    count: torch.Tensor  # [rows] int64: tokens generated so far
    finished: torch.Tensor  # [rows] bool: stop id, EOS or max_tokens reached (or a free row)
    max_tokens: torch.Tensor  # [rows] int64
    temperature: torch.Tensor  # [rows] float32 (0: greedy)
    top_k: torch.Tensor  # [rows] int64 (0: off)
    top_p: torch.Tensor  # [rows] float32 (1: off)
    stop_ids: torch.Tensor  # [rows, stops] int64, -1 padded: stop ids, and EOS unless ignored
    uniforms: torch.Tensor  # [rows, draws] float64: column j is the draw of token j + 1
    step: torch.Tensor  # [] int64: index of the current step in the ring
    ring_tokens: torch.Tensor  # [ring, rows] int64
    ring_logprobs: torch.Tensor  # [ring, rows] float32
    ring_top_ids: torch.Tensor  # [ring, rows, top] int64
    ring_top_logprobs: torch.Tensor  # [ring, rows, top] float32

    # Per-row buffers and what a free row holds: finished, greedy, position 0 (so it never
    # writes outside its slots and never sees an empty mask, which would give NaN).
    ROW_FIELDS: ClassVar[dict[str, float | bool]] = {
        "tokens": 0,
        "pos": 0,
        "count": 0,
        "finished": True,
        "max_tokens": 1,
        "temperature": 0.0,
        "top_k": 0,
        "top_p": 1.0,
        "stop_ids": -1,
        "uniforms": 0.0,
    }

    @classmethod
    def allocate(
        cls, config: Any, capacity: Capacity, device: torch.device, dtype: torch.dtype
    ) -> SlotState:
        layers = config.num_hidden_layers
        _, kv_heads, head_dim = head_layout(config)
        c = capacity
        kv = (c.rows, kv_heads, c.slots, head_dim)

        def full(shape: tuple[int, ...], value: float | bool, kind: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=kind, device=device)

        rows = (c.rows,)
        long, f32 = torch.long, torch.float32
        return cls(
            capacity=c,
            keys=[torch.zeros(kv, dtype=dtype, device=device) for _ in range(layers)],
            values=[torch.zeros(kv, dtype=dtype, device=device) for _ in range(layers)],
            tokens=full(rows, 0, long),
            pos=full(rows, 0, long),
            count=full(rows, 0, long),
            finished=full(rows, True, torch.bool),
            max_tokens=full(rows, 1, long),
            temperature=full(rows, 0.0, f32),
            top_k=full(rows, 0, long),
            top_p=full(rows, 1.0, f32),
            stop_ids=full((c.rows, c.stops), -1, long),
            uniforms=full((c.rows, c.draws), 0.0, torch.float64),
            step=full((), 0, long),
            ring_tokens=full((c.ring, c.rows), 0, long),
            ring_logprobs=full((c.ring, c.rows), 0.0, f32),
            ring_top_ids=full((c.ring, c.rows, c.top), 0, long),
            ring_top_logprobs=full((c.ring, c.rows, c.top), 0.0, f32),
        )

    def per_row(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every buffer indexed by row first: the per-row fields, then each layer's KV."""
        for name in self.ROW_FIELDS:
            yield name, getattr(self, name)
        for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True)):
            yield f"keys.{layer}", k
            yield f"values.{layer}", v

    def grown(self, config: Any, capacity: Capacity) -> SlotState:
        """A state of ``capacity`` (which covers this one's) holding this one's rows."""
        new = SlotState.allocate(config, capacity, self.tokens.device, self.keys[0].dtype)
        for (_, old), (_, bigger) in zip(self.per_row(), new.per_row(), strict=True):
            bigger[tuple(slice(0, n) for n in old.shape)].copy_(old)
        return new

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy rows ``src`` onto rows ``dst`` (every per-row buffer, every layer's KV)."""
        for _, buffer in self.per_row():
            buffer.index_copy_(0, dst, buffer.index_select(0, src))

    def free(self, rows: torch.Tensor) -> None:
        """Make ``rows`` inert (see ``ROW_FIELDS``); their KV is left as it is."""
        for name, value in self.ROW_FIELDS.items():
            getattr(self, name).index_fill_(0, rows, value)


class SlotCache:
    """What a transformers model sees as ``past_key_values`` in a decode step: ``update`` writes
    each row's new key and value into slot ``pos[row]`` and returns the first ``window`` slots."""

    def __init__(self, state: SlotState, rows: int, window: int) -> None:
        self.state, self.rows, self.window = state, rows, window
        kv_heads, head_dim = state.keys[0].shape[1], state.keys[0].shape[3]
        # One scatter index for every layer: [rows, kv_heads, 1, head_dim] -> slot pos[row].
        self.index = state.pos[:rows].view(rows, 1, 1, 1).expand(rows, kv_heads, 1, head_dim)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *_: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.state.keys[layer_idx][: self.rows]
        values = self.state.values[layer_idx][: self.rows]
        keys.scatter_(2, self.index, key_states)
        values.scatter_(2, self.index, value_states)
        return keys[:, :, : self.window], values[:, :, : self.window]


def decode_step(
    model: torch.nn.Module,
    state: SlotState,
    rows: int,
    window: int,
    *,
    sample: bool,
    filtered: bool,
    top: int,
) -> None:
    """One decode step of rows ``[0, rows)`` over the first ``window`` slots, in place.

    Only device tensors are read or written (no ``.item()``, no Python branch on a value), so a
    CUDA graph can record it and the host need not wait for it. ``sample``: some row samples
    (False: all greedy), ``filtered``: some sampled row uses top-k / top-p, ``top``: top
    alternatives to record; the host knows all three from the rows' settings.
    """
    s = state
    tokens, pos, count = s.tokens[:rows], s.pos[:rows], s.count[:rows]
    done = s.finished[:rows]
    slots = torch.arange(window, device=pos.device)
    mask = (slots <= pos.unsqueeze(-1)).view(rows, 1, 1, window)
    out = model(
        input_ids=tokens.unsqueeze(-1),
        position_ids=pos.unsqueeze(-1),
        # A dict skips transformers' mask creation (host-side checks, shapes from the cache).
        attention_mask={"full_attention": mask},
        past_key_values=SlotCache(s, rows, window),
        use_cache=True,
        logits_to_keep=1,
        grail_slots=True,
    )
    logits = out.logits[:, -1, :].float()
    uniforms = None
    if sample:
        # Token `count` of the row (0-based) uses draw column count - 1 (token 0 was drawn at
        # the prefill); finished rows read a clamped column, and their token is not kept.
        column = (count - 1).clamp(0, s.uniforms.shape[1] - 1).unsqueeze(-1)
        uniforms = s.uniforms[:rows].gather(1, column).squeeze(-1)
    token, logp = draw_rows(
        logits,
        s.temperature[:rows],
        s.top_k[:rows],
        s.top_p[:rows],
        uniforms,
        filtered=filtered,
    )
    at = s.step.view(1)
    s.ring_tokens[:, :rows].index_copy_(0, at, token.unsqueeze(0))
    chosen = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    s.ring_logprobs[:, :rows].index_copy_(0, at, chosen.unsqueeze(0))
    if top:
        best = torch.topk(logp, top, dim=-1)
        s.ring_top_ids[:, :rows, :top].index_copy_(0, at, best.indices.unsqueeze(0))
        s.ring_top_logprobs[:, :rows, :top].index_copy_(0, at, best.values.unsqueeze(0))
    active = ~done
    new_count = count + active
    stop = (token.unsqueeze(-1) == s.stop_ids[:rows]).any(-1) | (new_count >= s.max_tokens[:rows])
    s.finished[:rows] = done | stop
    s.tokens[:rows] = torch.where(active, token, tokens)
    s.pos[:rows] = pos + active
    s.count[:rows] = new_count
    s.step.add_(1)
