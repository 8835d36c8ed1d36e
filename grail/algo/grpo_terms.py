"""The terms of the GRPO loss, each a small pure function with its formula (TRL's) beside it.

`grail.algo.grpo.grpo_loss` calls them in the order they appear here; the notation (logp, old,
ref, beh, m, A, ρ, w, G) is in grail/algo/grpo.py's docstring. Tensors in, tensors out: no
settings object, no model, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grail.core.choices import ImportanceSamplingLevel, ISCorrection, KLEstimator, LossType

__all__ = [
    "Normaliser",
    "Tokens",
    "clipped_surrogate",
    "count_tokens",
    "entropy_bonus",
    "importance_weights",
    "kl_estimate",
    "kl_penalty",
    "log_importance_weights",
    "loss_metrics",
    "masked",
]


@dataclass(frozen=True)
class Tokens:
    """The completion tokens of one micro-batch (or of one piece of it) and their counts.

    keep: [B, T] bool, m: the same in the loss dtype, per_sequence: [B] Σ_t m, total: Σ_{b,t} m.
    norm_batch (B) and norm_tokens (max(Σ_{b,t} m, 1)) are what the normalisers divide by: the
    whole micro-batch's counts when these tokens are one piece of it (``is_piece``, padding-free
    pieces, grail/train/packing.py), so that the pieces' losses add up to the micro-batch's.
    """

    keep: Tensor
    m: Tensor
    per_sequence: Tensor
    total: Tensor
    norm_batch: int
    norm_tokens: Tensor
    is_piece: bool


def count_tokens(
    mask: Tensor, dtype: torch.dtype, microbatch_counts: tuple[int, int] | None
) -> Tokens:
    """The tokens ``mask`` covers (bool, or numbers that are all 0 or 1) and their counts;
    ``microbatch_counts`` = (B, Σ m) of the whole micro-batch when ``mask`` is a piece of it."""
    if mask.dtype == torch.bool:
        keep = mask
    else:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError("mask must hold only 0 and 1 (a token the loss covers, or not)")
        keep = mask != 0
    m = keep.to(dtype)
    tokens_per_seq = m.sum(-1)
    num_tokens = tokens_per_seq.sum()
    batch = mask.shape[0]
    if microbatch_counts is None:
        norm_batch, norm_tokens = batch, num_tokens.clamp(min=1.0)
    else:
        norm_batch, whole_tokens = microbatch_counts
        if norm_batch < batch or whole_tokens < float(num_tokens):
            raise ValueError(
                f"microbatch_counts {microbatch_counts} count fewer completions or tokens than "
                f"this piece has ({batch}, {int(num_tokens)})"
            )
        norm_tokens = num_tokens.new_tensor(float(max(whole_tokens, 1)))
    return Tokens(
        keep=keep,
        m=m,
        per_sequence=tokens_per_seq,
        total=num_tokens,
        norm_batch=norm_batch,
        norm_tokens=norm_tokens,
        is_piece=microbatch_counts is not None,
    )


def masked(x: Tensor, keep: Tensor, dtype: torch.dtype, grad: bool = False) -> Tensor:
    """``x`` in the loss dtype on completion tokens and 0 on padding; detached unless ``grad``.

    The padding is zeroed before any arithmetic, so NaN/inf there cannot leak into the loss or
    (via 0 · inf in backward) into the gradient.
    """
    x = x if grad else x.detach()
    return torch.where(keep, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


@dataclass(frozen=True)
class Normaliser:
    """TRL's normalisers: a per-token term x of one micro-batch to its share of the loss.

    For a micro-batch of B completions that is one of G in its optimizer step (G =
    ``accumulation_steps``, TRL's ``current_gradient_accumulation_steps``), the generation batch
    holding N completion tokens in S micro-batches (``num_items_in_batch``,
    ``steps_per_generation``):

        grpo     1/B · Σ_b [ Σ_t m·x / max(Σ_t m, 1) ] / G    per-sequence mean, then mean
        bnpo     Σ_{b,t} m·x / max(Σ_{b,t} m, 1) / G           token mean over the micro-batch
        dr_grpo  Σ_{b,t} m·x / (B · max_completion_length) / G  no length normalisation
        dapo     Σ_{b,t} m·x / (N · G / S)                     N·G/S: the tokens of one
                 optimizer step's window when the generation batch's are spread evenly over it

    B and Σ_{b,t} m are the whole micro-batch's when the tokens are a piece of it (`Tokens`).
    """

    loss_type: LossType
    tokens: Tokens
    steps: int  # G
    steps_per_generation: int  # S
    max_completion_length: int | None
    num_items: float | None  # N (dapo only)

    @classmethod
    def of(
        cls,
        loss_type: LossType,
        tokens: Tokens,
        max_completion_length: int | None,
        num_items_in_batch: int | float | Tensor | None,
        accumulation_steps: int,
        steps_per_generation: int,
    ) -> Normaliser:
        """The normaliser of ``loss_type``, refusing counts it cannot divide by."""
        n_items: float | None = None
        if loss_type == "dapo":
            if num_items_in_batch is None:
                raise ValueError(
                    "loss_type 'dapo' requires num_items_in_batch (completion tokens in the "
                    "whole generation batch)"
                )
            n_items = float(num_items_in_batch)
            if not (math.isfinite(n_items) and n_items > 0):
                raise ValueError(f"num_items_in_batch must be a finite number > 0, got {n_items}")
            if n_items < float(tokens.total):
                raise ValueError(
                    f"num_items_in_batch ({n_items:g}) is smaller than the completion tokens in "
                    f"this micro-batch ({int(tokens.total)}); it must count the whole "
                    "generation batch"
                )
            if accumulation_steps > steps_per_generation:
                raise ValueError(
                    f"accumulation_steps ({accumulation_steps}) exceeds steps_per_generation "
                    f"({steps_per_generation}): an optimizer step cannot span more micro-batches "
                    "than the generation batch has"
                )
        if loss_type == "dr_grpo":
            longest = int(tokens.per_sequence.max())
            if longest > max_completion_length:  # type: ignore[operator]
                raise ValueError(
                    f"a completion has {longest} tokens, more than max_completion_length "
                    f"({max_completion_length}) that dr_grpo normalises by"
                )
        return cls(
            loss_type=loss_type,
            tokens=tokens,
            steps=accumulation_steps,
            steps_per_generation=steps_per_generation,
            max_completion_length=max_completion_length,
            num_items=n_items,
        )

    def __call__(self, x: Tensor) -> Tensor:
        """x's share of the loss: Σ m·x by the loss type's normaliser, accumulation included."""
        tokens, steps = self.tokens, self.steps
        x = x.expand_as(tokens.m) * tokens.m
        if self.loss_type == "grpo":
            per_sequence = x.sum(-1) / tokens.per_sequence.clamp(min=1.0)
            if not tokens.is_piece:
                return per_sequence.mean() / steps
            return per_sequence.sum() / tokens.norm_batch / steps
        if self.loss_type == "bnpo":
            return x.sum() / tokens.norm_tokens / steps
        if self.loss_type == "dr_grpo":
            return x.sum() / (tokens.norm_batch * self.max_completion_length) / steps  # type: ignore[operator]
        return x.sum() / (self.num_items * steps / self.steps_per_generation)  # type: ignore[operator]  # dapo


def log_importance_weights(
    logp: Tensor,
    old: Tensor,
    tokens: Tokens,
    level: ImportanceSamplingLevel,
    logratio_clamp: float | None,
) -> tuple[Tensor, Tensor]:
    """s, the log of the policy ratio ρ = exp(s), and where ``logratio_clamp`` clamped it.

        token     s[b,t] = logp[b,t] − old[b,t]
        sequence  s[b]   = Σ_t m·(logp − old) / max(Σ_t m, 1)   [B, 1], broadcast to the tokens
                  of b (GSPO's length-normalised sequence log ratio; TRL's
                  ``log_importance_weights``)
        then, with ``logratio_clamp`` = c:  s = clamp(s, −c, c)

    The clamp is a hard trust region: beyond it a token gets no policy gradient.
    """
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = (log_ratio.sum(-1) / tokens.per_sequence.clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    if logratio_clamp is not None:
        clamped = log_w.detach().abs() > logratio_clamp
        log_w = log_w.clamp(-logratio_clamp, logratio_clamp)
    else:
        clamped = torch.zeros_like(log_w, dtype=torch.bool)
    return log_w, clamped


def clipped_surrogate(
    policy_ratio: Tensor, adv: Tensor, epsilon: float, eps_high: float, is_ratio_max: float | None
) -> tuple[Tensor, Tensor]:
    """pg, the clipped policy-gradient term per token (or per sequence), and where δ capped ρ.

    pg = −min(ρ'·A, clip(ρ, 1 − ε, 1 + ε_high)·A)
    ρ' = min(ρ, δ) with δ = ``is_ratio_max`` (TRL's ``delta``, two-sided clipping), else ρ
    """
    coef_1 = policy_ratio
    coef_2 = torch.clamp(coef_1, 1.0 - epsilon, 1.0 + eps_high)
    ratio = coef_1.detach()
    if is_ratio_max is not None:
        capped = ratio > is_ratio_max
        coef_1 = torch.clamp(coef_1, max=is_ratio_max)
    else:
        capped = torch.zeros_like(ratio, dtype=torch.bool)
    return -torch.min(coef_1 * adv, coef_2 * adv), capped  # [B, T] or [B, 1]


def importance_weights(
    old: Tensor,
    behaviour_logprobs: Tensor | None,
    tokens: Tokens,
    mode: ISCorrection,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[Tensor, Tensor]:
    """w, the importance weights between the trainer's "old" policy and the server's sampling
    policy (TRL's ``vllm_importance_sampling_mode``), and where r fell outside [C_min, C_max].

        d = m·(old − beh), NaN (a token the server could not score) as 0
        token_*     r[b,t] = exp(d[b,t])
        sequence_*  r[b]   = exp(Σ_t d[b,t]), for every token of b (a product of token ratios,
                    not a mean)
        *_truncate  w = clamp(r, C_min, C_max)
        *_mask      w = r inside [C_min, C_max], 0 outside
        none        w = 1
    with C = ``clip_min``/``clip_max`` (TRL's ``vllm_importance_sampling_clip_min``/``_max``; a
    None bound is open), for ``mode`` d's granularity and what is done outside.
    """
    if mode == "none":
        is_w = torch.ones_like(tokens.m[:, :1])
        return is_w, torch.zeros_like(is_w, dtype=torch.bool)
    beh = masked(behaviour_logprobs, tokens.keep, tokens.m.dtype)  # type: ignore[arg-type]
    diff = torch.nan_to_num(old - beh, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # [B, 1]
    raw = torch.exp(diff)
    lo, hi = clip_min, clip_max
    outside = torch.zeros_like(raw, dtype=torch.bool)
    if lo is not None:
        outside |= raw < lo
    if hi is not None:
        outside |= raw > hi
    if mode.endswith("truncate"):
        is_w = raw if lo is None and hi is None else torch.clamp(raw, min=lo, max=hi)
    else:
        is_w = raw.masked_fill(outside, 0.0)
    return is_w, outside


def kl_estimate(logp: Tensor, ref: Tensor, estimator: KLEstimator) -> Tensor:
    """KL[b,t], Schulman's estimators of KL(π_θ ‖ π_ref) per token (TRL uses k3):

    k1  logp − ref
    k2  ½ (logp − ref)²
    k3  exp(ref − logp) − (ref − logp) − 1
    """
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    return torch.exp(ref - logp) - (ref - logp) - 1.0


def kl_penalty(
    kl_tok: Tensor,
    policy_ratio: Tensor,
    kl_coef: float,
    bias_correction: bool,
    normalise: Normaliser,
) -> Tensor:
    """The KL term of the loss:  β · normalise(KL · ρ)  with ``bias_correction`` (TRL's
    ``use_bias_correction_kl``), else  β · normalise(KL); β = ``kl_coef``.

    ρ is taken before δ and carries gradient: even on-policy, where ρ = 1, the correction
    changes the KL gradient.
    """
    kl_term = kl_tok * policy_ratio if bias_correction else kl_tok
    return kl_coef * normalise(kl_term)


def entropy_bonus(ent: Tensor, tokens: Tokens, entropy_coef: float, steps: int) -> Tensor:
    """The entropy term of the loss:  −α · Σ_{b,t} m·H / max(Σ_{b,t} m, 1) / G.

    A token mean whatever the loss type (TRL): the bonus does not depend on how the policy
    term is normalised. ``ent`` is H already zeroed on padding, with its gradient.
    """
    return -entropy_coef * (ent.sum() / tokens.norm_tokens) / steps


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------


def _token_mean(x: Tensor, tokens: Tokens) -> Tensor:
    return (x.to(tokens.m.dtype) * tokens.m).sum() / tokens.total.clamp(min=1.0)


def _unit_mean(x: Tensor, tokens: Tokens) -> Tensor:
    # TRL's masked_batch_mean: per token, or per sequence at sequence level.
    return x.to(tokens.m.dtype).mean() if x.shape[-1] == 1 else _token_mean(x, tokens)


def _masked_max(x: Tensor, tokens: Tokens) -> Tensor:
    dtype = tokens.m.dtype
    if x.shape[-1] == 1:
        return x.max().to(dtype)
    top = x.to(dtype).masked_fill(~tokens.keep, float("-inf")).max()
    return torch.where(tokens.total > 0, top, torch.zeros_like(top))  # 0 with no tokens


def _effective_sample_size(is_w: Tensor, tokens: Tokens) -> Tensor:
    """(Σw)² / (n Σw²), the normalised effective sample size of the importance weights (per
    token, or per sequence in the sequence modes): 1 when all equal, 1/n when one carries all
    the weight. Defined as 1 with nothing to weigh or all-zero weights."""
    units = tokens.m if is_w.shape[-1] != 1 else torch.ones_like(is_w)
    w_sum = (is_w * units).sum()
    w_sq = (is_w * is_w * units).sum()
    return torch.where(
        w_sq > 0, w_sum * w_sum / (units.sum() * w_sq).clamp(min=1e-30), torch.ones_like(w_sq)
    ).clamp(max=1.0)


@torch.no_grad()
def loss_metrics(
    tokens: Tokens,
    steps: int,
    *,
    epsilon: float,
    eps_high: float,
    losses: tuple[Tensor, Tensor, Tensor, Tensor],
    ratio: Tensor,
    adv: Tensor,
    capped: Tensor,
    clamped: Tensor,
    is_w: Tensor,
    outside: Tensor,
    kl_tok: Tensor | None,
    ent: Tensor | None,
    old: Tensor,
    behaviour_logprobs: Tensor | None,
) -> dict[str, float]:
    """`grpo_loss`'s metrics (its docstring names them) from the terms it computed, ``losses``
    being (L, L_pg, L_kl, L_entropy) and ``ratio`` ρ detached; ε and ε_high as in
    `clipped_surrogate`.

    Gathered into one tensor so that a GPU run pays one device sync, not twenty.
    """
    loss, loss_pg, loss_kl, loss_entropy = losses
    low = (ratio < 1.0 - epsilon) & (adv < 0)
    high = (ratio > 1.0 + eps_high) & (adv > 0)
    values = {
        "loss_total": loss.detach() * steps,
        "loss_pg": loss_pg.detach() * steps,
        "loss_kl": loss_kl.detach() * steps,
        "loss_entropy": loss_entropy.detach() * steps,
        "ratio_mean": _unit_mean(ratio, tokens),
        "ratio_max": _masked_max(ratio, tokens),
        "clip_frac_low": _unit_mean(low, tokens),
        "clip_frac_high": _unit_mean(high, tokens),
        "clip_frac": _unit_mean(low | high, tokens),
        "ratio_cap_frac": _unit_mean(capped, tokens),
        "logratio_clamp_frac": _unit_mean(clamped, tokens),
        "is_clip_frac": _unit_mean(outside, tokens),
        "is_weight_mean": _unit_mean(is_w, tokens),
        "is_ess": _effective_sample_size(is_w, tokens),
        "num_tokens": tokens.total,
    }
    if kl_tok is not None:
        values["kl"] = _token_mean(kl_tok.detach(), tokens)
    if ent is not None:
        values["entropy"] = _token_mean(ent.detach(), tokens)
    if behaviour_logprobs is not None:
        gap = (old - masked(behaviour_logprobs, tokens.keep, tokens.m.dtype)).abs()
        values["logprob_mismatch"] = _token_mean(gap, tokens)
        values["logprob_mismatch_max"] = _masked_max(gap, tokens)
    numbers = torch.stack([v.reshape(()).to(torch.float64) for v in values.values()]).tolist()
    return dict(zip(values, numbers, strict=True))
