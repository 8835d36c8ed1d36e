"""Multi-fidelity racing: a race whose rounds climb a ladder of fidelities (pure; no I/O).

    uv run grail-train -m hydra/sweeper=grail_race train.lr=1e-3,5e-3,2e-2 train.iterations=200 \
        'hydra.sweeper.ladder=["iterations=0.33"]'

The ladder names the cheaper fidelities, cheapest first; the top of the ladder is the command's
own config (fidelity `full`). Each rung is a race of its own (grail/study/race.py: initial seeds,
seeds only to the settings not yet separated from the best, one round ahead at most) over the
settings promoted to it; the first rung races every setting. When a rung's race is over, the
settings it has not shown worse (the best, those equivalent to it, those not separated from it)
go up to the next rung; a setting shown worse stops there. The verdict of the top rung is the
study's; `overturned` says which lower rungs' verdicts it contradicts.

A rung is a list of overrides, with two shorthands for the fidelities issue 44 names:
`iterations=F` (F x train.iterations, rounded, at least 1; F as 0.33 or 1/3) and `problems=F` (F x
data.problems_per_iteration); anything else is a Hydra override as on the command line
(`model=tiny`, `model.lora.enabled=true`, `train.iterations=50`). Several in one rung are
separated by spaces: "model=tiny iterations=0.5".

What this does not do: start a rung before the one below it is over. A rung's promotions need
its verdicts, and its verdicts need its runs; the slots a rung's last runs leave free stay idle
until they end (a ladder of R rungs pays R such tails; a plain race pays one).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction

from grail.core.records import override_key
from grail.study.race import BEST, EQUIVALENT, NOTHING_LEARNT, WORSE
from grail.study.sweep import SweepError

TOP = "full"  # the fidelity of the top rung: the command's own config
# shorthand -> the config key it is a fraction of
FRACTIONS = {"iterations": "train.iterations", "problems": "data.problems_per_iteration"}
ITERATIONS = FRACTIONS["iterations"]


@dataclass(frozen=True)
class Rung:
    """One fidelity of the ladder: its name (as the ladder gives it; `full` for the top) and the
    overrides its runs get on top of the race's own."""

    index: int
    name: str
    overrides: tuple[str, ...]

    @property
    def directory(self) -> str:
        """The rung's directory under the sweep directory: a race directory of its own."""
        return f"r{self.index}"


def parse_ladder(entries: Sequence[str], base: Mapping[str, int]) -> list[Rung]:
    """The rungs, cheapest first and the top (`full`, no overrides) last. `base`: the values
    the fractions scale (train.iterations, data.problems_per_iteration of the command's config).
    Raises SweepError naming a bad entry."""
    if isinstance(entries, str) or not isinstance(entries, Sequence):
        raise SweepError(
            f"hydra.sweeper.ladder must be a list of rungs, cheapest first, e.g. "
            f"'hydra.sweeper.ladder=[\"iterations=0.33\"]', got {entries!r}"
        )
    rungs = []
    for i, entry in enumerate(entries):
        text = str(entry).strip()
        where = f"hydra.sweeper.ladder[{i}] ({text!r})"
        if not text:
            raise SweepError(
                f"{where}: a rung needs at least one override; the top rung is the "
                "command's own config, so leave it out of the ladder"
            )
        if text == TOP or "'" in text or '"' in text:
            raise SweepError(
                f"{where}: a rung is overrides such as iterations=0.33 or model=tiny, "
                f"without quotes (and not {TOP!r}, the top rung's name)"
            )
        overrides = [_expand(item, base, where) for item in text.split()]
        keys = [override_key(o) for o in overrides]
        if len(set(keys)) != len(keys):
            raise SweepError(f"{where}: a key is set twice: {' '.join(overrides)}")
        rungs.append(Rung(i, text, tuple(overrides)))
    names = [r.name for r in rungs]
    if len(set(names)) != len(names):
        raise SweepError(f"hydra.sweeper.ladder lists a rung twice: {names}")
    return [*rungs, Rung(len(rungs), TOP, ())]


def _expand(item: str, base: Mapping[str, int], where: str) -> str:
    if "=" not in item or item.startswith("="):
        raise SweepError(f"{where}: {item!r} is not key=value")
    key, value = item.split("=", 1)
    if key not in FRACTIONS:
        return item
    target = FRACTIONS[key]
    try:
        fraction = float(Fraction(value))  # 0.33, or 1/3 exactly
    except (ValueError, ZeroDivisionError):
        fraction = math.nan
    if not 0 < fraction < 1:
        raise SweepError(
            f"{where}: {key}={value} must be a fraction in (0, 1) of {target} "
            f"({base.get(target)} here); for another value set {target}=N"
        )
    if target not in base:
        raise SweepError(f"{where}: {key}= scales {target}, which the config does not set")
    return f"{target}={max(1, round(fraction * base[target]))}"


def continued_iterations(lower: Rung, upper: Rung, base: Mapping[str, int]) -> int | None:
    """The upper rung's train.iterations when its runs can continue the lower rung's (the two
    differ in train.iterations alone, the upper's larger: a resume may raise it, and the run
    trains on as if it had been started that long, grail/train/resume.py); else None."""

    def split(rung: Rung) -> tuple[set[str], int | None]:
        rest = {o for o in rung.overrides if override_key(o) != ITERATIONS}
        given = [o.split("=", 1)[1] for o in rung.overrides if override_key(o) == ITERATIONS]
        value = given[0] if given else base.get(ITERATIONS)
        try:
            return rest, None if value is None else int(value)
        except ValueError:
            return rest, None

    (low_rest, low), (up_rest, up) = split(lower), split(upper)
    if low_rest != up_rest or low is None or up is None or up <= low:
        return None
    return up


def promoted(outcomes: Mapping[str, str], settings: Sequence[str]) -> list[str]:
    """The settings that go up from a rung whose race is over, in the sweep's order: every one
    judged and not shown worse (best, equivalent, not separated). When nothing was learnt the
    rung told nothing apart, so all judged settings go up. A setting without any value (every
    run failed) is not judged and does not go up."""
    nothing_learnt = bool(outcomes) and all(o == NOTHING_LEARNT for o in outcomes.values())
    return [
        label
        for label in settings
        if label in outcomes and (outcomes[label] != WORSE or nothing_learnt)
    ]


@dataclass(frozen=True)
class Overturned:
    """A lower rung's verdict about a setting that the top rung's contradicts."""

    fidelity: str
    setting: str
    was: str  # the lower rung's outcome
    now: str  # the top rung's


def overturned(
    lower: Sequence[tuple[str, Mapping[str, str]]], top: Mapping[str, str]
) -> list[Overturned]:
    """Which lower rungs' verdicts the top's contradicts. `lower`: (fidelity, setting -> outcome)
    per rung below the top; `top`: setting -> outcome at the top. A claim is contradicted when a
    setting called best or equivalent below is worse at the top. "Not separated" claims nothing,
    and a setting called worse below never reached the top, so that claim cannot be checked."""
    found = []
    for fidelity, outcomes in lower:
        for setting, was in outcomes.items():
            now = top.get(setting)
            if now is None:
                continue
            if was in (BEST, EQUIVALENT) and now == WORSE:
                found.append(Overturned(fidelity, setting, was, now))
    return found
