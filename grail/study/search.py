"""Search beyond the grid: a Bayesian search (Optuna's TPE) over any config keys, with seeds as
replicates, through the same launchers and run directories as a grid sweep, resumable.

    uv run grail-train -m hydra/sweeper=grail_optuna \\
        'train.lr=tag(log, interval(1e-4, 1e-2))' 'train.kl_coef=interval(0, 0.1)' \\
        hydra.sweeper.n_trials=20 hydra.sweeper.seeds=3 train.iterations=50

Why a sweeper of our own rather than hydra-optuna-sweeper: that plugin (1.3.0, its latest) pins
optuna<3.0, while grail uses optuna 5 for its pruners and journal storage, and it has no seed
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

The study lives in Optuna's journal storage at `<sweep dir>/optuna/search.journal`. A rerun of the
same command with `resume=true` and the same `hydra.sweep.dir` reloads it: finished trials stay,
trials left RUNNING are launched again with the same settings and job numbers (their runs then
resume from their newest checkpoint, grail.study.sweep.decide), and the search goes on until
`n_trials` trials are finished. At the end: the best setting with its mean and 95% CI over seeds,
the top trials, and `<sweep dir>/optuna/best.yaml`.

Optuna is imported inside the sweeper only: Hydra imports this module (through
hydra_plugins/grail_search) whenever it starts, `grail-train --help` included.
"""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from grail.core.records import LAUNCH_KEYS, atomic_write_text, metric_records
from grail.study.runs import run_status
from grail.study.search_space import (
    Space,
    job_numbers,
    job_overrides,
    launch_blocks,
    parse_space,
    seed_list,
    setting_overrides,
    trials_per_batch,
)
from grail.study.stats import METRICS, metric_of, t_interval, trained_curve
from grail.study.sweep import SweepError

if TYPE_CHECKING:
    import optuna
    from optuna.distributions import BaseDistribution

log = logging.getLogger("grail.study.search")

SEARCH_DIR = "optuna"  # below the sweep directory
JOURNAL = "search.journal"
BEST = "best.yaml"
DIRECTIONS = ("maximize", "minimize")
STUDY_ATTR = "grail_search"  # the study's user attribute holding what defines the search
TOP_TRIALS = 5  # rows of the table printed at the end
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
    sampler_seed: int | None = 0
    n_startup_trials: int = 10  # TPE samples at random until this many trials are finished
    max_batch_size: int | None = None


ConfigStore.instance().store(
    group="hydra/sweeper", name="grail_optuna_schema", node=SearchSweeperConf, provider="grail"
)


# ---- a trial's outcome from its runs -------------------------------------------------------------

COMPLETE, FAIL, PRUNED, RUNNING = "complete", "fail", "pruned", "running"


@dataclass(frozen=True)
class Outcome:
    """What a trial's runs say. `value`: mean of the metric over seeds (complete trials);
    `partial`/`step`: for a pruned trial, the mean of the metric over the evals its runs reached,
    and the last iteration all of them reached (the intermediate value Optuna ranks it by)."""

    state: str
    values_by_seed: dict[int, float] = field(default_factory=dict)
    reason: str = ""
    partial: float | None = None
    step: int | None = None

    @property
    def value(self) -> float | None:
        v = list(self.values_by_seed.values())
        return sum(v) / len(v) if v and self.state == COMPLETE else None


def trial_outcome(runs: Mapping[int, Path], metric: str) -> Outcome:
    """The outcome of a trial from its run directories (seed -> directory): failed if any run
    failed (or completed without an eval to compute the metric from), else running if any has no
    summary yet, else pruned if any was pruned, else complete."""
    failed: list[str] = []
    missing: list[Path] = []
    pruned: list[Path] = []
    values: dict[int, float] = {}
    evals_by_run: list[list[dict[str, Any]]] = []
    for seed, run_dir in runs.items():
        status = run_status(run_dir)
        evals = metric_records(run_dir, "eval")
        evals_by_run.append(evals)
        if status.status == "incomplete":
            missing.append(run_dir)
        elif status.status == "done":
            value = metric_of(evals, metric)
            if value is None:
                failed.append(
                    f"run {run_dir} completed without an eval after training started, so it has "
                    f"no {metric}: evaluate at least once (eval.enabled=true, "
                    "eval.interval <= train.iterations)"
                )
            else:
                values[seed] = value
        elif status.status == "pruned":
            pruned.append(run_dir)
        else:
            why = (status.error or "").splitlines() or [""]
            failed.append(f"run {run_dir} failed: {why[0]}")
    if failed:
        return Outcome(FAIL, values, "; ".join(failed))
    if missing:
        names = ", ".join(str(p) for p in missing)
        return Outcome(RUNNING, values, f"no summary.json in {names} (killed or still running)")
    if pruned:
        partial, step = None, None
        curves = [trained_curve(evals) for evals in evals_by_run]
        if all(curves):
            step = min(c[-1][0] for c in curves)
            known = [v for evals in evals_by_run if (v := metric_of(evals, metric)) is not None]
            partial = sum(known) / len(known) if known else None
        names = ", ".join(str(p) for p in pruned)
        return Outcome(PRUNED, values, f"pruned: {names}", partial=partial, step=step)
    return Outcome(COMPLETE, values)


# ---- the study ----------------------------------------------------------------------------------


def study_signature(
    space: Space, seeds: Sequence[int], metric: str, direction: str
) -> dict[str, Any]:
    """What makes two invocations the same search (stored with the study, checked on resume)."""
    from optuna.distributions import distribution_to_json

    fixed = {}
    for o in space.fixed:
        key = o.split("=", 1)[0]
        if key.lstrip("+~") not in LAUNCH_KEYS:
            fixed[key] = o
    return {
        "params": {k: distribution_to_json(d) for k, d in space.distributions.items()},
        "fixed": fixed,
        "seeds": list(seeds),
        "metric": metric,
        "direction": direction,
    }


def check_signature(stored: Mapping[str, Any], now: Mapping[str, Any], journal: Path) -> None:
    """Raise SweepError when this invocation is another search than the one stored: other
    distributions, seeds, metric or direction, or a fixed key given another value (the runs of
    one study would then differ in more than their parameters). Fixed keys added or dropped are
    allowed, as for a grid's rerun (say, a longer request timeout)."""
    changes = []
    for key in ("params", "seeds", "metric", "direction"):
        if stored.get(key) != now.get(key):
            changes.append(f"{key}: {stored.get(key)} before, {now.get(key)} now")
    before, after = stored.get("fixed", {}), now.get("fixed", {})
    for key in sorted(before.keys() & after.keys()):
        if before[key] != after[key]:
            changes.append(f"{before[key]} before, {after[key]} now")
    if changes:
        raise SweepError(
            f"the study in {journal} was made by a different search ("
            + "; ".join(changes)
            + "). Rerun the original command with resume=true, or start a new search (a new "
            "hydra.sweep.dir)"
        )


def open_study(
    journal: Path,
    name: str,
    signature: Mapping[str, Any],
    *,
    resume: bool,
    sampler: optuna.samplers.BaseSampler,
) -> optuna.Study:
    """The study in `journal`: created (holding `signature`) when absent; loaded and checked with
    `resume`; refused without it, since starting over would mix two searches in one directory."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal.parent.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    exists = name in optuna.study.get_all_study_names(storage)
    if exists and not resume:
        raise SweepError(
            f"{journal} already holds the study {name!r}: add resume=true to continue it, or "
            "start a new search (a new hydra.sweep.dir)"
        )
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        sampler=sampler,
        direction=signature["direction"],
        load_if_exists=True,
    )
    stored = study.user_attrs.get(STUDY_ATTR)
    if stored is None:
        study.set_user_attr(STUDY_ATTR, dict(signature))
    else:
        check_signature(stored, signature, journal)
    return study


# ---- the sweeper --------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A trial whose jobs are being launched."""

    number: int
    trial: optuna.Trial
    setting: list[str]
    jobs: list[int]


class OptunaSearchSweeper(Sweeper):
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
        super().__init__()
        if isinstance(params, DictConfig):
            params = OmegaConf.to_container(params)  # type: ignore[assignment]
        self.params = dict(params or {})
        self.n_trials = n_trials
        self.seeds_spec = seeds
        self.metric = metric
        self.direction = direction
        self.study_name = study_name
        self.sampler_seed = sampler_seed
        self.n_startup_trials = n_startup_trials
        self.max_batch_size = max_batch_size
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher: Launcher | None = None
        self.runner: _Runner | None = None  # the last sweep's, for a look at its study

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
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise SweepError(
                f"hydra.sweeper.max_batch_size must be >= 1 or null, got {self.max_batch_size}"
            )
        assert self.config is not None
        subdir = OmegaConf.to_container(self.config.hydra.sweep)["subdir"]  # type: ignore[index]
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
        import optuna

        assert self.config is not None and self.launcher is not None
        assert self.hydra_context is not None
        seeds = self._check_settings()
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        space = parse_space(self.params, arguments, parser)
        self._check_composes(space, seeds[0])

        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial, ours
        sampler = optuna.samplers.TPESampler(
            seed=self.sampler_seed, n_startup_trials=self.n_startup_trials
        )
        journal = sweep_dir / SEARCH_DIR / JOURNAL
        signature = study_signature(space, seeds, self.metric, self.direction)
        resume = bool(OmegaConf.select(self.config, "resume", default=False))
        study = open_study(journal, self.study_name, signature, resume=resume, sampler=sampler)
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
        self.runner = _Runner(self, study, space, seeds, sweep_dir)
        returns = self.runner.run()
        self.runner.finish()
        return returns


def _sample(distribution: BaseDistribution) -> Any:
    """One value of `distribution` (its first choice or low end), for the composition check."""
    from optuna.distributions import CategoricalDistribution

    if isinstance(distribution, CategoricalDistribution):
        return distribution.choices[0]
    return distribution.low  # type: ignore[attr-defined]


class _Runner:
    """One invocation of the search: relaunch what an interrupted one left running, then ask,
    launch and tell until the study holds n_trials finished trials."""

    def __init__(
        self,
        sweeper: OptunaSearchSweeper,
        study: optuna.Study,
        space: Space,
        seeds: list[int],
        sweep_dir: Path,
    ) -> None:
        self.sweeper = sweeper
        self.study = study
        self.space = space
        self.names = list(space.distributions)
        self.seeds = seeds
        self.sweep_dir = sweep_dir
        self.returns: list[Any] = []
        self.left_running = 0  # trials this invocation could not finish (a run without summary)

    def run_dir(self, job: int) -> Path:
        return self.sweep_dir / str(job)

    def _finished(self) -> int:
        from optuna.trial import TrialState

        states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        return len(self.study.get_trials(deepcopy=False, states=states))

    def run(self) -> list[Any]:
        import optuna
        from optuna.trial import TrialState

        stale = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        if stale:
            log.info(
                "resuming %d interrupted trial(s): %s",
                len(stale),
                ", ".join(str(t.number) for t in stale),
            )
            pending = []
            for frozen in stale:
                trial = optuna.Trial(self.study, frozen._trial_id)
                setting = frozen.user_attrs.get("overrides") or setting_overrides(
                    frozen.params, self.names
                )
                pending.append(
                    _Pending(frozen.number, trial, list(setting), self._jobs(frozen.number))
                )
            self._launch_and_tell(pending)

        per_batch = trials_per_batch(self.sweeper.max_batch_size, len(self.seeds))
        while (todo := self.sweeper.n_trials - self._finished() - self.left_running) > 0:
            pending = []
            for _ in range(min(per_batch, todo)):
                trial = self.study.ask(fixed_distributions=self.space.distributions)
                setting = setting_overrides(trial.params, self.names)
                jobs = self._jobs(trial.number)
                trial.set_user_attr("overrides", setting)
                trial.set_user_attr("jobs", jobs)
                trial.set_user_attr("seeds", self.seeds)
                pending.append(_Pending(trial.number, trial, setting, jobs))
            self._launch_and_tell(pending)
        return self.returns

    def _jobs(self, number: int) -> list[int]:
        return job_numbers(number, len(self.seeds))

    def _launch_and_tell(self, pending: list[_Pending]) -> None:
        assert self.sweeper.launcher is not None
        by_job: dict[int, list[str]] = {}
        for p in pending:
            log.info("trial %d: %s (jobs %s)", p.number, " ".join(p.setting), _span(p.jobs))
            for job, seed in zip(p.jobs, self.seeds, strict=True):
                by_job[job] = job_overrides(self.space.fixed, p.setting, seed)
        for block in launch_blocks(list(by_job), self.sweeper.max_batch_size):
            batch = [by_job[j] for j in block]
            self.sweeper.validate_batch_is_legal(batch)
            results = self.sweeper.launcher.launch(batch, initial_job_idx=block[0])
            for r in results:
                _ = r.return_value  # a job that raised (not a failed run: those end in summary)
            self.returns.append(results)
        for p in pending:
            self._tell(p)

    def _tell(self, p: _Pending) -> None:
        from optuna.trial import TrialState

        runs = {seed: self.run_dir(job) for job, seed in zip(p.jobs, self.seeds, strict=True)}
        outcome = trial_outcome(runs, self.sweeper.metric)
        label = " ".join(p.setting)
        p.trial.set_user_attr(
            "values_by_seed", {str(s): v for s, v in outcome.values_by_seed.items()}
        )
        if outcome.state == COMPLETE:
            self.study.tell(p.number, outcome.value)
            interval = t_interval(list(outcome.values_by_seed.values()))
            log.info(
                "trial %d (%s): %s %.4f over %s%s",
                p.number,
                label,
                self.sweeper.metric,
                outcome.value,
                f"{interval.n} seed{'s' if interval.n != 1 else ''}",
                f", 95% CI [{interval.lo:.4f}, {interval.hi:.4f}]"
                if interval.lo is not None
                else "",
            )
        elif outcome.state == PRUNED:
            if outcome.partial is not None and outcome.step is not None:
                p.trial.report(outcome.partial, outcome.step)  # ranks it for TPE among pruned ones
            self.study.tell(p.number, state=TrialState.PRUNED)
            log.info("trial %d (%s): pruned (%s)", p.number, label, outcome.reason)
        elif outcome.state == FAIL:
            self.study.tell(p.number, state=TrialState.FAIL)
            log.warning("trial %d (%s): failed: %s", p.number, label, outcome.reason)
        else:
            self.left_running += 1
            log.warning(
                "trial %d (%s): not finished, %s; rerun with resume=true to finish it",
                p.number,
                label,
                outcome.reason,
            )

    # -- the end --

    def finish(self) -> None:
        """Print the best setting and the top trials; write best.yaml."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        count = {s: sum(t.state == s for t in trials) for s in TrialState}
        counts = (
            f"{count[TrialState.COMPLETE]} complete, {count[TrialState.PRUNED]} pruned, "
            f"{count[TrialState.FAIL]} failed, {count[TrialState.RUNNING]} unfinished"
        )
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        if not complete:
            log.warning("search %r: no complete trial (%s)", self.study.study_name, counts)
            return
        reverse = self.sweeper.direction == "maximize"
        complete.sort(key=lambda t: t.value, reverse=reverse)  # type: ignore[arg-type,return-value]
        best = complete[0]
        best_record = self._best_record(best)
        atomic_write_text(
            self.sweep_dir / SEARCH_DIR / BEST, yaml.safe_dump(best_record, sort_keys=False)
        )
        self._print(complete[:TOP_TRIALS], best_record, counts)

    def _seed_values(self, trial: optuna.trial.FrozenTrial) -> list[float]:
        stored = trial.user_attrs.get("values_by_seed") or {}
        return [float(v) for v in stored.values()]

    def _best_record(self, best: optuna.trial.FrozenTrial) -> dict[str, Any]:
        interval = t_interval(self._seed_values(best))
        setting = list(
            best.user_attrs.get("overrides") or setting_overrides(best.params, self.names)
        )
        fixed = [o for o in self.space.fixed if o.split("=", 1)[0].lstrip("+~") not in LAUNCH_KEYS]
        return {
            "study": self.study.study_name,
            "trial": best.number,
            "metric": self.sweeper.metric,
            "direction": self.sweeper.direction,
            "value": best.value,
            "ci95": None if interval.lo is None else [interval.lo, interval.hi],
            "seeds": {
                int(s): float(v) for s, v in (best.user_attrs.get("values_by_seed") or {}).items()
            },
            "params": {k: _plain(v) for k, v in best.params.items()},
            "overrides": setting,
            "runs": [str(self.run_dir(j)) for j in self._jobs(best.number)],
            "command": shlex.join(["uv", "run", "grail-train", *fixed, *setting]),
        }

    def _print(
        self, top: list[optuna.trial.FrozenTrial], best: Mapping[str, Any], counts: str
    ) -> None:
        from rich.console import Console
        from rich.markup import escape
        from rich.table import Table

        metric = self.sweeper.metric
        table = Table(
            title=f"search {self.study.study_name!r}: top {len(top)} of {counts} trials "
            f"({metric}, mean over seeds, 95% CI Student t)",
            title_justify="left",
        )
        for column in ("trial", metric, "95% CI", "seeds", "setting"):
            table.add_column(column, justify="right" if column != "setting" else "left")
        for t in top:
            interval = t_interval(self._seed_values(t))
            ci = "n/a" if interval.lo is None else f"[{interval.lo:.3f}, {interval.hi:.3f}]"
            setting = t.user_attrs.get("overrides") or setting_overrides(t.params, self.names)
            table.add_row(
                str(t.number), f"{t.value:.3f}", ci, str(interval.n), escape(" ".join(setting))
            )
        console = Console(stderr=True, soft_wrap=True)
        console.print(table)
        ci = best["ci95"]
        console.print(
            f"best: trial {best['trial']}, {escape(' '.join(best['overrides']))}: {metric} "
            f"{best['value']:.4f}"
            + (f", 95% CI [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "")
            + f" over {_seeds(len(best['seeds']))}; written to {self.sweep_dir / SEARCH_DIR / BEST}"
        )
        console.print(f"train with it: {escape(best['command'])}")


def _plain(value: Any) -> Any:
    """A parameter value as YAML writes it plainly (numpy scalars and the like as Python's)."""
    if isinstance(value, bool | int | str) or value is None:
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return str(value)


def _seeds(n: int) -> str:
    return f"{n} seed{'s' if n != 1 else ''}" + (" (no interval from one)" if n == 1 else "")


def _span(jobs: Sequence[int]) -> str:
    return f"{jobs[0]}-{jobs[-1]}" if len(jobs) > 1 else str(jobs[0])
