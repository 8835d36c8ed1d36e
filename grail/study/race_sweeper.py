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
- No batch barrier: the submitit launchers (local, SLURM) get one job per `launch` call, from a
  thread per running job, so a slot is refilled as soon as its run ends. Any other launcher (the
  basic one runs the job in this process, and `grail-train` installs a signal handler, which only
  the main thread may) runs one job at a time, in the main thread.
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
import queue
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from grail.core.records import LAUNCH_KEYS, atomic_write_text, metric_records, override_key
from grail.study.race import BEST, NOT_SEPARATED, Decided, Judge, Race, RaceOptions, Run
from grail.study.runs import read_overrides, run_status
from grail.study.stats import SEED_KEY, censored_value, seed_run
from grail.study.sweep import SUBMITIT_LOCAL, SUBMITIT_SLURM, SweepError

log = logging.getLogger("grail.study.race")

RACE_METRICS = ("auc", "final")  # `best` is a max over noisy evals: biased upwards, unfit to race
VERDICT = "verdict.json"
RACE_RECORD = "race.json"
JOB_SUBDIR = "${hydra.job.num}"  # Hydra's default, which the race replaces per job
THREADED_LAUNCHERS = (SUBMITIT_LOCAL, SUBMITIT_SLURM)
# What a launching thread hands back: (slot, run, what the job raised, if anything)
Ended = queue.Queue[tuple[int, Run, BaseException | None]]


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


ConfigStore.instance().store(
    group="hydra/sweeper", name="grail_race_schema", node=RaceSweeperConf, provider="grail"
)


# ---- the settings -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    index: int
    overrides: list[str]  # the swept keys' values, in the command's order

    @property
    def label(self) -> str:
        return " ".join(self.overrides)


def parse_settings(
    params: Mapping[str, Any], arguments: Sequence[str], parser: OverridesParser
) -> tuple[list[Setting], list[str]]:
    """The settings (the cartesian product of the swept values, in Hydra's grid order) and the
    overrides every run gets. Raises SweepError naming a bad entry."""
    entries = [(f"hydra.sweeper.params.{k}", f"{k}={v}") for k, v in params.items()]
    entries += [("the command line", a) for a in arguments]
    swept: dict[str, list[str]] = {}
    fixed: dict[str, str] = {}
    for where, text in entries:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            raise SweepError(f"{where}: cannot parse {text!r}: {exc}") from exc
        if override.is_hydra_override():
            continue  # applied by Hydra already
        key = override.get_key_element()
        if override_key(key) == SEED_KEY:
            raise SweepError(
                f"{where}: {text!r} sets the seed, which the race chooses itself (seeds 0, 1, ... "
                "up to hydra.sweeper.max_seeds)"
            )
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
    product = list(itertools.product(*swept.values())) if swept else []
    settings = [Setting(i, list(p)) for i, p in enumerate(product)]
    return settings, list(fixed.values())


def run_name(setting: Setting, seed: int) -> str:
    return f"s{setting.index}_seed{seed}"


RUN_NAME = re.compile(r"s(\d+)_seed(\d+)")  # run_name's pattern: setting index, seed


# ---- a run's result -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """How a run directory stands for the race: `ended` (completed, pruned or failed) and its
    value (None for a failed run, or one without an eval after training started)."""

    ended: bool
    value: float | None
    status: str


def read_result(run_dir: Path, metric: str) -> Result:
    """The run's `metric` as grail-report computes it from its eval records; a pruned run's
    censored as the report counts it (grail.study.stats.censored_value: over the evaluations it
    reached, at most its success rate where it was stopped)."""
    status = run_status(run_dir).status
    if status not in ("done", "pruned"):
        return Result(status == "failed", None, status)
    run = seed_run(run_dir.name, [], status, metric_records(run_dir, "eval"))
    value = run.metric(metric) if status == "done" else censored_value(run, metric)
    return Result(True, value, status)


# ---- verdict.json -------------------------------------------------------------------------------


def _as_dict(overrides: Sequence[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def _optional(kind: type, value: Any) -> Any:
    """A number as JSON writes it (numpy's as Python's), None as null."""
    return None if value is None else kind(value)


def verdict_record(race: Race, settings: Sequence[Setting]) -> dict[str, Any]:
    """verdict.json: the verdicts over the results so far, one entry per setting (judged ones in
    the judge's order, best first; settings without any value yet last, with n_seeds 0)."""
    by_label = {s.label: s for s in settings}
    verdicts = race.verdicts()
    entries = []
    best = None
    for v in verdicts:
        overrides = _as_dict(by_label[v.label].overrides)
        if v.outcome == BEST:
            best = overrides
        entries.append(
            {
                "overrides": overrides,
                "outcome": v.outcome.value,
                "n_seeds": int(v.n_seeds),
                "mean": float(v.mean),
                "ci": [float(x) for x in v.ci],
                "p": _optional(float, v.p),
                "seeds_to_separate": _optional(int, v.seeds_to_separate),
            }
        )
    judged = {v.label for v in verdicts}
    for s in settings:
        if s.label not in judged:
            entries.append(
                {
                    "overrides": _as_dict(s.overrides),
                    "outcome": NOT_SEPARATED,
                    "n_seeds": len(race.values[s.label]),
                    "mean": None,
                    "ci": None,
                    "p": None,
                    "seeds_to_separate": None,
                }
            )
    return {
        "best": best,
        "decided": race.is_decided(),
        "runs": race.ended,
        "settings": entries,
    }


# ---- the sweeper --------------------------------------------------------------------------------


class RaceSweeper(Sweeper):
    """Hydra sweeper running a race (see the module doc). Hydra instantiates it as
    hydra_plugins.grail_race.race_sweeper.RaceSweeper: plugins must live there."""

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
    ) -> None:
        super().__init__()
        if isinstance(params, DictConfig):
            params = OmegaConf.to_container(params)  # type: ignore[assignment]
        self.params = dict(params or {})
        self.initial_seeds = initial_seeds
        self.max_seeds = max_seeds
        self.max_runs = max_runs
        self.metric = metric
        self.alpha = alpha
        self.delta = delta
        self.max_batch_size = max_batch_size
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher: Launcher | None = None
        self.race: Race | None = None  # the last sweep's, for a look at its state

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )

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

    def _check_record(self, sweep_dir: Path, record: Mapping[str, Any], resume: bool) -> None:
        """A directory that holds a race continues it only with resume=true and the same race."""
        path = sweep_dir / RACE_RECORD
        if not path.is_file():
            return
        if not resume:
            raise SweepError(
                f"{sweep_dir} holds a race already ({RACE_RECORD}): add resume=true to continue "
                "it, or choose another hydra.sweep.dir"
            )
        stored = json.loads(path.read_text())
        changed = [k for k in ("settings", "fixed", "metric") if stored.get(k) != record[k]]
        if changed:
            what = "; ".join(f"{k}: {stored.get(k)} before, {record[k]} now" for k in changed)
            raise SweepError(
                f"{sweep_dir} holds another race ({what}): rerun its own command with "
                "resume=true, or start a new race (a new hydra.sweep.dir)"
            )

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
        race = Race([s.label for s in settings], options, judge, decided)

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        resume = bool(OmegaConf.select(self.config, "resume", default=False))
        record = self._record(settings, fixed)
        self._check_record(sweep_dir, record, resume)
        atomic_write_text(sweep_dir / RACE_RECORD, json.dumps(record, indent=2) + "\n")
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        self.race = race
        runner = RaceRunner(self, race, settings, fixed, sweep_dir)
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


class RaceRunner:
    """One invocation of a race: read what the run directories hold, launch what the race asks
    in free slots, feed back each run's result, write verdict.json as results come in."""

    def __init__(
        self,
        sweeper: RaceSweeper,
        race: Race,
        settings: list[Setting],
        fixed: list[str],
        sweep_dir: Path,
    ) -> None:
        self.sweeper = sweeper
        self.race = race
        self.settings = {s.label: s for s in settings}
        self.fixed = fixed
        self.sweep_dir = sweep_dir
        self.metric = sweeper.metric
        assert sweeper.config is not None
        target = OmegaConf.select(sweeper.config, "hydra.launcher._target_", default=None)
        self.threaded = target in THREADED_LAUNCHERS
        parallel = sweeper.max_batch_size
        # One slot per running job; without a batch size (SLURM) as many as the race asks for.
        self.slots = (parallel or len(settings) * race.options.max_seeds) if self.threaded else 1
        self.jobs_in_slot = [0] * self.slots
        self.returns: list[Any] = []
        self.to_relaunch: list[Run] = []

    def run_dir(self, run: Run) -> Path:
        label, seed = run
        return self.sweep_dir / run_name(self.settings[label], seed)

    def overrides(self, run: Run) -> list[str]:
        label, seed = run
        name = run_name(self.settings[label], seed)
        return [
            *self.fixed,
            *self.settings[label].overrides,
            f"{SEED_KEY}={seed}",
            f"hydra.sweep.subdir={name}",
        ]

    def load(self) -> None:
        """Every run an earlier invocation started (whatever max_seeds was then): ended ones
        read, the others (killed, failed) to be launched again first. A directory made for
        another setting raises SweepError."""
        by_index = list(self.settings.values())
        found = []
        for path in self.sweep_dir.iterdir() if self.sweep_dir.is_dir() else []:
            if path.is_dir() and (match := RUN_NAME.fullmatch(path.name)):
                index, seed = int(match[1]), int(match[2])
                if index >= len(by_index):
                    raise SweepError(f"{path} is not a run of this race's {len(by_index)} settings")
                found.append((seed, index, path))
        for seed, index, run_dir in sorted(found):
            setting = by_index[index]
            recorded = [o for o in read_overrides(run_dir) if override_key(o) != SEED_KEY]
            if recorded and not set(setting.overrides) <= set(recorded):
                raise SweepError(
                    f"{run_dir} holds a run of {' '.join(recorded)}, not {setting.label}: the "
                    "sweep's values or their order changed. Rerun the original command with "
                    "resume=true, or start a new race (a new hydra.sweep.dir)"
                )
            run = (setting.label, seed)
            self.race.start(run)
            result = read_result(run_dir, self.metric)
            if result.status in ("done", "pruned"):
                self.race.end(run, result.value)
            else:
                self.to_relaunch.append(run)
        if self.to_relaunch:
            names = ", ".join(self.run_dir(r).name for r in self.to_relaunch)
            log.info("race: launching again what an earlier attempt left unfinished: %s", names)

    def _job_number(self, slot: int) -> int:
        """A job number that `grail-train` reads as `slot`: job mod slots == slot (slots is
        hydra.sweeper.max_batch_size, the `parallel` of grail.study.sweep.assign_resources)."""
        number = self.jobs_in_slot[slot] * self.slots + slot
        self.jobs_in_slot[slot] += 1
        return number

    def _launch(self, run: Run, slot: int, job: int, done: Ended) -> None:
        assert self.sweeper.launcher is not None
        error: BaseException | None = None
        try:
            results = self.sweeper.launcher.launch([self.overrides(run)], initial_job_idx=job)
            for r in results:
                _ = r.return_value  # a job that raised (not a failed run: those end in summary)
            self.returns.append(results)
        except BaseException as exc:
            if not self.threaded and not isinstance(exc, Exception):
                raise  # Ctrl-C in a job run in this process: stop here, as a grid does
            error = exc  # handed to the main thread, which stops the race once its runs ended
        done.put((slot, run, error))

    def _next(self) -> tuple[Run, bool] | None:
        if self.to_relaunch:
            return self.to_relaunch.pop(0), True
        run = self.race.next_run()
        return (run, False) if run is not None else None

    def run(self) -> list[Any]:
        done: Ended = queue.Queue()
        free = list(range(self.slots))
        running: dict[int, Run] = {}
        error: BaseException | None = None
        try:
            while True:
                while free and error is None and (nxt := self._next()) is not None:
                    run, again = nxt
                    if not again:
                        self.race.start(run)
                    slot = free.pop(0)
                    running[slot] = run
                    log.info(
                        "race: %s seed %d -> %s (slot %d)",
                        run[0],
                        run[1],
                        self.run_dir(run).name,
                        slot,
                    )
                    job = self._job_number(slot)
                    if self.threaded:
                        threading.Thread(
                            target=self._launch, args=(run, slot, job, done), daemon=True
                        ).start()
                    else:
                        self._launch(run, slot, job, done)
                if not running:
                    break
                slot, run, raised = _get(done)
                del running[slot]
                free.append(slot)
                free.sort()
                error = error or raised
                self._ended(run)
        except KeyboardInterrupt:
            # The runs got the same Ctrl-C; what they wrote is kept, so say how to go on.
            log.warning(
                "race interrupted with %d run(s) going; to continue it, rerun the same command "
                "with resume=true hydra.sweep.dir=%s",
                len(running),
                self.sweep_dir.absolute(),
            )
            raise SystemExit(130) from None
        finally:
            self._write_verdict()
        if error is not None:
            raise error
        self._finish()
        return self.returns

    def _ended(self, run: Run) -> None:
        result = read_result(self.run_dir(run), self.metric)
        if not result.ended:
            log.warning(
                "race: %s ended without a summary (killed?); rerun with resume=true to finish it",
                self.run_dir(run),
            )
        elif result.value is None:
            log.warning("race: %s has no %s (%s)", self.run_dir(run), self.metric, result.status)
        self.race.end(run, result.value)
        self._write_verdict()

    def _write_verdict(self) -> None:
        record = verdict_record(self.race, list(self.settings.values()))
        atomic_write_text(self.sweep_dir / VERDICT, json.dumps(record, indent=2) + "\n")

    def _finish(self) -> None:
        record = verdict_record(self.race, list(self.settings.values()))
        state = "decided" if record["decided"] else "not decided"
        log.info(
            "race %s after %d runs: best %s; verdicts in %s",
            state,
            record["runs"],
            record["best"],
            self.sweep_dir / VERDICT,
        )
        for entry in record["settings"]:
            log.info(
                "  %s: %s, %s %s over %d seeds, CI %s, p %s",
                " ".join(f"{k}={v}" for k, v in entry["overrides"].items()),
                entry["outcome"],
                self.metric,
                entry["mean"],
                entry["n_seeds"],
                entry["ci"],
                entry["p"],
            )


def _get(done: Ended) -> tuple[int, Run, BaseException | None]:
    """The next ended run; polling, so Ctrl-C reaches the main thread while it waits."""
    while True:
        try:
            return done.get(timeout=0.5)
        except queue.Empty:
            continue
