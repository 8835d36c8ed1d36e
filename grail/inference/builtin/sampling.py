"""Token sampling in the built-in engine: what a drawn token and its logprob mean.

The trainer relies on these numbers (docs/protocols.md, "What a log-probability means"):

- ``logprob`` of a sampled token ``y`` at step ``t`` is computed in float32 as

      logprob_t = log_softmax(logits_t / T)[y]            (T > 0)
      logprob_t = log_softmax(logits_t)[y]                (T = 0, greedy: y = argmax logits_t)

  i.e. the distribution AFTER temperature and BEFORE top-k / top-p filtering (SGLang's default,
  vLLM's ``processed_logprobs`` without truncation). The trainer computes the same quantity, so
  sample with ``top_p=1`` and top-k off when the logprobs must be exactly on-policy: with
  filtering, the token is drawn from the renormalised truncated distribution while the reported
  logprob is that of the untruncated one.
- Sampling: top-k keeps the logits >= the k-th largest, top-p keeps the smallest prefix of the
  sorted distribution whose mass reaches ``top_p`` (top-k first, then top-p, as vLLM). The token
  is drawn by inverse CDF with ONE uniform from the sequence's own ``torch.Generator``, so a
  sequence's draw never depends on what else is in the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, already validated by the server."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no top alternatives; k: k alternatives per step


def draw(
    logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """Sample one token per row of ``logits`` [R, V] (float32) under ``params``; row r draws its
    uniform from ``generators[r]``. Returns the tokens, their logprobs
    ``log_softmax(logits / T)[token]`` and, when ``params.logprobs`` asks for them, the top
    alternatives (token id, logprob) per row, best first (see the module docstring)."""
    greedy = params.temperature < GREEDY_EPS
    scaled = logits if greedy else logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        token = torch.argmax(logits, dim=-1)
    else:
        filtered = scaled
        vocab = filtered.shape[-1]
        if 0 < params.top_k < vocab:
            kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, -math.inf)
        if params.top_p < 1.0:
            probs_sorted, order = torch.sort(
                torch.softmax(filtered, dim=-1), dim=-1, descending=True
            )
            # Drop a token when the mass before it already reaches top_p (keeps >= 1 token).
            drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            filtered = filtered.masked_fill(drop, -math.inf)
        probs = torch.softmax(filtered.double(), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.stack(
            [
                torch.rand((), generator=g, device=logits.device, dtype=torch.float64)
                for g in generators
            ]
        )
        token = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)
        # Rounding at the top end of the CDF can point past the last token or at a token of
        # probability 0: take the most likely token then.
        past = token >= vocab
        hit = probs.gather(-1, token.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1)
        bad = past | (hit == 0.0)
        if bool(bad.any()):
            token = torch.where(bad, torch.argmax(probs, dim=-1), token)
    chosen = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    top = None
    if params.logprobs:
        best = torch.topk(logp, min(params.logprobs, logp.shape[-1]), dim=-1)
        top = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    return token.tolist(), chosen.tolist(), top


def draw_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    uniforms: torch.Tensor | None,
    *,
    filtered: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`draw` for rows with settings of their own, as tensors, with no host synchronisation (the
    static decode path runs it inside a CUDA graph). Row r uses ``temperature[r]`` (below
    ``GREEDY_EPS``: greedy), ``top_k[r]`` (0 or >= the vocabulary: off), ``top_p[r]`` (1: off)
    and the uniform ``uniforms[r]`` (float64; None: every row is greedy). ``filtered=False``
    promises that no sampled row uses top-k or top-p, and skips the sorts they need.

    Returns the tokens [R] and ``log_softmax(logits / T)`` [R, V]. On CPU every row's token and
    logprobs are bitwise those `draw` gives it with its settings and uniform (tested): the same
    ops in the same order, the per-row settings selected with masks instead of Python branches.
    """
    greedy = temperature < GREEDY_EPS
    best = torch.argmax(logits, dim=-1)
    if uniforms is None:
        return best, torch.log_softmax(logits, dim=-1)
    # Greedy rows divide by 1, which is exact: their logprobs stay log_softmax(logits).
    scaled = logits / torch.where(greedy, 1.0, temperature).unsqueeze(-1)
    logp = torch.log_softmax(scaled, dim=-1)
    vocab = scaled.shape[-1]
    filt = scaled
    if filtered:
        # The k-th largest value, as `topk(...).values[:, -1]` finds it; k off -> the smallest
        # value, which masks nothing.
        k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
        ordered = torch.sort(filt, dim=-1, descending=True).values
        kth = ordered.gather(-1, (k - 1).unsqueeze(-1))
        filt = filt.masked_fill(filt < kth, -math.inf)
        probs_sorted, order = torch.sort(torch.softmax(filt, dim=-1), dim=-1, descending=True)
        drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= top_p.unsqueeze(-1)
        # top_p = 1 is off, as in `draw`: float rounding can take the cumulative sum past 1
        # before the last token, which would drop tokens `draw` keeps.
        drop_sorted &= (top_p < 1.0).unsqueeze(-1)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        filt = filt.masked_fill(drop, -math.inf)
    probs = torch.softmax(filt.double(), dim=-1)
    cdf = probs.cumsum(-1)
    token = torch.searchsorted(cdf, uniforms.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)
    # As in `draw`, without asking the host whether any row needs it.
    hit = probs.gather(-1, token.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1)
    bad = (token >= vocab) | (hit == 0.0)
    token = torch.where(bad, torch.argmax(probs, dim=-1), token)
    return torch.where(greedy, best, token), logp
