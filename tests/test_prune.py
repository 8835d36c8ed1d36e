"""Early pruning of hopeless runs (grail/study/prune.py): Optuna's pruners with their real journal
storage decide; a pruned run's status everywhere (summary schema, sweep reruns, run status, the
report, the end of a sweep); and once end to end through the real `grail-train -m`."""

from __future__ import annotations

import csv
import json
import os
import sys
import warnings
from pathlib import Path

import optuna
import pytest
import yaml
from helpers import forked
from helpers.run_dirs import TINY_RUN, eval_record, make_run, write_hydra
from hydra import compose, initialize_config_dir
from jsonschema import ValidationError
from omegaconf import OmegaConf
from optuna.trial import TrialState

from grail.core.config import Config, DataConfig, EvalConfig, PruneConfig
from grail.core.errors import ConfigError
from grail.core.records import (
    PRUNE_TRIAL,
    read_metrics,
    read_pruned,
    validate_metrics,
    write_metrics,
    write_summary,
)
from grail.core.validate import validate
from grail.report.cli import main as report_main
from grail.study import prune as prune_module
from grail.study.prune import (
    NoPruning,
    RunTrial,
    open_study,
    open_trial,
    setting_label,
    storage_path,
)
from grail.study.rungs import Judge
from grail.study.runs import run_status
from grail.study.sweep import Action, RunRecord, decide
from grail.train.cli import CONF_DIR
from grail.train.sweep_job import SweepOutcome


def _config(study_dir: Path, seed: int = 0, **prune: object) -> Config:
    return Config(
        seed=seed,
        study_dir=str(study_dir),
        data=DataConfig(environment="copy_digits"),
        eval=EvalConfig(interval=2),
        # The rung mechanics at the full error level (spending: tests/test_prune_rungs.py, below).
        prune=PruneConfig(**{"pruner": "asha", "min_iterations": 2, "spending": False, **prune}),  # type: ignore[arg-type]
    )


def _evaluate(run_dir: Path, iteration: int, success: float) -> None:
    """What the loop's evaluation leaves on disk before it asks the pruner."""
    path = run_dir / "metrics" / f"eval_iter_{iteration:03d}.json"
    write_metrics(path, eval_record(iteration, success, success), "eval")


def _trial(
    cfg: Config, run_dir: Path, start: int, judge: Judge | None = None
) -> RunTrial | NoPruning:
    """`open_trial` given what the loop gives it of `cfg`."""
    return open_trial(
        cfg.prune,
        run_dir,
        start,
        study_dir=cfg.study_dir,
        seed=cfg.seed,
        iterations=cfg.train.iterations,
        judge=judge,
    )


def _open(cfg: Config, run_dir: Path, lr: str, start: int = 0) -> RunTrial:
    """The trial of a run of setting train.lr=`lr` on cfg.seed, as the loop opens it: Hydra's
    overrides file first (the setting is read from it)."""
    if not (run_dir / ".hydra" / "overrides.yaml").exists():
        write_hydra(run_dir, [f"train.lr={lr}", f"seed={cfg.seed}"], 8)
    trial = _trial(cfg, run_dir, start)
    assert isinstance(trial, RunTrial)
    return trial


def _run(
    cfg: Config, run_dir: Path, lr: str, successes: dict[int, float], start: int = 0
) -> int | None:
    """A run through the loop's calls: evaluations at the given iterations, asking the pruner
    after each but the last, then finish. Returns the iteration it was pruned at, or None."""
    trial = _open(cfg, run_dir, lr, start)
    last = max(successes)
    for iteration, success in sorted(successes.items()):
        _evaluate(run_dir, iteration, success)
        if iteration != last and trial.should_prune(iteration):
            trial.finish()
            return iteration
    trial.finish()
    return None


def _trials(study_dir: Path) -> list[optuna.trial.FrozenTrial]:
    return open_study(study_dir).get_trials(deepcopy=False)


# Three seeds of a good setting (1e-2) and of a bad one (1e-3); rungs at 2 and 4 updates.
GOOD = {0: {1: 0.6, 3: 0.7, 5: 0.8}, 1: {1: 0.7, 3: 0.8, 5: 0.9}, 2: {1: 0.65, 3: 0.7, 5: 0.9}}
BAD = {0: {1: 0.1, 3: 0.9, 5: 0.9}, 1: {1: 0.12, 3: 0.9, 5: 0.9}, 2: {1: 0.08, 3: 0.9, 5: 0.9}}


# ---- the rule, on real Optuna storage -----------------------------------------------------------


def test_a_setting_worse_over_its_seeds_is_pruned_the_best_never(tmp_path: Path) -> None:
    """Settings, not runs: no run of "bad" is pruned until three of its seeds are at the rung
    beside three of "good"; then the one asking is (the others at their next evaluation)."""
    cfg = {seed: _config(tmp_path, seed=seed, reduction_factor=2) for seed in range(3)}
    pruned = {}
    for seed in range(3):  # one run after another: all of good, then all of bad
        pruned[("1e-2", seed)] = _run(cfg[seed], tmp_path / f"good{seed}", "1e-2", GOOD[seed])
    for seed in range(3):
        pruned[("1e-3", seed)] = _run(cfg[seed], tmp_path / f"bad{seed}", "1e-3", BAD[seed])
    # bad's seeds 0 and 1 met fewer than min_seeds of their setting at every rung: not judged,
    # they complete. Its third seed is judged at rung 2 and pruned.
    assert pruned == {("1e-2", s): None for s in range(3)} | {
        ("1e-3", 0): None,
        ("1e-3", 1): None,
        ("1e-3", 2): 1,
    }
    trials = _trials(tmp_path)
    assert [(t.user_attrs, t.state) for t in trials] == [
        ({"setting": f"train.lr={lr}", "seed": str(seed)}, state)
        for lr, seed, state in [
            *((lr, s, TrialState.COMPLETE) for lr in ("1e-2",) for s in range(3)),
            ("1e-3", 0, TrialState.COMPLETE),
            ("1e-3", 1, TrialState.COMPLETE),
            ("1e-3", 2, TrialState.PRUNED),
        ]
    ]
    record = json.loads((tmp_path / "bad2" / PRUNE_TRIAL).read_text())
    assert record["study"] == "prune" and record["trial"] == 5
    assert record["storage"] == str(storage_path(tmp_path).absolute())
    pruned_record = read_pruned(tmp_path / "bad2")
    assert pruned_record is not None and pruned_record.pop("p") < 0.05
    assert pruned_record == {
        "iteration": 1,
        "value": 0.08,
        "metric": "auc",
        "pruner": "asha",
        "rung": 2,
        "best": "train.lr=1e-2",
        "seeds": 3,
    }
    assert read_pruned(tmp_path / "good0") is None
    # The complete trials hold their final value: auc, the mean over the evaluations.
    assert trials[0].value == pytest.approx((0.6 + 0.7 + 0.8) / 3)


def test_runs_that_passed_a_rung_early_are_rechecked_as_the_others_arrive(tmp_path: Path) -> None:
    """Arrival order buys nothing: runs of "bad" that reached the rung before enough seeds were
    there are judged again at each evaluation until their next rung (runs in parallel)."""
    cfg = {
        seed: _config(tmp_path, seed=seed, min_iterations=2, reduction_factor=4)
        for seed in (0, 1, 2)
    }
    bad = {seed: _open(cfg[seed], tmp_path / f"bad{seed}", "1e-3") for seed in range(3)}
    for seed in range(3):  # bad first at rung 2 (step 2): nothing to compare with
        _evaluate(tmp_path / f"bad{seed}", 1, BAD[seed][1])
        assert not bad[seed].should_prune(1)
    for seed in range(3):
        _run(cfg[seed], tmp_path / f"good{seed}", "1e-2", GOOD[seed])
    # At their next evaluation (step 4, still before rung 8) the evidence at rung 2 is complete.
    for seed in range(3):
        _evaluate(tmp_path / f"bad{seed}", 3, 0.9)
        assert bad[seed].should_prune(3)
        assert bad[seed].pruned is not None and bad[seed].pruned["rung"] == 2


def test_a_late_learner_is_judged_where_it_is_not_where_it_started(tmp_path: Path) -> None:
    """Once a run reached a later rung, earlier ones are not looked at again: "bad" catches up
    by rung 4, so more evidence of its poor start at rung 2 prunes nothing."""
    cfg = {seed: _config(tmp_path, seed=seed, reduction_factor=2) for seed in (0, 1, 2)}
    for seed in range(3):
        _run(cfg[seed], tmp_path / f"good{seed}", "1e-2", GOOD[seed])
    late = {seed: _open(cfg[seed], tmp_path / f"bad{seed}", "1e-3") for seed in range(3)}
    for seed in range(2):
        _evaluate(tmp_path / f"bad{seed}", 1, BAD[seed][1])
        assert not late[seed].should_prune(1)  # two seeds: too few to judge
        _evaluate(tmp_path / f"bad{seed}", 3, 0.95)
        assert not late[seed].should_prune(3)  # at rung 4 now, still too few
    _evaluate(tmp_path / "bad2", 1, BAD[2][1])
    assert late[2].should_prune(1)  # its own rung 2 holds three seeds now: pruned there
    _evaluate(tmp_path / "bad0", 5, 0.95)
    assert not late[0].should_prune(5)  # judged at rung 4 (too few there), not at rung 2


def test_no_pruning_before_min_iterations(tmp_path: Path) -> None:
    cfg = {
        seed: _config(tmp_path, seed=seed, reduction_factor=2, min_iterations=4)
        for seed in (0, 1, 2)
    }
    for seed in range(3):
        assert _run(cfg[seed], tmp_path / f"good{seed}", "1e-2", {1: 0.9, 3: 0.9, 5: 0.9}) is None
    for seed in range(3):
        # Far worse at 2 updates, but that is before min_iterations; at 4 it is judged.
        worse = {1: 0.0, 3: 0.01 * seed, 5: 0.0}
        assert _run(cfg[seed], tmp_path / f"bad{seed}", "1e-3", worse) == (3 if seed == 2 else None)


def test_the_last_evaluation_is_reported_when_the_run_completes(tmp_path: Path) -> None:
    cfg = _config(tmp_path, metric="success")
    run_dir = tmp_path / "run"
    trial = _open(cfg, run_dir, "1e-2")
    _evaluate(run_dir, 1, 0.2)
    assert not trial.should_prune(1)
    _evaluate(run_dir, 3, 0.4)  # the last iteration's: the loop does not ask, the run ends
    trial.finish()
    (frozen,) = _trials(tmp_path)
    assert frozen.state == TrialState.COMPLETE and frozen.value == pytest.approx(0.4)
    assert frozen.intermediate_values == {2: pytest.approx(0.2), 4: pytest.approx(0.4)}


def test_seeds_are_paired_so_a_hard_seed_hides_nothing(tmp_path: Path) -> None:
    """Seed 2 is hard for both settings. Seed by seed, "b" is a little below "a" on every one,
    which pairing shows; over unpaired means the seeds' spread (0.05 to 0.8) would hide it."""
    cfg = {seed: _config(tmp_path, seed=seed, reduction_factor=2) for seed in (0, 1, 2)}
    a = {0: 0.8, 1: 0.7, 2: 0.05}
    b = {0: 0.79, 1: 0.688, 2: 0.041}
    for seed in range(3):
        assert _run(cfg[seed], tmp_path / f"a{seed}", "1e-2", {1: a[seed], 3: a[seed]}) is None
    pruned = [_run(cfg[s], tmp_path / f"b{s}", "3e-2", {1: b[s], 3: b[s]}) for s in range(3)]
    assert pruned == [None, None, 1]
    assert {t.user_attrs["setting"] for t in _trials(tmp_path)} == {
        "train.lr=1e-2",
        "train.lr=3e-2",
    }
    names = optuna.get_all_study_names(
        optuna.storages.JournalStorage(
            optuna.storages.journal.JournalFileBackend(str(storage_path(tmp_path)))
        )
    )
    assert names == ["prune"]


def test_a_resumed_run_keeps_its_trial_and_a_step_is_reported_once(tmp_path: Path) -> None:
    cfg = _config(tmp_path, reduction_factor=2)
    run_dir = tmp_path / "run"
    trial = _open(cfg, run_dir, "1e-2")
    _evaluate(run_dir, 1, 0.5)
    assert not trial.should_prune(1)
    _evaluate(run_dir, 2, 0.6)  # then killed: no finish(), the trial stays running

    # Resumed after checkpoint iter_001 (start 2): its own trial, iteration 2 rerun. Optuna would
    # warn and ignore a second value for a step; the rerun's differs by float noise at most.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = _open(cfg, run_dir, "1e-2", start=2)
        assert again.number == trial.number
        _evaluate(run_dir, 1, 0.55)  # a rewritten earlier file does not change the trial
        assert again.report(1) == 0.5
        _evaluate(run_dir, 3, 0.7)
        assert not again.should_prune(3)
    (frozen,) = _trials(tmp_path)
    assert frozen.state == TrialState.RUNNING
    assert frozen.intermediate_values == {2: 0.5, 4: pytest.approx((0.55 + 0.6 + 0.7) / 3)}

    # A run that failed ends its trial (FAIL); retried, it gets a new one holding its evaluations,
    # labelled with the same setting and seed (the rule counts the newest of the two).
    again.fail()
    retried = _open(cfg, run_dir, "1e-2", start=4)
    assert retried.number == trial.number + 1
    states = {t.number: (t.state, t.intermediate_values) for t in _trials(tmp_path)}
    assert states[trial.number][0] == TrialState.FAIL
    assert set(states[retried.number][1]) == {2, 3, 4}  # evals at iterations 1, 2, 3 on disk
    assert _trials(tmp_path)[retried.number].user_attrs == {"setting": "train.lr=1e-2", "seed": "0"}

    # Started over (no checkpoint): the old running trial ends, a new one starts empty.
    for path in (run_dir / "metrics").glob("*.json"):
        path.unlink()
    fresh = _open(cfg, run_dir, "1e-2", start=0)
    assert fresh.number == retried.number + 1
    states = {t.number: (t.state, t.intermediate_values) for t in _trials(tmp_path)}
    assert states[retried.number][0] == TrialState.FAIL
    assert states[fresh.number] == (TrialState.RUNNING, {})


def test_a_decision_survives_a_kill_before_the_checkpoint(tmp_path: Path) -> None:
    cfg = {seed: _config(tmp_path, seed=seed, reduction_factor=2) for seed in (0, 1, 2)}
    for seed in range(3):
        _run(cfg[seed], tmp_path / f"good{seed}", "1e-2", GOOD[seed])
    for seed in range(2):
        _run(cfg[seed], tmp_path / f"bad{seed}", "1e-3", BAD[seed])
    run_dir = tmp_path / "bad2"
    trial = _open(cfg[2], run_dir, "1e-3")
    _evaluate(run_dir, 1, 0.1)
    assert trial.should_prune(1)  # then killed before its checkpoint committed: no finish()

    # Resumed from iter_000 (start 1): iteration 1 reruns and stops there without asking again
    # (the evidence may have changed since; the decision taken is the one kept).
    def no_judge(values: object) -> list[object]:
        raise AssertionError("a resumed run asked again")

    resumed = _trial(cfg[2], run_dir, 1, judge=no_judge)  # type: ignore[arg-type]
    assert isinstance(resumed, RunTrial) and resumed.number == trial.number
    _evaluate(run_dir, 1, 0.1)
    assert resumed.should_prune(1)
    resumed.finish()
    assert _trials(tmp_path)[trial.number].state == TrialState.PRUNED


def test_pruning_off_clears_an_old_record_on_a_fresh_start(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / PRUNE_TRIAL).write_text('{"pruned": {"iteration": 1}}')
    cfg = _config(tmp_path, pruner=None)
    assert isinstance(_trial(cfg, run_dir, 3), NoPruning)  # a resume keeps it
    assert (run_dir / PRUNE_TRIAL).exists()
    assert isinstance(_trial(cfg, run_dir, 0), NoPruning)
    assert not (run_dir / PRUNE_TRIAL).exists()
    assert not (tmp_path / "optuna").exists()  # no storage touched


# ---- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"prune": PruneConfig(pruner="hyperband")}, "prune.pruner='hyperband' is not one of"),
        ({"prune": PruneConfig(pruner="asha", metric="best")}, "prune.metric='best'"),
        ({"prune": PruneConfig(pruner="asha", reduction_factor=1)}, "prune.reduction_factor"),
        ({"prune": PruneConfig(pruner="median")}, "prune.pruner='median' is not one of"),
        ({"prune": PruneConfig(pruner="asha", min_seeds=1)}, "prune.min_seeds must be >= 2"),
        ({"prune": PruneConfig(pruner="asha", alpha=1.0)}, "prune.alpha must be in"),
        ({"prune": PruneConfig(pruner="asha", min_iterations=0)}, "prune.min_iterations"),
        ({"eval": EvalConfig(enabled=False)}, "eval.enabled=true"),
        ({"study_dir": None}, "prune.pruner=asha needs a study_dir"),
    ],
)
def test_config_errors_name_the_key(tmp_path: Path, change: dict, message: str) -> None:
    cfg = _config(tmp_path)
    for key, value in change.items():
        setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        validate(cfg)


def test_the_config_group_switches_it_on() -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        off = compose(config_name="offline_grpo")
        asha = compose(
            config_name="offline_grpo", overrides=["+prune=asha", "prune.min_iterations=20"]
        )
    assert off.prune.pruner is None
    assert OmegaConf.to_container(asha.prune) == {
        "pruner": "asha",
        "min_iterations": 20,
        "reduction_factor": 3,
        "min_seeds": 3,
        "alpha": 0.05,
        "spending": True,
        "metric": "auc",
    }
    config: Config = OmegaConf.to_object(asha)  # type: ignore[assignment]
    config.study_dir = "/tmp/study"
    validate(config)


# ---- the pruned status everywhere ---------------------------------------------------------------

PRUNED = {"iteration": 3, "value": 0.125, "metric": "auc", "pruner": "asha"}


def test_a_pruned_summary_validates_and_says_why(tmp_path: Path) -> None:
    summary = write_summary(tmp_path, 1.0, pruned=PRUNED)
    assert summary["status"] == "pruned" and summary["pruned"] == PRUNED
    validate_metrics(read_metrics(tmp_path / "summary.json"), "summary")
    without = {k: v for k, v in summary.items() if k != "pruned"}
    with pytest.raises(ValidationError, match="'pruned' is a required property"):
        validate_metrics(without, "summary")
    with pytest.raises(ValidationError):
        validate_metrics({**summary, "pruned": {**PRUNED, "pruner": "hyperband"}}, "summary")
    # The seed-aware rule's why: the rung, the best setting there, shared seeds, Holm's p.
    why = {**PRUNED, "rung": 2, "best": "train.lr=1e-2", "seeds": 3, "p": 0.01}
    validate_metrics({**summary, "pruned": why}, "summary")
    with pytest.raises(ValidationError):
        validate_metrics({**summary, "pruned": {**why, "seeds": 1}}, "summary")


def test_a_rerun_of_the_sweep_skips_a_pruned_run() -> None:
    record = RunRecord(status="pruned", has_progress=True, overrides=("train.lr=1",))
    decision = decide(record, resume=True, overrides=["train.lr=1", "resume=true"])
    assert (decision.action, decision.reason) == (Action.SKIP, "pruned earlier")
    assert decide(record, resume=False, overrides=["train.lr=1"]).action is Action.START


def _study(sweep: Path) -> dict[str, Path]:
    """A study caught mid-way: two settings on two seeds, one run of each kind."""
    runs = {
        "completed": (["train.lr=1e-3", "seed=0"], 0.6),
        "failed": (["train.lr=1e-3", "seed=1"], 0.5),
        "pruned": (["train.lr=1e-2", "seed=0"], 0.1),
        "running": (["train.lr=1e-2", "seed=1"], 0.4),
        "completed2": (["train.lr=1e-3", "seed=2"], 0.7),
        "completed3": (["train.lr=1e-2", "seed=2"], 0.8),
    }
    made = {}
    for job, (kind, (overrides, level)) in enumerate(runs.items()):
        done = 2 if kind == "pruned" else 4
        run = make_run(
            sweep / str(job),
            overrides,
            iterations=4,
            done=done,
            success=lambda i, level=level: level,
            completed=kind.startswith("completed"),
        )
        if kind == "failed":
            write_summary(run, 1.0, error=RuntimeError("CUDA OOM"))
        if kind == "pruned":
            write_summary(run, 1.0, pruned={**PRUNED, "iteration": 1, "value": 0.1})
        made[kind] = run
    return made


def test_run_status_and_report_on_a_study_with_every_kind_of_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    runs = _study(sweep)
    status = {kind: run_status(path).status for kind, path in runs.items()}
    assert status == {
        "completed": "done",
        "failed": "failed",
        "pruned": "pruned",
        "running": "incomplete",
        "completed2": "done",
        "completed3": "done",
    }
    assert run_status(runs["pruned"]).error is None

    stats_csv, runs_csv = tmp_path / "stats.csv", tmp_path / "runs.csv"
    argv = [str(sweep), "--out", str(tmp_path), "--csv", str(stats_csv)]
    assert report_main([*argv, "--runs-csv", str(runs_csv)]) == 0
    text = capsys.readouterr().out
    assert "6 runs: 3 done, 1 failed, 1 incomplete, 1 pruned" in text
    table_row = next(line for line in text.splitlines() if line.startswith("│ 2 "))
    assert "pruned" in table_row and "2/4" in table_row  # the run table: status, iterations
    assert "not in the statistics (2 runs)" in text  # the failed and the running one
    assert "pruned runs count, censored" in text

    rows = {r["setting"]: r for r in _csv(stats_csv)}
    hi, lo = rows["train.lr=1e-2"], rows["train.lr=1e-3"]
    # train.lr=1e-2: seed 2 completed (0.8), seed 0 pruned at 0.1 counts, censored: the setting
    # is not scored on its survivor alone.
    assert (hi["n_seeds"], hi["n_censored"], hi["censored_seeds"]) == ("2", "1", "0")
    assert (hi["pruned"], hi["failed"], hi["incomplete"]) == ("1", "0", "1")
    assert float(hi["mean"]) == pytest.approx((0.1 + 0.8) / 2) and hi["seeds"] == "0 2"
    assert (lo["n_seeds"], lo["pruned"], lo["failed"], lo["incomplete"]) == ("2", "0", "1", "0")
    per_run = {r["run"]: r["status"] for r in _csv(runs_csv)}
    assert per_run["2"] == "pruned"
    assert {r["run"]: r["status"] for r in _csv(tmp_path / "summary.csv")}["2"] == "pruned"


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _outcome(sweep: Path) -> int:
    """The end-of-sweep callback's exit code (what it prints goes to stderr)."""
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    try:
        SweepOutcome().on_multirun_end(config)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def test_the_end_of_a_sweep_counts_pruned_runs_as_ended(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    runs = _study(sweep)
    assert _outcome(sweep) == 1
    err = capsys.readouterr().err
    assert "2 of 6 runs did not complete (1 pruned early (prune.pruner), not failures)" in err
    assert "  1 (train.lr=1e-3 seed=1): failed - RuntimeError: CUDA OOM" in err
    assert "  3 (train.lr=1e-2 seed=1): incomplete" in err
    assert "\n  2 (" not in err  # the pruned run is not listed as a problem

    for kind in ("failed", "running"):
        write_summary(runs[kind], 1.0)
    assert _outcome(sweep) == 0
    assert "all 6 runs ended: 5 completed, 1 pruned early" in capsys.readouterr().err


# ---- end to end: grail-train -m with the real loop --------------------------------------------

SMALL = [
    *TINY_RUN,
    "eval.interval=2",
    "checkpoint.save_interval=5",  # iteration 1 is checkpointed only because it is pruned there
    "train.iterations=6",
]
PRUNE = ["+prune=asha", "prune.min_iterations=2", "prune.spending=False"]  # as the sweep writes it


def _grail_train(*args: str, timeout: float = 240) -> tuple[int, str]:
    result = forked.run(
        [sys.executable, "-m", "grail.train.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return result.returncode, result.stdout + result.stderr


def _earlier_runs(sweep: Path) -> None:
    """What an earlier sweep into the same study_dir leaves: three seeds of another setting with
    eval success 0.9 to 1.0 throughout, and seed 2 of the sweep's own setting, as poor as the tiny
    model is after 2 iterations. The sweep below runs seeds 0 and 1: seed 0 finds two seeds of
    its setting at rung 2 (fewer than prune.min_seeds=3) and completes; seed 1 makes three, its
    setting is shown worse, and it is pruned there."""
    study = open_study(sweep)
    own = setting_label([*SMALL, *PRUNE])
    for setting, seed, level in [
        ("an earlier setting", 0, 1.0),
        ("an earlier setting", 1, 0.9),
        ("an earlier setting", 2, 0.95),
        (own, 2, 0.0),
    ]:
        trial = study.ask()
        trial.set_user_attr("setting", setting)
        trial.set_user_attr("seed", str(seed))
        for step in (2, 4, 6):
            trial.report(level, step)
        study.tell(trial, level)


def test_a_sweep_prunes_a_run_keeps_its_files_and_a_rerun_skips_it(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _earlier_runs(sweep)
    command = ["-m", f"hydra.sweep.dir={sweep}", *SMALL, *PRUNE, "seed=0,1"]
    code, out = _grail_train(*command)
    assert code == 0, out[-4000:]
    assert "all 2 runs ended: 1 completed, 1 pruned early" in out, out[-4000:]

    completed, pruned = sweep / "0", sweep / "1"
    summary = read_metrics(pruned / "summary.json")
    validate_metrics(summary, "summary")
    assert summary["status"] == "pruned" and summary["iterations"] == 2
    assert summary["pruned"]["iteration"] == 1 and summary["pruned"]["pruner"] == "asha"
    assert summary["pruned"]["value"] < 0.9
    assert (summary["pruned"]["rung"], summary["pruned"]["best"]) == (2, "an earlier setting")
    assert (pruned / "checkpoints" / "iter_001").is_dir()  # saved although save_interval=5
    assert sorted(p.name for p in (pruned / "metrics").iterdir()) == [
        "eval_baseline.json",
        "eval_iter_001.json",
        "train_iter_000.json",
        "train_iter_001.json",
    ]
    assert read_metrics(completed / "summary.json")["status"] == "completed"
    assert len(list((completed / "metrics").glob("train_iter_*.json"))) == 6
    trials = _trials(sweep)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5 + [TrialState.PRUNED]
    assert trials[5].user_attrs == {"setting": setting_label([*SMALL, *PRUNE]), "seed": "1"}

    # The same command with resume=true: both runs ended, nothing runs again.
    code, out = _grail_train(*command, "resume=true")
    assert code == 0, out[-4000:]
    assert "pruned earlier, skipping (resume=true)" in out
    for run in (pruned, completed):
        actions = [json.loads(line)["action"] for line in (run / "attempts.jsonl").open()]
        assert actions == ["start", "skip"]
    assert read_metrics(pruned / "summary.json")["status"] == "pruned"

    # A single run resumed in the pruned run's directory says so and trains nothing.
    overrides = yaml.safe_load((pruned / ".hydra" / "overrides.yaml").read_text())
    overrides = [o for o in overrides if not o.startswith("resume=")]
    code, out = _grail_train(
        f"hydra.run.dir={pruned}", *overrides, "resume=true", f"study_dir={sweep}"
    )
    assert code == 0, out[-4000:]
    assert "was pruned after iteration 1" in out
    assert "started builtin server" not in out
    assert "pruned after iteration 1 (auc" in out  # the summary shown at the end
    assert read_metrics(pruned / "summary.json")["status"] == "pruned"
    assert not (pruned / "metrics" / "train_iter_002.json").exists()


@pytest.mark.parametrize(("spending", "rung_alpha"), [(True, 0.05 * (2 / 20) ** 3), (False, 0.05)])
def test_early_rungs_judge_at_the_spent_error_level(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spending: bool, rung_alpha: float
) -> None:
    """prune.spending (the default): the rung at iteration 2 of 20 judges at alpha x 0.1^3."""
    levels: list[float] = []
    real = prune_module.verdicts_judge
    monkeypatch.setattr(prune_module, "verdicts_judge", lambda a: levels.append(a) or real(a))
    cfg = _config(tmp_path, spending=spending)
    cfg.train.iterations = 20
    trial = _open(cfg, tmp_path / "run", "1e-3")
    trial.decide(step=2)
    assert levels == [pytest.approx(rung_alpha)]
