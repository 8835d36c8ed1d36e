"""Verdicts over seeds: which setting is best, and what can be said of each other one.

Pure math (numpy and scipy, no I/O), shared by `grail-report`, racing and seed-aware pruning.
`judge(values)` takes, per setting, one number per seed (e.g. the auc of each run) and returns one
`Verdict` per setting: the best (highest mean) first, then every other one with one of three
outcomes against it:

- WORSE: shown worse than the best by a paired test over the seeds both share, with the family-wise
  error over all the comparisons held at `alpha` (Holm, see `holm`);
- EQUIVALENT: shown within `delta` of the best by a paired equivalence test (TOST);
- NOT_SEPARATED: neither yet; `seeds_to_separate` estimates how many seeds per setting would show
  it worse with probability `power` (None when that would take more than SEEDS_CAP: the difference
  is ~0 next to its spread, which only the equivalence test can settle).

Every choice below was made on simulations of 3-8 seeds of bimodal, saturated data like the
default task's (seeds at 0.27 / 0.82 / 0.00; 1.0 / 0.996 / 1.0), reproduced in
tests/test_verdicts.py:

1. The interval of a bounded metric (success rates, auc in [0, 1]) is the Chernoff-Hoeffding
   (Bernoulli-KL) interval, valid for ANY distribution on [lo, hi]. A Student t interval (or a
   bootstrap) built from the spread of 3 seeds that all land in one mode is ~zero wide and covered
   the mean in only 26% of the simulated studies of a setting at 1.0 with rare 0.996s, 15% of one
   that succeeds on 1 seed in 20; a Wilson-type score interval dips to 85%. The KL interval covered
   >= 99% everywhere, at a width cost: 3 seeds at 1.0 give [0.29, 1], 3 seeds at 0.016-0.031 give
   [0, 0.74]. That is what 3 seeds can say without assuming a shape: 3 draws of a coin with
   P(heads) = 0.3 land heads three times in 2.7% of studies. The width shrinks as log(2/alpha)/n
   (8 seeds at 1.0: [0.63, 1]). Among the distribution-free intervals tried it was the narrowest
   on 3-5 seeds: the betting interval of Waudby-Smith & Ramdas (2023) is 5-10% wider there (and
   depends on the order of the seeds), empirical Bernstein and Anderson's DKW bound cover [0, 1].
   Unbounded metrics (bounds=None) get the Student t interval.

2. "Worse" is the paired Student t test over the shared seeds, two-sided, Holm-adjusted over all
   k(k-1)/2 pairs of the k settings, and needs at least `min_seeds_to_decide(k)` shared seeds:
   - paired, because the seed (data order, initial weights) moves every setting alike;
   - t, because nothing distribution-free can decide on 4-6 seeds: the exact sign-flip test's
     smallest two-sided p is 2 / 2^n (0.125 with 4 seeds), before any multiplicity. The t test
     separates the issue's 1e-3 from 5e-3 on 4 seeds and 2e-2 on 5-6 (82% / 97% of simulated
     studies). Under the null "both settings draw from the same per-seed distribution" the
     paired differences are symmetric, where the t test is conservative at the usual levels
     (Efron 1969) except for the ties below;
   - two-sided and over all pairs, because the best is picked after seeing the data: Holm over
     only the k - 1 comparisons with the post hoc best called a setting worse in 6-9% of null
     studies of 3-5 settings, even on normal data. Any "worse" lies in the family of all
     pairwise two-sided tests, whichever setting is best, and Holm over that family (the
     comparisons with the best are a subset, see `holm`) bounds the error by alpha;
   - the minimum seeds, because the t test calls differences that are identical on every seed
     (0/1 outcomes: seeds that either solve the task or not) certain, p = 0. For a fair coin that
     happens to one pair of settings with probability 2 * 4^-n; the minimum keeps it below alpha
     summed over all pairs (3 seeds for 2 settings, 4 for 3-4, 5 for 5-7, 6 for 8-14, 7 for
     15-29).
   Simulated false "worse" with the best picked post hoc, 2-5 settings, 3-8 seeds: <= 5% on
   continuous, saturated, jittered bimodal and the issue's data; up to 5.5% on exact 0/1 data.

3. "Equivalent" is the TOST (two one-sided t tests, Schuirmann 1987) of the paired differences
   against the margin +-delta, at alpha, with the same minimum of seeds. It is the usual test
   (it assumes the mean difference is near normal); it is not corrected for multiplicity, since
   an equivalence claim about one setting is not a claim about the others.

4. `seeds_to_separate` is the normal-approximation sample size of the paired t test, with t
   quantiles iterated to the needed degrees of freedom (`_seeds_for_power`), at the Holm level
   the setting was compared at and the observed mean difference and spread; at least the minimum
   above and one more than the shared seeds, None above SEEDS_CAP.

Settings with different seed sets are paired on the seeds they share; a setting sharing fewer than
2 seeds with the best has no test (p None) and is NOT_SEPARATED.

5. NOTHING_LEARNT, every setting's verdict when no run learnt anything: every value of every
   setting lies at the metric's lower bound (`bounds[0]`: for the success rates grail-report and
   the race compare, 0: no run solved a single held-out problem in any evaluation the metric
   counts). Then there is no best, and "equivalent" would claim the settings do equally well at
   something; the runs say nothing about which setting is better, only that none learnt (train
   longer, or try other values). See `nothing_learnt` for why the definition is the floor, not an
   interval or the baseline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from scipy import optimize, special

# Above this many seeds per setting, separation is reported as out of reach (None).
SEEDS_CAP = 100


class Outcome(StrEnum):
    BEST = "best"
    WORSE = "worse"
    NOT_SEPARATED = "not_separated"
    EQUIVALENT = "equivalent"
    NOTHING_LEARNT = "nothing_learnt"  # every setting's, when no run learnt (`nothing_learnt`)


@dataclass(frozen=True)
class VerdictSettings:
    alpha: float = 0.05  # family-wise error over the settings compared with the best (Holm)
    delta: float = 0.02  # equivalence margin (TOST), in the metric's units
    power: float = 0.8  # for seeds_to_separate
    bounds: tuple[float, float] | None = (0.0, 1.0)  # the metric's range; None = unbounded
    confidence: float = 0.95

    def __post_init__(self) -> None:
        for name in ("alpha", "power", "confidence"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"VerdictSettings.{name} must be in (0, 1), got {value!r}")
        if not self.delta >= 0.0:
            raise ValueError(f"VerdictSettings.delta must be >= 0, got {self.delta!r}")
        if self.bounds is not None and not self.bounds[0] < self.bounds[1]:
            raise ValueError(f"VerdictSettings.bounds must be (lo, hi) with lo < hi: {self.bounds}")


@dataclass(frozen=True)
class Verdict:
    label: str  # the setting's label (as grail/study/stats.py labels settings)
    outcome: Outcome
    n_seeds: int
    mean: float
    ci: tuple[float, float]  # inside `bounds` when bounds is set
    p: float | None  # Holm-adjusted p of "worse than the best"; None for the best
    effect: float | None  # mean paired difference (this - best) over shared seeds
    seeds_to_separate: int | None  # NOT_SEPARATED only: estimated seeds (per setting), 80% power
    n_shared: int = 0  # seeds shared with the best (the pairs behind p and effect)
    # NOT_SEPARATED with |effect| < delta only: estimated seeds per setting for the TOST to show
    # equivalence with probability `power`, were the true difference the observed one
    seeds_to_equivalence: int | None = None


# ---- intervals ----------------------------------------------------------------------------------


def _bernoulli_kl(p: float, q: float) -> float:
    """KL divergence between Bernoulli(p) and Bernoulli(q), q strictly inside (0, 1)."""
    total = 0.0
    if p > 0.0:
        total += p * math.log(p / q)
    if p < 1.0:
        total += (1.0 - p) * math.log((1.0 - p) / (1.0 - q))
    return total


def kl_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided interval for the mean of values in [0, 1], valid for any distribution there.

    Chernoff-Hoeffding: for X in [0, 1] with mean mu, E[exp(h X)] <= 1 - mu + mu e^h (convexity),
    so P(mean of n >= x) <= exp(-n kl(x, mu)) for x > mu, kl the Bernoulli KL divergence, and
    likewise below. Each side at (1 - confidence) / 2 gives the interval
    {mu : n kl(mean, mu) <= log(2 / (1 - confidence))}. At a mean of 0 or 1 it is exact for 0/1
    data (the bound 1 - (alpha/2)^(1/n) of Clopper-Pearson with no success).
    """
    n = len(values)
    if n == 0:
        raise ValueError("kl_interval needs at least one value")
    mean = min(1.0, max(0.0, float(np.mean(values))))
    level = math.log(2.0 / (1.0 - confidence)) / n
    eps = 1e-15

    def excess(q: float) -> float:
        return _bernoulli_kl(mean, q) - level

    if mean <= 0.0:
        lo = 0.0
    else:
        lo = 0.0 if excess(eps) <= 0.0 else float(optimize.brentq(excess, eps, mean))
    if mean >= 1.0:
        hi = 1.0
    else:
        hi = 1.0 if excess(1.0 - eps) <= 0.0 else float(optimize.brentq(excess, mean, 1.0 - eps))
    return max(0.0, lo), min(1.0, hi)


def t_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """Student t interval with n - 1 degrees of freedom; (-inf, inf) for one value."""
    n = len(values)
    if n == 0:
        raise ValueError("t_interval needs at least one value")
    mean = float(np.mean(values))
    if n == 1:
        return -math.inf, math.inf
    half = float(special.stdtrit(n - 1, 0.5 + confidence / 2)) * float(np.std(values, ddof=1))
    half /= math.sqrt(n)
    return mean - half, mean + half


def mean_interval(
    values: Sequence[float], settings: VerdictSettings = VerdictSettings()
) -> tuple[float, float]:
    """The interval of the mean the verdicts use: KL within `settings.bounds` (rescaled to [0, 1]
    and back), Student t when unbounded."""
    if settings.bounds is None:
        return t_interval(values, settings.confidence)
    lo, hi = settings.bounds
    span = hi - lo
    a, b = kl_interval([(v - lo) / span for v in values], settings.confidence)
    return lo + a * span, lo + b * span


# ---- tests --------------------------------------------------------------------------------------


def min_seeds_to_decide(n_settings: int, alpha: float = 0.05) -> int:
    """Fewest shared seeds for a WORSE or EQUIVALENT verdict among `n_settings` settings: the
    smallest n >= 3 where the chance that a fair coin's 0/1 outcomes differ alike on all n seeds
    for some pair of settings (2 * 4^-n a pair, which a t test calls certain) is <= alpha."""
    pairs = max(1, n_settings * (n_settings - 1) // 2)
    n = 3
    while 2.0 * pairs * 4.0**-n > alpha:
        n += 1
    return n


# Differences are of floats that went through sums and subtractions: a spread below this (relative
# to the largest difference) is rounding, not data.
_NO_SPREAD = 1e-9


def _mean_sd(d: np.ndarray) -> tuple[float, float]:
    """Mean and sample sd of the differences, both snapped to 0 when below rounding."""
    scale = max(1.0, float(np.max(np.abs(d))))
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    return (0.0 if abs(mean) <= _NO_SPREAD * scale else mean), (
        0.0 if sd <= _NO_SPREAD * scale else sd
    )


def paired_t_p(diffs: Sequence[float]) -> float:
    """Two-sided p of the paired Student t test that the mean difference is 0 (n - 1 df). No
    spread: p = 1 when all differences are 0, else 0 (the same difference on every seed)."""
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n < 2:
        raise ValueError(f"paired_t_p needs at least 2 differences, got {n}")
    mean, sd = _mean_sd(d)
    if sd == 0.0:
        return 1.0 if mean == 0.0 else 0.0
    return float(2.0 * special.stdtr(n - 1, -abs(mean) / (sd / math.sqrt(n))))


def tost_p(diffs: Sequence[float], delta: float) -> float:
    """p of the two one-sided t tests that the mean difference lies within (-delta, delta): the
    larger of the p of "mean <= -delta" and of "mean >= delta". No spread: 0 when the difference
    is strictly inside the margin, else 1."""
    d = np.asarray(diffs, dtype=float)
    n = len(d)
    if n < 2:
        raise ValueError(f"tost_p needs at least 2 differences, got {n}")
    mean, sd = _mean_sd(d)
    if sd == 0.0:
        return 0.0 if abs(mean) < delta else 1.0
    se = sd / math.sqrt(n)
    p_above = float(special.stdtr(n - 1, -(mean + delta) / se))  # rejects mean <= -delta
    p_below = float(special.stdtr(n - 1, (mean - delta) / se))  # rejects mean >= delta
    return max(p_above, p_below)


def holm(p_values: Sequence[float], family: int | None = None) -> list[float]:
    """Holm step-down adjusted p-values, in the order given.

    The i-th smallest p (from 0) is multiplied by `family - i` and the products made monotone. With
    `family` = len(p_values) this is Holm (1979). With a larger family (the k(k-1)/2 pairs, of
    which the comparisons with the post hoc best are a subset), each adjusted p is at least the
    one Holm gives the same test within the whole family: a subset test's rank r' is at most its
    rank r there, so its multiplier family - r' + 1 is at least family - r + 1, and a test of the
    family ranked before it is bounded by the next subset test's product. So the family-wise
    error over all the pairs, whichever was picked as best, stays <= alpha.
    """
    m = len(p_values)
    family = m if family is None else family
    if family < m:
        raise ValueError(f"holm: family {family} smaller than the {m} p-values")
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (family - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def _seeds_for_power(ratio: float, alpha_tail: float, power: float, minimum: int) -> int | None:
    """Smallest n >= minimum with sqrt(n) * ratio >= t_{1-alpha_tail, n-1} + t_{power, n-1}, the
    normal-approximation sample size of a t test with t quantiles at n - 1 degrees of freedom;
    None above SEEDS_CAP. `ratio` is |difference| / spread of one paired difference."""
    if ratio <= 0.0 or not math.isfinite(ratio):
        return minimum if ratio == math.inf else None
    z = float(special.ndtri(1.0 - alpha_tail) + special.ndtri(power))
    n = max(minimum, math.ceil((z / ratio) ** 2))  # the normal answer: a lower bound
    while n <= SEEDS_CAP:
        df = n - 1
        needed = float(special.stdtrit(df, 1.0 - alpha_tail) + special.stdtrit(df, power))
        if math.sqrt(n) * ratio >= needed:
            return n
        n += 1
    return None


# ---- verdicts -----------------------------------------------------------------------------------


def _check(values: Mapping[str, Mapping[str, float]], settings: VerdictSettings) -> None:
    if not values:
        raise ValueError("judge needs at least one setting")
    for label, by_seed in values.items():
        if not by_seed:
            raise ValueError(f"setting {label!r} has no values")
        for seed, v in by_seed.items():
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"setting {label!r}, seed {seed!r}: not a finite number: {v!r}")
            if settings.bounds is not None and not (settings.bounds[0] <= v <= settings.bounds[1]):
                raise ValueError(
                    f"setting {label!r}, seed {seed!r}: {v} outside the bounds {settings.bounds}"
                )


def nothing_learnt(
    values: Mapping[str, Mapping[str, float]], settings: VerdictSettings = VerdictSettings()
) -> bool:
    """True when every value of every setting lies at the metric's lower bound (within rounding):
    for a success rate, no run solved one held-out problem in any evaluation it counts. False for
    an unbounded metric, which has no floor to be at.

    Why the floor, and not the alternatives:
    - the interval's upper bound below a small epsilon: 3 seeds at 0 give the KL interval
      [0, 0.71] (3 draws of a coin that lands heads 30% of the time all land tails in 34% of
      studies); an upper bound below 0.05 takes 72 seeds, so the rule would never fire where it
      matters, after the race's first round;
    - every run's final success equal to its baseline: the verdicts see one number per run, not
      its baseline; and runs that stayed at a baseline above 0 solve problems, so the settings
      are compared on something, and equal there is what EQUIVALENT means.
    """
    if settings.bounds is None:
        return False
    lo, hi = settings.bounds
    floor = lo + _NO_SPREAD * (hi - lo)
    return all(v <= floor for by_seed in values.values() for v in by_seed.values())


def judge(
    values: Mapping[str, Mapping[str, float]], settings: VerdictSettings = VerdictSettings()
) -> list[Verdict]:
    """One Verdict per setting: `values` maps a setting's label to {seed: value}; the best is the
    highest mean (ties: the first label in sorted order), listed first, then the others by mean
    (highest first) and label. When `nothing_learnt`, every setting is NOTHING_LEARNT instead, in
    label order (no best, no test). See the module doc for the methods."""
    _check(values, settings)
    if nothing_learnt(values, settings):
        return [
            Verdict(
                label=label,
                outcome=Outcome.NOTHING_LEARNT,
                n_seeds=len(values[label]),
                mean=float(np.mean(list(values[label].values()))),
                ci=mean_interval(list(values[label].values()), settings),
                p=None,
                effect=None,
                seeds_to_separate=None,
            )
            for label in sorted(values)
        ]
    means = {label: float(np.mean(list(v.values()))) for label, v in values.items()}
    order = sorted(values, key=lambda label: (-means[label], label))
    best, others = order[0], order[1:]
    k = len(order)
    n_min = min_seeds_to_decide(k, settings.alpha)

    diffs: dict[str, list[float]] = {}
    for label in others:
        shared = sorted(set(values[label]) & set(values[best]))
        diffs[label] = [values[label][s] - values[best][s] for s in shared]
    testable = [label for label in others if len(diffs[label]) >= 2]
    raw = [paired_t_p(diffs[label]) for label in testable]
    family = k * (k - 1) // 2
    adjusted = dict(zip(testable, holm(raw, family), strict=True))
    # the Holm multiplier each comparison got: the level its seeds_to_separate is planned at
    ranked = sorted(range(len(testable)), key=raw.__getitem__)
    multiplier = {testable[i]: family - rank for rank, i in enumerate(ranked)}

    def interval(label: str) -> tuple[float, float]:
        return mean_interval(list(values[label].values()), settings)

    verdicts = [
        Verdict(
            label=best,
            outcome=Outcome.BEST,
            n_seeds=len(values[best]),
            mean=means[best],
            ci=interval(best),
            p=None,
            effect=None,
            seeds_to_separate=None,
            n_shared=len(values[best]),
        )
    ]
    for label in others:
        d = diffs[label]
        n = len(d)
        effect = float(np.mean(d)) if d else None
        p = adjusted.get(label)
        outcome = Outcome.NOT_SEPARATED
        to_separate = to_equivalence = None
        if p is not None and effect is not None and n >= n_min:
            if p <= settings.alpha and effect < 0.0:
                outcome = Outcome.WORSE
            elif tost_p(d, settings.delta) <= settings.alpha:
                outcome = Outcome.EQUIVALENT
        if outcome is Outcome.NOT_SEPARATED and effect is not None and n >= 2:
            diff, sd = _mean_sd(np.asarray(d))
            floor = max(n_min, n + 1)
            ratio = abs(diff) / sd if sd > 0 else (math.inf if diff != 0 else 0.0)
            alpha_tail = settings.alpha / multiplier[label] / 2  # two-sided at its Holm level
            to_separate = _seeds_for_power(ratio, alpha_tail, settings.power, floor)
            if abs(diff) < settings.delta:
                margin = settings.delta - abs(diff)
                tost_ratio = margin / sd if sd > 0 else math.inf
                # both one-sided tests must pass: power split over the two tails
                to_equivalence = _seeds_for_power(
                    tost_ratio, settings.alpha, 1.0 - (1.0 - settings.power) / 2, floor
                )
        verdicts.append(
            Verdict(
                label=label,
                outcome=outcome,
                n_seeds=len(values[label]),
                mean=means[label],
                ci=interval(label),
                p=p,
                effect=effect,
                seeds_to_separate=to_separate,
                n_shared=n,
                seeds_to_equivalence=to_equivalence,
            )
        )
    return verdicts


def decided(verdicts: Sequence[Verdict]) -> bool:
    """True when every non-best verdict is WORSE or EQUIVALENT (nothing left to race); never when
    nothing was learnt (no best to decide)."""
    return all(v.outcome in (Outcome.BEST, Outcome.WORSE, Outcome.EQUIVALENT) for v in verdicts)
