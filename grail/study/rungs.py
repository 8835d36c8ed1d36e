"""The rung rule of seed-aware pruning (grail/study/prune.py does the I/O): at a rung, whether a
run's setting is shown worse than the best setting there, over the seeds that reached the rung,
paired by seed. Pure: no storage, no clock, so a replay of any order of arrival tests it whole.

Why our own rule and not Optuna's pruners. ASHA and the median rule compare trials: one run's
value against the values other runs left at the same step. A study here is settings x seeds, and
on small tasks the seed moves a run more than the setting does (README: held-out success 0.00 to
1.00 by seed alone), so a one-run comparison is a coin toss, and its answer depends on who came
first: ASHA never prunes the first run at a rung, and judges each later one by whoever happened
to be there. In the study of issue 27 (train.lr=1e-3,5e-3,2e-2 x 3 seeds, first rung at iteration
20) it pruned the best setting on 2 of its 3 seeds, because 2e-2 led until about iteration 70 on
some seeds before collapsing, and it never pruned 1e-3 when 1e-3 was listed first. Here the unit
is the setting: its seeds at the rung against the best setting's seeds at the rung, paired by
seed, with the same test and multiplicity control (Holm) as the study's verdicts
(grail.study.verdicts.judge). A run is pruned only when its setting is shown worse there.

Definitions (docs/sweeps.md, "Prune hopeless runs"):
- step = iterations trained (iteration + 1). Rungs at min_iterations x reduction_factor^k, the
  successive-halving schedule; a run is at rung r from its first evaluation at a step >= r, and
  its value at r is that evaluation's.
- A setting enters a rung's comparison once `min_seeds` of its seeds have a value there; fewer
  say nothing yet, for or against. Its runs are pruned when the judge calls it WORSE than the
  best setting of that comparison, over at least `min_seeds` seeds the two share.
- A run is judged at the latest rung it has reached, again at each of its evaluations until it
  reaches the next: one that passed a rung before enough seeds were there is re-checked against
  the larger evidence as the others arrive, so arriving first buys nothing. Earlier rungs are not
  looked at again once a run has reached a later one: a late learner that has caught up is judged
  by where it is now, not by where it started. (So a run that outpaces the others to the next
  rung leaves the earlier rung's evidence behind; it faces the next rung's instead.)
- What no rule at a rung can do is see the future: a late learner behind the early leader there,
  on enough seeds, is shown worse. Early rungs therefore judge at a smaller error level, spent
  over the run (`spent_alpha`): a rung a fraction t of the way through the run tests at
  alpha x t^3, the power family of Kim & DeMets (1987) that approximates O'Brien-Fleming's
  group-sequential boundaries, the usual answer to looking at a trial's data again and again.
  At iteration 20 of 150 that is alpha x 0.0024 (1.2e-4 for alpha 0.05): only overwhelming
  evidence prunes there (with three settings the verdicts then want 8 shared seeds), while the
  rungs past mid-run test near alpha. tests/test_prune_rungs.py measures it on curves shaped like
  issue 27's; docs/sweeps.md says where to put the first rung.
- Several values for one (setting, seed) (a retried run's new trial beside the failed one): the
  newest trial that has a value at the rung counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from grail.study.verdicts import Outcome, Verdict

# setting label -> {seed: value} -> one verdict per setting, the best first (verdicts.judge with
# its settings bound; tests pass their own)
Judge = Callable[[Mapping[str, Mapping[str, float]]], Sequence[Verdict]]


@dataclass(frozen=True)
class RunCurve:
    """One run's evaluations as the rule sees them (one Optuna trial)."""

    setting: str  # the run's overrides without its seed (grail.study.stats.setting_of)
    seed: str
    values: Mapping[int, float]  # step -> the pruning metric after that many iterations
    order: int  # later runs of one (setting, seed) win (a retry's trial after the failed one)


@dataclass(frozen=True)
class Prune:
    """Why a setting's runs stop: shown worse than `best` at rung `rung`."""

    rung: int  # in steps (iterations trained)
    best: str  # the best setting's label at the rung
    seeds: int  # seeds shared with the best there
    p: float | None  # Holm-adjusted p of "worse than the best"
    effect: float | None  # mean paired difference (this - best)


def spent_alpha(alpha: float, rung: int, iterations: int) -> float:
    """The error level of the verdicts at `rung` of a run of `iterations` iterations: alpha x t^3,
    t = rung / iterations (capped at 1); see the module doc."""
    fraction = min(1.0, rung / iterations) if iterations > 0 else 1.0
    return alpha * fraction**3


def latest_rung(step: int, min_iterations: int, reduction_factor: int) -> int | None:
    """The highest rung at or below `step`; None before the first."""
    if step < min_iterations:
        return None
    rung = min_iterations
    while rung * reduction_factor <= step:
        rung *= reduction_factor
    return rung


def value_at(values: Mapping[int, float], rung: int) -> float | None:
    """The value of the first evaluation at a step >= `rung` (None: not there yet)."""
    reached = [step for step in values if step >= rung]
    return values[min(reached)] if reached else None


def rung_table(curves: Iterable[RunCurve], rung: int) -> dict[str, dict[str, float]]:
    """setting -> {seed: value at `rung`} over the runs that reached it."""
    table: dict[str, dict[str, float]] = {}
    for curve in sorted(curves, key=lambda c: c.order):  # newer overwrite older
        value = value_at(curve.values, rung)
        if value is not None:
            table.setdefault(curve.setting, {})[curve.seed] = value
    return table


def judge_rung(
    curves: Iterable[RunCurve], setting: str, rung: int, min_seeds: int, judge: Judge
) -> Prune | None:
    """A Prune when `setting` is shown worse than the best setting at `rung` (see the module doc),
    else None: not worse, or not enough seeds there to say."""
    table = rung_table(curves, rung)
    compared = {label: seeds for label, seeds in table.items() if len(seeds) >= min_seeds}
    if setting not in compared or len(compared) < 2:
        return None
    verdicts = judge(compared)
    best = verdicts[0]
    mine = next(v for v in verdicts if v.label == setting)
    shared = len(compared[setting].keys() & compared[best.label].keys())
    if mine.label == best.label or mine.outcome is not Outcome.WORSE or shared < min_seeds:
        return None
    return Prune(rung=rung, best=best.label, seeds=shared, p=mine.p, effect=mine.effect)
