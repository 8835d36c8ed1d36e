"""Batch invariance of the built-in engine: row-wise attention and the start-up probes.

With plain batching a row's numbers depend on its neighbours: the attention reduction runs over
the padded length, and BLAS picks a different GEMM kernel for a different number of rows (MKL on
AVX-512, 2 threads: row outputs of a 896x4864 layer differ by up to ~6e-5 between 1, 2-3 and 4
rows; all multiples of 4 agree). Since the harness sends concurrent requests, batch composition
is timing-dependent, so "same config and seed -> same metrics" needs invariance. In
batch-invariant mode (default on CPU) the engine therefore

1. computes attention row by row over that row's own tokens only (padding sliced away, not
   masked), so the reduction lengths are those of the row alone; rows with the same padding
   share one attention call where a start-up probe finds the kernel's per-row results
   independent of the batch size: PyTorch's CPU kernel with one thread (with several it splits
   short queries by batch size), so on CPU the attention runs on one thread (`one_thread`)
   whatever the engine's thread count;
2. measures at start-up, on the model's own linear layers, the smallest ``q`` (1, 2, 4, 8 or 16)
   such that a row's output is the same for every row count that is a multiple of ``q``, and
   always runs batches of a multiple of ``q`` rows (at most ``q - 1`` inert filler rows).

The result (tested): a request's tokens and logprobs are bitwise identical whether it runs alone
or batched with other prompts of other lengths. On CUDA the default is off (cuBLAS chooses
kernels by shape heuristics, and the per-row attention loop costs too much there); results then
vary by float rounding with batch composition.

Importing this module registers the row-wise attention with transformers as
``ROWWISE_ATTENTION``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

ROWWISE_ATTENTION = "grail_rowwise"


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """Torch's CPU kernels on one thread inside the block, the engine's count again after it.

    The row-wise attention runs on one thread so that rows of equal padding can share one call
    at any thread count: PyTorch's CPU attention is batch-invariant with one thread only, and
    with several every row needed a call of its own, which made a 2-thread server slower than a
    1-thread one (docs/benchmarks.md, "CPU threads"). Switching costs microseconds; the linear
    layers, most of a decode step, keep all the threads."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _row_groups(starts: Sequence[int], grouped: bool) -> list[tuple[int, list[int]]]:
    """Rows that may share one attention call: those with the same padding (so the same
    unpadded length), in row order; one row per group when ``grouped`` is off."""
    if not grouped:
        return [(int(s), [b]) for b, s in enumerate(starts)]
    groups: dict[int, list[int]] = {}
    for b, s in enumerate(starts):
        groups.setdefault(int(s), []).append(b)
    return list(groups.items())


def _rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    grail_pad_starts: Sequence[int] | None = None,
    grail_group_rows: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention computed separately for each row over its own (unpadded) keys.

    ``grail_pad_starts[b]`` is the number of left-padding positions of row ``b``. Query position
    ``j`` sits at absolute position ``Tk - Tq + j``; queries inside the padding get zeros (their
    outputs and cached keys are never read by real positions). Returns ``[B, Tq, H, D]`` like the
    transformers attention functions.

    ``grail_group_rows``: rows with the same padding run in one call (as a batch of rows of equal
    length). Only where the engine measured that the attention kernel's per-row results do not
    depend on the batch size (``attention_batch_invariant``): true of PyTorch's CPU kernel with
    one thread, not with several (it then splits short queries differently by batch size), so on
    CPU the attention runs on one thread (`one_thread`).
    """
    batch, heads, q_len, head_dim = query.shape
    starts = grail_pad_starts if grail_pad_starts is not None else [0] * batch
    out = query.new_zeros(batch, q_len, heads, head_dim)
    gqa = key.shape[1] != heads
    with one_thread(query.device):
        for start, rows in _row_groups(starts, grail_group_rows):
            _attend_rows(query, key, value, out, start, rows, scaling, gqa, grail_group_rows)
    return out, None


def _attend_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    start: int,
    rows: list[int],
    scaling: float | None,
    gqa: bool,
    views: bool = False,
) -> None:
    """Rows `rows` (equal padding `start`) of the batch attend over their own keys into `out`.
    `views`: the keys and values are read where they lie (a view of the cache's room), not
    copied first; only where `attention_batch_invariant` found the kernel's results on such
    views equal to those on contiguous copies. The copies were ~a quarter of a decode step
    (py-spy, benchmarks/episodes.py)."""
    q_len, k_len = query.shape[2], key.shape[2]
    q_start = max(0, start - (k_len - q_len))
    sel: slice | torch.Tensor = slice(rows[0], rows[-1] + 1)  # a run of rows: views
    if rows[-1] - rows[0] + 1 != len(rows):
        sel = torch.tensor(rows, device=query.device)  # scattered rows: gathered
    q, k, v = query[sel], key[sel], value[sel]
    q = q[:, :, q_start:].contiguous()
    k, v = k[:, :, start:], v[:, :, start:]
    if not views:
        k, v = k.contiguous(), v.contiguous()
    n_rows, cols = q.shape[2], k.shape[2]
    if n_rows == 1:
        mask, causal = None, False
    elif n_rows == cols:
        mask, causal = None, True
    else:  # queries are the last `n_rows` of `cols` positions
        offset = cols - n_rows
        mask = torch.ones(n_rows, cols, dtype=torch.bool, device=q.device).tril(offset)
        causal = False
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa
    )
    out[sel, q_start:] = o.transpose(1, 2)


def attention_batch_invariant(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``scaled_dot_product_attention`` gives each row the same result in a batch of rows
    as alone, for this head layout on one thread, as the engine runs it (probed with random
    inputs on decode, prefill and partial-prefill shapes): the batch's keys and values as views
    into larger tensors (the cache's room and padding, `_attend_rows` with `views`), each row
    alone on contiguous copies. A measurement, like ``linear_row_quantum``."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    gqa = kv_heads != heads
    with torch.inference_mode(), one_thread(device):  # as `_rowwise_attention` runs it
        for q_len, k_len in ((1, 1), (1, 9), (1, 300), (3, 40), (17, 17), (2, 700)):
            for batch in (2, 3, 8, 32):
                q = torch.randn(batch, heads, q_len, head_dim, generator=generator)
                # Keys and values with 3 padding positions before and 5 positions of room after.
                shape = (batch, kv_heads, k_len + 8, head_dim)
                k, v = (
                    torch.randn(*shape, generator=generator),
                    torch.randn(*shape, generator=generator),
                )
                q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
                k, v = k[:, :, 3 : 3 + k_len], v[:, :, 3 : 3 + k_len]
                mask = None
                if 1 < q_len < k_len:
                    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
                    mask = mask.tril(k_len - q_len)
                kw: dict[str, Any] = {
                    "attn_mask": mask,
                    "is_causal": q_len == k_len > 1,
                    "enable_gqa": gqa,
                }
                together = F.scaled_dot_product_attention(q, k, v, **kw)
                for b in range(batch):
                    alone = F.scaled_dot_product_attention(
                        q[b : b + 1], k[b : b + 1].contiguous(), v[b : b + 1].contiguous(), **kw
                    )
                    if not torch.equal(alone[0], together[b]):
                        return False
    return True


AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_attention)


def linear_row_quantum(
    model: torch.nn.Module, max_rows: int = 256, max_features: int = 4096
) -> int | None:
    """Smallest q in (1, 2, 4, 8, 16) such that a linear layer's row outputs are the same for
    every row count that is a multiple of q (probed up to ``max_rows``), or None.

    Why multiples: MKL computes full blocks of rows with one kernel and a remainder with another,
    and how it splits rows depends on the thread count (measured on AVX-512 with 2 threads: all
    M >= 12 agree, with 16 threads all M >= 28, but every multiple of 4 agrees in both). Probed
    on each distinct (in, out, bias, dtype) linear of the model with random inputs, the output
    features truncated to ``max_features`` to keep a large vocabulary head cheap. A measurement
    of the BLAS in use at this thread count, not a proof; the end-to-end invariance is tested.
    """
    linears: dict[tuple[Any, ...], torch.nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features, module.bias is not None)
            linears.setdefault((*key, module.weight.dtype), module)
    generator = torch.Generator(device="cpu").manual_seed(0)
    sizes = sorted({*range(1, 65), 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, max_rows})
    sizes = [m for m in sizes if m <= max_rows]
    agrees = dict.fromkeys(sizes, True)
    with torch.inference_mode():
        for lin in linears.values():
            weight = lin.weight[:max_features]
            bias = lin.bias[:max_features] if lin.bias is not None else None
            x = torch.randn(max_rows, lin.in_features, generator=generator)
            x = x.to(device=weight.device, dtype=weight.dtype)
            ref = F.linear(x, weight, bias)
            for m in sizes:
                if agrees[m] and not torch.equal(F.linear(x[:m], weight, bias), ref[:m]):
                    agrees[m] = False
    for quantum in (1, 2, 4, 8, 16):
        if all(ok for m, ok in agrees.items() if m % quantum == 0):
            return quantum
    return None


def head_layout(config: Any) -> tuple[int, int, int]:
    """A causal LM config's (attention heads, key/value heads, head dimension)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, head_dim


def group_attention_ok(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether rows of equal padding may share one attention call for this model's head layout
    (`attention_batch_invariant` on its heads; False where the config does not say)."""
    if not getattr(model.config, "num_attention_heads", None):
        return False
    return attention_batch_invariant(*head_layout(model.config), dtype, device)
