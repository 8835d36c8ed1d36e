"""Statistics over seeds for `grail-report`: group runs by setting (their overrides minus `seed`),
reduce each run's eval curve to one number, and summarise each setting across its seeds.

Pure functions over lists and dicts (no file I/O), so they are tested on hand-made numbers:

- `metric_of(evals, name)`: `final` (success rate at the last eval), `best` (highest success
  rate of an eval after training started) or `auc` (mean success rate over those evals: the area
  under the eval curve per eval point). The baseline eval (iteration -1) never counts.
- `summarize(groups, metric, settings)`: each setting's values by seed, judged against the best
  by `grail.study.verdicts.judge` (best / worse / not separated / equivalent, or nothing learnt
  for every setting when every run is at 0, with an interval
  that stays inside [0, 1]). Completed runs count with their value; a pruned run counts too,
  censored: with its value where the pruner stopped it, at most its success rate at that eval
  (`censored_value`), so a setting is never scored on the seeds that survived alone.
- `t_interval(values)`: mean and Student t interval (the TPE search's summary; the report uses the
  verdicts' interval).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grail.core.records import LAUNCH_KEYS, override_key
from grail.study.runs import distinguishing_overrides
from grail.study.verdicts import Outcome, Verdict, VerdictSettings, judge, mean_interval

METRICS = ("final", "best", "auc")
SEED_KEY = "seed"
DEFAULT_SEED = "default"  # the seed of a run launched without a seed override
CONFIDENCE = 0.95
CI_METHOD = "Chernoff-Hoeffding (KL) interval, valid for any distribution in [0, 1]"
# Every metric above is a success rate or a mean of success rates: bounded by [0, 1]. The report's
# defaults (`grail-report --alpha/--delta` replace them).
BOUNDS = (0.0, 1.0)
REPORT_SETTINGS = VerdictSettings(bounds=BOUNDS, confidence=CONFIDENCE)

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


def censored_value(run: SeedRun, metric: str) -> float | None:
    """The value a pruned run counts with: its metric over the evals it had, but at most its
    success rate at the eval where the pruner stopped it (it was stopped for doing badly there;
    an earlier peak or the mean of better early evals would flatter it)."""
    value = run.metric(metric)
    if value is None or run.final is None:
        return value
    return min(value, run.final)


@dataclass
class SettingStats:
    """One setting across its seeds: the metric over its completed and pruned (censored) runs,
    its verdict against the best, and the runs left out counted."""

    label: str
    metric: str
    values_by_seed: dict[str, float]  # completed runs with the metric, and pruned ones (censored)
    censored: frozenset[str]  # the seeds among values_by_seed whose run was pruned
    interval: Interval
    median: float | None
    min: float | None
    max: float | None
    done: int  # completed runs (with or without the metric)
    failed: int
    incomplete: int
    runs: list[SeedRun]
    pruned: int = 0
    # runs with a value whose seed an earlier run of this setting has: the same setting and seed
    # again is the same experiment again, not another replicate, so the seed counts once
    repeated: int = 0
    rank: int = 0  # 1 = best mean; 0 = no value, or nothing learnt (no setting ranks above another)
    verdict: Verdict | None = None  # None for settings without values

    @property
    def n(self) -> int:
        return self.interval.n

    @property
    def n_censored(self) -> int:
        return len(self.censored)

    @property
    def is_best(self) -> bool:
        return self.rank == 1


def setting_stats(label: str, runs: Sequence[SeedRun], metric: str) -> SettingStats:
    """The statistics of one setting, before the verdicts: completed runs with their value, pruned
    ones censored (`censored_value`); a seed run twice: the last, the other counted `repeated`."""
    by_seed: dict[str, float] = {}
    censored: set[str] = set()
    repeated = 0
    for r in runs:
        if r.status == "done" and (v := r.metric(metric)) is not None:
            repeated += r.seed in by_seed
            by_seed[r.seed] = v
            censored.discard(r.seed)
        elif r.status == "pruned" and (v := censored_value(r, metric)) is not None:
            repeated += r.seed in by_seed
            by_seed[r.seed] = v
            censored.add(r.seed)
    values = list(by_seed.values())
    mean = sum(values) / len(values) if values else None
    return SettingStats(
        label=label,
        metric=metric,
        values_by_seed=by_seed,
        censored=frozenset(censored),
        interval=Interval(len(values), mean, None, None),
        median=statistics.median(values) if values else None,
        min=min(values) if values else None,
        max=max(values) if values else None,
        done=sum(r.status == "done" for r in runs),
        failed=sum(r.status == "failed" for r in runs),
        incomplete=sum(r.status == "incomplete" for r in runs),
        runs=list(runs),
        pruned=sum(r.status == "pruned" for r in runs),
        repeated=repeated,
    )


def summarize(
    groups: Mapping[str, Sequence[SeedRun]],
    metric: str,
    settings: VerdictSettings = REPORT_SETTINGS,
) -> list[SettingStats]:
    """Every setting, in the verdicts' order (best first, then by mean; settings without a value
    last, by label), each with its verdict and the verdicts' interval of its mean."""
    all_stats = {label: setting_stats(label, runs, metric) for label, runs in groups.items()}
    have = {label: s for label, s in all_stats.items() if s.values_by_seed}
    missing = sorted((s for s in all_stats.values() if not s.values_by_seed), key=lambda s: s.label)
    if not have:
        return missing
    verdicts = judge({label: s.values_by_seed for label, s in have.items()}, settings)
    ranked = []
    for rank, v in enumerate(verdicts, start=1):
        s = have[v.label]
        s.rank, s.verdict = (0 if v.outcome is Outcome.NOTHING_LEARNT else rank), v
        s.interval = Interval(v.n_seeds, v.mean, v.ci[0], v.ci[1])
        ranked.append(s)
    return ranked + missing


@dataclass(frozen=True)
class CurvePoint:
    version: int
    interval: Interval


def mean_curve(
    curves: Sequence[Sequence[tuple[int, float]]],
    settings: VerdictSettings = REPORT_SETTINGS,
) -> list[CurvePoint]:
    """Per policy version, the mean over the runs that have a point there and the verdicts'
    interval of it (the table's interval, so a band stays inside the bounds)."""
    at: dict[int, list[float]] = {}
    for curve in curves:
        for x, y in curve:
            at.setdefault(x, []).append(y)
    points = []
    for x in sorted(at):
        lo, hi = mean_interval(at[x], settings)
        points.append(CurvePoint(x, Interval(len(at[x]), sum(at[x]) / len(at[x]), lo, hi)))
    return points
