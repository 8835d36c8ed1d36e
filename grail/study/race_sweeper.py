"""hydra/sweeper=grail_race: racing over seeds (grail/study/race.py) through Hydra's launchers.

    uv run grail-train -m hydra/sweeper=grail_race train.lr=1e-3,5e-3,2e-2

The settings are the cartesian product of the swept values (as in a grid); the race gives each
its seeds (`seed=` is set by the race, so it is not swept) and stops when the verdicts
(grail/study/verdicts.py) are decided. The layout:

- Run directories `<sweep dir>/s<setting index>_seed<seed>` (the setting's index in the grid's
  order), set per job by a `hydra.sweep.subdir` override: a run's directory depends only on its
  setting and seed, so a rerun finds every run where it was.
- Job numbers say only which slot a run takes: a run started in free slot s of P gets a job number
  with `job mod P == s`, so `grail.study.sweep.assign_resources` gives it that slot's GPUs and cores
  while the runs of the other slots go on. P is `hydra.sweeper.max_batch_size` (automatic for the
  local launcher, as for a grid).
- No batch barrier: the launcher gets one job at a time, as soon as a slot is free
  (grail/study/race_runner.py, which also reads each run's result and writes verdict.json).
- After every run that ends, `<sweep dir>/verdict.json` (written atomically) holds the verdicts so
  far (`verdict_record`, in the shape docs/sweeps.md gives); `<sweep dir>/race.json` what defines
  the race (settings, fixed overrides, metric), checked on resume.

Resume: the same command with `resume=true` and the same `hydra.sweep.dir`. Runs that ended
(completed or pruned) are read; runs without a summary (killed) and failed ones are launched again
first (`grail-train` resumes or retries them in their directories); then the race goes on. Without
`resume=true` a directory that holds a race is refused.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf

from grail.core.records import LAUNCH_KEYS, atomic_write_text, override_key
from grail.study.ladder import FRACTIONS, Rung, continued_iterations, parse_ladder
from grail.study.ladder_runner import (
    LADDER_RECORD,
    climb,
    continue_run,
    fidelity_override,
)
from grail.study.race import Decided, Judge, Race, RaceOptions
from grail.study.race_runner import RaceRunner, Setting, check_record, run_name
from grail.study.stats import SEED_KEY
from grail.study.sweep import SweepError
from grail.study.sweeper_base import GrailSweeper, sweep_overrides

log = logging.getLogger("grail.study.race")

RACE_METRICS = ("auc", "final")  # `best` is a max over noisy evals: biased upwards, unfit to race
RACE_RECORD = "race.json"
JOB_SUBDIR = "${hydra.job.num}"  # Hydra's default, which the race replaces per job


@dataclass
class RaceSweeperConf:
    """hydra/sweeper=grail_race (conf/hydra/sweeper/grail_race.yaml). Typed, so a misspelt key
    fails at composition naming it."""

    _target_: str = "hydra_plugins.grail_race.race_sweeper.RaceSweeper"
    params: dict[str, Any] = field(default_factory=dict)  # key -> "a,b,c", as on the command line
    initial_seeds: int = 3
    max_seeds: int = 10
    max_runs: int | None = None
    metric: str = "auc"
    alpha: float = 0.05
    delta: float = 0.02
    max_batch_size: int | None = None
    ladder: list[str] | None = None  # cheaper fidelities, cheapest first (grail/study/ladder.py)


ConfigStore.instance().store(
    group="hydra/sweeper", name="grail_race_schema", node=RaceSweeperConf, provider="grail"
)

# ---- the settings -------------------------------------------------------------------------------


def parse_settings(
    params: Mapping[str, Any], arguments: Sequence[str], parser: OverridesParser
) -> tuple[list[Setting], list[str]]:
    """The settings (the cartesian product of the swept values, in Hydra's grid order) and the
    overrides every run gets. Raises SweepError naming a bad entry, or the one setting when there
    are fewer than two to race."""
    swept: dict[str, list[str]] = {}
    fixed: dict[str, str] = {}
    seed = "the race chooses itself (seeds 0, 1, ... up to hydra.sweeper.max_seeds)"
    for where, text, override in sweep_overrides(params, arguments, parser, seed):
        key = override.get_key_element()
        swept.pop(key, None)
        fixed.pop(key, None)
        if override.is_sweep_override():
            try:
                values = list(override.sweep_string_iterator())
            except HydraException as exc:
                raise SweepError(
                    f"{where}: {text!r}: a race compares listed values (a,b,c, choice(...) or "
                    f"range(...)), not a continuous {type(override.value()).__name__}: {exc}"
                ) from exc
            swept[key] = [f"{key}={v}" for v in values]
        else:
            fixed[key] = override.input_line or f"{key}={override.get_value_element_as_str()}"
    # No key swept is one setting (the product of no lists): every run the same config.
    settings = [Setting(i, list(p)) for i, p in enumerate(itertools.product(*swept.values()))]
    if len(settings) < 2:
        same = [o for o in fixed.values() if override_key(o) not in LAUNCH_KEYS]
        one = settings[0].label if swept else " ".join(same) or "the config as composed"
        raise SweepError(
            f"a race needs at least two settings to compare, got 1 ({one}): sweep a key over "
            "several values, e.g. train.lr=1e-3,5e-3,2e-2"
        )
    return settings, list(fixed.values())


# ---- the sweeper --------------------------------------------------------------------------------


class RaceSweeper(GrailSweeper):
    """Hydra sweeper running a race (see the module doc). Hydra instantiates it as
    hydra_plugins.grail_race.race_sweeper.RaceSweeper: plugins must live there."""

    # report.html's drawing, `draw_page(sweep_dir, race_over=...)`: the report layer's, which
    # the plugin (above every layer) sets; None draws no page.
    draw_page: Callable[..., Any] | None = None

    def __init__(
        self,
        params: Mapping[str, Any] | None = None,
        initial_seeds: int = 3,
        max_seeds: int = 10,
        max_runs: int | None = None,
        metric: str = "auc",
        alpha: float = 0.05,
        delta: float = 0.02,
        max_batch_size: int | None = None,
        ladder: Sequence[str] | None = None,
    ) -> None:
        super().__init__(params, max_batch_size)
        self.ladder = None if ladder is None else list(ladder)
        self.initial_seeds = initial_seeds
        self.max_seeds = max_seeds
        self.max_runs = max_runs
        self.metric = metric
        self.alpha = alpha
        self.delta = delta
        self.race: Race | None = None  # the last sweep's, for a look at its state

    # -- checks --

    def _options(self) -> RaceOptions:
        if self.metric not in RACE_METRICS:
            raise SweepError(
                f"hydra.sweeper.metric={self.metric!r} is not one of {', '.join(RACE_METRICS)}"
            )
        if not 0 < self.alpha < 1:
            raise SweepError(f"hydra.sweeper.alpha must be in (0, 1), got {self.alpha!r}")
        if not self.delta >= 0:
            raise SweepError(f"hydra.sweeper.delta must be >= 0, got {self.delta!r}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise SweepError(
                f"hydra.sweeper.max_batch_size must be >= 1 or null, got {self.max_batch_size}"
            )
        assert self.config is not None
        sweep = OmegaConf.to_container(self.config.hydra.sweep)  # unresolved: ${hydra.job.num}
        assert isinstance(sweep, dict)
        if sweep["subdir"] != JOB_SUBDIR:
            raise SweepError(
                f"hydra.sweep.subdir={sweep['subdir']!r}: the race names each run's directory "
                f"by its setting and seed itself, so leave it at the default {JOB_SUBDIR}"
            )
        return RaceOptions(self.initial_seeds, self.max_seeds, self.max_runs)

    def _judge(self) -> tuple[Judge, Decided]:
        """The statistics (grail/study/verdicts.py), with this race's alpha and delta; success
        rates (auc and final alike) lie in [0, 1]."""
        from grail.study import verdicts

        settings = verdicts.VerdictSettings(alpha=self.alpha, delta=self.delta, bounds=(0.0, 1.0))
        return (lambda values: verdicts.judge(values, settings)), verdicts.decided

    def _record(self, settings: Sequence[Setting], fixed: Sequence[str]) -> dict[str, Any]:
        return {
            "settings": [s.overrides for s in settings],
            "fixed": sorted(o for o in fixed if override_key(o) not in LAUNCH_KEYS),
            "metric": self.metric,
        }

    # -- the race --

    def sweep(self, arguments: list[str]) -> list[Any]:
        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        options = self._options()
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        settings, fixed = parse_settings(self.params, arguments, parser)
        # a misspelt key or a wrong type fails here, before any run, naming the key
        self.validate_batch_is_legal([[*fixed, *s.overrides, f"{SEED_KEY}=0"] for s in settings])
        judge, decided = self._judge()
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        resume = bool(OmegaConf.select(self.config, "resume", default=False))
        if self.ladder is not None:
            return self._climb(settings, fixed, options, (judge, decided), sweep_dir, resume)
        race = Race([s.label for s in settings], options, judge, decided)
        if (sweep_dir / LADDER_RECORD).is_file():
            raise SweepError(
                f"{sweep_dir} holds a multi-fidelity race ({LADDER_RECORD}): rerun its own "
                "command (with its hydra.sweeper.ladder) and resume=true, or choose another "
                "hydra.sweep.dir"
            )
        record = self._record(settings, fixed)
        check_record(sweep_dir / RACE_RECORD, record, resume, "a race")
        atomic_write_text(sweep_dir / RACE_RECORD, json.dumps(record, indent=2) + "\n")
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.race = race
        runner = RaceRunner(
            race,
            settings,
            fixed,
            sweep_dir,
            launcher=self.launcher,
            launcher_target=OmegaConf.select(self.config, "hydra.launcher._target_", default=None),
            metric=self.metric,
            parallel=self.max_batch_size,
            page=self.draw_page,
        )
        log.info(
            "race of %d settings in %s: %d seeds each, then up to %d, %s, alpha %g, delta %g",
            len(settings),
            sweep_dir,
            options.initial_seeds,
            options.max_seeds,
            self.metric,
            self.alpha,
            self.delta,
        )
        runner.load()
        return runner.run()

    # -- the multi-fidelity race --

    def _base(self, fixed: Sequence[str]) -> dict[str, int]:
        """The values a rung's fractions scale: the command's (a fixed override wins over the
        composed config, which Hydra composes without the sweep's own params)."""
        assert self.config is not None
        base = {}
        for key in FRACTIONS.values():
            value = OmegaConf.select(self.config, key, default=None)
            for override in fixed:
                if override_key(override) == key:
                    value = override.split("=", 1)[1]
            try:
                base[key] = int(value)
            except (TypeError, ValueError):
                continue
        return base

    def _climb(
        self,
        settings: list[Setting],
        fixed: list[str],
        options: RaceOptions,
        statistics: tuple[Judge, Decided],
        sweep_dir: Path,
        resume: bool,
    ) -> list[Any]:
        assert self.config is not None and self.launcher is not None
        base = self._base(fixed)
        rungs = parse_ladder(self.ladder or [], base)
        for rung in rungs[:-1]:  # a rung's misspelt key fails here, before any run
            self.validate_batch_is_legal(
                [[*fixed, *rung.overrides, fidelity_override(rung), *settings[0].overrides]]
            )
        record = {
            **self._record(settings, fixed),
            "ladder": [{"fidelity": r.name, "overrides": list(r.overrides)} for r in rungs],
        }
        if (sweep_dir / RACE_RECORD).is_file():
            raise SweepError(
                f"{sweep_dir} holds a race without a ladder ({RACE_RECORD}): choose another "
                "hydra.sweep.dir for a multi-fidelity race"
            )
        check_record(sweep_dir / LADDER_RECORD, record, resume, "a multi-fidelity race")
        atomic_write_text(sweep_dir / LADDER_RECORD, json.dumps(record, indent=2) + "\n")
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        judge, decided = statistics
        launcher = self.launcher
        launcher_target = OmegaConf.select(self.config, "hydra.launcher._target_", default=None)
        log.info(
            "multi-fidelity race of %d settings in %s, rungs %s: %d seeds each, then up to %d, "
            "%s, alpha %g, delta %g",
            len(settings),
            sweep_dir,
            " -> ".join(r.name for r in rungs),
            options.initial_seeds,
            options.max_seeds,
            self.metric,
            self.alpha,
            self.delta,
        )

        def start_rung(rung: Rung, members: list[Setting]) -> tuple[Race, RaceRunner]:
            race = Race([s.label for s in members], options, judge, decided, alone=True)
            rung_dir = sweep_dir / rung.directory
            own = {override_key(o) for o in rung.overrides}
            rung_fixed = [
                *(o for o in fixed if override_key(o) not in own),
                *rung.overrides,
                fidelity_override(rung),
            ]
            rung_record = self._record(members, rung_fixed)
            # the ladder was checked: a rung directory left by another ladder still is refused
            check_record(rung_dir / RACE_RECORD, rung_record, True, "a race")
            rung_dir.mkdir(parents=True, exist_ok=True)
            below = rungs[rung.index - 1] if rung.index else None
            continued = None if below is None else continued_iterations(below, rung, base)

            def reuse(setting: Setting, seed: int, run_dir: Path) -> bool:
                """A promoted setting's run continues its run of the rung below (same seed),
                when the two rungs differ only in train.iterations."""
                assert below is not None and continued is not None
                lower = sweep_dir / below.directory / run_name(setting, seed)
                overrides = runner.overrides((setting.label, seed))
                return continue_run(lower, run_dir, continued, rung.name, overrides)

            atomic_write_text(rung_dir / RACE_RECORD, json.dumps(rung_record, indent=2) + "\n")
            self.race = race
            runner = RaceRunner(
                race,
                members,
                rung_fixed,
                rung_dir,
                launcher=launcher,
                launcher_target=launcher_target,
                metric=self.metric,
                parallel=self.max_batch_size,
                page=self.draw_page,
                subdir=f"{rung.directory}/",
                grid_size=len(settings),
                title=f"race, rung {rung.index + 1}/{len(rungs)} ({rung.name})",
                reuse=None if continued is None else reuse,
            )
            runner.load()
            return race, runner

        return climb(rungs, settings, start_rung, sweep_dir)
