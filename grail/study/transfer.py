"""Transfer verdicts: does a cheap study's answer hold at the expensive fidelity? (pure math)

Two studies of the same settings (one cheap: fewer iterations, a smaller model, LoRA, fewer
problems; one expensive), each summarized over its seeds (grail/study/stats.py `summarize`), are
compared setting by setting:

- the cheap best's verdict at the expensive fidelity: the expensive study's own verdict of that
  setting (paired over the expensive seeds, Holm; grail/study/verdicts.py): `best`,
  `equivalent` (within delta of the best), `worse`, or `not separated yet`, with the seeds that
  would settle it;
- the rank agreement: Kendall's tau between the settings' means at the two fidelities (1: the
  same order, -1: reversed), over the settings both studies measured, with a bootstrap interval
  over seeds (each study's seeds resampled, the settings of a seed kept together, as the
  verdicts pair them), inside [-1, 1] by construction.

With two or three settings tau takes a few values only (three settings: -1, -1/3, 1/3, 1), so the
interval is coarse: it says how often resampled seeds would order the settings otherwise.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy.stats import kendalltau

from grail.study.stats import SettingStats
from grail.study.verdicts import Outcome

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0  # the same studies give the same interval


@dataclass(frozen=True)
class TransferRow:
    """One setting at both fidelities (None: not measured there)."""

    label: str
    cheap_mean: float | None
    cheap_rank: int  # 0: no value (or nothing learnt)
    expensive_mean: float | None
    expensive_rank: int
    expensive: SettingStats | None  # its statistics and verdict at the expensive fidelity


@dataclass(frozen=True)
class Transfer:
    rows: list[TransferRow]  # in the expensive study's order (best first), then cheap-only ones
    cheap_best: str | None  # the cheap study's best setting (None: no best, e.g. nothing learnt)
    outcome: Outcome | None  # its verdict at the expensive fidelity (None: not measured there)
    seeds_to_settle: int | None  # expensive seeds per setting that would separate it, if open
    tau: float | None  # Kendall's tau of the means over the shared settings (None: < 2 of them)
    tau_interval: tuple[float, float] | None  # 95% bootstrap interval over seeds
    shared: int  # settings measured at both fidelities


def _means(
    values: Mapping[str, Mapping[str, float]], seeds: Mapping[str, Sequence[str]]
) -> dict[str, float]:
    return {
        label: sum(values[label][s] for s in picks) / len(picks)
        for label, picks in seeds.items()
        if picks
    }


def _tau(cheap: Mapping[str, float], expensive: Mapping[str, float]) -> float | None:
    labels = sorted(set(cheap) & set(expensive))
    if len(labels) < 2:
        return None
    a, b = [cheap[x] for x in labels], [expensive[x] for x in labels]
    if len(set(a)) < 2 or len(set(b)) < 2:  # ties everywhere: no order to agree on
        return None
    return float(kendalltau(a, b).statistic)


def _resampled(values: Mapping[str, Mapping[str, float]], rng: random.Random) -> dict[str, float]:
    """Each setting's mean over seeds drawn with replacement from the study's seeds, one draw
    per seed shared by the settings that have it (so that paired settings stay paired)."""
    all_seeds = sorted({s for per in values.values() for s in per})
    drawn = [rng.choice(all_seeds) for _ in all_seeds]
    picks = {label: [s for s in drawn if s in per] for label, per in values.items()}
    return _means(values, picks)


def tau_interval(
    cheap: Mapping[str, Mapping[str, float]],
    expensive: Mapping[str, Mapping[str, float]],
    samples: int = BOOTSTRAP_SAMPLES,
    confidence: float = 0.95,
) -> tuple[float, float] | None:
    """A percentile bootstrap interval of Kendall's tau, both studies' seeds resampled."""
    rng = random.Random(BOOTSTRAP_SEED)
    taus = []
    for _ in range(samples):
        t = _tau(_resampled(cheap, rng), _resampled(expensive, rng))
        if t is not None:
            taus.append(t)
    if len(taus) < samples // 2:  # mostly ties: no interval worth the name
        return None
    taus.sort()
    tail = (1 - confidence) / 2
    return taus[int(tail * (len(taus) - 1))], taus[int((1 - tail) * (len(taus) - 1))]


def transfer(cheap: Sequence[SettingStats], expensive: Sequence[SettingStats]) -> Transfer:
    """The cheap study's answer at the expensive fidelity (see the module docstring)."""
    by_label = {s.label: s for s in expensive}
    cheap_by_label = {s.label: s for s in cheap}
    best = next((s.label for s in cheap if s.is_best), None)
    rows = [
        TransferRow(
            s.label,
            cheap_by_label[s.label].interval.mean if s.label in cheap_by_label else None,
            cheap_by_label[s.label].rank if s.label in cheap_by_label else 0,
            s.interval.mean,
            s.rank,
            s,
        )
        for s in expensive
    ]
    rows += [
        TransferRow(s.label, s.interval.mean, s.rank, None, 0, None)
        for s in cheap
        if s.label not in by_label
    ]
    verdict = by_label[best].verdict if best is not None and best in by_label else None
    cheap_values = {s.label: s.values_by_seed for s in cheap if s.values_by_seed}
    expensive_values = {s.label: s.values_by_seed for s in expensive if s.values_by_seed}
    shared = set(cheap_values) & set(expensive_values)
    tau = _tau(
        {k: v.interval.mean for k, v in cheap_by_label.items() if v.interval.mean is not None},
        {k: v.interval.mean for k, v in by_label.items() if v.interval.mean is not None},
    )
    interval = (
        tau_interval({k: cheap_values[k] for k in shared}, {k: expensive_values[k] for k in shared})
        if tau is not None
        else None
    )
    return Transfer(
        rows=rows,
        cheap_best=best,
        outcome=verdict.outcome if verdict is not None else None,
        seeds_to_settle=(
            verdict.seeds_to_separate
            if verdict is not None and verdict.outcome is Outcome.NOT_SEPARATED
            else None
        ),
        tau=tau,
        tau_interval=interval,
        shared=len(shared),
    )
