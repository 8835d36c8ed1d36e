"""Seed-aware pruning of hopeless settings: after each evaluation a run reports its metric to the
study's shared storage and asks whether its setting (its overrides without `seed`) is shown worse
than the best setting at the latest rung it reached, over the seeds that reached that rung, paired
by seed (the rule and why it is ours, not Optuna's pruners: grail/study/rungs.py). Such a run
stops there, keeping its checkpoint and metrics, with `status: "pruned"` in its summary.

    uv run grail-train -m hydra/launcher=local +prune=asha train.lr=1e-3,3e-3,1e-2 seed=0,1,2

Optuna's storage is the only state runs share: no protocol of ours between processes. It is a
journal file, `<study_dir>/optuna/prune.journal` (Optuna's JournalStorage over
JournalFileBackend: appends under a lock file, so runs in separate processes, on one machine or on
SLURM nodes sharing the file system, see each other's values at once). Optuna's pruners are not
used: the decision is `grail.study.rungs.judge_rung` over every trial of the study.

- One study, `prune`, for every run of the study directory. One trial per run, with user attrs
  `setting` (the label: the run's overrides without seed, as the report groups them) and `seed`,
  and the metric as intermediate values per step.
- The trial's number is kept in the run directory (`prune_trial.json`, written atomically), so a
  resumed run (`resume=true`) goes on reporting to its own trial. Optuna keeps the first value
  reported for a step and ignores later ones; a resume reruns (deterministically) the iterations
  after its checkpoint, so a step already reported is not reported again. A finished trial cannot
  be reopened: a run resumed after its trial was told FAIL (a retried sweep run) or COMPLETE
  (train.iterations raised), or with pruning newly switched on, gets a new trial that is first
  given the evaluations already on disk (the rule counts the newest trial of a setting and seed).
- step = iteration + 1, the number of updates applied before the evaluation (the report's policy
  version), so `prune.min_iterations` counts iterations trained.
- The value: `auc`, the mean eval success over the evaluations after training started so far
  (steadier), or `success`, this evaluation's success rate; the baseline never counts.
- At the end the trial is told COMPLETE (with the final value), PRUNED, or FAIL (the run raised);
  an interrupted run (Ctrl-C, SIGTERM) leaves it running, for `resume=true` to continue. Every
  trial's values stay evidence at the rungs it reached, whatever its state: a pruned run's seed
  still counts at the rung that pruned it.

The decision to prune is written to `prune_trial.json` before the iteration's checkpoint is
committed: a run killed in between stops at the same iteration when resumed, without asking again
(the evidence at the rung may have grown since; the decision taken is the one kept).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grail.core.config import PruneConfig
from grail.core.errors import ConfigError
from grail.core.records import PRUNE_TRIAL, atomic_write_text, metric_records, read_json
from grail.study.rungs import Judge, Prune, RunCurve, judge_rung, latest_rung, spent_alpha
from grail.study.runs import read_overrides
from grail.study.stats import metric_of, setting_of
from grail.study.verdicts import VerdictSettings, judge

if TYPE_CHECKING:  # optuna (half a second to import) loads only when pruning is on
    import optuna

log = logging.getLogger(__name__)

STORAGE = Path("optuna") / "prune.journal"  # inside the study directory
STUDY = "prune"
SETTING_ATTR, SEED_ATTR = "setting", "seed"  # the trial's user attrs
# prune.metric -> the report's name for the same number (grail/study/stats.py)
_REPORT_METRIC = {"auc": "auc", "success": "final"}


def storage_path(study_dir: str | Path) -> Path:
    return Path(study_dir) / STORAGE


def setting_label(overrides: list[str]) -> str:
    """A run's setting: its overrides without seed (grail.study.stats.setting_of), as one string."""
    return " ".join(setting_of(overrides)) or "(defaults)"


def verdicts_judge(alpha: float) -> Judge:
    """grail.study.verdicts.judge with family-wise error `alpha`, as the rung rule calls it."""
    settings = VerdictSettings(alpha=alpha)
    return lambda values: judge(values, settings)


def open_study(study_dir: str | Path) -> optuna.Study:
    """The study in `study_dir`'s storage, created by the first run that asks."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    # Optuna's log lines go to the run's log (Hydra's handlers), not to its own stderr handler.
    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()
    path = storage_path(study_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(
        storage=JournalStorage(JournalFileBackend(str(path))),
        study_name=STUDY,
        direction="maximize",
        pruner=optuna.pruners.NopPruner(),  # the decision is ours: grail/study/rungs.py
        # Nothing is sampled here (Hydra's grid sets the parameters): the cheapest sampler.
        sampler=optuna.samplers.RandomSampler(seed=0),
        load_if_exists=True,  # runs starting together race to create it; all get the one study
    )


def study_curves(study: optuna.Study) -> list[RunCurve]:
    """Every trial of the study that says which setting and seed it is, as the rule reads it."""
    curves = []
    for trial in study.get_trials(deepcopy=False):
        setting, seed = trial.user_attrs.get(SETTING_ATTR), trial.user_attrs.get(SEED_ATTR)
        if isinstance(setting, str) and isinstance(seed, str):  # a trial not yet labelled: skip
            curves.append(RunCurve(setting, seed, dict(trial.intermediate_values), trial.number))
    return curves


def metric_value(evals: list[dict[str, Any]], metric: str, iteration: int) -> float | None:
    """`prune.metric` after iteration `iteration`, from eval records (see the module doc); None
    without a trained evaluation up to there."""
    return metric_of([e for e in evals if e["iteration"] <= iteration], _REPORT_METRIC[metric])


class NoPruning:
    """What the loop holds with pruning off: never prunes, records nothing."""

    def should_prune(self, iteration: int) -> bool:
        return False

    def fail(self) -> None:
        pass

    def finish(self) -> None:
        pass


class RunTrial:
    """A run's trial in the study: reports evaluations, applies the rung rule, tells the end."""

    def __init__(
        self,
        run_dir: Path,
        cfg: PruneConfig,
        study: optuna.Study,
        number: int,
        journal: Path,
        pruned: dict[str, Any] | None = None,
        judge: Judge | None = None,
        iterations: int | None = None,
    ) -> None:
        import optuna

        self.run_dir, self.cfg, self.study, self.number = run_dir, cfg, study, number
        self.journal = journal  # the storage's file, named in prune_trial.json
        self.pruned = pruned  # set once the rule said stop (grail.core.records.read_pruned)
        self.judge = judge  # None: the verdicts' judge at the rung's spent error level
        self.iterations = iterations  # train.iterations: how far through the run a rung is
        # The public way to a trial by its number: the storage's ids (the storage is the study's,
        # which Study keeps as `_storage`; ask() hands out Trial objects the same way).
        self._storage = study._storage
        study_id = self._storage.get_study_id_from_name(study.study_name)
        self._trial_id = self._storage.get_trial_id_from_study_id_trial_number(study_id, number)
        self._trial = optuna.trial.Trial(study, self._trial_id)

    def state(self) -> optuna.trial.TrialState:
        return self._storage.get_trial(self._trial_id).state

    @property
    def setting(self) -> str:
        return str(self._storage.get_trial(self._trial_id).user_attrs[SETTING_ATTR])

    def label(self, setting: str, seed: str) -> None:
        """Name the trial's setting and seed (once, when it is created)."""
        self._storage.set_trial_user_attr(self._trial_id, SETTING_ATTR, setting)
        self._storage.set_trial_user_attr(self._trial_id, SEED_ATTR, seed)

    def save(self) -> None:
        """prune_trial.json: which trial is this run's, and whether it was pruned."""
        record = {
            "storage": str(self.journal),
            "study": self.study.study_name,
            "trial": self.number,
            "pruned": self.pruned,
        }
        atomic_write_text(self.run_dir / PRUNE_TRIAL, json.dumps(record, indent=2) + "\n")

    def report(self, iteration: int, evals: list[dict[str, Any]] | None = None) -> float | None:
        """Report the metric after `iteration` (step iteration + 1) unless that step has a value
        already (a rerun after a resume: Optuna would keep the first and warn); returns the value
        the trial holds for the step (None: no trained evaluation yet)."""
        evals = metric_records(self.run_dir, "eval") if evals is None else evals
        step = iteration + 1
        known = self._storage.get_trial(self._trial_id).intermediate_values
        if step in known:
            return known[step]
        value = metric_value(evals, self.cfg.metric, iteration)
        if value is not None:
            self._trial.report(value, step)
        return value

    def backfill(self, start_iteration: int) -> None:
        """Report the evaluations on disk of the iterations before `start_iteration` (those a
        resumed run does not rerun) that the trial lacks."""
        evals = metric_records(self.run_dir, "eval")
        for iteration in sorted({e["iteration"] for e in evals}):
            if 0 <= iteration < start_iteration:
                self.report(iteration, evals)

    def decide(self, step: int) -> Prune | None:
        """The rung rule at the latest rung at or below `step`, on the study as it is now."""
        rung = latest_rung(step, self.cfg.min_iterations, self.cfg.reduction_factor)
        if rung is None:
            return None
        curves = study_curves(self.study)
        alpha = self.cfg.alpha
        if self.cfg.spending and self.iterations is not None:
            alpha = spent_alpha(alpha, rung, self.iterations)
        judge = self.judge or verdicts_judge(alpha)
        return judge_rung(curves, self.setting, rung, self.cfg.min_seeds, judge)

    def should_prune(self, iteration: int) -> bool:
        """After the evaluation of `iteration` (its metrics file written): report it, and whether
        the run stops here. A yes is recorded at once (see the module doc)."""
        if self.pruned is not None:  # decided before this run was interrupted and resumed
            return iteration >= self.pruned["iteration"]
        value = self.report(iteration)
        if value is None:
            return False
        decision = self.decide(iteration + 1)
        if decision is None:
            return False
        self.pruned = {
            "iteration": iteration,
            "value": value,
            "metric": self.cfg.metric,
            "pruner": self.cfg.pruner,
            "rung": decision.rung,
            "best": decision.best,
            "seeds": decision.seeds,
            "p": decision.p,
        }
        self.save()
        log.info(
            "pruned after iteration %d: at rung %d (iterations trained) its setting (%s) is worse "
            "than %s over %d seeds (%s, Holm-adjusted p=%s); its checkpoint and metrics are kept",
            iteration,
            decision.rung,
            self.setting,
            decision.best,
            decision.seeds,
            self.cfg.metric,
            "n/a" if decision.p is None else f"{decision.p:.3g}",
        )
        return True

    def fail(self) -> None:
        """The run raised: FAIL, unless the trial already ended. Never masks the run's error."""
        from optuna.trial import TrialState

        try:
            self.study.tell(self.number, state=TrialState.FAIL, skip_if_finished=True)
        except Exception:
            log.warning("could not mark trial %d of %s failed", self.number, self.study.study_name)

    def finish(self) -> None:
        """The loop ended: PRUNED when the rule stopped it, else COMPLETE with the final value.
        The last evaluation is reported here (the loop does not ask about it: the run ends there
        anyway), so it is evidence at the rungs it reached for the runs still going."""
        from optuna.trial import TrialState

        if self.state() != TrialState.RUNNING:  # told before this process was killed
            return
        if self.pruned is not None:
            self.study.tell(self.number, state=TrialState.PRUNED)
            return
        evals = metric_records(self.run_dir, "eval")
        value = self.report(max((e["iteration"] for e in evals), default=-1), evals)
        if value is None:  # nothing to compare it by: not a completed trial
            self.study.tell(self.number, state=TrialState.FAIL)
            return
        self.study.tell(self.number, value)


def open_trial(
    prune: PruneConfig,
    run_dir: Path,
    start_iteration: int,
    *,
    study_dir: str | None,
    seed: int,
    iterations: int,
    judge: Judge | None = None,
) -> RunTrial | NoPruning:
    """The trial of the run in `run_dir` that starts at `start_iteration` (0: fresh, else resumed
    after a checkpoint): its own trial when it has one still running, else a new one labelled with
    the run's setting (from `.hydra/overrides.yaml`) and `seed`, given the evaluations already on
    disk. NoPruning with pruning off. `iterations`: train.iterations. `judge`: the verdicts' judge
    unless given (tests)."""
    path = run_dir / PRUNE_TRIAL
    if prune.pruner is None:
        if start_iteration == 0:  # a fresh start: an old attempt's record says nothing about it
            path.unlink(missing_ok=True)
        return NoPruning()
    if study_dir is None:  # validate() says so first; kept for callers that skip it
        raise ConfigError(f"prune.pruner={prune.pruner} needs study_dir")
    from optuna.trial import TrialState

    study = open_study(study_dir)
    journal = storage_path(study_dir).absolute()
    old = read_json(path) or {}
    if old.get("study") == study.study_name and old.get("storage") == str(journal):
        try:
            trial = RunTrial(
                run_dir,
                prune,
                study,
                old["trial"],
                journal,
                old.get("pruned"),
                judge,
                iterations,
            )
        except KeyError:  # the storage lost it (the journal removed): a new trial below
            log.warning(
                "trial %s of %s not in %s: a new one", old["trial"], study.study_name, journal
            )
        else:
            if trial.state() == TrialState.RUNNING:
                if start_iteration > 0:
                    trial.backfill(start_iteration)
                    return trial
                trial.fail()  # this run starts over: the old attempt's trial ends here
    trial = RunTrial(
        run_dir,
        prune,
        study,
        study.ask().number,
        journal,
        judge=judge,
        iterations=iterations,
    )
    trial.label(setting_label(read_overrides(run_dir)), str(seed))
    trial.save()
    trial.backfill(start_iteration)
    log.info(
        "pruning: trial %d of %s in %s, setting %s, seed %d",
        trial.number,
        study.study_name,
        journal,
        trial.setting,
        seed,
    )
    return trial
