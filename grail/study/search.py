"""Search beyond the grid: a Bayesian search (Optuna's TPE) over any config keys, with seeds as
replicates, through the same launchers and run directories as a grid sweep, resumable.

    uv run grail-train -m hydra/sweeper=grail_optuna \\
        'train.lr=tag(log, interval(1e-4, 1e-2))' 'train.kl_coef=interval(0, 0.1)' \\
        hydra.sweeper.n_trials=20 hydra.sweeper.seeds=3 train.iterations=50

Why a sweeper of our own rather than hydra-optuna-sweeper: that plugin (1.3.0, its latest) pins
optuna<3.0, while grail uses optuna 5 for its journal storage, and it has no seed
replicates, no trial state from a run's own record (failed, pruned, killed) and no batching that
keeps grail's per-slot resource split valid. So this is a thin one, keeping that plugin's config
shape where it fits (`params` in Hydra's sweep grammar, `n_trials`, `direction`, `study_name`).

The layout. A trial is one setting (a value per searched key); its jobs are that setting on each
seed: job number = trial number × n_seeds + seed index, run directory `<sweep dir>/<job number>`
as in a grid sweep, with `seed=<s>` among its overrides, so `grail-report` groups a trial's runs
as one setting and shows its statistics over seeds. Jobs go to the launcher in consecutive blocks
of at most `max_batch_size` (several trials at once when their seeds fit), which is what keeps
`slot = job number mod max_batch_size` unique among the runs alive together (grail/study/sweep.py).

A trial's value is the mean over its seeds of `metric` (grail.study.stats.metric_of on each run's
eval records); its state comes from the runs' summary.json: a failed run fails the trial, a pruned
one prunes it, a run without a summary (killed) leaves it RUNNING.

The study lives in Optuna's journal storage at `<sweep dir>/optuna/search.journal`
(grail/study/search_study.py). A rerun of the
same command with `resume=true` and the same `hydra.sweep.dir` reloads it: finished trials stay,
trials left RUNNING are launched again with the same settings and job numbers (their runs then
resume from their newest checkpoint, grail.study.sweep.decide), and the search goes on until
`n_trials` trials are finished. Each trial's sampler is seeded from `sampler_seed` and the trial's
number (search_study.trial_sampler), so a resumed search proposes what the uninterrupted one would
have, instead of replaying the random stream of its first trials. At the end: the best setting
with its mean and 95% CI over seeds, the top trials, and `<sweep dir>/optuna/best.yaml` (the
ask/launch/tell loop and this report: grail/study/search_runner.py). A wrong command, or a rerun
without `resume=true` in a directory that holds a study, is refused in one line (exit code 2).

Optuna is imported inside the sweeper only: Hydra imports this module (through
hydra_plugins/grail_search) whenever it starts, `grail-train --help` included.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from grail.study.search_runner import SearchRunner
from grail.study.search_space import (
    Space,
    job_overrides,
    parse_space,
    seed_list,
    setting_overrides,
)
from grail.study.search_study import JOURNAL, SEARCH_DIR, open_study, study_signature
from grail.study.stats import METRICS
from grail.study.sweep import SweepError
from grail.study.sweeper_base import GrailSweeper

if TYPE_CHECKING:
    from optuna.distributions import BaseDistribution

log = logging.getLogger("grail.study.search")  # one logger for the whole search

DIRECTIONS = ("maximize", "minimize")
# Hydra names each job's directory by `hydra.sweep.subdir`; the search finds a trial's runs by it.
JOB_SUBDIR = "${hydra.job.num}"


@dataclass
class SearchSweeperConf:
    """hydra/sweeper=grail_optuna (conf/hydra/sweeper/grail_optuna.yaml). Typed, so a misspelt
    key fails at composition naming it."""

    _target_: str = "hydra_plugins.grail_search.search_sweeper.OptunaSearchSweeper"
    # key -> distribution in Hydra's sweep grammar, e.g. {train.lr: "tag(log, interval(1e-4,1e-2))"}
    # (the same can be written on the command line: 'train.lr=tag(log, interval(1e-4, 1e-2))')
    params: dict[str, Any] = field(default_factory=dict)
    n_trials: int = 20  # finished trials the study should hold
    seeds: Any = 3  # k: seeds 0..k-1; or a list of seeds
    metric: str = "auc"  # auc | final | best (grail.study.stats)
    direction: str = "maximize"
    study_name: str = "search"
    sampler_seed: int | None = 0  # with the trial's number, seeds each trial's TPE; null: random
    n_startup_trials: int = 10  # TPE samples at random until this many trials are finished
    max_batch_size: int | None = None


ConfigStore.instance().store(
    group="hydra/sweeper", name="grail_optuna_schema", node=SearchSweeperConf, provider="grail"
)


# ---- the sweeper --------------------------------------------------------------------------------


class OptunaSearchSweeper(GrailSweeper):
    """Hydra sweeper running the search (see the module doc). Hydra instantiates it as
    hydra_plugins.grail_search.search_sweeper.OptunaSearchSweeper: plugins must live there."""

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        n_trials: int = 20,
        seeds: Any = 3,
        metric: str = "auc",
        direction: str = "maximize",
        study_name: str = "search",
        sampler_seed: int | None = 0,
        n_startup_trials: int = 10,
        max_batch_size: int | None = None,
    ) -> None:
        super().__init__(params, max_batch_size)
        self.n_trials = n_trials
        self.seeds_spec = seeds
        self.metric = metric
        self.direction = direction
        self.study_name = study_name
        self.sampler_seed = sampler_seed
        self.n_startup_trials = n_startup_trials
        self.runner: SearchRunner | None = None  # the last sweep's, for a look at its study

    # -- checks --

    def _check_settings(self) -> list[int]:
        if self.metric not in METRICS:
            raise SweepError(
                f"hydra.sweeper.metric={self.metric!r} is not one of {', '.join(METRICS)}"
            )
        if self.direction not in DIRECTIONS:
            raise SweepError(
                f"hydra.sweeper.direction={self.direction!r} is not one of {', '.join(DIRECTIONS)}"
            )
        if not isinstance(self.n_trials, int) or self.n_trials < 1:
            raise SweepError(f"hydra.sweeper.n_trials must be >= 1, got {self.n_trials!r}")
        if self.sampler_seed is not None and (
            not isinstance(self.sampler_seed, int) or self.sampler_seed < 0
        ):
            raise SweepError(
                f"hydra.sweeper.sampler_seed must be an int >= 0 or null, got {self.sampler_seed!r}"
            )
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise SweepError(
                f"hydra.sweeper.max_batch_size must be >= 1 or null, got {self.max_batch_size}"
            )
        assert self.config is not None
        sweep = OmegaConf.to_container(self.config.hydra.sweep)  # unresolved: ${hydra.job.num}
        assert isinstance(sweep, dict)
        subdir = sweep["subdir"]
        if subdir != JOB_SUBDIR:
            raise SweepError(
                f"hydra.sweep.subdir={subdir!r}: the search finds a trial's runs by their job "
                f"number, so it needs the default {JOB_SUBDIR}"
            )
        return seed_list(self.seeds_spec)

    def _check_composes(self, space: Space, seed: int) -> None:
        """Compose a job's config for every choice and the low end of every range before the
        study holds anything: a misspelt key or a wrong type fails here, naming the key, instead
        of failing every trial."""
        from optuna.distributions import CategoricalDistribution

        base = {n: _sample(d) for n, d in space.distributions.items()}
        names = list(space.distributions)
        batch = [job_overrides(space.fixed, setting_overrides(base, names), seed)]
        for name, dist in space.distributions.items():
            if isinstance(dist, CategoricalDistribution):
                for choice in dist.choices[1:]:
                    params = {**base, name: choice}
                    batch.append(job_overrides(space.fixed, setting_overrides(params, names), seed))
        self.validate_batch_is_legal(batch)

    # -- the search --

    def sweep(self, arguments: list[str]) -> list[Any]:
        """Hydra's entry point: the search, with a wrong command or a directory that holds
        another search (SweepError) told in one line and exit code 2, as grail-train tells any
        configuration error, rather than as Hydra's traceback."""
        try:
            return self.search(arguments)
        except SweepError as exc:
            log.error("%s", exc)
            sys.exit(2)

    def search(self, arguments: list[str]) -> list[Any]:
        """The search (see the module doc); raises SweepError for a wrong command."""
        import optuna

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        seeds = self._check_settings()
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        space = parse_space(self.params, arguments, parser)
        self._check_composes(space, seeds[0])

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial, ours
        journal = sweep_dir / SEARCH_DIR / JOURNAL
        signature = study_signature(space, seeds, self.metric, self.direction)
        resume = bool(OmegaConf.select(self.config, "resume", default=False))
        study = open_study(journal, self.study_name, signature, resume=resume)
        # Only once the study is accepted: a refused rerun leaves the sweep's record as it was.
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        log.info(
            "search %r in %s: %d trials x %d seeds (%s), TPE, %s %s, batches of %s jobs",
            self.study_name,
            journal,
            self.n_trials,
            len(seeds),
            ", ".join(map(str, seeds)),
            self.direction,
            self.metric,
            self.max_batch_size or "1 trial's",
        )
        self.runner = SearchRunner(self, study, space, seeds, sweep_dir)
        returns = self.runner.run()
        self.runner.finish()
        return returns


def _sample(distribution: BaseDistribution) -> Any:
    """One value of `distribution` (its first choice or low end), for the composition check."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[0]
    return distribution.low  # type: ignore[attr-defined]
