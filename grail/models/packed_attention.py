"""Attention over a packed row that costs what its samples cost: each sample attends to itself.

A padding-free piece (grail/train/packing.py) is one row holding several samples. transformers'
sdpa reads the layout from the position ids and builds a dense [T, T] block-diagonal mask, and
with a mask sdpa cannot run its flash kernel: it computes all T^2 scores of the row, most of them
masked. Measured on an H200 (docs/benchmarks.md): the GRPO update at the Qwen2.5-0.5B shape ran
at 3.6% MFU with 4096-token pieces, its backward passes taking ~110 ms per piece where the
matrix work alone needs ~10 ms.

`PACKED_SDPA` is sdpa run once per sample, causal and without a mask (the flash kernel on CUDA),
over the sample's slice of the row: sum_i S_i^2 scores instead of T^2. The samples' lengths come
with the forward call (`segment_lengths`, host integers: slicing needs no device sync); a call
without them (the padded micro-batches, generation, evaluation) is plain sdpa with its mask, so
the model can keep this implementation for all its forward passes, gradient checkpointing's
recomputation included.

Why a loop of sdpa calls and not a varlen kernel: flash-attn's wheels are far too large to carry
to every machine, flex_attention needs torch.compile (its first update did not finish within
120 s on the H200) and has no CPU backward, so the CPU tests could not check it; torch's own
`torch.nn.attention.varlen` is CUDA-only and newer than the torch the GPU machines run. The loop
runs everywhere, and the CPU tests check it against the padded update.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from peft import PeftModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "grail_packed_sdpa"
_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@torch.compiler.disable  # one call per sample: traced, every new set of lengths would recompile
def _per_sample(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    segment_lengths: Sequence[int] | torch.Tensor,
    **kwargs: Any,
) -> torch.Tensor:
    lengths = (
        segment_lengths.tolist()
        if isinstance(segment_lengths, torch.Tensor)
        else [int(n) for n in segment_lengths]
    )
    if sum(lengths) != query.shape[2]:
        raise ValueError(
            f"segment_lengths sum to {sum(lengths)} for a row of {query.shape[2]} tokens: a "
            "packed row's samples' lengths add up to its length"
        )
    # Not cuDNN's attention, torch's first choice on Hopper: it builds an execution plan for each
    # new sequence length, ~2.3 ms of CPU per call and again for its backward, and every sample's
    # length is new (measured on an H200: 7.0 of an update's 9.2 CPU seconds, docs/benchmarks.md).
    with sdpa_kernel(_BACKENDS) if query.is_cuda else contextlib.nullcontext():
        return _attend(module, query, key, value, lengths, **kwargs)


def _attend(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segment_lengths: Sequence[int],
    **kwargs: Any,
) -> torch.Tensor:
    outputs = [
        # attention_mask None and is_causal None: causal over the sample alone (sdpa's flash
        # kernel where it has one); a one-token sample attends to itself.
        sdpa_attention_forward(module, q, k, v, None, is_causal=None, **kwargs)[0]
        for q, k, v in zip(
            query.split(list(segment_lengths), dim=2),
            key.split(list(segment_lengths), dim=2),
            value.split(list(segment_lengths), dim=2),
            strict=True,
        )
    ]
    return torch.cat(outputs, dim=1)  # [1, T, heads, head_dim], as sdpa_attention_forward returns


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    segment_lengths: Sequence[int] | torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature; `segment_lengths` (the samples' lengths in
    row order, summing to T) makes it attend per sample and ignore the mask. As a (CPU) tensor
    the lengths are data to a compiled body, not constants that recompile it at every batch."""
    if segment_lengths is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(
            f"segment_lengths given for a batch of {query.shape[0]} rows: a packed row is one row"
        )
    for name in ("is_causal", "position_ids"):  # per sample: causal, positions already applied
        kwargs.pop(name, None)
    return _per_sample(module, query, key, value, segment_lengths, **kwargs), None


def use_packed_sdpa(model: torch.nn.Module) -> bool:
    """Switch `model` (a transformers model, or a PEFT model over one) from sdpa to
    `PACKED_SDPA`; False, and nothing changed, when it runs another attention (eager, flash,
    flex: flash-attention already reads the samples from the position ids)."""
    base: Any = model.get_base_model() if isinstance(model, PeftModel) else model
    if not isinstance(base, PreTrainedModel):
        return False
    current = base.config._attn_implementation
    if current == PACKED_SDPA:
        return True
    if current != "sdpa":
        return False
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    # The padded passes still need sdpa's mask; the packed ones ignore it.
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    base.set_attn_implementation(PACKED_SDPA)
    return True


def packed_sdpa_enabled(module: torch.nn.Module) -> bool:
    """Whether `module` (a model or its decoder) attends with `PACKED_SDPA`."""
    config = getattr(module, "config", None)
    return getattr(config, "_attn_implementation", None) == PACKED_SDPA
