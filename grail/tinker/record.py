"""The metrics record each optimizer step of a Tinker-driven run writes:
``<run-dir>/runs/<model_id>/metrics/train_iter_XXX.json``, valid against the same schema as
grail-train's (grail/schemas/train_iteration.schema.json), so grail-report and the loggers read it.

What the server cannot know is written as zero: rewards and success live in the client's loop,
so ``reward_mean``, ``reward_std``, ``success_rate`` are 0 and the ``tinker`` block says so.
"Completion" tokens are the positions the loss weighs (a nonzero weight or advantage), "prompt"
tokens the rest. ``logprob_mismatch`` (every loss but cross_entropy) is the mean |logp - q| over the
weighed tokens: how far the learner's log-probabilities are from the sampler's.

When a training client's run ends (it is unloaded, its session closes or times out, or the server
stops), ``summary.json`` beside the records says so in grail-train's shape, so grail-report lists
the run as done rather than incomplete.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from grail.core.records import (
    SCHEMA_VERSION,
    SUMMARY,
    run_summary,
    train_metrics_path,
    write_metrics,
)
from grail.tinker.losses import CLIPPED, clip_bounds
from grail.tinker.wire import Datum


@dataclass
class StepStats:
    """What the forward/backward passes since the last optimizer step add up to."""

    loss: float = 0.0
    datums: int = 0
    prompt_tokens: int = 0
    completion_lengths: list[int] = field(default_factory=list)
    mismatch_sum: float = 0.0
    mismatch_tokens: int = 0
    clipped_low: int = 0
    clipped_high: int = 0
    train_s: float = 0.0
    loss_fns: set[str] = field(default_factory=set)

    def add_datum(
        self, datum: Datum, logp: torch.Tensor, loss_fn: str, config: dict[str, float]
    ) -> None:
        key = "weights" if loss_fn == "cross_entropy" else "advantages"
        weighed = torch.from_numpy(datum.inputs[key].values.copy()) != 0
        weighed = weighed.to(logp.device)
        count = int(weighed.sum())
        self.datums += 1
        self.loss_fns.add(loss_fn)
        self.completion_lengths.append(count)
        self.prompt_tokens += len(datum.tokens) - count
        if loss_fn != "cross_entropy" and count:
            q = torch.from_numpy(datum.inputs["logprobs"].values.copy()).to(logp.device)
            self.mismatch_sum += float((logp.float() - q).abs()[weighed].sum())
            self.mismatch_tokens += count
            if loss_fn in CLIPPED:
                ratio = torch.exp(logp.float() - q)[weighed]
                lo, hi = clip_bounds(config)
                self.clipped_low += int((ratio < lo).sum())
                self.clipped_high += int((ratio > hi).sum())


def write_step_record(
    run_dir: Path, iteration: int, stats: StepStats, grad_norm: float, lr: float, model_id: str
) -> dict[str, Any]:
    lengths = stats.completion_lengths or [0]
    weighed = sum(stats.completion_lengths)
    record: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "iteration": iteration,
        "reward_mean": 0.0,
        "reward_std": 0.0,
        "success_rate": 0.0,
        "truncated_frac": 0.0,
        "zero_variance_group_frac": 0.0,
        "completion_length": {
            "mean": sum(lengths) / len(lengths),
            "min": min(lengths),
            "max": max(lengths),
        },  # fmt: skip
        "tokens": {"prompt": stats.prompt_tokens, "completion": weighed},
        "loss_total": stats.loss,
        "loss_pg": stats.loss,
        "kl": None,
        "entropy": None,
        "clip_frac_low": stats.clipped_low / weighed if weighed else 0.0,
        "clip_frac_high": stats.clipped_high / weighed if weighed else 0.0,
        "grad_norm": grad_norm,
        "lr": lr,
        "logprob_mismatch": (
            stats.mismatch_sum / stats.mismatch_tokens if stats.mismatch_tokens else None
        ),
        "tokens_per_s": None,
        "optimizer_steps": 1,
        "timings": {
            "generation_s": 0.0,
            "train_s": stats.train_s,
            "weight_sync_s": 0.0,
            "eval_s": 0.0,
            "checkpoint_s": 0.0,
            "iteration_s": stats.train_s,
        },  # fmt: skip
        "policy": {"version": iteration, "staleness": 0, "pipelined": False},
        "tinker": {
            "model_id": model_id,
            "loss_fns": sorted(stats.loss_fns),
            "datums": stats.datums,
            "note": "rewards are the client's: reward_mean, reward_std, success_rate are 0 here",
        },
    }
    write_metrics(train_metrics_path(run_dir, iteration), record, "train_iteration")
    return record


def write_run_summary(run_dir: Path, model_id: str, wall_time_s: float, ended: str) -> None:
    """summary.json of a training client's run that ended: grail-train's summary of the records
    it wrote (``run_summary``: iterations, tokens, train time; no evals, which are the client's),
    status "completed", and a ``tinker`` block saying how it ended. Written atomically, only
    where the run left something (records or checkpoints): a client that never stepped or saved
    leaves no directory, and gets none."""
    if not run_dir.is_dir():
        return
    summary = run_summary(run_dir, "completed", wall_time_s)
    summary["tinker"] = {"model_id": model_id, "ended": ended}
    write_metrics(run_dir / SUMMARY, summary, "summary")
