"""The GRPO policy loss (the advantages it takes are computed in grail/algo/advantages.py, the
per-token log-probs and entropy in grail/algo/logprobs.py, re-exported here).

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

The per-token objective (minimised):

    ℓ[b,t] = w[b,t] · pg[b,t]  +  β · KL[b,t] · (ρ[b,t] if kl_bias_correction else 1)

aggregated over the micro-batch by the loss type's normaliser into L_pg, minus an entropy bonus:

    L = L_pg − α · Σ_{b,t} m·H / max(Σ_{b,t} m, 1) / G

`grpo_loss` computes it in steps, each a small pure function in grail/algo/grpo_terms.py with
its formula beside it: `log_importance_weights` (s, ρ = exp(s)), `clipped_surrogate` (pg, ρ'),
`importance_weights` (w), `Normaliser` (L_pg and the other terms by the loss type's normaliser),
`kl_estimate` and `kl_penalty` (KL), `entropy_bonus`, `loss_metrics`.

The returned loss is L: the caller back-propagates it as it is and steps the optimizer after
the G micro-batches of the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from grail.algo.grpo_terms import (
    Normaliser,
    clipped_surrogate,
    count_tokens,
    entropy_bonus,
    importance_weights,
    kl_estimate,
    kl_penalty,
    log_importance_weights,
    loss_metrics,
    masked,
)
from grail.algo.logprobs import DEFAULT_CHUNK_SIZE, token_entropy, token_logprobs
from grail.core.choices import ImportanceSamplingLevel, ISCorrection, KLEstimator, LossType

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "GRPOLossConfig",
    "ISCorrection",
    "ImportanceSamplingLevel",
    "KLEstimator",
    "LossType",
    "grpo_loss",
    "token_entropy",
    "token_logprobs",
]


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")


# --------------------------------------------------------------------------------------------
# Settings
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GRPOLossConfig:
    """Settings of the GRPO objective; the formulas are in the functions that use them (below).

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

    loss_type: LossType = LossType.grpo
    importance_sampling_level: ImportanceSamplingLevel = ImportanceSamplingLevel.token
    epsilon: float = 0.2
    epsilon_high: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.k3
    kl_bias_correction: bool = True
    entropy_coef: float = 0.0
    is_ratio_max: float | None = None
    logratio_clamp: float | None = None
    is_correction: ISCorrection = ISCorrection.none
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        _check_choice("loss_type", self.loss_type, tuple(LossType))
        _check_choice(
            "importance_sampling_level",
            self.importance_sampling_level,
            tuple(ImportanceSamplingLevel),
        )
        _check_choice("kl_estimator", self.kl_estimator, tuple(KLEstimator))
        _check_choice("is_correction", self.is_correction, tuple(ISCorrection))

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

    @property
    def eps_high(self) -> float:
        """Upper clip width: ``epsilon_high``, or ``epsilon`` when unset (symmetric clipping)."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


# --------------------------------------------------------------------------------------------
# The loss, step by step
# --------------------------------------------------------------------------------------------


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
    """The GRPO loss of one micro-batch and its metrics (formulas: the module docstring, and
    each term's beside its function in grail/algo/grpo_terms.py).

    Args:
        logprobs: [B, T] current-policy log-probs of the completion tokens (carries the grad).
        old_logprobs: [B, T] log-probs under the policy being optimised away from.
        advantages: [B] one advantage per completion.
        mask: [B, T] 1 for the tokens the loss covers (those the policy sampled), 0 for padding
            and for an episode's context (bool, int or float 0/1).
        config: the loss settings.
        ref_logprobs: [B, T] frozen reference log-probs; required when ``kl_coef > 0``, and
            used for the ``kl`` metric whenever given.
        behaviour_logprobs: [B, T] what the inference server reported when sampling; required
            unless ``is_correction`` is "none"; feeds the ``logprob_mismatch`` metrics whenever
            given.
        entropy: [B, T] per-token entropy; required when ``entropy_coef > 0``. Unlike the other
            inputs it is not detached: the bonus acts through its gradient.
        num_items_in_batch: sampled (masked-in) tokens in the whole generation batch (dapo
            only, where it is required).
        accumulation_steps: G, the micro-batches of this optimizer step (this one included).
        steps_per_generation: S, the micro-batches of the generation batch (dapo only).
        microbatch_counts: (B, Σ m) of the whole micro-batch when these inputs are one piece of
            it (padding-free pieces, grail/train/packing.py): the normalisers (`Normaliser`) and the
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
    check_inputs(
        config,
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs,
        behaviour_logprobs,
        entropy,
        accumulation_steps,
        steps_per_generation,
    )
    # float32 at least (float64 stays float64): bf16 ratios of nearby log-probs are noise.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    tokens = count_tokens(mask, dtype, microbatch_counts)
    normalise = Normaliser.of(
        config.loss_type,
        tokens,
        config.max_completion_length,
        num_items_in_batch,
        accumulation_steps,
        steps_per_generation,
    )

    logp = masked(logprobs, tokens.keep, dtype, grad=True)
    old = masked(old_logprobs, tokens.keep, dtype)
    adv = advantages.detach().to(dtype).unsqueeze(1)  # [B, 1]

    log_w, clamped = log_importance_weights(
        logp, old, tokens, config.importance_sampling_level, config.logratio_clamp
    )
    policy_ratio = torch.exp(log_w)  # ρ, with its gradient (the KL bias correction uses it)
    pg, capped = clipped_surrogate(
        policy_ratio, adv, config.epsilon, config.eps_high, config.is_ratio_max
    )
    is_w, outside = importance_weights(
        old,
        behaviour_logprobs,
        tokens,
        config.is_correction,
        config.is_clip_min,
        config.is_clip_max,
    )
    if config.is_correction != "none":
        pg = pg * is_w
    loss_pg = normalise(pg)
    zero = logp.new_zeros(())

    kl_tok: Tensor | None = None
    if ref_logprobs is not None:
        ref = masked(ref_logprobs, tokens.keep, dtype)
        # The KL term carries gradient only when it is part of the loss.
        kl_tok = kl_estimate(
            logp if config.kl_coef > 0 else logp.detach(), ref, config.kl_estimator
        )
    loss_kl = zero
    if kl_tok is not None and config.kl_coef > 0:
        loss_kl = kl_penalty(
            kl_tok, policy_ratio, config.kl_coef, config.kl_bias_correction, normalise
        )

    ent = None if entropy is None else masked(entropy, tokens.keep, dtype, grad=True)
    loss_entropy = zero
    if ent is not None and config.entropy_coef > 0:
        loss_entropy = entropy_bonus(ent, tokens, config.entropy_coef, accumulation_steps)

    loss = loss_pg + loss_kl + loss_entropy

    metrics = loss_metrics(
        tokens,
        accumulation_steps,
        epsilon=config.epsilon,
        eps_high=config.eps_high,
        losses=(loss, loss_pg, loss_kl, loss_entropy),
        ratio=policy_ratio.detach(),
        adv=adv,
        capped=capped,
        clamped=clamped,
        is_w=is_w,
        outside=outside,
        kl_tok=kl_tok,
        ent=ent,
        old=old,
        behaviour_logprobs=behaviour_logprobs,
    )
    return loss, metrics


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


def check_inputs(
    config: GRPOLossConfig,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None,
    behaviour_logprobs: Tensor | None,
    entropy: Tensor | None,
    accumulation_steps: int,
    steps_per_generation: int,
) -> None:
    """Refuse, before any arithmetic, inputs of the wrong type, shape or device, non-finite
    advantages, and settings without the inputs they need (`grpo_loss`'s arguments)."""
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
