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

On CUDA, where torch has it, the row goes to torch's own varlen flash kernel
(`torch.nn.attention.varlen.varlen_attn`) in one call per layer instead of one sdpa call per
sample: the update on a GPU is launch-bound (docs/benchmarks.md), and a 16,384-token piece holds
~30 samples, so the loop launched ~30 forward and ~30 backward kernels per layer. Elsewhere (CPU,
float32, dropout, a sliding window, a torch without it) the loop of sdpa calls runs, which the
CPU tests check against the padded update; tests/gpu checks the kernel against the loop.
flash-attn's wheels are far too large to carry to every machine, and flex_attention needs
torch.compile (its first update did not finish within 120 s on the H200) and has no CPU backward.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
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
    half = _half_dtype(query)
    if half is not None and _varlen_applies(query, kwargs):
        # Under autocast the queries arrive in float32 (the rotary embedding multiplies by
        # float32 cos/sin); sdpa would cast them to the autocast dtype, the custom op does not.
        q, k, v = (x.to(half) for x in (query, key, value))
        return _attend_varlen(q, k, v, lengths, kwargs.get("scaling"))
    # Not cuDNN's attention, torch's first choice on Hopper: it builds an execution plan for each
    # new sequence length, ~2.3 ms of CPU per call and again for its backward, and every sample's
    # length is new (measured on an H200: 7.0 of an update's 9.2 CPU seconds, docs/benchmarks.md).
    with sdpa_kernel(_BACKENDS) if query.is_cuda else contextlib.nullcontext():
        return _attend(module, query, key, value, lengths, **kwargs)


def _load_varlen() -> Callable[..., Any] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch before 2.10
        return None
    return varlen_attn


_VARLEN = _load_varlen()
_VARLEN_PARAMETERS = set() if _VARLEN is None else set(inspect.signature(_VARLEN).parameters)
# torch 2.10-2.11 name causality `is_causal` and take no scale; later ones a window, (-1, 0) being
# causal, and a scale.
_VARLEN_CAUSAL: dict[str, Any] = (
    {"is_causal": True} if "is_causal" in _VARLEN_PARAMETERS else {"window_size": (-1, 0)}
)


def _half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype a flash kernel would attend in: the queries' own, or autocast's."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if query.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return None


def _varlen_applies(query: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    scaling = kwargs.get("scaling")
    return (
        _VARLEN is not None
        and query.is_cuda
        and not kwargs.get("dropout")
        and kwargs.get("sliding_window") is None
        and (
            "scale" in _VARLEN_PARAMETERS
            or scaling is None
            or abs(scaling * query.shape[-1] ** 0.5 - 1.0) < 1e-6  # the kernel's own 1/sqrt(d)
        )
    )


def _attend_varlen(
    query: torch.Tensor,  # [1, heads, T, head_dim]
    key: torch.Tensor,  # [1, kv_heads, T, head_dim]
    value: torch.Tensor,
    segment_lengths: Sequence[int],
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each sample of the row, all samples in one flash-varlen call."""
    assert _VARLEN is not None
    group = query.shape[1] // key.shape[1]  # grouped-query heads: each kv head serves `group`
    if group > 1:
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    bounds = torch.tensor([0, *segment_lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    bounds = bounds.to(query.device, non_blocking=True)
    longest = max(segment_lengths)
    out = _VARLEN(
        query[0].transpose(0, 1),  # [T, heads, head_dim]
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        bounds,
        bounds,
        longest,
        longest,
        **({"scale": scaling} if "scale" in _VARLEN_PARAMETERS else {}),
        **_VARLEN_CAUSAL,
    )
    return out[None]  # [1, T, heads, head_dim], as sdpa_attention_forward returns


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
