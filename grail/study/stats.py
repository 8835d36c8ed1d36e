"""Statistics over seeds for `grail-report`: group runs by setting (their overrides minus `seed`),
reduce each run's eval curve to one number, and summarise each setting across its seeds.

Pure functions over lists and dicts (no file I/O), so they are tested on hand-made numbers:

- `metric_of(evals, name)`: `final` (success rate at the last eval), `best` (highest success
  rate of an eval after training started) or `auc` (mean success rate over those evals: the area
  under the eval curve per eval point). The baseline eval (iteration -1) never counts.
- `t_interval(values)`: mean and 95% confidence interval, Student t with n - 1 degrees of freedom.
  One value has no interval: `lo` and `hi` are None (shown as "n/a").
- `paired_tie(best, other, test)`: is `other` statistically indistinguishable from the best
  setting? A paired test over the seeds both share, two-sided, alpha 0.05: `t` (paired Student
  t, the default: it can separate settings with 2 to 5 seeds, the usual study) or `wilcoxon`
  (signed-rank: no normality assumed, but with fewer than 6 seeds its p never drops below 0.05).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grail.core.records import LAUNCH_KEYS, override_key
from grail.study.runs import distinguishing_overrides, natural_key

METRICS = ("final", "best", "auc")
SEED_KEY = "seed"
DEFAULT_SEED = "default"  # the seed of a run launched without a seed override
CONFIDENCE = 0.95
ALPHA = 0.05
CI_METHOD = "Student t over seeds"
# grail-report --test: the paired test against the best setting, by name, and how it is named in
# the output.
TESTS = {
    "t": "paired Student t over shared seeds",
    "wilcoxon": "Wilcoxon signed-rank over shared seeds",
}
DEFAULT_TEST = "t"
# Below this many paired seeds the two-sided exact Wilcoxon p can never drop under 0.05
# (its smallest value is 2 / 2**n: 0.0625 with 5 seeds).
WILCOXON_MIN_SEEDS = 6

R = TypeVar("R")


# ---- one run ------------------------------------------------------------------------------------


def _success(record: Mapping[str, Any]) -> float | None:
    value = record.get("success_rate")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def trained_curve(evals: Sequence[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(iteration, success rate) of the evals after training started (iteration >= 0), in order."""
    points = []
    for e in evals:
        iteration = e.get("iteration")
        if isinstance(iteration, int) and iteration >= 0 and (v := _success(e)) is not None:
            points.append((iteration, v))
    return sorted(points)


def metric_of(evals: Sequence[Mapping[str, Any]], name: str) -> float | None:
    """One number per run from its eval records (see the module doc); None without a trained
    eval."""
    if name not in METRICS:
        raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
    values = [v for _, v in trained_curve(evals)]
    if not values:
        return None
    if name == "final":
        return values[-1]
    if name == "best":
        return max(values)
    return sum(values) / len(values)


@dataclass
class SeedRun:
    """One run as the statistics see it."""

    name: str
    overrides: list[str]
    status: str  # done | failed | pruned | incomplete
    final: float | None = None
    best: float | None = None
    auc: float | None = None
    # (policy version, success rate) of every eval, baseline (version 0) included: the plot
    curve: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None

    @property
    def seed(self) -> str:
        return seed_of(self.overrides)

    def metric(self, name: str) -> float | None:
        if name not in METRICS:
            raise ValueError(f"unknown metric {name!r}; known: {', '.join(METRICS)}")
        return getattr(self, name)


def seed_run(
    name: str,
    overrides: list[str],
    status: str,
    evals: Sequence[Mapping[str, Any]],
    error: str | None = None,
) -> SeedRun:
    curve = []
    for e in evals:
        iteration = e.get("iteration")
        if isinstance(iteration, int) and (v := _success(e)) is not None:
            curve.append((iteration + 1, v))  # policy version: updates applied before the eval
    return SeedRun(
        name=name,
        overrides=list(overrides),
        status=status,
        final=metric_of(evals, "final"),
        best=metric_of(evals, "best"),
        auc=metric_of(evals, "auc"),
        curve=sorted(curve),
        error=error,
    )


# ---- grouping -----------------------------------------------------------------------------------


def seed_of(overrides: Sequence[str]) -> str:
    """The value of the run's `seed=` override; DEFAULT_SEED when it has none."""
    for o in overrides:
        if override_key(o) == SEED_KEY and "=" in o:
            return o.split("=", 1)[1]
    return DEFAULT_SEED


def setting_of(overrides: Sequence[str]) -> tuple[str, ...]:
    """The overrides that define a setting: all but the seed and launch keys, in a fixed order."""
    return tuple(sorted(o for o in overrides if override_key(o) not in {SEED_KEY, *LAUNCH_KEYS}))


def group_by_setting(
    runs: Sequence[R], overrides: Callable[[R], Sequence[str]]
) -> dict[str, list[R]]:
    """Runs grouped by their overrides minus `seed`, labelled by the overrides that tell the
    settings apart (`grail.study.runs.distinguishing_overrides`; "(defaults)" when none). Settings
    in first-seen order, runs within one in the order given."""
    groups: dict[tuple[str, ...], list[R]] = {}
    for run in runs:
        groups.setdefault(setting_of(overrides(run)), []).append(run)
    keys = list(groups)
    labels = [
        " ".join(label) or "(defaults)"
        for label in distinguishing_overrides([list(k) for k in keys])
    ]
    return {label: groups[key] for label, key in zip(labels, keys, strict=True)}


# ---- statistics ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """Mean of `n` values and its confidence interval; lo = hi = None when n < 2."""

    n: int
    mean: float | None
    lo: float | None
    hi: float | None


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval:
    """Mean and two-sided Student t confidence interval (n - 1 degrees of freedom)."""
    from scipy import stats

    n = len(values)
    if n == 0:
        return Interval(0, None, None, None)
    mean = sum(values) / n
    if n < 2:
        return Interval(1, mean, None, None)
    sem = statistics.stdev(values) / math.sqrt(n)
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sem
    return Interval(n, mean, mean - half, mean + half)


@dataclass(frozen=True)
class Tie:
    """The paired comparison of one setting with the best one."""

    p: float | None  # None when no test could be made
    tied: bool  # statistically indistinguishable from the best (also when untestable)
    reason: str
    n_shared: int
    test: str = DEFAULT_TEST  # a key of TESTS


def paired_tie(
    best_by_seed: Mapping[str, float],
    other_by_seed: Mapping[str, float],
    alpha: float = ALPHA,
    test: str = DEFAULT_TEST,
) -> Tie:
    """A paired two-sided test (`TESTS[test]`) over the seeds both settings have. Fewer than 2
    shared seeds: no test, p None, counted as tied ("n/a"). Identical values on every shared
    seed: tied with p = 1. Otherwise tied when p >= alpha. The t test of differences that are
    the same on every seed (no spread) gives p = 0: a consistent difference."""
    import warnings

    from scipy import stats

    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; known: {', '.join(TESTS)}")

    shared = sorted(set(best_by_seed) & set(other_by_seed), key=natural_key)
    n = len(shared)
    if n < 2:
        return Tie(None, True, f"n/a: {n} shared seed{'s' if n != 1 else ''}", n, test)
    a = [best_by_seed[s] for s in shared]
    b = [other_by_seed[s] for s in shared]
    if all(x == y for x, y in zip(a, b, strict=True)):
        return Tie(1.0, True, "identical on every shared seed", n, test)
    with warnings.catch_warnings():  # scipy warns when the differences have no spread
        warnings.simplefilter("ignore", RuntimeWarning)
        if test == "t":
            p = float(stats.ttest_rel(a, b, alternative="two-sided").pvalue)
        else:
            p = float(stats.wilcoxon(a, b, alternative="two-sided").pvalue)
    if not math.isfinite(p):
        return Tie(None, True, f"n/a: no test over {n} shared seeds", n, test)
    if p >= alpha:
        return Tie(p, True, f"p={p:.3g} >= {alpha:g} over {n} shared seeds", n, test)
    return Tie(p, False, f"p={p:.3g} < {alpha:g} over {n} shared seeds", n, test)


@dataclass
class SettingStats:
    """One setting across its seeds: the metric over its completed runs, and the others counted
    (pruned runs too: stopped early by the pruner, their values would mix short runs with full
    ones)."""

    label: str
    metric: str
    values_by_seed: dict[str, float]  # completed runs that have the metric
    interval: Interval
    median: float | None
    min: float | None
    max: float | None
    done: int  # completed runs (with or without the metric)
    failed: int
    incomplete: int
    runs: list[SeedRun]
    pruned: int = 0
    rank: int = 0  # 1 = best mean; 0 = no value
    tie: Tie | None = None  # None for the best setting itself and for settings without values

    @property
    def n(self) -> int:
        return self.interval.n

    @property
    def is_best(self) -> bool:
        return self.rank == 1


def setting_stats(label: str, runs: Sequence[SeedRun], metric: str) -> SettingStats:
    """The statistics of one setting; only completed runs count (a seed run twice: the last)."""
    by_seed: dict[str, float] = {}
    for r in runs:
        if r.status == "done" and (v := r.metric(metric)) is not None:
            by_seed[r.seed] = v
    values = list(by_seed.values())
    return SettingStats(
        label=label,
        metric=metric,
        values_by_seed=by_seed,
        interval=t_interval(values),
        median=statistics.median(values) if values else None,
        min=min(values) if values else None,
        max=max(values) if values else None,
        done=sum(r.status == "done" for r in runs),
        failed=sum(r.status == "failed" for r in runs),
        incomplete=sum(r.status == "incomplete" for r in runs),
        runs=list(runs),
        pruned=sum(r.status == "pruned" for r in runs),
    )


def summarize(
    groups: Mapping[str, Sequence[SeedRun]], metric: str, test: str = DEFAULT_TEST
) -> list[SettingStats]:
    """Every setting, ranked by mean (highest first; settings without a value last, by label),
    each compared with the best one (`paired_tie`)."""
    all_stats = [setting_stats(label, runs, metric) for label, runs in groups.items()]
    have = [s for s in all_stats if s.interval.mean is not None]
    missing = sorted((s for s in all_stats if s.interval.mean is None), key=lambda s: s.label)
    have.sort(key=lambda s: natural_key(s.label))
    have.sort(key=lambda s: s.interval.mean, reverse=True)  # type: ignore[arg-type,return-value]
    for rank, s in enumerate(have, start=1):
        s.rank = rank
    if have:
        best = have[0]
        for s in have[1:]:
            s.tie = paired_tie(best.values_by_seed, s.values_by_seed, test=test)
    return have + missing


@dataclass(frozen=True)
class CurvePoint:
    version: int
    interval: Interval


def mean_curve(curves: Sequence[Sequence[tuple[int, float]]]) -> list[CurvePoint]:
    """Per policy version, the mean and t interval over the runs that have a point there."""
    at: dict[int, list[float]] = {}
    for curve in curves:
        for x, y in curve:
            at.setdefault(x, []).append(y)
    return [CurvePoint(x, t_interval(at[x])) for x in sorted(at)]
