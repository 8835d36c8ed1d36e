"""A run directory as the report sees it: its metrics, status and overrides, loaded once."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grail.core.records import SUMMARY, metric_records, read_json
from grail.study.runs import (
    distinguishing_overrides,
    find_runs,
    read_config,
    read_overrides,
    run_status,
)


@dataclass
class RunReport:
    """One run, reduced to what the table, the CSV and the plot show."""

    name: str
    path: Path
    overrides: list[str]
    status: str  # done | failed | pruned | incomplete
    error: str | None
    iterations: int  # train iterations with metrics
    target_iterations: int | None  # train.iterations of its config
    baseline: dict[str, Any] | None  # eval before training
    final: dict[str, Any] | None  # newest eval after training started
    best_success: dict[str, Any] | None  # trained eval with the highest success rate
    best_reward: dict[str, Any] | None  # trained eval with the highest mean reward
    train_rewards: list[float]
    time_s: float | None  # training time summed over attempts (see load_run)
    wall_time_s: float | None  # the last attempt's wall time, from its summary
    # metric name -> [(policy version, value)], for the plot
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)  # its eval records, baseline first
    label: str = ""

    def value(self, key: str) -> float | None:
        """A sortable number for `key` (see SORT_KEYS); None when the run has none yet."""
        return SORT_KEYS[key][0](self)


def _get(record: dict[str, Any] | None, key: str) -> float | None:
    if record is None:
        return None
    value = record.get(key)
    return float(value) if isinstance(value, int | float) else None


def _first_last_gain(r: RunReport) -> float | None:
    return r.train_rewards[-1] - r.train_rewards[0] if len(r.train_rewards) >= 2 else None


def load_run(run_dir: Path, name: str) -> RunReport:
    """Everything the report shows about one run directory, whatever state it is in."""
    status = run_status(run_dir)
    trains = metric_records(run_dir, "train")
    evals = metric_records(run_dir, "eval")
    trained = [e for e in evals if e["iteration"] >= 0]
    baseline = next((e for e in evals if e["iteration"] == -1), None)
    # Time spent training (iterations, their evals and checkpoints, plus the baseline eval) summed
    # over every attempt: comparable between runs whatever their start-up cost or number of
    # resumes, and defined for runs still going. The last attempt's wall time is in the CSV.
    spent = [_get(t.get("timings"), "iteration_s") for t in trains] + [_get(baseline, "eval_s")]
    known = [s for s in spent if s is not None]
    summary = read_json(run_dir / SUMMARY)
    target = read_config(run_dir).get("train", {}).get("iterations")

    series: dict[str, list[tuple[int, float]]] = {name: [] for name, _ in PLOT_PANELS}
    for e in evals:  # version = updates applied before this eval
        version = e["iteration"] + 1
        for key, metric in (("eval_success", "success_rate"), ("eval_reward", "reward_mean")):
            if (v := _get(e, metric)) is not None:
                series[key].append((version, v))
    for t in trains:  # rollouts and loss of iteration i come from version i
        for key, metric in (("train_reward", "reward_mean"), ("kl", "kl"), ("entropy", "entropy")):
            if (v := _get(t, metric)) is not None and math.isfinite(v):
                series[key].append((t["iteration"], v))

    return RunReport(
        name=name,
        path=run_dir,
        overrides=read_overrides(run_dir),
        status=status.status,
        error=status.error,
        iterations=len(trains),
        target_iterations=target if isinstance(target, int) else None,
        baseline=baseline,
        final=trained[-1] if trained else None,
        best_success=max(trained, key=lambda e: (e["success_rate"], e["iteration"]))
        if trained
        else None,
        best_reward=max(trained, key=lambda e: (e["reward_mean"], e["iteration"]))
        if trained
        else None,
        train_rewards=[v for _, v in series["train_reward"]],
        time_s=sum(known) if known else None,
        wall_time_s=_get(summary, "wall_time_s"),
        series=series,
        evals=evals,
    )


def load_runs(root: Path) -> list[RunReport]:
    """Every run under `root` (or `root` itself), labelled by what sets it apart."""
    root = Path(root)
    paths = find_runs(root)
    runs = [load_run(p, p.relative_to(root).as_posix() if p != root else p.name) for p in paths]
    for run, label in zip(runs, distinguishing_overrides([r.overrides for r in runs]), strict=True):
        run.label = " ".join(label)
    return runs


# name -> (value of a run, higher is better)
SORT_KEYS: dict[str, tuple[Callable[[RunReport], float | None], bool]] = {
    "final_success": (lambda r: _get(r.final, "success_rate"), True),
    "best_success": (lambda r: _get(r.best_success, "success_rate"), True),
    "final_reward": (lambda r: _get(r.final, "reward_mean"), True),
    "best_reward": (lambda r: _get(r.best_reward, "reward_mean"), True),
    "train_reward": (lambda r: r.train_rewards[-1] if r.train_rewards else None, True),
    "reward_gain": (_first_last_gain, True),
    "iterations": (lambda r: float(r.iterations), True),
    "time": (lambda r: r.time_s, False),
}


PLOT_PANELS = (
    ("eval_success", "eval success rate"),
    ("eval_reward", "eval mean reward"),
    ("train_reward", "train reward (mean)"),
    ("kl", "KL to reference"),
    ("entropy", "entropy"),
)
