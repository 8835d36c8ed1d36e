"""Group-relative advantages: what each completion's reward is worth against its group's.

Rewards in, one advantage per completion and plain-float statistics out: no model, no I/O. The
formula is TRL's (``GRPOTrainer._generate_and_score_completions``, ``scale_rewards``); the loss
that consumes the advantages is in grail/algo/grpo.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from grail.core.choices import ScaleRewards

__all__ = ["ScaleRewards", "compute_advantages"]


def compute_advantages(
    rewards: Tensor,
    scale_rewards: ScaleRewards = ScaleRewards.group,
    clip_percentile: float | None = None,
    eps: float = 1e-4,
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages from rewards ``[num_groups, group_size]`` (TRL's formula).

        A[g,i] = r[g,i] − mean_i r[g,i]
        "group":  A[g,i] /= std_i r[g,i] + eps      (unbiased std within the group)
        "batch":  A[g,i] /= std_{g,i} r[g,i] + eps  (unbiased std over the whole batch)
        "none":   A unscaled (Dr. GRPO's recommendation: scaling biases towards easy/hard groups)

    A group whose rewards are all equal carries no learning signal: its advantages are set to
    exactly 0 (not merely ~1e-8 from rounding of the mean), so it contributes exactly zero
    policy gradient, and it is counted in ``zero_variance_groups`` / ``zero_variance_group_frac``
    (TRL's ``frac_reward_zero_std``).

    ``clip_percentile`` = p clamps A to ±c with c the p-th percentile (linear interpolation) of
    |A|. The percentile is taken over the groups that carry signal only: zero-variance groups
    contribute exact zeros that would otherwise drag c towards 0 (with half the groups solved or
    failed outright, p = 50 would zero every advantage).

    Returns float32 advantages of the same shape and stats (plain floats): ``reward_mean``,
    ``reward_std`` (whole batch), ``reward_std_group_mean`` (mean within-group std),
    ``zero_variance_groups``, ``zero_variance_group_frac``, ``adv_abs_mean``, ``adv_clip_frac``,
    and ``adv_clip_value`` when clipping is on.
    """
    allowed = tuple(ScaleRewards)
    if scale_rewards not in allowed:
        raise ValueError(
            f"unknown scale_rewards {scale_rewards!r}; expected one of {', '.join(allowed)}"
        )
    if not isinstance(rewards, Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be [num_groups, group_size], got shape {tuple(rewards.shape)}"
        )
    num_groups, group_size = rewards.shape
    if num_groups == 0:
        raise ValueError("rewards has no groups (shape [0, group_size])")
    if group_size < 2:
        raise ValueError(
            f"group_size must be >= 2 for group-relative advantages, got {group_size}: "
            "a single completion per prompt has no group baseline and yields zero advantage"
        )
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise TypeError(f"rewards must be real numbers, got dtype {rewards.dtype}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be a finite number >= 0, got {eps}")
    if clip_percentile is not None and not (0.0 < clip_percentile <= 100.0):
        raise ValueError(f"clip_percentile must be in (0, 100], got {clip_percentile}")

    # float64 so that centring and scaling add no error of their own before the float32 output.
    r = rewards.detach().to(torch.float64)
    finite = torch.isfinite(r)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise ValueError(
            f"rewards contain {int((~finite).sum())} non-finite value(s), first at "
            f"[group {bad[0]}, sample {bad[1]}]"
        )

    adv = r - r.mean(dim=1, keepdim=True)
    group_std = r.std(dim=1, keepdim=True)
    if scale_rewards == "group":
        adv = adv / (group_std + eps)
    elif scale_rewards == "batch":
        adv = adv / (r.std() + eps)

    zero_var = r.amax(dim=1) == r.amin(dim=1)  # exact: no tolerance to tune
    adv = torch.where(zero_var.unsqueeze(1), torch.zeros_like(adv), adv)

    stats: dict[str, float] = {
        "reward_mean": float(r.mean()),
        "reward_std": float(r.std()) if r.numel() > 1 else 0.0,
        "reward_std_group_mean": float(group_std.mean()),
        "zero_variance_groups": float(zero_var.sum()),
        "zero_variance_group_frac": float(zero_var.double().mean()),
    }

    clip_frac = 0.0
    if clip_percentile is not None:
        signal = adv[~zero_var].abs().flatten()
        if signal.numel() > 0:
            c = torch.quantile(signal, clip_percentile / 100.0)
            clipped = adv.abs() > c
            clip_frac = float(clipped.double().mean())
            adv = adv.clamp(-c, c)
            stats["adv_clip_value"] = float(c)
        else:
            stats["adv_clip_value"] = 0.0
    stats["adv_clip_frac"] = clip_frac
    stats["adv_abs_mean"] = float(adv.abs().mean())
    return adv.to(torch.float32), stats
