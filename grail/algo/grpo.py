"""The GRPO objective: group advantages and the policy loss (the per-token log-probs and entropy
it takes are computed in grail/algo/logprobs.py, re-exported here).

Tensors in, a loss and a dict of plain-float metrics out: no model, no I/O. The loss follows
TRL's ``GRPOTrainer._compute_loss`` term for term (tests/test_trl_parity.py runs TRL itself),
with TRL's names (``loss_type`` grpo | bnpo | dr_grpo | dapo, ``importance_sampling_level``
token | sequence, ``epsilon``/``epsilon_high``), so that a run configured here means what the
same settings mean in TRL.

Notation (one micro-batch of B completions padded to T tokens):
    logp[b,t]   log π_θ(y_t | y_<t)          current policy, carries the gradient
    old[b,t]    log π_old(y_t | y_<t)        the policy the samples are optimised away from
    ref[b,t]    log π_ref(y_t | y_<t)        frozen reference (KL penalty)
    beh[b,t]    log μ(y_t | y_<t)            behaviour policy: what the inference server reported
    m[b,t]      1 on completion tokens, 0 on padding
    A[b]        advantage of completion b

The per-token objective (minimised), aggregated by ``loss_type`` as L_pg below:

    ℓ[b,t] = w[b,t] · pg[b,t]  +  β · KL[b,t] · (ρ[b,t] if kl_bias_correction else 1)

    pg[b,t] = −min(ρ'·A[b], clip(ρ, 1 − ε, 1 + ε_high)·A[b])
    ρ       = exp(s),  s = logp − old per token ("token"), or the length-normalised sequence
              log ratio  s[b] = Σ_t m·(logp − old) / max(Σ_t m, 1)  broadcast to tokens ("sequence",
              GSPO; TRL's ``log_importance_weights``); s is first clamped to [−c, c] when
              ``logratio_clamp`` = c is set
    ρ'      = min(ρ, δ) with δ = ``is_ratio_max`` (TRL's ``delta``, two-sided clipping), else ρ
    w[b,t]  importance sampling between the trainer's "old" policy and the server's sampling
            policy (TRL's ``vllm_importance_sampling_mode``, ``is_correction`` here), from
            d = m·(old − beh):  token_*: r = exp(d[b,t]);  sequence_*: r = exp(Σ_t d[b,t]) for
            every token of b;  *_truncate: w = clamp(r, C_min, C_max);  *_mask: w = r inside
            [C_min, C_max], 0 outside;  "none": w = 1.  C = ``is_clip_min``/``is_clip_max``
    KL      = k1: logp − ref;  k2: ½(logp − ref)²;  k3: exp(ref − logp) − (ref − logp) − 1,
              times ρ (before δ; it carries gradient, so even on-policy, where ρ = 1, the KL
              gradient changes) when ``kl_bias_correction`` (TRL's ``use_bias_correction_kl``)

TRL's normalisers, for a micro-batch of B completions that is one of G in its optimizer step
(G = ``accumulation_steps``, TRL's ``current_gradient_accumulation_steps``), the generation batch
holding N completion tokens in S micro-batches (``num_items_in_batch``, ``steps_per_generation``):

    grpo     L_pg = 1/B · Σ_b [ Σ_t m·ℓ / max(Σ_t m, 1) ] / G    per-sequence mean, then mean
    bnpo     L_pg = Σ_{b,t} m·ℓ / max(Σ_{b,t} m, 1) / G           token mean over the micro-batch
    dr_grpo  L_pg = Σ_{b,t} m·ℓ / (B · max_completion_length) / G  no length normalisation
    dapo     L_pg = Σ_{b,t} m·ℓ / (N · G / S)                     N·G/S: the tokens of one
             optimizer step's window when the generation batch's are spread evenly over it

and the entropy bonus, whatever the loss type (H: the current policy's per-token entropy):

    L = L_pg − α · Σ_{b,t} m·H / max(Σ_{b,t} m, 1) / G

The returned loss is this L: the caller back-propagates it as it is and steps the optimizer
after the G micro-batches of the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import torch
from torch import Tensor

from grail.algo.logprobs import DEFAULT_CHUNK_SIZE, token_entropy, token_logprobs
from grail.core.config import (
    ImportanceSamplingLevel,
    ISCorrection,
    KLEstimator,
    LossType,
    ScaleRewards,
)

if TYPE_CHECKING:
    from grail.core.config import Config

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "GRPOLossConfig",
    "ISCorrection",
    "ImportanceSamplingLevel",
    "KLEstimator",
    "LossType",
    "ScaleRewards",
    "compute_advantages",
    "grpo_loss",
    "token_entropy",
    "token_logprobs",
]


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


# --------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------


def compute_advantages(
    rewards: Tensor,
    scale_rewards: ScaleRewards = "group",
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
    _check_choice("scale_rewards", scale_rewards, get_args(ScaleRewards))
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


# --------------------------------------------------------------------------------------------
# The loss
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GRPOLossConfig:
    """Settings of the GRPO objective; see the module docstring for the formulas.

    loss_type, importance_sampling_level, epsilon, epsilon_high: as TRL's GRPOConfig.
    kl_coef: β (TRL's ``beta``); ``ref_logprobs`` are required when > 0.
    kl_estimator: k1 | k2 | k3 (Schulman's estimators of KL(π_θ ‖ π_ref); TRL uses k3).
    kl_bias_correction: multiply the KL term by the policy ratio ρ (TRL's
        ``use_bias_correction_kl``, default True there and here).
    entropy_coef: α, weight of the entropy bonus; ``entropy`` is required when > 0.
    is_ratio_max: δ, cap on the unclipped ratio (TRL's ``delta``). It must exceed
        1 + epsilon_high, where it only ever bites on negative advantages (a token made far
        more likely although its completion was bad).
    logratio_clamp: c, clamp of the log importance weight to [−c, c] before exp; tokens beyond
        it get no policy gradient (a hard trust region that also keeps exp finite).
    is_correction, is_clip_min, is_clip_max: importance sampling between the trainer's old
        log-probs and the server's (TRL's ``vllm_importance_sampling_mode``,
        ``vllm_importance_sampling_clip_min``/``_max``; "none" turns it off, a None bound is
        open); ``behaviour_logprobs`` are required unless "none".
    max_completion_length: the dr_grpo normaliser (required for dr_grpo).
    """

    loss_type: LossType = "grpo"
    importance_sampling_level: ImportanceSamplingLevel = "token"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_bias_correction: bool = True
    entropy_coef: float = 0.0
    is_ratio_max: float | None = None
    logratio_clamp: float | None = None
    is_correction: ISCorrection = "none"
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        _check_choice("loss_type", self.loss_type, get_args(LossType))
        _check_choice(
            "importance_sampling_level",
            self.importance_sampling_level,
            get_args(ImportanceSamplingLevel),
        )
        _check_choice("kl_estimator", self.kl_estimator, get_args(KLEstimator))
        _check_choice("is_correction", self.is_correction, get_args(ISCorrection))

        def positive(name: str, value: float | None) -> None:
            if value is None:
                return
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")

        def non_negative(name: str, value: float) -> None:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

        positive("epsilon", self.epsilon)
        positive("epsilon_high", self.epsilon_high)
        non_negative("kl_coef", self.kl_coef)
        non_negative("entropy_coef", self.entropy_coef)
        positive("is_ratio_max", self.is_ratio_max)
        positive("logratio_clamp", self.logratio_clamp)
        positive("is_clip_min", self.is_clip_min)
        positive("is_clip_max", self.is_clip_max)
        lo, hi = self.is_clip_min, self.is_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ValueError(f"is_clip_min ({lo}) must be < is_clip_max ({hi})")
        if self.is_ratio_max is not None and self.is_ratio_max <= 1.0 + self.eps_high:
            raise ValueError(
                f"is_ratio_max ({self.is_ratio_max}) must be > 1 + epsilon_high "
                f"({1.0 + self.eps_high}); a lower cap would clip the ratio inside the trust region"
            )
        mcl = self.max_completion_length
        if mcl is not None and (isinstance(mcl, bool) or not isinstance(mcl, int) or mcl < 1):
            raise ValueError(f"max_completion_length must be a positive int, got {mcl!r}")
        if self.loss_type == "dr_grpo" and mcl is None:
            raise ValueError(
                "loss_type 'dr_grpo' requires max_completion_length (its normaliser is "
                "B * max_completion_length)"
            )

    @classmethod
    def from_config(cls, cfg: Config) -> GRPOLossConfig:
        """The objective `grail-train` optimises: `train.*`, and `generation.max_new_tokens` as
        the dr_grpo normaliser."""
        t = cfg.train
        return cls(
            loss_type=t.loss_type,  # type: ignore[arg-type]  # checked by config.validate
            importance_sampling_level=t.importance_sampling_level,  # type: ignore[arg-type]
            epsilon=t.epsilon,
            epsilon_high=t.epsilon_high,
            kl_coef=t.kl_coef,
            kl_estimator=t.kl_estimator,  # type: ignore[arg-type]
            kl_bias_correction=t.kl_bias_correction,
            is_ratio_max=t.is_ratio_max,
            logratio_clamp=t.logratio_clamp,
            entropy_coef=t.entropy_coef,
            is_correction=t.is_correction,  # type: ignore[arg-type]
            is_clip_min=t.is_clip_min,
            is_clip_max=t.is_clip_max,
            max_completion_length=cfg.generation.max_new_tokens,
        )

    @property
    def eps_high(self) -> float:
        """Upper clip width: ``epsilon_high``, or ``epsilon`` when unset (symmetric clipping)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


def _check_same(name: str, x: Tensor | None, like: Tensor) -> None:
    if x is None:
        return
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.shape != like.shape:
        raise ValueError(
            f"{name} shape {tuple(x.shape)} does not match logprobs shape {tuple(like.shape)}"
        )
    if x.device != like.device:
        raise ValueError(f"{name} is on {x.device} but logprobs on {like.device}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be floating point, got dtype {x.dtype}")


def grpo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    config: GRPOLossConfig,
    ref_logprobs: Tensor | None = None,
    behaviour_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    num_items_in_batch: int | float | Tensor | None = None,
    accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    microbatch_counts: tuple[int, int] | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss of one micro-batch and its metrics (formulas in the module docstring).

    Args:
        logprobs: [B, T] current-policy log-probs of the completion tokens (carries the grad).
        old_logprobs: [B, T] log-probs under the policy being optimised away from.
        advantages: [B] one advantage per completion.
        mask: [B, T] 1 for completion tokens, 0 for padding (bool, int or float 0/1).
        config: the loss settings.
        ref_logprobs: [B, T] frozen reference log-probs; required when ``kl_coef > 0``, and
            used for the ``kl`` metric whenever given.
        behaviour_logprobs: [B, T] what the inference server reported when sampling; required
            unless ``is_correction`` is "none"; feeds the ``logprob_mismatch`` metrics whenever
            given.
        entropy: [B, T] per-token entropy; required when ``entropy_coef > 0``. Unlike the other
            inputs it is not detached: the bonus acts through its gradient.
        num_items_in_batch: completion tokens in the whole generation batch (dapo only, where
            it is required).
        accumulation_steps: G, the micro-batches of this optimizer step (this one included).
        steps_per_generation: S, the micro-batches of the generation batch (dapo only).
        microbatch_counts: (B, Σ m) of the whole micro-batch when these inputs are one piece of
            it (padding-free pieces, grail/train/packing.py): the normalisers above and the
            entropy bonus's use them instead of this piece's own, so the pieces' losses (and
            gradients) add up to the micro-batch's. None: the inputs are the micro-batch.

    Only ``logprobs`` (and ``entropy``) receive gradient: old, ref, behaviour and advantages
    are detached. Padding positions never matter, whatever they hold (NaN included).

    Metrics (plain floats): ``loss_total``, ``loss_pg``, ``loss_kl``, ``loss_entropy`` (each
    term of the returned loss times G, the loss of a step made of micro-batches like this one;
    they sum to ``loss_total``), ``ratio_mean``, ``ratio_max`` (ρ after ``logratio_clamp``,
    before ``is_ratio_max``), ``clip_frac_low`` (ρ < 1 − ε and A < 0), ``clip_frac_high``
    (ρ > 1 + ε_high and A > 0), ``clip_frac`` (either), ``ratio_cap_frac``,
    ``logratio_clamp_frac``, ``is_clip_frac`` (importance ratios truncated or masked),
    ``is_weight_mean``, ``is_ess`` ((Σw)² / (n Σw²); 1.0 with the correction off),
    ``num_tokens``; ``kl`` (the estimator, without the bias correction) when ``ref_logprobs``
    is given, ``entropy`` when ``entropy`` is given, ``logprob_mismatch`` and
    ``logprob_mismatch_max`` (|old − behaviour|) when ``behaviour_logprobs`` is given. Ratio,
    clip and importance-sampling fractions are over completion tokens at token level and over
    sequences at sequence level, as TRL reports them.
    """
    if not isinstance(config, GRPOLossConfig):
        raise TypeError(f"config must be a GRPOLossConfig, got {type(config).__name__}")
    if not isinstance(logprobs, Tensor):
        raise TypeError(f"logprobs must be a torch.Tensor, got {type(logprobs).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if not logprobs.is_floating_point():
        raise TypeError(f"logprobs must be floating point, got dtype {logprobs.dtype}")
    batch = logprobs.shape[0]
    if batch == 0:
        raise ValueError("empty batch: logprobs has B = 0")
    _check_same("old_logprobs", old_logprobs, logprobs)
    _check_same("ref_logprobs", ref_logprobs, logprobs)
    _check_same("behaviour_logprobs", behaviour_logprobs, logprobs)
    _check_same("entropy", entropy, logprobs)
    if old_logprobs is None:
        raise ValueError("old_logprobs is required (pass logprobs.detach() when on-policy)")
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != logprobs.shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} does not match logprobs shape {tuple(logprobs.shape)}"
        )
    if mask.device != logprobs.device:
        raise ValueError(f"mask is on {mask.device} but logprobs on {logprobs.device}")
    if not isinstance(advantages, Tensor):
        raise TypeError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if advantages.shape != (batch,):
        raise ValueError(
            f"advantages must be [B] = [{batch}] (one per completion), got shape "
            f"{tuple(advantages.shape)}"
        )
    if advantages.device != logprobs.device:
        raise ValueError(f"advantages on {advantages.device} but logprobs on {logprobs.device}")
    if not advantages.is_floating_point():
        raise TypeError(f"advantages must be floating point, got dtype {advantages.dtype}")
    if not bool(torch.isfinite(advantages).all()):
        raise ValueError("advantages contain NaN or inf")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {config.kl_coef} > 0 requires ref_logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef = {config.entropy_coef} > 0 requires entropy")
    if config.is_correction != "none" and behaviour_logprobs is None:
        raise ValueError(f"is_correction = {config.is_correction!r} requires behaviour_logprobs")
    for name, count in (
        ("accumulation_steps", accumulation_steps),
        ("steps_per_generation", steps_per_generation),
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{name} must be a positive int, got {count!r}")

    # float32 at least (float64 stays float64): bf16 ratios of nearby log-probs are noise.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    if mask.dtype == torch.bool:
        keep = mask
    else:
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError("mask must hold only 0 and 1 (completion token or padding)")
        keep = mask != 0
    m = keep.to(dtype)
    tokens_per_seq = m.sum(-1)
    num_tokens = tokens_per_seq.sum()
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

    if config.loss_type == "dapo":
        if num_items_in_batch is None:
            raise ValueError(
                "loss_type 'dapo' requires num_items_in_batch (completion tokens in the whole "
                "generation batch)"
            )
        n_items = float(num_items_in_batch)
        if not (math.isfinite(n_items) and n_items > 0):
            raise ValueError(f"num_items_in_batch must be a finite number > 0, got {n_items}")
        if n_items < float(num_tokens):
            raise ValueError(
                f"num_items_in_batch ({n_items:g}) is smaller than the completion tokens in this "
                f"micro-batch ({int(num_tokens)}); it must count the whole generation batch"
            )
        if accumulation_steps > steps_per_generation:
            raise ValueError(
                f"accumulation_steps ({accumulation_steps}) exceeds steps_per_generation "
                f"({steps_per_generation}): an optimizer step cannot span more micro-batches "
                "than the generation batch has"
            )
    if config.loss_type == "dr_grpo":
        longest = int(tokens_per_seq.max())
        if longest > config.max_completion_length:  # type: ignore[operator]
            raise ValueError(
                f"a completion has {longest} tokens, more than max_completion_length "
                f"({config.max_completion_length}) that dr_grpo normalises by"
            )

    def clean(x: Tensor, grad: bool = False) -> Tensor:
        # Zero the padding before any arithmetic, so NaN/inf there cannot leak into the loss
        # or (via 0 · inf in backward) into the gradient.
        x = x if grad else x.detach()
        return torch.where(keep, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))

    logp = clean(logprobs, grad=True)
    old = clean(old_logprobs)
    adv = advantages.detach().to(dtype).unsqueeze(1)  # [B, 1]
    steps = accumulation_steps

    def aggregate(x: Tensor) -> Tensor:
        """Σ m·x by the loss type's normaliser, accumulation included (module docstring)."""
        x = x.expand_as(m) * m
        if config.loss_type == "grpo":
            per_sequence = x.sum(-1) / tokens_per_seq.clamp(min=1.0)
            if microbatch_counts is None:
                return per_sequence.mean() / steps
            return per_sequence.sum() / norm_batch / steps
        if config.loss_type == "bnpo":
            return x.sum() / norm_tokens / steps
        if config.loss_type == "dr_grpo":
            return x.sum() / (norm_batch * config.max_completion_length) / steps  # type: ignore[operator]
        return x.sum() / (n_items * steps / steps_per_generation)  # dapo

    # Log importance weights: per token, or GSPO's length-normalised sequence log ratio.
    log_ratio = logp - old
    if config.importance_sampling_level == "token":
        log_w = log_ratio
    else:
        log_w = (log_ratio.sum(-1) / tokens_per_seq.clamp(min=1.0)).unsqueeze(-1)  # [B, 1]
    if config.logratio_clamp is not None:
        clamped = log_w.detach().abs() > config.logratio_clamp
        log_w = log_w.clamp(-config.logratio_clamp, config.logratio_clamp)
    else:
        clamped = torch.zeros_like(log_w, dtype=torch.bool)

    eps_low, eps_high = config.epsilon, config.eps_high
    policy_ratio = torch.exp(log_w)  # ρ, with its gradient (the KL bias correction uses it)
    coef_1 = policy_ratio
    coef_2 = torch.clamp(coef_1, 1.0 - eps_low, 1.0 + eps_high)
    ratio = coef_1.detach()
    if config.is_ratio_max is not None:
        capped = ratio > config.is_ratio_max
        coef_1 = torch.clamp(coef_1, max=config.is_ratio_max)
    else:
        capped = torch.zeros_like(ratio, dtype=torch.bool)
    pg = -torch.min(coef_1 * adv, coef_2 * adv)  # [B, T] or [B, 1]

    if config.is_correction != "none":
        # TRL computes the log difference masked, with NaN (a token the server could not
        # score) as 0; the sequence modes sum it (a product of token ratios, not a mean).
        beh = clean(behaviour_logprobs)  # type: ignore[arg-type]
        diff = torch.nan_to_num(old - beh, nan=0.0)
        if config.is_correction.startswith("sequence"):
            diff = diff.sum(-1, keepdim=True)  # [B, 1]
        raw = torch.exp(diff)
        lo, hi = config.is_clip_min, config.is_clip_max
        outside = torch.zeros_like(raw, dtype=torch.bool)
        if lo is not None:
            outside |= raw < lo
        if hi is not None:
            outside |= raw > hi
        if config.is_correction.endswith("truncate"):
            is_w = raw if lo is None and hi is None else torch.clamp(raw, min=lo, max=hi)
        else:
            is_w = raw.masked_fill(outside, 0.0)
        pg = pg * is_w
    else:
        is_w = torch.ones_like(m[:, :1])
        outside = torch.zeros_like(is_w, dtype=torch.bool)

    loss_pg = aggregate(pg)
    zero = logp.new_zeros(())

    kl_tok: Tensor | None = None
    if ref_logprobs is not None:
        ref = clean(ref_logprobs)
        # The KL term carries gradient only when it is part of the loss.
        cur = logp if config.kl_coef > 0 else logp.detach()
        if config.kl_estimator == "k1":
            kl_tok = cur - ref
        elif config.kl_estimator == "k2":
            kl_tok = 0.5 * (cur - ref) ** 2
        else:
            kl_tok = torch.exp(ref - cur) - (ref - cur) - 1.0
    loss_kl = zero
    if kl_tok is not None and config.kl_coef > 0:
        kl_term = kl_tok * policy_ratio if config.kl_bias_correction else kl_tok
        loss_kl = config.kl_coef * aggregate(kl_term)

    ent: Tensor | None = None
    if entropy is not None:
        ent = torch.where(keep, entropy.to(dtype), torch.zeros((), dtype=dtype, device=m.device))
    loss_entropy = zero
    if ent is not None and config.entropy_coef > 0:
        # A token mean whatever the loss type (TRL): the bonus does not depend on how the
        # policy term is normalised.
        loss_entropy = -config.entropy_coef * (ent.sum() / norm_tokens) / steps

    loss = loss_pg + loss_kl + loss_entropy

    # Metrics: gathered into one tensor so a GPU run pays one device sync, not twenty.
    with torch.no_grad():
        count = num_tokens.clamp(min=1.0)

        def token_mean(x: Tensor) -> Tensor:
            return (x.to(dtype) * m).sum() / count

        def unit_mean(x: Tensor) -> Tensor:
            # TRL's masked_batch_mean: per token, or per sequence at sequence level.
            return x.to(dtype).mean() if x.shape[-1] == 1 else token_mean(x)

        def masked_max(x: Tensor) -> Tensor:
            if x.shape[-1] == 1:
                return x.max().to(dtype)
            top = x.to(dtype).masked_fill(~keep, float("-inf")).max()
            return torch.where(num_tokens > 0, top, torch.zeros_like(top))  # 0 with no tokens

        low = (ratio < 1.0 - eps_low) & (adv < 0)
        high = (ratio > 1.0 + eps_high) & (adv > 0)
        names = [
            "loss_total",
            "loss_pg",
            "loss_kl",
            "loss_entropy",
            "ratio_mean",
            "ratio_max",
            "clip_frac_low",
            "clip_frac_high",
            "clip_frac",
            "ratio_cap_frac",
            "logratio_clamp_frac",
            "is_clip_frac",
            "is_weight_mean",
            "is_ess",
            "num_tokens",
        ]
        # Normalised effective sample size of the importance weights (per token, or per sequence
        # in the sequence modes): 1 when all equal, 1/n when one carries all the weight. Defined
        # as 1 with nothing to weigh or all-zero weights.
        units = m if is_w.shape[-1] != 1 else torch.ones_like(is_w)
        w_sum = (is_w * units).sum()
        w_sq = (is_w * is_w * units).sum()
        ess = torch.where(
            w_sq > 0, w_sum * w_sum / (units.sum() * w_sq).clamp(min=1e-30), torch.ones_like(w_sq)
        ).clamp(max=1.0)
        values = [
            loss.detach() * steps,
            loss_pg.detach() * steps,
            loss_kl.detach() * steps,
            loss_entropy.detach() * steps,
            unit_mean(ratio),
            masked_max(ratio),
            unit_mean(low),
            unit_mean(high),
            unit_mean(low | high),
            unit_mean(capped),
            unit_mean(clamped),
            unit_mean(outside),
            unit_mean(is_w),
            ess,
            num_tokens,
        ]
        if kl_tok is not None:
            names.append("kl")
            values.append(token_mean(kl_tok.detach()))
        if ent is not None:
            names.append("entropy")
            values.append(token_mean(ent.detach()))
        if behaviour_logprobs is not None:
            gap = (old - clean(behaviour_logprobs)).abs()
            names += ["logprob_mismatch", "logprob_mismatch_max"]
            values += [token_mean(gap), masked_max(gap)]
        numbers = torch.stack([v.reshape(()).to(torch.float64) for v in values]).tolist()
    return loss, dict(zip(names, numbers, strict=True))
