"""Racing over seeds (F-Race's idea, brought to a sweep): every setting runs on a few seeds, then
seeds are added only to the settings not yet separated from the best, until the best is separated
from, or equivalent to, every other one, or a seed or run budget is spent.

Pure state, no I/O: `Race` is told which runs started and how they ended, and answers which run
to start next (`next_run`) and what is known so far (`verdicts`). The sweeper
(grail/study/race_sweeper.py) launches what it answers and feeds back what the run directories say;
the statistics are the `judge` and `decided` it is given (grail/study/verdicts.py in the sweeper,
fakes in tests).

The schedule, for settings X1..XS and k = initial_seeds:

1. The initial round: every setting on seeds 0..k-1, seed-major (seed 0 of every setting, then
   seed 1, ...), whatever the statistics say meanwhile: k seeds per setting are the least the
   verdicts may rest on.
2. Then, each time a slot is free, the verdicts over the results so far pick the settings still in
   the race: the best and those not separated from it (`worse` and `equivalent` ones get no more
   seeds). Each gets its next seed (seeds in order, so every setting's seeds are the same 0..n-1
   and the judge pairs them), the lowest seed first. A seed s >= k starts only once every setting
   in the race has ended its seeds below s - 1: the race runs at most one round ahead of its
   results, so a free slot is filled at once while the round before is finishing, but no setting
   runs seeds that results already in could show it does not need.
3. No new run starts once the verdicts are decided (`decided`), the settings in the race have
   max_seeds seeds, or max_runs runs started. Runs still going then end, and the verdicts over all
   results are the race's answer; should those runs undo the decision, racing goes on.
4. Nor once they say that nothing was learnt (`nothing_learnt`: every run of every setting at 0,
   grail/study/verdicts.py): there is no best to race for, and seeds up to max_seeds for every
   setting would be the most expensive way to learn that the settings need changing (more
   iterations, other values). A run still going that learns something undoes it, as in 3.

A run that failed ends without a value (its seed is missing from that setting's pairs); a pruned
run ends with its censored value (grail.study.stats.censored_value, as the report counts it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from grail.study.sweep import SweepError

if TYPE_CHECKING:
    from grail.study.verdicts import Verdict

# The verdict outcomes (grail.study.verdicts.Outcome's values, compared as text so that this
# module loads without numpy and scipy) that keep a setting in the race.
BEST, NOT_SEPARATED, NOTHING_LEARNT = "best", "not_separated", "nothing_learnt"
EQUIVALENT, WORSE = "equivalent", "worse"
IN_RACE = (BEST, NOT_SEPARATED)


# grail.study.verdicts.judge and decided, with the race's settings bound: setting label ->
# {seed (as text): value} -> one verdict per setting that has a value
Judge = Callable[[Mapping[str, Mapping[str, float]]], Sequence["Verdict"]]
Decided = Callable[[Sequence["Verdict"]], bool]


@dataclass(frozen=True)
class RaceOptions:
    """hydra.sweeper.initial_seeds / max_seeds / max_runs (conf/hydra/sweeper/grail_race.yaml)."""

    initial_seeds: int = 3
    max_seeds: int = 10
    max_runs: int | None = None  # None: no budget but max_seeds

    def __post_init__(self) -> None:
        for name in ("initial_seeds", "max_seeds"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise SweepError(
                    f"hydra.sweeper.{name} must be an int >= 2 (a paired test needs two seeds), "
                    f"got {value!r}"
                )
        if self.max_seeds < self.initial_seeds:
            raise SweepError(
                f"hydra.sweeper.max_seeds={self.max_seeds} is below "
                f"hydra.sweeper.initial_seeds={self.initial_seeds}"
            )
        if self.max_runs is not None and (
            isinstance(self.max_runs, bool) or not isinstance(self.max_runs, int)
        ):
            raise SweepError(
                f"hydra.sweeper.max_runs must be an int or null, got {self.max_runs!r}"
            )


Run = tuple[str, int]  # (setting label, seed)


@dataclass
class Race:
    """The state of one race (see the module doc). `settings`: the labels, in the sweep's order
    (ties between runs to start are broken by it)."""

    settings: list[str]
    options: RaceOptions
    judge: Judge
    decided: Decided
    # A rung of a multi-fidelity race (grail/study/ladder.py) may hold one setting, the only one
    # promoted to it: it runs its initial seeds, and is best by elimination.
    alone: bool = False
    started: dict[str, set[int]] = field(default_factory=dict)  # seeds launched (ended or not)
    running: set[Run] = field(default_factory=set)
    values: dict[str, dict[int, float]] = field(default_factory=dict)  # ended with a value
    # the judge's verdicts over `values`, until a run ends with a value (judging can be slow)
    _verdicts: list[Verdict] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.settings) < (1 if self.alone else 2):
            named = f" ({self.settings[0]})" if self.settings else ""
            raise SweepError(
                f"a race needs at least two settings to compare, got {len(self.settings)}{named}: "
                "sweep a key over several values, e.g. train.lr=1e-3,5e-3,2e-2"
            )
        if len(set(self.settings)) != len(self.settings):
            raise SweepError(f"a setting is listed twice: {self.settings}")
        for label in self.settings:
            self.started.setdefault(label, set())
            self.values.setdefault(label, {})

    # -- what happened --

    def start(self, run: Run) -> None:
        label, seed = run
        if seed in self.started[label]:
            raise ValueError(f"{label} seed {seed} started twice")
        self.started[label].add(seed)
        self.running.add(run)

    def end(self, run: Run, value: float | None) -> None:
        """`run` ended: with its metric, or None (failed, or no value to score it by)."""
        label, seed = run
        if seed not in self.started[label]:
            raise ValueError(f"{label} seed {seed} ended without starting")
        self.running.discard(run)
        if value is not None:
            self.values[label][seed] = value
            self._verdicts = None

    # -- what is known --

    @property
    def runs(self) -> int:
        """Runs started so far (ended, running, or failed)."""
        return sum(len(seeds) for seeds in self.started.values())

    @property
    def ended(self) -> int:
        """Runs whose results are in (with a value, or failed)."""
        return self.runs - len(self.running)

    def verdicts(self) -> list[Verdict]:
        """The judge's verdicts over the values so far (settings without one are left out);
        [] until two settings have values (one, in a race of one setting)."""
        if self._verdicts is not None:
            return self._verdicts
        scored = {
            label: {str(seed): v for seed, v in sorted(by_seed.items())}
            for label, by_seed in self.values.items()
            if by_seed
        }
        enough = min(2, len(self.settings))
        self._verdicts = list(self.judge(scored)) if len(scored) >= enough else []
        return self._verdicts

    def is_decided(self) -> bool:
        """The verdicts are decided, and about every setting: one without any value (every run
        of it failed) keeps the race undecided, although no seed is added to it."""
        verdicts = self.verdicts()
        return bool(verdicts) and self.decided(verdicts) and all(self.values.values())

    def nothing_learnt(self) -> bool:
        """The verdicts say that no run of any setting learnt anything (module doc, step 4)."""
        verdicts = self.verdicts()
        return bool(verdicts) and all(v.outcome == NOTHING_LEARNT for v in verdicts)

    # -- what to do next --

    def next_run(self) -> Run | None:
        """The run to start in a free slot now, or None (wait for a run to end, or the race is
        over: see `over`)."""
        if self.options.max_runs is not None and self.runs >= self.options.max_runs:
            return None
        initial = self.options.initial_seeds
        for seed in range(initial):
            for label in self.settings:
                if seed not in self.started[label]:
                    return label, seed
        verdicts = self.verdicts()
        if not verdicts or self.decided(verdicts) or self.nothing_learnt():
            return None
        in_race = {v.label for v in verdicts if v.outcome in IN_RACE}
        contenders = [label for label in self.settings if label in in_race]
        candidates = []
        for label in contenders:
            seed = _next_seed(self.started[label])
            if seed >= self.options.max_seeds:
                continue
            # at most one round ahead of the results (the module doc's step 2)
            if not any(t < seed - 1 for other, t in self.running if other in in_race):
                candidates.append((seed, self.settings.index(label), label))
        if not candidates:
            return None
        seed, _, label = min(candidates)
        return label, seed

    def over(self) -> bool:
        """Nothing running and nothing to start: the verdicts are final."""
        return not self.running and self.next_run() is None

    def unfinished(self) -> list[Run]:
        return sorted(self.running, key=lambda run: (run[1], self.settings.index(run[0])))


def _next_seed(started: set[int]) -> int:
    """The lowest seed not started yet (seeds go in order, so normally len(started))."""
    seed = 0
    while seed in started:
        seed += 1
    return seed
