"""The Tinker SDK's built-in loss functions, each as its documented formula, per datum.

Tensors in, tensors out; no model here. ``logp`` [N] is the policy's log-probability of each of
a datum's ``target_tokens`` (position t predicts ``target_tokens[t]`` from ``model_input[:t+1]``),
computed with gradient by the trainer. Every loss is a SUM over tokens and datums (not a mean):
a client normalises through its weights or advantages, as on the hosted service.

- ``cross_entropy`` (inputs ``target_tokens``, ``weights``)::

      L = sum_t  -w_t * logp_t

- ``importance_sampling`` (inputs ``target_tokens``, ``logprobs`` = q, the sampler's
  log-probabilities, ``advantages`` = A)::

      ratio_t = exp(logp_t - q_t)
      L = sum_t  -ratio_t * A_t

  whose gradient is the REINFORCE gradient ``-ratio_t * A_t * grad logp_t`` corrected for the
  sampler not being exactly the learner.
- ``ppo`` (same inputs; ``loss_fn_config`` ``clip_low_threshold`` = lo, default 0.8, and
  ``clip_high_threshold`` = hi, default 1.2: bounds on the ratio itself, 1 -/+ epsilon)::

      L = sum_t  -min(ratio_t * A_t, clip(ratio_t, lo, hi) * A_t)

- ``cispo`` (same inputs and config as ppo, same defaults): the clipped ratio, held constant
  (``sg``, stop-gradient), weighs the log-probability::

      L = sum_t  -sg(clip(ratio_t, lo, hi)) * logp_t * A_t

- ``dro`` (same inputs; ``loss_fn_config`` ``beta``, required: the hosted service documents the
  loss but not a default, and guessing one would train with a penalty nobody chose)::

      L = sum_t  -(logp_t * A_t - beta / 2 * (logp_t - q_t)^2)

Each returns the per-token loss (``elementwise_loss``, summed into ``loss:sum``); the response also
carries ``logprobs`` (logp, detached).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

PPO_CLIP_LOW, PPO_CLIP_HIGH = 0.8, 1.2

# The inputs each loss reads, besides target_tokens (which every loss needs).
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
}
# loss_fn_config keys each loss reads; others are refused (a typo must not be ignored silently).
CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
}
# The losses that clip the ratio (their records count the clipped tokens).
CLIPPED = ("ppo", "cispo")


def clip_bounds(config: Mapping[str, float]) -> tuple[float, float]:
    """(lo, hi) of a clipping loss: its ``loss_fn_config`` thresholds, or ppo's defaults."""
    return (
        config.get("clip_low_threshold", PPO_CLIP_LOW),
        config.get("clip_high_threshold", PPO_CLIP_HIGH),
    )


class LossInputError(ValueError):
    """A loss function, its config or a datum's inputs this server cannot use."""


def check_loss(loss_fn: str, config: Mapping[str, float | str]) -> dict[str, float]:
    """The loss's numeric config, after refusing an unknown loss or config key."""
    if loss_fn not in REQUIRED_INPUTS:
        supported = ", ".join(REQUIRED_INPUTS)
        raise LossInputError(
            f"loss_fn {loss_fn!r} is not supported by this server (supported: {supported})"
        )
    unknown = sorted(set(config) - set(CONFIG_KEYS[loss_fn]))
    if unknown:
        allowed = ", ".join(CONFIG_KEYS[loss_fn]) or "none"
        raise LossInputError(
            f"loss_fn_config key(s) {', '.join(unknown)} are not used by {loss_fn} "
            f"(it takes: {allowed})"
        )
    numeric: dict[str, float] = {}
    for key, value in config.items():
        if not isinstance(value, int | float) or value != value:
            raise LossInputError(f"loss_fn_config {key}={value!r} must be a finite number")
        numeric[key] = float(value)
    if loss_fn in CLIPPED:
        lo, hi = clip_bounds(numeric)
        if not 0 <= lo <= 1 <= hi:
            raise LossInputError(
                f"{loss_fn} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {lo}, {hi}"
            )
    if loss_fn == "dro" and not numeric.get("beta", -1.0) >= 0:
        raise LossInputError(
            "dro needs loss_fn_config={'beta': B} with B >= 0 (the weight of its quadratic "
            "penalty; no default is documented, so none is assumed)"
        )
    return numeric


def cross_entropy(
    logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> Tensor:
    return -inputs["weights"] * logp


def importance_sampling(
    logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]
) -> Tensor:
    ratio = torch.exp(logp - inputs["logprobs"])
    return -ratio * inputs["advantages"]


def ppo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    lo, hi = clip_bounds(config)
    ratio = torch.exp(logp - inputs["logprobs"])
    advantages = inputs["advantages"]
    return -torch.minimum(ratio * advantages, torch.clamp(ratio, lo, hi) * advantages)


def cispo(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    lo, hi = clip_bounds(config)
    weight = torch.clamp(torch.exp(logp - inputs["logprobs"]), lo, hi).detach()
    return -weight * logp * inputs["advantages"]


def dro(logp: Tensor, inputs: Mapping[str, Tensor], config: Mapping[str, float]) -> Tensor:
    penalty = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * config["beta"] * penalty)


LOSSES: dict[str, Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
}
