"""Run directories for sweep and report tests: synthetic ones (schema-valid metrics written with
the same `write_metrics` the loop uses, plus Hydra's `.hydra/` files, in any state a run can be
in), and `grail_train`, which makes real ones through the command line."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from grail.core.records import write_metrics
from helpers.forked import run

REPO = Path(__file__).resolve().parents[2]
# The smallest real workload: a few problems and evaluation seeds, so a real run of the tiny model
# takes seconds. Tests add their own iterations, eval interval and checkpointing.
TINY_RUN = [
    "data.problems_per_iteration=4",
    "data.rollouts_per_problem=4",
    "eval.num_ids=8",
    "eval.replicates=2",
    "eval.report_ks=[1,2]",
]


def grail_train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`grail-train ARGS` from the repository root, its output captured. The timeout bounds a
    hang, not a speed: an 80-iteration run (~30 s idle) took over 120 s on a 2-core machine
    running three other test processes."""
    return run(
        [sys.executable, "-m", "grail.train.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def train_record(iteration: int, reward: float, *, kl: float | None = 0.01) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "iteration": iteration,
        "reward_mean": reward,
        "reward_std": 0.1,
        "success_rate": min(1.0, max(0.0, reward)),
        "truncated_frac": 0.0,
        "zero_variance_group_frac": 0.0,
        "completion_length": {"mean": 4.0, "min": 4, "max": 4},
        "tokens": {"prompt": 100, "completion": 40},
        "loss_total": 0.1,
        "loss_pg": 0.1,
        "kl": kl,
        "entropy": 2.0 - 0.05 * iteration,
        "clip_frac_low": 0.0,
        "clip_frac_high": 0.0,
        "grad_norm": 0.5,
        "lr": 1e-4,
        "logprob_mismatch": 0.0,
        "tokens_per_s": 100.0,
        "policy": {"version": iteration, "staleness": 0, "pipelined": False},
        "timings": {
            "generation_s": 0.5,
            "train_s": 0.3,
            "weight_sync_s": 0.1,
            "eval_s": 0.0,
            "checkpoint_s": 0.1,
            "iteration_s": 1.0,
        },
    }


def eval_record(iteration: int, success: float, reward: float) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "iteration": iteration,
        "environment": "copy_digits",
        "num_tasks": 8,
        "replicates": 2,
        "success_rate": success,
        "reward_mean": reward,
        "pass@k": {"1": success},
        "mean@k": {"1": reward},
        "best@k": {"1": reward},
        "eval_s": 2.0,
    }


def summary_record(iterations: int, wall_time_s: float) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "status": "completed",
        "iterations": iterations,
        "final_eval": None,
        "best_eval": None,
        "tokens": {"prompt": 100 * iterations, "completion": 40 * iterations},
        "wall_time_s": wall_time_s,
    }


def write_hydra(run_dir: Path, overrides: list[str], iterations: int) -> None:
    hydra_dir = run_dir / ".hydra"
    hydra_dir.mkdir(parents=True, exist_ok=True)
    (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    (hydra_dir / "config.yaml").write_text(yaml.safe_dump({"train": {"iterations": iterations}}))


def make_run(
    run_dir: Path,
    overrides: list[str],
    *,
    iterations: int,
    done: int,
    eval_interval: int = 2,
    reward: Callable[[int], float] = lambda i: 0.1 + 0.05 * i,
    success: Callable[[int], float] = lambda i: min(1.0, 0.1 * i),
    kl: float | None = 0.01,
    completed: bool = False,
    wall_time_s: float = 60.0,
) -> Path:
    """A run of `iterations` planned iterations that got `done` of them written, with an eval
    before training and after every `eval_interval` iterations; `completed` adds its summary."""
    write_hydra(run_dir, overrides, iterations)
    metrics = run_dir / "metrics"
    write_metrics(metrics / "eval_baseline.json", eval_record(-1, 0.0, reward(0)), "eval")
    for i in range(done):
        write_metrics(
            metrics / f"train_iter_{i:03d}.json",
            train_record(i, reward(i), kl=kl),
            "train_iteration",
        )
        if (i + 1) % eval_interval == 0 or i == iterations - 1:
            write_metrics(
                metrics / f"eval_iter_{i:03d}.json",
                eval_record(i, success(i + 1), reward(i + 1)),
                "eval",
            )
    if completed:
        write_metrics(run_dir / "summary.json", summary_record(done, wall_time_s), "summary")
    return run_dir
