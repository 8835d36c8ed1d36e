"""A search trial's outcome from its runs (grail/study/search.py): each run's summary.json and
eval records say whether the trial completed (and its value, the mean of the metric over its
seeds), failed, was pruned, or is still running (a run killed before writing its summary)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grail.core.records import metric_records
from grail.study.runs import run_status
from grail.study.stats import metric_of, trained_curve

COMPLETE, FAIL, PRUNED, RUNNING = "complete", "fail", "pruned", "running"


@dataclass(frozen=True)
class Outcome:
    """What a trial's runs say. `value`: mean of the metric over seeds (complete trials);
    `partial`/`step`: for a pruned trial, the mean of the metric over the evals its runs reached,
    and the last iteration all of them reached (the intermediate value Optuna ranks it by)."""

    state: str
    values_by_seed: dict[int, float] = field(default_factory=dict)
    reason: str = ""
    partial: float | None = None
    step: int | None = None

    @property
    def value(self) -> float | None:
        v = list(self.values_by_seed.values())
        return sum(v) / len(v) if v and self.state == COMPLETE else None


def trial_outcome(runs: Mapping[int, Path], metric: str) -> Outcome:
    """The outcome of a trial from its run directories (seed -> directory): failed if any run
    failed (or completed without an eval to compute the metric from), else running if any has no
    summary yet, else pruned if any was pruned, else complete."""
    failed: list[str] = []
    missing: list[Path] = []
    pruned: list[Path] = []
    values: dict[int, float] = {}
    evals_by_run: list[list[dict[str, Any]]] = []
    for seed, run_dir in runs.items():
        status = run_status(run_dir)
        evals = metric_records(run_dir, "eval")
        evals_by_run.append(evals)
        if status.status == "incomplete":
            missing.append(run_dir)
        elif status.status == "done":
            value = metric_of(evals, metric)
            if value is None:
                failed.append(
                    f"run {run_dir} completed without an eval after training started, so it has "
                    f"no {metric}: evaluate at least once (eval.enabled=true, "
                    "eval.interval <= train.iterations)"
                )
            else:
                values[seed] = value
        elif status.status == "pruned":
            pruned.append(run_dir)
        else:
            why = (status.error or "").splitlines() or [""]
            failed.append(f"run {run_dir} failed: {why[0]}")
    if failed:
        return Outcome(FAIL, values, "; ".join(failed))
    if missing:
        names = ", ".join(str(p) for p in missing)
        return Outcome(RUNNING, values, f"no summary.json in {names} (killed or still running)")
    if pruned:
        partial, step = None, None
        curves = [trained_curve(evals) for evals in evals_by_run]
        if all(curves):
            step = min(c[-1][0] for c in curves)
            known = [v for evals in evals_by_run if (v := metric_of(evals, metric)) is not None]
            partial = sum(known) / len(known) if known else None
        names = ", ".join(str(p) for p in pruned)
        return Outcome(PRUNED, values, f"pruned: {names}", partial=partial, step=step)
    return Outcome(COMPLETE, values)
