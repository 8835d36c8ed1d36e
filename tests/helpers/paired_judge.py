"""A stand-in for grail.study.verdicts.judge in the pruning tests, with its interface (values:
setting -> {seed: value}; one verdict per setting, the best first): a one-sided paired t test of
each setting against the best (highest mean) over their shared seeds, Holm-adjusted. "worse"
when the adjusted p is below alpha, else "not_separated"."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from scipy import stats


@dataclass(frozen=True)
class FakeVerdict:
    label: str
    outcome: str
    n_seeds: int
    mean: float
    p: float | None
    effect: float | None


def _p_worse(diffs: list[float]) -> float:
    """One-sided paired t: p of "this is below the best" from the differences (this - best)."""
    if len(diffs) < 2:
        return 1.0
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0:
        return 0.0 if mean < 0 else 1.0
    return float(stats.t.cdf(mean / (sd / math.sqrt(len(diffs))), len(diffs) - 1))


def paired_judge(
    values: Mapping[str, Mapping[str, float]], alpha: float = 0.05
) -> list[FakeVerdict]:
    means = {label: statistics.fmean(seeds.values()) for label, seeds in values.items()}
    order = sorted(values, key=lambda label: (-means[label], label))
    best = order[0]
    raw: dict[str, tuple[float, float | None]] = {}
    for label in order[1:]:
        shared = sorted(values[label].keys() & values[best].keys())
        diffs = [values[label][s] - values[best][s] for s in shared]
        raw[label] = (_p_worse(diffs), statistics.fmean(diffs) if diffs else None)
    # Holm: the k-th smallest p times (m - k + 1), kept monotone, capped at 1.
    adjusted: dict[str, float] = {}
    running = 0.0
    for k, label in enumerate(sorted(raw, key=lambda lb: raw[lb][0])):
        running = max(running, min(1.0, raw[label][0] * (len(raw) - k)))
        adjusted[label] = running
    verdicts = [FakeVerdict(best, "best", len(values[best]), means[best], None, None)]
    for label in order[1:]:
        p = adjusted[label]
        outcome = "worse" if p < alpha else "not_separated"
        verdicts.append(
            FakeVerdict(label, outcome, len(values[label]), means[label], p, raw[label][1])
        )
    return verdicts
