"""Per-token log-probabilities and entropy of a policy's logits, chunked over token positions.

Tensors in, tensors out (used by the update, grail/train/update.py, and the objective's tests). A
full-vocabulary float32 log-softmax of a whole micro-batch is never materialised: the work runs
`chunk_size` positions at a time, forward and backward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["DEFAULT_CHUNK_SIZE", "token_entropy", "token_logprobs"]

# Rows (token positions) per chunk in token_logprobs / token_entropy: at a 152k vocabulary one
# chunk is 512 × 152k × 4 B ≈ 300 MB of float32, against ~10 GB for a full 16 × 1024 batch.
DEFAULT_CHUNK_SIZE = 512


def _check_logits(logits: Tensor, temperature: float, chunk_size: int) -> None:
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 3:
        raise ValueError(f"logits must be [B, T, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got dtype {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError("logits have an empty vocabulary dimension (V = 0)")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature)):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def _acc_dtype(x: Tensor) -> torch.dtype:
    """float32 for half/bfloat16/float32 inputs; float64 inputs keep float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _row_blocks(x: Tensor, chunk_size: int) -> Iterator[tuple[int, int, Tensor]]:
    """Yield ``(r0, r1, rows)``: blocks of at most ``chunk_size`` rows of ``x`` [B, T, V] as views.

    ``r0:r1`` index the flattened B*T positions. When ``x`` cannot be flattened without a copy
    (e.g. ``logits[:, :-1]``), a block is a [n, T, V] view of whole sequences (or a [t, V] piece
    of one sequence when T > chunk_size) instead of a copy of the input. Callers flatten what
    they compute from a block with ``_scaled``.
    """
    b, t, v = x.shape
    try:
        flat = x.view(b * t, v)
    except RuntimeError:
        if t <= chunk_size:
            # Whole sequences per block, not one per block: short completions (a few tokens)
            # would otherwise cost one Python iteration and several tiny ops per sequence.
            per_block = chunk_size // t
            for i0 in range(0, b, per_block):
                i1 = min(i0 + per_block, b)
                yield i0 * t, i1 * t, x[i0:i1]
            return
        for i in range(b):
            for t0 in range(0, t, chunk_size):
                t1 = min(t0 + chunk_size, t)
                yield i * t + t0, i * t + t1, x[i, t0:t1]
        return
    for r0 in range(0, b * t, chunk_size):
        r1 = min(r0 + chunk_size, b * t)
        yield r0, r1, flat[r0:r1]


def _scaled(rows: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """``rows / T`` in ``dtype`` as a [rows, V] tensor, for reading only: at T = 1 it may be
    ``rows`` itself. x / 1 is x exactly, and the division is a pass over [rows, 151,936] floats
    that took 54 of the 833 ms of an update's GPU time on an H200 (docs/benchmarks.md)."""
    z = rows.to(dtype)
    return _unscale(z, temperature).reshape(-1, z.shape[-1])


def _unscale(x: Tensor, temperature: float) -> Tensor:
    """``x / T``, skipped at T = 1 (where it changes no bit)."""
    return x if temperature == 1.0 else x / temperature


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[ids], one chunk of rows in float32 at a time, forward and backward.

    Plain autograd would keep every chunk's float32 log-softmax alive for the backward pass; this
    saves only the input logits (no copy) and the per-row log-normaliser, and recomputes the
    softmax per chunk in backward:  ∂/∂z_j log p_y = (1[j = y] − p_j) / T.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, ids: Tensor, temperature: float, chunk_size: int) -> Tensor:
        b, t, _ = logits.shape
        acc = _acc_dtype(logits)
        out = torch.empty(b * t, dtype=acc, device=logits.device)
        lse = torch.empty(b * t, dtype=acc, device=logits.device)
        flat_ids = ids.reshape(-1)
        for r0, r1, rows in _row_blocks(logits, chunk_size):
            z = _scaled(rows, acc, temperature)
            lse[r0:r1] = torch.logsumexp(z, dim=-1)
            out[r0:r1] = z.gather(-1, flat_ids[r0:r1].unsqueeze(-1)).squeeze(-1) - lse[r0:r1]
        ctx.save_for_backward(logits, flat_ids, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out.view(b, t)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, flat_ids, lse = ctx.saved_tensors
        b, t, v = logits.shape
        g = grad_out.reshape(-1).to(lse.dtype)
        grad = torch.empty((b * t, v), dtype=logits.dtype, device=logits.device)
        for r0, r1, rows in _row_blocks(logits, ctx.chunk_size):
            p = torch.exp(_scaled(rows, lse.dtype, ctx.temperature) - lse[r0:r1].unsqueeze(-1))
            gz = -p * g[r0:r1].unsqueeze(-1)
            gz.scatter_add_(-1, flat_ids[r0:r1].unsqueeze(-1), g[r0:r1].unsqueeze(-1))
            grad[r0:r1] = _unscale(gz, ctx.temperature)
        return grad.view(b, t, v), None, None, None


class _TokenEntropy(torch.autograd.Function):
    """H = −Σ_j p_j log p_j with log p = z − logsumexp(z), z = logits / T; chunked like
    ``_TokenLogprobs``. Summing the non-negative terms −p log p avoids the cancellation of the
    equivalent logsumexp(z) − Σ p z when H is small next to the logits.

    Backward:  ∂H/∂z_j = −p_j (log p_j + H),  and ∂/∂logits = ∂/∂z / T.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        b, t, _ = logits.shape
        out = torch.empty(b * t, dtype=_acc_dtype(logits), device=logits.device)
        for r0, r1, rows in _row_blocks(logits, chunk_size):
            logp = torch.log_softmax(_scaled(rows, out.dtype, temperature), dim=-1)
            out[r0:r1] = -(logp.exp() * logp).sum(-1)
        ctx.save_for_backward(logits)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return out.view(b, t)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (logits,) = ctx.saved_tensors
        b, t, v = logits.shape
        acc = _acc_dtype(logits)
        g = grad_out.reshape(-1).to(acc)
        grad = torch.empty((b * t, v), dtype=logits.dtype, device=logits.device)
        for r0, r1, rows in _row_blocks(logits, ctx.chunk_size):
            logp = torch.log_softmax(_scaled(rows, acc, ctx.temperature), dim=-1)
            p = logp.exp()
            h = -(p * logp).sum(-1, keepdim=True)
            grad[r0:r1] = _unscale(-p * (logp + h) * g[r0:r1].unsqueeze(-1), ctx.temperature)
        return grad.view(b, t, v), None, None


def token_logprobs(
    logits: Tensor,
    token_ids: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Per-token log-probabilities ``log softmax(logits / T)[token_ids]``, float32 ``[B, T]``.

    ``logits`` [B, T, V] must be the logits that *predict* ``token_ids`` [B, T]: for a causal LM
    run on prompt+completion, the caller passes ``logits[:, P-1:-1]`` for completion ids
    ``input_ids[:, P:]``. Divide by the sampling temperature so the log-probs match what the
    inference server reports for the same tokens.

    Computed in float32 for half, bfloat16 and float32 logits (float64 stays float64): a bf16
    log-softmax loses ~3 significant digits, enough to bias the policy ratio. It runs
    ``chunk_size`` rows at a time, so the float32 copy of a large vocabulary never exists for
    the whole batch; the same holds in the backward pass, which recomputes the softmax per chunk
    and returns a gradient in the logits' dtype. A non-contiguous ``logits`` view (such as
    ``logits[:, :-1]``) is read in place, not copied.
    """
    _check_logits(logits, temperature, chunk_size)
    if not isinstance(token_ids, Tensor):
        raise TypeError(f"token_ids must be a torch.Tensor, got {type(token_ids).__name__}")
    if token_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"token_ids shape {tuple(token_ids.shape)} does not match logits [B, T] = "
            f"{tuple(logits.shape[:2])}"
        )
    if token_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise TypeError(f"token_ids must be an integer tensor, got dtype {token_ids.dtype}")
    if token_ids.device != logits.device:
        raise ValueError(f"token_ids on {token_ids.device} but logits on {logits.device}")
    vocab = logits.shape[-1]
    if token_ids.numel() > 0:
        lo, hi = int(token_ids.min()), int(token_ids.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(
                f"token_ids out of range [0, {vocab}): min {lo}, max {hi} "
                "(padding positions need a valid id too; mask them in the loss instead)"
            )
    if logits.shape[0] * logits.shape[1] == 0:
        return logits.new_zeros(logits.shape[:2], dtype=_acc_dtype(logits))
    return _TokenLogprobs.apply(logits, token_ids.long(), float(temperature), chunk_size)


def token_entropy(
    logits: Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Tensor:
    """Per-position entropy ``H = −Σ_j p_j log p_j`` of ``p = softmax(logits / T)``, [B, T].

    Chunked and float32 like ``token_logprobs``; differentiable, so it can feed the entropy
    bonus of ``grpo_loss`` (detach it to use it as a metric only).
    """
    _check_logits(logits, temperature, chunk_size)
    if logits.shape[0] * logits.shape[1] == 0:
        return logits.new_zeros(logits.shape[:2], dtype=_acc_dtype(logits))
    return _TokenEntropy.apply(logits, float(temperature), chunk_size)
