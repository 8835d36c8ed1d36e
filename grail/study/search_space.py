"""The search space and job layout of the search sweeper (grail/study/search.py): Hydra's sweep
grammar read into Optuna distributions, the seeds a trial runs on, and how a trial's jobs are
numbered and handed to the launcher.

    interval(a, b)            float in [a, b]        tag(log, interval(a, b)): log scale
    range(a, b[, step])       int (or float) a, a+step, ... < b     tag(log, range(a, b)): log
    choice(x, y, z) or x,y,z  categorical            shuffle(...) of a range: categorical

Job numbers: trial number × number of seeds + seed index, consecutive within a trial, and handed
to the launcher in blocks of consecutive numbers no longer than `max_batch_size`, which keeps
`slot = job number mod max_batch_size` unique among the runs alive together (grail/study/sweep.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import IntervalSweep, Override, RangeSweep, Transformer
from hydra.errors import HydraException
from omegaconf import ListConfig, OmegaConf

from grail.study.stats import SEED_KEY
from grail.study.sweep import SweepError
from grail.study.sweeper_base import sweep_overrides

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution


@dataclass(frozen=True)
class Space:
    """What the search varies (param name -> distribution, in the order given) and the overrides
    every job gets unchanged."""

    distributions: dict[str, BaseDistribution]
    fixed: list[str] = field(default_factory=list)


def distribution_of(override: Override) -> BaseDistribution | None:
    """The Optuna distribution of a sweep override (None for a plain value), as
    hydra-optuna-sweeper reads them, except that `range` keeps Hydra's meaning (stop excluded):

        interval(a, b)            float in [a, b]        tag(log, interval(a, b)): log scale
        range(a, b[, step])       int (or float) a, a+step, ... < b     tag(log, range(a, b)): log
        choice(x, y, z) or x,y,z  categorical            shuffle(...) of a range: categorical
    """
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if not override.is_sweep_override():
        return None
    value = override.value()
    log_scale = "log" in getattr(value, "tags", set())
    if override.is_choice_sweep() or (isinstance(value, RangeSweep) and value.shuffle):
        choices = list(override.sweep_iterator(transformer=Transformer.encode))
        return CategoricalDistribution(choices)  # type: ignore[arg-type]  # Hydra's encoded values
    if isinstance(value, RangeSweep):
        values: list[Any] = list(override.sweep_iterator(transformer=Transformer.encode))
        if not values:
            raise ValueError("the range is empty")
        step = abs(value.step)
        if all(isinstance(v, int) for v in values):
            return IntDistribution(min(values), max(values), log=log_scale, step=int(step))
        if log_scale:
            raise ValueError("a log scale needs an int range or an interval")
        # Hydra adds the step up in floats (0.1 + 0.1 + 0.1 = 0.30000000000000004), which Optuna
        # would refuse as not a whole number of steps: 12 significant digits are plenty.
        low, high = (float(f"{x:.12g}") for x in (min(values), max(values)))
        return FloatDistribution(low, high, step=float(step))
    if isinstance(value, IntervalSweep):
        assert value.start is not None and value.end is not None  # the grammar requires both
        return FloatDistribution(float(value.start), float(value.end), log=log_scale)
    raise ValueError("not a sweep the search knows: use interval(...), range(...) or choice(...)")


def _fixed_override(override: Override) -> str:
    """A plain override as the user wrote it (`resume=true` stays so, not `resume=True`)."""
    if override.input_line:
        return override.input_line
    return f"{override.get_key_element()}={override.get_value_element_as_str()}"


def parse_space(
    params: Mapping[str, Any] | None,
    arguments: Sequence[str],
    parser: OverridesParser | None = None,
) -> Space:
    """The search space from `hydra.sweeper.params` and the command line's overrides: a sweep
    value (interval, range, choice, a,b,c) is searched, a plain value fixed for every job. The
    command line wins over `params` for the same key. Raises SweepError naming the bad entry."""
    parser = parser or OverridesParser.create()
    searched: dict[str, BaseDistribution] = {}
    fixed: dict[str, str] = {}
    seed = (
        "the search sets for every job from hydra.sweeper.seeds (a number k for seeds 0..k-1, "
        "or a list such as [3,7,11])"
    )
    for where, text, override in sweep_overrides(params, arguments, parser, seed):
        name = override.get_key_element()
        try:
            distribution = distribution_of(override)
        except (ValueError, HydraException) as exc:
            raise SweepError(f"{where}: {text!r}: {exc}") from exc
        searched.pop(name, None)
        fixed.pop(name, None)
        if distribution is None:
            fixed[name] = _fixed_override(override)
        else:
            searched[name] = distribution
    if not searched:
        raise SweepError(
            "nothing to search: give at least one key a distribution, on the command line "
            "('train.lr=tag(log, interval(1e-4, 1e-2))') or in hydra.sweeper.params"
        )
    return Space(distributions=searched, fixed=list(fixed.values()))


def seed_list(seeds: Any) -> list[int]:
    """hydra.sweeper.seeds as a list: k -> 0..k-1; a list of distinct ints as given."""
    if isinstance(seeds, bool):
        raise SweepError(f"hydra.sweeper.seeds must be a number or a list of ints, got {seeds!r}")
    if isinstance(seeds, int):
        if seeds < 1:
            raise SweepError(f"hydra.sweeper.seeds must be >= 1, got {seeds}")
        return list(range(seeds))
    if isinstance(seeds, ListConfig):
        seeds = OmegaConf.to_container(seeds)
    if (
        isinstance(seeds, list | tuple)
        and seeds
        and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)
    ):
        if len(set(seeds)) != len(seeds):
            raise SweepError(f"hydra.sweeper.seeds lists a seed twice: {list(seeds)}")
        return list(seeds)
    raise SweepError(
        f"hydra.sweeper.seeds must be a number k (seeds 0..k-1) or a non-empty list of ints, "
        f"got {seeds!r}"
    )


def setting_overrides(params: Mapping[str, Any], names: Sequence[str]) -> list[str]:
    """A trial's parameters as overrides, in the order of the search space."""
    return [f"{n}={Override._get_value_element_as_str(params[n])}" for n in names]


def job_overrides(fixed: Sequence[str], setting: Sequence[str], seed: int) -> list[str]:
    return [*fixed, *setting, f"{SEED_KEY}={seed}"]


def job_numbers(trial_number: int, n_seeds: int) -> list[int]:
    """The jobs of a trial, one per seed: consecutive, so a trial's runs sit side by side."""
    return [trial_number * n_seeds + i for i in range(n_seeds)]


def trials_per_batch(max_batch_size: int | None, n_seeds: int) -> int:
    """How many trials to ask for at once: as many as fit whole in a batch, at least one. Without
    a batch size (the launcher does not share this machine) one: the search learns from each
    trial before asking the next."""
    if max_batch_size is None:
        return 1
    return max(1, max_batch_size // n_seeds)


def launch_blocks(jobs: Sequence[int], max_batch_size: int | None) -> list[list[int]]:
    """Job numbers as the blocks to hand the launcher one after the other: runs of consecutive
    numbers (a launcher numbers a batch's jobs from its first one), each cut to at most
    `max_batch_size`, so `job mod max_batch_size` differs between the jobs of a block."""
    blocks: list[list[int]] = []
    for job in sorted(set(jobs)):
        last = blocks[-1] if blocks else None
        if (
            last is not None
            and job == last[-1] + 1
            and (max_batch_size is None or len(last) < max_batch_size)
        ):
            last.append(job)
        else:
            blocks.append([job])
    return blocks
