"""One policy update: a pass over an iteration's rollouts in micro-batches (how a micro-batch is
laid out and run forward: grail/train/microbatch.py).

Old log-probabilities (the policy the samples are optimised away from) follow TRL: when the
iteration makes a single optimizer step they are the current log-probabilities detached (ratio 1,
exactly on-policy); when it makes several, they are computed once before the first step, except
for the first step's own micro-batches, which still see the old policy when they train, so their
detached log-probabilities are the old ones and the extra forward pass is skipped.
The server's behaviour log-probabilities feed the importance-sampling correction and the
mismatch metric (grpo.py).

A batch in which every advantage is exactly 0 (every group's rewards were equal) carries no
gradient when neither the KL nor the entropy term is on: every term of the loss is A times
something finite. Its forward and backward passes are skipped, but not its optimizer steps:
AdamW moves the weights on a zero gradient too (momentum from earlier steps, weight decay, the
step count its bias correction uses), so each step is taken with gradients set to zero, which is
the step the full passes would have led to, and the schedule advances as usual. The record says
`update_skipped: true` and holds null for what needs the policy's log-probabilities.

Sharded over N ranks (torch.distributed initialised, the model under FSDP2: issue 29), every rank
calls `policy_update` with the same batch, settings and sharded model. Each runs its share of
every micro-batch (grail/train/rank_share.py: balanced by tokens, the same pieces per rank, dummy
passes where a rank has fewer), normalised by the whole micro-batch and the whole batch; FSDP2
sums the ranks' gradients; the pieces' metrics are gathered after each optimizer step and merged
as one rank merges its own pieces. The update is then the 1-rank update up to float rounding
(tests/test_distributed_update.py), except for metrics that are not token means: at sequence
level the ratio and clip fractions, and the importance-sampling metrics of the sequence modes and
`is_ess`, are merged per piece as the padding-free layout merges them, by tokens. Without
torch.distributed, or on one rank, none of this runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from grail.algo.grpo import GRPOLossConfig, grpo_loss
from grail.algo.kl_control import AdaptiveKL
from grail.envs import env_factory
from grail.envs.episodes import is_episodic
from grail.rollouts.batch import RolloutBatch
from grail.train.microbatch import (
    MicroBatch,
    microbatch_pieces,
    microbatches,
    pack_microbatch,
    policy_logprobs,
)
from grail.train.packing import (
    packed_row,
    resolve_micro_batch_tokens,
)
from grail.train.rank_comm import all_gather, rank_and_world, sum_gradients_over_ranks
from grail.train.rank_share import rank_share

if TYPE_CHECKING:
    from grail.core.config import Config


def loss_config(cfg: Config) -> GRPOLossConfig:
    """The objective `grail-train` optimises: `train.*`, and the most tokens a completion can
    sample as the dr_grpo normaliser: `generation.max_new_tokens`, times `data.max_turns` for an
    episode environment (TRL's max_completion_length bounds a multi-turn completion whole)."""
    t = cfg.train
    most = cfg.generation.max_new_tokens
    if is_episodic(env_factory(cfg.data.environment)):
        most *= cfg.data.max_turns
    return GRPOLossConfig(
        loss_type=t.loss_type,
        importance_sampling_level=t.importance_sampling_level,
        epsilon=t.epsilon,
        epsilon_high=t.epsilon_high,
        kl_coef=t.kl_coef,
        kl_estimator=t.kl_estimator,
        kl_bias_correction=t.kl_bias_correction,
        is_ratio_max=t.is_ratio_max,
        logratio_clamp=t.logratio_clamp,
        entropy_coef=t.entropy_coef,
        is_correction=t.is_correction,
        is_clip_min=t.is_clip_min,
        is_clip_max=t.is_clip_max,
        max_completion_length=most,
    )


@dataclass
class UpdateSettings:
    loss: GRPOLossConfig
    temperature: float  # the sampling temperature: log-probs are log-softmax(logits / T)
    batch_size: int  # micro-batch, in samples
    grad_accum_steps: int
    grad_clip: float
    micro_batch_tokens: int | None = 0  # padding-free pieces; None: resolve_micro_batch_tokens

    @classmethod
    def from_config(cls, cfg: Config) -> UpdateSettings:
        return cls(
            loss=loss_config(cfg),
            temperature=cfg.generation.temperature,
            batch_size=cfg.train.batch_size,
            grad_accum_steps=cfg.train.grad_accum_steps,
            grad_clip=cfg.train.grad_clip,
            micro_batch_tokens=cfg.train.micro_batch_tokens,
        )


def _merge(
    metrics: list[dict[str, float]], weights: list[float], add: tuple[str, ...] = ()
) -> dict[str, float]:
    """Token-weighted mean of per-micro-batch metrics; maxima stay maxima, counts (and the keys
    in `add`) add up."""
    merged: dict[str, float] = {}
    total = sum(weights) or 1.0
    for key in metrics[0]:
        values = [m[key] for m in metrics if key in m]
        if key.endswith("_max"):
            merged[key] = max(values)
        elif key == "num_tokens" or key in add:
            merged[key] = sum(values)
        else:
            merged[key] = sum(v * w for v, w in zip(values, weights, strict=True)) / total
    return merged


def carries_no_gradient(batch: RolloutBatch, loss: GRPOLossConfig) -> bool:
    """True when the loss gradient of `batch` is exactly zero whatever the weights: every
    advantage is exactly 0 and neither the KL nor the entropy term is on."""
    return (
        loss.kl_coef == 0
        and loss.entropy_coef == 0
        and all(s.advantage == 0.0 for s in batch.samples)
    )


_LOSS_METRICS = ("loss_total", "loss_pg", "loss_kl", "loss_entropy")

# A skipped update's metrics: the loss and its clipping fractions are exactly 0 when every
# advantage is 0 (clipping counts only tokens with A < 0 or A > 0) ...
_ZERO_ADVANTAGE_METRICS = (
    "loss_total",
    "loss_pg",
    "loss_kl",
    "loss_entropy",
    "clip_frac_low",
    "clip_frac_high",
    "clip_frac",
)
# ... and what needs the policy's log-probabilities was not measured (null in the record).
_UNMEASURED_METRICS = (
    "ratio_mean",
    "ratio_max",
    "ratio_cap_frac",
    "logratio_clamp_frac",
    "is_clip_frac",
    "is_weight_mean",
    "is_ess",
    "entropy",
    "logprob_mismatch",
    "logprob_mismatch_max",
)


def _optimizer_step(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    clip_grad_norm: Callable[[float], Tensor],
    grad_clip: float,
) -> float:
    """Clip, step (not on a non-finite norm), clear the gradients, advance the schedule; returns
    the gradient norm before clipping."""
    norm = clip_grad_norm(grad_clip)
    # Sharded parameters (FSDP2) give a DTensor norm: its value is the full tensor's.
    grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return grad_norm


@dataclass(frozen=True)
class _Plan:
    """How one iteration's rollouts are run: `units[i]` is micro-batch i as its forward passes
    run it (one piece, or padding-free pieces), `steps` groups the units of each optimizer step
    and `pieces` lists every forward input in the order they run; `tokens_in_batch` counts the
    sampled tokens of the whole batch. Sharded over ranks, a unit holds this rank's pieces of
    the micro-batch, dummies included (`_rank_plan`)."""

    units: list[list[MicroBatch]]
    steps: list[list[list[MicroBatch]]]
    pieces: list[MicroBatch]
    tokens_in_batch: int


def _plan(
    batch: RolloutBatch, settings: UpdateSettings, pad_token_id: int, device: torch.device
) -> _Plan:
    budget = resolve_micro_batch_tokens(settings.micro_batch_tokens, device)
    units = [
        microbatch_pieces(items, pad_token_id, device, budget)
        for items in microbatches(batch, settings.batch_size)
    ]
    return _plan_of(units, settings, sum(mb.num_tokens for unit in units for mb in unit))


def _plan_of(
    units: list[list[MicroBatch]], settings: UpdateSettings, tokens_in_batch: int
) -> _Plan:
    pieces = [piece for unit in units for piece in unit]
    steps = [
        units[i : i + settings.grad_accum_steps]
        for i in range(0, len(units), settings.grad_accum_steps)
    ]
    return _Plan(units=units, steps=steps, pieces=pieces, tokens_in_batch=tokens_in_batch)


def _rank_plan(
    batch: RolloutBatch,
    settings: UpdateSettings,
    pad_token_id: int,
    device: torch.device,
    rank: int,
    world_size: int,
) -> _Plan:
    """`_plan` of `rank`'s share of every micro-batch (grail/train/rank_share.py), in the same
    layout; each piece normalised as the whole micro-batch (`whole`), the batch's token count
    the whole batch's, so the ranks' losses add up to the 1-rank loss. Every rank runs the same
    number of pieces per micro-batch, made up with dummies (a one-sample piece of the
    micro-batch), and pads completions to the micro-batch's longest: the padded layout runs one
    forward pass when that is 1 token, two otherwise, and the ranks must agree on it."""
    budget = resolve_micro_batch_tokens(settings.micro_batch_tokens, device)
    units: list[list[MicroBatch]] = []
    for items in microbatches(batch, settings.batch_size):
        share = rank_share(items, world_size, rank, budget)
        whole = (len(items), sum(s.num_sampled for _, s in items))
        width = max(1, *(len(s.completion_ids) for _, s in items))
        parts = share.pieces + [items[:1]] * (share.passes - len(share.pieces))
        units.append(
            [
                replace(
                    pack_microbatch(part, pad_token_id, device, min_width=width),
                    packed=packed_row(part, device) if budget > 0 else None,
                    whole=whole,
                    dummy=i >= len(share.pieces),
                )
                for i, part in enumerate(parts)
            ]
        )
    tokens_in_batch = sum(s.num_sampled for s in batch.samples)  # every rank's
    return _plan_of(units, settings, tokens_in_batch)


def _frozen_logprobs(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    plan: _Plan,
    settings: UpdateSettings,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> tuple[list[Tensor | None], list[Tensor | None]]:
    """The old and the reference log-probs of every piece, computed before training starts;
    None where a piece needs none (module docstring)."""

    def logprobs_of(m: torch.nn.Module, mb: MicroBatch) -> Tensor:
        return policy_logprobs(m, mb, settings.temperature, autocast=autocast)[0]

    pieces = plan.pieces
    # Several optimizer steps per iteration: freeze the pre-update policy's log-probs first. The
    # first step's micro-batches need no extra pass: the policy has not moved yet when they run,
    # so their own log-probs, detached, are the old ones (None below).
    old_logprobs: list[Tensor | None] = [None] * len(pieces)
    if len(plan.steps) > 1:
        first = sum(len(unit) for unit in plan.steps[0])
        with torch.no_grad():
            old_logprobs[first:] = [logprobs_of(model, mb) for mb in pieces[first:]]
    ref_logprobs: list[Tensor | None] = [None] * len(pieces)
    if ref_model is not None and settings.loss.kl_coef > 0:
        with torch.no_grad():
            ref_logprobs = [logprobs_of(ref_model, mb) for mb in pieces]
    return old_logprobs, ref_logprobs


def _train_microbatch(
    model: torch.nn.Module,
    unit: list[MicroBatch],
    old_logprobs: list[Tensor | None],
    ref_logprobs: list[Tensor | None],
    loss_config: GRPOLossConfig,
    settings: UpdateSettings,
    *,
    tokens_in_batch: int,
    accumulation_steps: int,
    steps_per_generation: int,
    backward: Callable[[Tensor], None],
    autocast: Callable[[], AbstractContextManager[Any]],
) -> list[tuple[dict[str, float], int]]:
    """Forward, loss and backward of one micro-batch, piece after piece (`unit`, with each
    piece's old and reference log-probs); returns each piece's loss metrics and completion
    tokens, dummies left out."""
    piece_metrics: list[tuple[dict[str, float], int]] = []
    for mb, old, ref in zip(unit, old_logprobs, ref_logprobs, strict=True):
        logprobs, entropy = policy_logprobs(
            model,
            mb,
            settings.temperature,
            entropy=True,
            entropy_grad=settings.loss.entropy_coef > 0,
            autocast=autocast,
        )
        loss, m = grpo_loss(
            logprobs,
            logprobs.detach() if old is None else old,
            mb.advantages,
            mb.loss_mask,
            loss_config,
            ref_logprobs=ref,
            behaviour_logprobs=mb.behaviour_logprobs,
            entropy=entropy,
            num_items_in_batch=tokens_in_batch,
            accumulation_steps=accumulation_steps,
            steps_per_generation=steps_per_generation,
            microbatch_counts=mb.whole,
        )
        if mb.dummy:
            # Its backward still runs: FSDP2 reduce-scatters on every rank together.
            backward(loss * 0.0)
            continue
        backward(loss)  # normalised for the accumulation as TRL does (grpo.py)
        piece_metrics.append((m, mb.num_tokens))
    return piece_metrics


def _unit_metrics(pieces: list[tuple[dict[str, float], int]]) -> tuple[dict[str, float], float]:
    """A micro-batch's loss metrics and completion tokens from its pieces' (on any rank): their
    loss terms add up to the micro-batch's, the rest are token-weighted means."""
    tokens = float(sum(n for _, n in pieces))
    if len(pieces) == 1:
        return pieces[0][0], tokens
    metrics = _merge([m for m, _ in pieces], [float(n) for _, n in pieces], add=_LOSS_METRICS)
    return metrics, tokens


def _token_weighted_kl(step_kl: list[tuple[float, float]]) -> float:
    """The per-token KL of an optimizer step from its micro-batches' (kl, tokens)."""
    tokens = sum(n for _, n in step_kl) or 1.0
    return sum(kl * n for kl, n in step_kl) / tokens


def policy_update(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    settings: UpdateSettings,
    *,
    pad_token_id: int,
    device: torch.device,
    backward: Callable[[Tensor], None],
    clip_grad_norm: Callable[[float], Tensor],
    on_microbatch_done: Callable[[], None] | None = None,
    kl_control: AdaptiveKL | None = None,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> dict[str, float | bool | None]:
    """Train one pass over `batch`; returns the iteration's training metrics.

    `backward` and `clip_grad_norm` come from accelerate (mixed precision, multi-GPU); the
    optimizer steps every `grad_accum_steps` micro-batches and once more on a remainder.
    Non-finite gradient norms skip the step and are counted. A batch that carries no gradient
    (`carries_no_gradient`) skips the forward and backward passes, not the steps (module
    docstring). With `kl_control` each step uses its coefficient, and it adapts to the step's
    measured KL after the step; `kl_coef` in the metrics is the coefficient after the batch.
    With `settings.micro_batch_tokens`, each micro-batch runs as padding-free pieces
    (grail/train/packing.py) inside `autocast`, the trainer's mixed-precision context.
    """
    if not batch.samples:
        raise ValueError("policy_update got a rollout batch with no samples")
    if carries_no_gradient(batch, settings.loss):
        return _zero_gradient_update(
            optimizer, scheduler, batch, settings, clip_grad_norm, on_microbatch_done
        )
    rank, world_size = rank_and_world()
    if world_size > 1:
        sum_gradients_over_ranks(model)
        plan = _rank_plan(batch, settings, pad_token_id, device, rank, world_size)
    else:
        plan = _plan(batch, settings, pad_token_id, device)
    old_logprobs, ref_logprobs = _frozen_logprobs(model, ref_model, plan, settings, autocast)

    model.train()
    metrics: list[dict[str, float]] = []
    weights: list[float] = []
    grad_norms: list[float] = []
    skipped = 0
    index = 0  # of the next piece in plan.pieces
    for step in plan.steps:
        loss_config = settings.loss
        if kl_control is not None:
            loss_config = replace(settings.loss, kl_coef=kl_control.value)
        step_pieces: list[list[tuple[dict[str, float], int]]] = []  # per micro-batch, run here
        for unit in step:
            pieces = _train_microbatch(
                model,
                unit,
                old_logprobs[index : index + len(unit)],
                ref_logprobs[index : index + len(unit)],
                loss_config,
                settings,
                tokens_in_batch=plan.tokens_in_batch,
                accumulation_steps=len(step),
                steps_per_generation=len(plan.units),
                backward=backward,
                autocast=autocast,
            )
            index += len(unit)
            step_pieces.append(pieces)
            if on_microbatch_done is not None:
                on_microbatch_done()
        if world_size > 1:
            # Every rank's pieces of each micro-batch, merged as one rank merges its own: the
            # metrics (and the KL the controller adapts to, on every rank alike) are the
            # 1-rank run's.
            ranks = all_gather(step_pieces)
            step_pieces = [[p for r in ranks for p in r[u]] for u in range(len(step))]
        step_kl: list[tuple[float, float]] = []  # (kl, tokens) per micro-batch
        for pieces in step_pieces:
            m, tokens = _unit_metrics(pieces)
            metrics.append(m)
            weights.append(tokens)
            if "kl" in m:
                step_kl.append((m["kl"], tokens))
        grad_norm = _optimizer_step(optimizer, scheduler, clip_grad_norm, settings.grad_clip)
        if math.isfinite(grad_norm):
            grad_norms.append(grad_norm)
        else:
            skipped += 1
        if kl_control is not None and step_kl and math.isfinite(grad_norm):
            kl_control.update(_token_weighted_kl(step_kl))

    result: dict[str, float | bool | None] = {**_merge(metrics, weights)}
    result["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else float("nan")
    result["optimizer_steps"] = float(len(plan.steps) - skipped)
    result["skipped_steps"] = float(skipped)
    result["update_skipped"] = False
    result["kl_coef"] = settings.loss.kl_coef if kl_control is None else kl_control.value
    return result


def _zero_gradient_update(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    settings: UpdateSettings,
    clip_grad_norm: Callable[[float], Tensor],
    on_microbatch_done: Callable[[], None] | None,
) -> dict[str, float | bool | None]:
    """`policy_update` of a batch that carries no gradient: the same optimizer steps, each on
    gradients set to zero, without a forward or backward pass. Every parameter the optimizer
    trains gets a zero gradient, as the backward pass gives every parameter the forward reaches
    (all of them in a causal LM)."""
    num_microbatches = len(microbatches(batch, settings.batch_size))
    for _ in range(num_microbatches):
        if on_microbatch_done is not None:
            on_microbatch_done()
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    num_steps = math.ceil(num_microbatches / settings.grad_accum_steps)
    grad_norms = []
    for _ in range(num_steps):
        for p in params:
            p.grad = torch.zeros_like(p)
        grad_norms.append(_optimizer_step(optimizer, scheduler, clip_grad_norm, settings.grad_clip))
    result: dict[str, float | bool | None] = dict.fromkeys(_ZERO_ADVANTAGE_METRICS, 0.0)
    result.update(dict.fromkeys(_UNMEASURED_METRICS))
    result["num_tokens"] = float(sum(s.num_sampled for s in batch.samples))
    result["grad_norm"] = sum(grad_norms) / len(grad_norms)
    result["optimizer_steps"] = float(num_steps)
    result["skipped_steps"] = 0.0
    result["update_skipped"] = True
    result["kl_coef"] = settings.loss.kl_coef  # KL off: a skipped update never adapts it
    return result
