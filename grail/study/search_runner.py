"""One invocation of the search (grail/study/search.py): relaunch the trials an interrupted one
left running, then ask Optuna for trials, launch their jobs (a setting on each seed) through
Hydra's launcher in blocks, and tell the study each trial's outcome (grail/study/search_outcome.py)
until it holds `n_trials` finished trials; at the end, the best setting and the top trials, and
`<sweep dir>/optuna/best.yaml`.

Optuna is imported inside the methods only (see grail/study/search.py).
"""

from __future__ import annotations

import logging
import math
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import yaml

from grail.core.records import LAUNCH_KEYS, atomic_write_text
from grail.study.progress import Row, State, StudyProgress
from grail.study.search_outcome import COMPLETE, FAIL, PRUNED, trial_outcome
from grail.study.search_space import (
    Space,
    job_numbers,
    job_overrides,
    launch_blocks,
    setting_overrides,
    trials_per_batch,
)
from grail.study.search_study import BEST, SEARCH_DIR, trial_sampler
from grail.study.stats import t_interval
from grail.study.sweep import SUBMITIT_LOCAL, SUBMITIT_SLURM, SweepError

if TYPE_CHECKING:
    import optuna
    from hydra.plugins.launcher import Launcher

log = logging.getLogger("grail.study.search")  # one logger for the whole search

TOP_TRIALS = 5  # rows of the table printed at the end
TOP_SHOWN = 3  # complete trials the progress display lists, above the running ones


@dataclass
class _Pending:
    """A trial whose jobs are being launched."""

    number: int
    trial: optuna.Trial
    setting: list[str]
    jobs: list[int]


class SearchSettings(Protocol):
    """What the runner reads of its sweeper (grail/study/search.py's OptunaSearchSweeper)."""

    n_trials: int
    metric: str
    sampler_seed: int | None
    n_startup_trials: int
    direction: str
    max_batch_size: int | None
    launcher: Launcher | None

    def validate_batch_is_legal(self, batch: Sequence[Sequence[str]]) -> None: ...


class SearchRunner:
    """One invocation of the search: relaunch what an interrupted one left running, then ask,
    launch and tell until the study holds n_trials finished trials."""

    def __init__(
        self,
        sweeper: SearchSettings,
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
        self.running: list[_Pending] = []  # trials whose jobs are out, not told yet
        launcher = type(sweeper.launcher)
        # the basic launcher runs each job in this process, printing on this terminal
        in_process = f"{launcher.__module__}.{launcher.__qualname__}" not in (
            SUBMITIT_LOCAL,
            SUBMITIT_SLURM,
        )
        self.progress = StudyProgress(self._progress_state, in_process=in_process)

    def run_dir(self, job: int) -> Path:
        return self.sweep_dir / str(job)

    def _finished(self) -> int:
        from optuna.trial import TrialState

        states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        return len(self.study.get_trials(deepcopy=False, states=states))

    def run(self) -> list[Any]:
        self.progress.start()
        try:
            return self._run()
        finally:
            self.progress.stop()

    def _run(self) -> list[Any]:
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
                trial = self._ask()
                setting = setting_overrides(trial.params, self.names)
                jobs = self._jobs(trial.number)
                trial.set_user_attr("overrides", setting)
                trial.set_user_attr("jobs", jobs)
                trial.set_user_attr("seeds", self.seeds)
                pending.append(_Pending(trial.number, trial, setting, jobs))
            self._launch_and_tell(pending)
        return self.returns

    def _ask(self) -> optuna.Trial:
        """A new trial, from a sampler seeded by its number (search_study.trial_sampler): the
        number Optuna gives the next trial is the count of trials the study holds."""
        number = len(self.study.get_trials(deepcopy=False))
        self.study.sampler = trial_sampler(
            self.sweeper.sampler_seed, self.sweeper.n_startup_trials, number
        )
        trial = self.study.ask(fixed_distributions=self.space.distributions)
        if trial.number != number:
            raise SweepError(
                f"the study in {self.sweep_dir / SEARCH_DIR} gave trial {trial.number} where "
                f"{number} was next: is another search running in {self.sweep_dir}?"
            )
        return trial

    def _jobs(self, number: int) -> list[int]:
        return job_numbers(number, len(self.seeds))

    def _launch_and_tell(self, pending: list[_Pending]) -> None:
        assert self.sweeper.launcher is not None
        by_job: dict[int, list[str]] = {}
        for p in pending:
            log.info("trial %d: %s (jobs %s)", p.number, " ".join(p.setting), _span(p.jobs))
            for job, seed in zip(p.jobs, self.seeds, strict=True):
                by_job[job] = job_overrides(self.space.fixed, p.setting, seed)
        self.running = list(pending)
        self.progress.update()
        for block in launch_blocks(list(by_job), self.sweeper.max_batch_size):
            batch = [by_job[j] for j in block]
            self.sweeper.validate_batch_is_legal(batch)
            results = self.sweeper.launcher.launch(batch, initial_job_idx=block[0])
            for r in results:
                _ = r.return_value  # a job that raised (not a failed run: those end in summary)
            self.returns.append(results)
        for p in pending:
            self._tell(p)
            self.running.remove(p)
            self.progress.update()

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

    def _progress_state(self) -> State:
        """What the terminal shows (grail/study/progress.py): the best trials so far, then the
        running ones."""
        from optuna.trial import TrialState

        trials = self.study.get_trials(deepcopy=False)
        finished = sum(
            t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL) for t in trials
        )
        complete = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        reverse = self.sweeper.direction == "maximize"
        complete.sort(key=lambda t: t.value, reverse=reverse)  # type: ignore[arg-type,return-value]
        rows = []
        for i, t in enumerate(complete[:TOP_SHOWN]):
            interval = t_interval(self._seed_values(t))
            setting = t.user_attrs.get("overrides") or setting_overrides(t.params, self.names)
            rows.append(
                Row(
                    f"trial {t.number} {' '.join(setting)}",
                    ended=interval.n,
                    running=0,
                    outcome="best" if i == 0 else "complete",
                    mean=t.value,
                    ci=None
                    if interval.lo is None or interval.hi is None
                    else (interval.lo, interval.hi),
                )
            )
        for p in self.running:
            label = f"trial {p.number} {' '.join(p.setting)}"
            rows.append(Row(label, ended=0, running=len(p.jobs), outcome="running"))
        left = self.sweeper.n_trials - finished - self.left_running - len(self.running)
        pruned = sum(t.state == TrialState.PRUNED for t in trials)
        failed = sum(t.state == TrialState.FAIL for t in trials)
        return State(
            f"search {self.study.study_name!r}",
            "trials",
            self.sweeper.metric,
            ended=finished,
            running=len(self.running),
            left=max(0, left),
            rows=tuple(rows),
            judged_by="state",
            note=", ".join(
                f"{n} {what}" for n, what in ((pruned, "pruned"), (failed, "failed")) if n
            ),
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
