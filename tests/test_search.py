"""The search sweeper (hydra/sweeper=grail_optuna, grail/study/search.py): its parameter grammar and
errors, how trials become jobs and batches, a trial's value and state from its runs, resuming an
interrupted study, and one real search through `grail-train -m`.

Most tests drive the sweeper with a fake launcher that writes run directories the way a real run
leaves them (tests/helpers/run_dirs.py), so no training runs; the last one trains for real.
"""

from __future__ import annotations

import csv
import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from helpers.run_dirs import TINY_RUN, grail_train, make_run
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from grail.core.records import atomic_write_text, metric_records
from grail.report.cli import main as report_main
from grail.study.search import OptunaSearchSweeper
from grail.study.search_outcome import trial_outcome
from grail.study.search_space import (
    job_numbers,
    launch_blocks,
    parse_space,
    seed_list,
    trials_per_batch,
)
from grail.study.search_study import BEST, JOURNAL, SEARCH_DIR
from grail.study.stats import metric_of, t_interval
from grail.study.sweep import SweepError
from grail.train.cli import CONF_DIR

REPO = Path(__file__).resolve().parents[1]


# ---- the parameter grammar ----------------------------------------------------------------------


def test_params_become_optuna_distributions_and_plain_values_stay_fixed() -> None:
    space = parse_space(
        {"train.kl_coef": "interval(0.0, 0.1)", "train.loss_type": "choice(grpo, dapo)"},
        [
            "train.lr=tag(log, interval(1e-4, 1e-2))",
            "train.batch_size=range(1, 4)",
            "train.epsilon=range(0.1, 0.35, 0.1)",
            "data.rollouts_per_problem=tag(log, range(2, 17))",
            "model=tiny,qwen2.5-0.5b",
            "train.iterations=50",
            "train.loss_type=bnpo",  # the command line wins: fixed, no longer searched
            "resume=true",
        ],
    )
    d = space.distributions
    assert list(d) == [
        "train.kl_coef",
        "train.lr",
        "train.batch_size",
        "train.epsilon",
        "data.rollouts_per_problem",
        "model",
    ]
    assert d["train.kl_coef"] == FloatDistribution(0.0, 0.1)
    assert d["train.lr"] == FloatDistribution(1e-4, 1e-2, log=True)
    assert d["train.batch_size"] == IntDistribution(1, 3)  # Hydra's range: the stop is excluded
    epsilon = d["train.epsilon"]
    assert isinstance(epsilon, FloatDistribution) and epsilon.step == pytest.approx(0.1)
    assert (epsilon.low, epsilon.high) == pytest.approx((0.1, 0.3))
    assert d["data.rollouts_per_problem"] == IntDistribution(2, 16, log=True)
    assert d["model"] == CategoricalDistribution(["tiny", "qwen2.5-0.5b"])
    assert space.fixed == ["train.iterations=50", "train.loss_type=bnpo", "resume=true"]


@pytest.mark.parametrize(
    "params,arguments,message",
    [
        (
            {},
            ["train.lr=interval(1e-3"],
            r"the command line: cannot parse 'train.lr=interval\(1e-3'",
        ),
        (
            {"train.lr": "tag(log, interval(0, 1))"},
            [],
            r"hydra.sweeper.params.train.lr: 'train.lr=tag\(log, interval\(0, 1\)\)': .*low",
        ),
        ({}, ["train.lr=interval(1e-3, 1e-2)", "seed=1,2"], "sets the seed.*hydra.sweeper.seeds"),
        ({"seed": "range(0, 4)"}, [], "hydra.sweeper.params.seed.*hydra.sweeper.seeds"),
        ({}, ["train.lr=1e-3", "train.iterations=5"], "nothing to search"),
        ({}, ["train.lr=tag(log, range(0.1, 1.0, 0.1))"], "log scale needs an int range"),
        ({}, ["train.batch_size=range(4, 1)"], "the range is empty"),
        ({}, ["train.lr=interval(1e-2, 1e-3)"], r"'train.lr=interval\(1e-2, 1e-3\)': .*low"),
    ],
)
def test_bad_params_name_the_entry(params: dict, arguments: list[str], message: str) -> None:
    with pytest.raises(SweepError, match=message):
        parse_space(params, arguments)


def test_seeds_and_settings_errors_name_the_key(tmp_path: Path) -> None:
    assert seed_list(3) == [0, 1, 2] and seed_list([7, 3]) == [7, 3]
    for bad in (0, [], [1, 1], "3", True, [1.5]):
        with pytest.raises(SweepError, match="hydra.sweeper.seeds"):
            seed_list(bad)
    for key, value in (
        ("metric", "mean"),
        ("direction", "up"),
        ("n_trials", 0),
        ("sampler_seed", -1),
    ):
        sweeper, _ = _sweeper(tmp_path / key, lambda *a: None, **{key: value})
        with pytest.raises(SweepError, match=f"hydra.sweeper.{key}"):
            sweeper.search(["train.lr=interval(0.1, 0.2)"])
        assert not (tmp_path / key / SEARCH_DIR).exists()  # refused before any study exists


# ---- jobs and batches ---------------------------------------------------------------------------


def test_trials_become_consecutive_jobs_in_blocks_that_keep_slots_unique() -> None:
    assert job_numbers(0, 3) == [0, 1, 2] and job_numbers(4, 3) == [12, 13, 14]
    assert trials_per_batch(4, 2) == 2 and trials_per_batch(4, 3) == 1
    assert trials_per_batch(2, 3) == 1 and trials_per_batch(None, 3) == 1
    # resumed trials 1 and 3 (seeds 2) beside new trials 5 and 6, batches of 4
    blocks = launch_blocks([2, 3, 6, 7, 10, 11, 12, 13], 4)
    assert blocks == [[2, 3], [6, 7], [10, 11, 12, 13]]
    # a trial with more seeds than a batch holds goes in several blocks
    assert launch_blocks([3, 4, 5], 2) == [[3, 4], [5]]
    assert launch_blocks([0, 1, 2, 5], None) == [[0, 1, 2], [5]]
    for block in launch_blocks(list(range(3, 40)), 4):
        assert len({job % 4 for job in block}) == len(block)  # grail.study.sweep's slot = job mod P


# ---- the fake launcher --------------------------------------------------------------------------

ITERATIONS = 4

# behaviour(run_dir, overrides as a dict, job number) -> None: writes what the run leaves behind
Behaviour = Callable[[Path, dict[str, str], int], None]


def success_of(lr: float, seed: int) -> Callable[[int], float]:
    """A made-up eval curve: higher for lr near 3e-3, different per seed."""
    quality = max(0.0, 1.0 - abs(lr - 3e-3) * 200)
    return lambda i: min(1.0, quality * i / ITERATIONS + 0.05 * seed)


def complete(run_dir: Path, kv: dict[str, str], job: int) -> None:
    lr, seed = float(kv["train.lr"]), int(kv["seed"])
    overrides = [f"{k}={v}" for k, v in kv.items()]
    make_run(
        run_dir,
        overrides,
        iterations=ITERATIONS,
        done=ITERATIONS,
        success=success_of(lr, seed),
        completed=True,
    )


def failed(run_dir: Path, kv: dict[str, str], job: int) -> None:
    make_run(run_dir, [f"{k}={v}" for k, v in kv.items()], iterations=ITERATIONS, done=1)
    summary = {
        "schema_version": 1,
        "status": "failed",
        "error": {"type": "FloatingPointError", "message": "loss is NaN at iteration 1"},
    }
    atomic_write_text(run_dir / "summary.json", json.dumps(summary))


def pruned(run_dir: Path, kv: dict[str, str], job: int) -> None:
    lr, seed = float(kv["train.lr"]), int(kv["seed"])
    make_run(
        run_dir,
        [f"{k}={v}" for k, v in kv.items()],
        iterations=ITERATIONS,
        done=2,
        success=success_of(lr, seed),
    )
    atomic_write_text(
        run_dir / "summary.json", json.dumps({"schema_version": 1, "status": "pruned"})
    )


def killed(run_dir: Path, kv: dict[str, str], job: int) -> None:
    make_run(run_dir, [f"{k}={v}" for k, v in kv.items()], iterations=ITERATIONS, done=1)


class FakeLauncher(Launcher):
    """Runs each job by writing its run directory (`behave(job)` picks how it ends); records
    every launch as (initial_job_idx, [overrides of each job])."""

    def __init__(self, sweep_dir: Path, behave: Callable[[int], Behaviour | None]) -> None:
        self.sweep_dir = sweep_dir
        self.behave = behave
        self.calls: list[tuple[int, list[list[str]]]] = []

    def setup(self, **kwargs: Any) -> None:
        pass

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[JobReturn]:
        self.calls.append((initial_job_idx, [list(o) for o in job_overrides]))
        returns = []
        for i, overrides in enumerate(job_overrides):
            job = initial_job_idx + i
            behaviour = self.behave(job) or complete
            behaviour(self.sweep_dir / str(job), dict(o.split("=", 1) for o in overrides), job)
            ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
            ret.return_value = None
            returns.append(ret)
        return returns


def _sweeper(
    sweep_dir: Path,
    behave: Callable[[int], Behaviour | None],
    *,
    resume: bool = False,
    **settings: Any,
) -> tuple[OptunaSearchSweeper, FakeLauncher]:
    """The sweeper as Hydra sets it up, with the fake launcher and no composition check."""
    sweeper = OptunaSearchSweeper(
        **{"n_trials": 5, "seeds": 2, "max_batch_size": 4, "n_startup_trials": 2, **settings}
    )
    launcher = FakeLauncher(sweep_dir, behave)
    sweeper.launcher = launcher
    sweeper.hydra_context = HydraContext(config_loader=None, callbacks=None)  # type: ignore[arg-type]
    sweeper.config = OmegaConf.create(
        {
            "resume": resume,
            "hydra": {"sweep": {"dir": str(sweep_dir), "subdir": "${hydra.job.num}"}},
        }
    )
    sweeper.validate_batch_is_legal = lambda batch: None  # type: ignore[method-assign]
    return sweeper, launcher


SEARCH = ["train.lr=tag(log, interval(1e-3, 1e-2))", "train.iterations=4"]


def _study(sweep_dir: Path) -> optuna.Study:
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(sweep_dir / SEARCH_DIR / JOURNAL)))
    return optuna.load_study(study_name="search", storage=storage)


def _by_trial(study: optuna.Study) -> dict[int, optuna.trial.FrozenTrial]:
    return {t.number: t for t in study.get_trials(deepcopy=False)}


# ---- layout, values, states ---------------------------------------------------------------------


def test_jobs_are_trial_times_seeds_in_batches_of_whole_trials(tmp_path: Path) -> None:
    sweeper, launcher = _sweeper(tmp_path, lambda job: None, n_trials=5, seeds=2, max_batch_size=4)
    sweeper.sweep(SEARCH)
    # two trials (4 jobs) per launch, numbered consecutively from the launch's first job
    assert [(first, len(batch)) for first, batch in launcher.calls] == [(0, 4), (4, 4), (8, 2)]
    study = _study(tmp_path)
    trials = _by_trial(study)
    assert sorted(trials) == [0, 1, 2, 3, 4]
    jobs = {first + i: o for first, batch in launcher.calls for i, o in enumerate(batch)}
    for number, trial in trials.items():
        assert trial.user_attrs["jobs"] == [2 * number, 2 * number + 1]
        lr = f"train.lr={trial.params['train.lr']}"
        assert trial.user_attrs["overrides"] == [lr]
        for seed, job in enumerate(trial.user_attrs["jobs"]):
            # fixed overrides first, then the setting, then the seed
            assert jobs[job] == ["train.iterations=4", lr, f"seed={seed}"]
            assert (tmp_path / str(job) / ".hydra" / "overrides.yaml").is_file()

    # one trial at a time when the launcher has no batch size (basic, SLURM)
    sweeper, launcher = _sweeper(tmp_path / "b", lambda job: None, n_trials=3, max_batch_size=None)
    sweeper.sweep(SEARCH)
    assert [(first, len(batch)) for first, batch in launcher.calls] == [(0, 2), (2, 2), (4, 2)]
    # more seeds than a batch holds: one trial in two launches
    sweeper, launcher = _sweeper(
        tmp_path / "c", lambda job: None, n_trials=2, seeds=3, max_batch_size=2
    )
    sweeper.sweep(SEARCH)
    assert [(first, len(batch)) for first, batch in launcher.calls] == [
        (0, 2),
        (2, 1),
        (3, 2),
        (5, 1),
    ]


def test_a_trials_value_is_the_mean_of_the_metric_over_its_seeds(tmp_path: Path) -> None:
    sweeper, _ = _sweeper(tmp_path, lambda job: None, n_trials=4, seeds=[3, 5], metric="auc")
    sweeper.sweep(SEARCH)
    study = _study(tmp_path)
    for trial in study.get_trials(deepcopy=False):
        assert trial.state == TrialState.COMPLETE
        per_seed = [
            metric_of(metric_records(tmp_path / str(job), "eval"), "auc")
            for job in trial.user_attrs["jobs"]
        ]
        assert trial.value == pytest.approx(sum(per_seed) / 2)
        assert trial.user_attrs["values_by_seed"] == {
            "3": pytest.approx(per_seed[0]),
            "5": pytest.approx(per_seed[1]),
        }
    best = yaml.safe_load((tmp_path / SEARCH_DIR / BEST).read_text())
    top = max(study.get_trials(deepcopy=False), key=lambda t: t.value)
    assert best["trial"] == top.number and best["value"] == pytest.approx(top.value)
    interval = t_interval(list(best["seeds"].values()))
    assert best["ci95"] == pytest.approx([interval.lo, interval.hi])
    assert sorted(best["seeds"]) == [3, 5]
    assert best["params"] == {"train.lr": top.params["train.lr"]}
    assert best["overrides"] == [f"train.lr={top.params['train.lr']}"]
    assert best["runs"] == [str(tmp_path / str(j)) for j in top.user_attrs["jobs"]]
    assert best["command"].endswith(f"train.iterations=4 train.lr={top.params['train.lr']}")


def test_failed_and_pruned_runs_fail_and_prune_their_trial(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # trial 0: seed 1 fails; trial 1: seed 0 is pruned; trials 2, 3 complete
    ends = {1: failed, 2: pruned}
    sweeper, _ = _sweeper(tmp_path, ends.get, n_trials=4)
    with caplog.at_level(logging.INFO, logger="grail.study.search"):
        sweeper.sweep(SEARCH)
    trials = _by_trial(_study(tmp_path))
    assert [trials[n].state for n in range(4)] == [
        TrialState.FAIL,
        TrialState.PRUNED,
        TrialState.COMPLETE,
        TrialState.COMPLETE,
    ]
    assert f"run {tmp_path / '1'} failed: FloatingPointError: loss is NaN" in caplog.text
    # a pruned trial keeps how far it got: Optuna's TPE ranks pruned trials by it
    assert list(trials[1].intermediate_values) == [1]  # the last eval both seeds reached
    assert (tmp_path / SEARCH_DIR / BEST).is_file()


def test_trial_outcome_from_run_directories(tmp_path: Path) -> None:
    kv = {"train.lr": "0.003", "seed": "0"}
    for name, end in (
        ("done", complete),
        ("failed", failed),
        ("pruned", pruned),
        ("killed", killed),
    ):
        end(tmp_path / name, kv, 0)
    outcome = trial_outcome({0: tmp_path / "done", 1: tmp_path / "killed"}, "final")
    assert outcome.state == "running" and "killed" in outcome.reason and outcome.value is None
    outcome = trial_outcome({0: tmp_path / "failed", 1: tmp_path / "killed"}, "final")
    assert outcome.state == "fail"  # decided whatever the other seeds do
    outcome = trial_outcome({0: tmp_path / "done", 1: tmp_path / "pruned"}, "final")
    assert outcome.state == "pruned" and outcome.step == 1
    # a completed run without any eval after training started has no metric: the trial fails
    make_run(
        tmp_path / "no-eval", ["seed=0"], iterations=1, done=1, eval_interval=5, completed=True
    )
    for path in (tmp_path / "no-eval" / "metrics").glob("eval_iter_*.json"):
        path.unlink()
    outcome = trial_outcome({0: tmp_path / "no-eval"}, "auc")
    assert outcome.state == "fail" and "eval.interval" in outcome.reason


def test_tpe_is_the_sampler_and_sampler_seed_makes_it_repeatable(tmp_path: Path) -> None:
    params = []
    for name in ("a", "b"):
        sweeper, _ = _sweeper(tmp_path / name, lambda job: None, n_trials=4, sampler_seed=11)
        sweeper.sweep(SEARCH)
        assert sweeper.runner is not None
        assert isinstance(sweeper.runner.study.sampler, optuna.samplers.TPESampler)
        params.append([t.params for t in _study(tmp_path / name).trials])
    assert params[0] == params[1]


# ---- resume -------------------------------------------------------------------------------------


def test_an_interrupted_search_resumes_its_running_trials_with_their_jobs(tmp_path: Path) -> None:
    # First attempt: trial 1's runs are killed (no summary); trial 2 is interrupted (Ctrl-C) while
    # its first run trains.
    def first(job: int) -> Behaviour | None:
        if job in (2, 3):
            return killed
        if job == 4:
            raise KeyboardInterrupt
        return None

    sweeper, launcher = _sweeper(tmp_path, first, n_trials=4, max_batch_size=2)
    with pytest.raises(KeyboardInterrupt):
        sweeper.sweep(SEARCH)
    before = _by_trial(_study(tmp_path))
    assert [before[n].state for n in range(3)] == [
        TrialState.COMPLETE,
        TrialState.RUNNING,
        TrialState.RUNNING,
    ]

    # A rerun without resume=true is refused: it would mix two searches in one directory.
    sweeper, _ = _sweeper(tmp_path, lambda job: None, n_trials=4, max_batch_size=2)
    with pytest.raises(SweepError, match="already holds the search 'search' .*: to continue it"):
        sweeper.search(SEARCH)
    # So is one with another search space.
    sweeper, _ = _sweeper(tmp_path, lambda job: None, resume=True, n_trials=4, max_batch_size=2)
    with pytest.raises(SweepError, match="made by a different search .*params"):
        sweeper.search(["train.lr=tag(log, interval(1e-4, 1e-2))", "train.iterations=4"])
    with pytest.raises(SweepError, match="train.iterations=4 before, train.iterations=8 now"):
        sweeper.search(["train.lr=tag(log, interval(1e-3, 1e-2))", "train.iterations=8"])

    # The same command with resume=true: trial 0 is not run again, trials 1 and 2 are launched
    # with their own jobs and settings, then trial 3 is asked for.
    sweeper, launcher = _sweeper(
        tmp_path, lambda job: None, resume=True, n_trials=4, max_batch_size=2
    )
    sweeper.sweep([*SEARCH, "resume=true"])
    launched = {first + i: o for first, batch in launcher.calls for i, o in enumerate(batch)}
    assert [first for first, _ in launcher.calls] == [2, 4, 6]
    for number in (1, 2):
        lr = f"train.lr={before[number].params['train.lr']}"
        for seed, job in enumerate((2 * number, 2 * number + 1)):
            assert launched[job] == ["train.iterations=4", "resume=true", lr, f"seed={seed}"]
    after = _by_trial(_study(tmp_path))
    assert sorted(after) == [0, 1, 2, 3]
    assert all(t.state == TrialState.COMPLETE for t in after.values())
    assert after[1].params == before[1].params and after[2].params == before[2].params
    assert after[0].value == before[0].value

    # Asking for more trials extends the study; a finished study launches nothing.
    sweeper, launcher = _sweeper(
        tmp_path, lambda job: None, resume=True, n_trials=4, max_batch_size=2
    )
    sweeper.sweep([*SEARCH, "resume=true"])
    assert launcher.calls == []
    sweeper, launcher = _sweeper(
        tmp_path, lambda job: None, resume=True, n_trials=5, max_batch_size=2
    )
    sweeper.sweep([*SEARCH, "resume=true"])
    assert [first for first, _ in launcher.calls] == [8]


# ---- through Hydra ------------------------------------------------------------------------------


def test_the_sweeper_config_composes_typed_with_the_automatic_batch_size() -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="offline_grpo",
            overrides=["hydra/sweeper=grail_optuna", "hydra.sweeper.seeds=[0,7]"],
            return_hydra_config=True,
        )
        assert cfg.hydra.sweeper._target_.startswith("hydra_plugins.")  # Hydra's rule for plugins
        assert cfg.hydra.sweeper.seeds == [0, 7] and cfg.hydra.sweeper.max_batch_size is None
        with pytest.raises(Exception, match="n_trial"):
            compose(
                config_name="offline_grpo",
                overrides=["hydra/sweeper=grail_optuna", "hydra.sweeper.n_trial=3"],
                return_hydra_config=True,
            )


def test_a_misspelt_key_fails_before_the_study_holds_anything(tmp_path: Path) -> None:
    result = grail_train(
        "-m",
        "hydra/sweeper=grail_optuna",
        "train.lrr=tag(log, interval(1e-3, 1e-2))",
        f"hydra.sweep.dir={tmp_path}",
        timeout=60,
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "lrr" in out, out[-3000:]
    assert not (tmp_path / SEARCH_DIR).exists()


def test_a_real_search_through_grail_train(tmp_path: Path) -> None:
    """Two trials of real training (tiny model, CPU), one seed each."""
    result = grail_train(
        "-m",
        "hydra/sweeper=grail_optuna",
        "train.lr=tag(log, interval(1e-3, 1e-2))",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.seeds=1",
        "train.iterations=2",
        *TINY_RUN,
        "eval.interval=1",
        f"hydra.sweep.dir={tmp_path}",
        timeout=180,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    study = _study(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2
    for t in study.trials:
        run = tmp_path / str(t.number)
        overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
        assert f"train.lr={t.params['train.lr']}" in overrides and "seed=0" in overrides
        assert json.loads((run / "summary.json").read_text())["status"] == "completed"
        assert t.value == metric_of(metric_records(run, "eval"), "auc")
    best = yaml.safe_load((tmp_path / SEARCH_DIR / BEST).read_text())
    assert best["trial"] in (0, 1) and best["metric"] == "auc"
    assert "best: trial" in out and "all 2 runs completed" in out  # ours, then SweepOutcome's


def test_parser_accepts_hydra_optuna_sweeper_spellings() -> None:
    """What a user of hydra-optuna-sweeper writes in `hydra.sweeper.params` reads the same."""
    space = parse_space(
        {"x": "range(-5, 5)", "y": "choice(1, 2, 4)", "z": "tag(log, interval(1, 10))"},
        [],
        OverridesParser.create(),
    )
    assert space.distributions["x"] == IntDistribution(-5, 4)
    assert space.distributions["y"] == CategoricalDistribution([1, 2, 4])
    assert space.distributions["z"] == FloatDistribution(1.0, 10.0, log=True)


# ---- a resumed search proposes what the uninterrupted one would (issue 28, point 5) ------------


def _killed_from(first_killed: int) -> Callable[[int], Behaviour | None]:
    """A launcher as SIGKILL leaves it: jobs from `first_killed` on get no summary, and the
    search stops when that job's batch returns (the sweeper process is gone)."""

    def behave(job: int) -> Behaviour | None:
        return killed if job >= first_killed else None

    return behave


class _Killed(Exception):
    """The end of the first attempt (SIGKILL ends the process; the test ends the sweep)."""


@pytest.mark.parametrize(
    ("n_startup_trials", "max_batch_size", "killed_trial"),
    [
        (10, 4, 0),  # the case: the first batch (trials 0 and 1) killed, all random
        (2, None, 3),  # TPE past its random start-up, one trial at a time
        (2, 4, 2),  # TPE, trials 2 and 3 killed together
    ],
)
def test_a_resumed_search_proposes_what_the_uninterrupted_one_does(
    tmp_path: Path, n_startup_trials: int, max_batch_size: int | None, killed_trial: int
) -> None:
    settings = {
        "n_trials": 6,
        "seeds": 2,
        "n_startup_trials": n_startup_trials,
        "max_batch_size": max_batch_size,
    }
    sweeper, _ = _sweeper(tmp_path / "whole", lambda job: None, **settings)
    sweeper.sweep(SEARCH)
    whole = [t.params for t in _study(tmp_path / "whole").trials]
    assert len({p["train.lr"] for p in whole}) == 6

    # First attempt: the runs of `killed_trial` (and of its batch) are killed, so is the sweeper.
    first_killed = 2 * killed_trial
    behave = _killed_from(first_killed)
    sweeper, launcher = _sweeper(tmp_path / "resumed", behave, **settings)
    original_launch = launcher.launch

    def launch_then_die(job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Any:
        returns = original_launch(job_overrides, initial_job_idx)
        if initial_job_idx + len(job_overrides) > first_killed:
            raise _Killed
        return returns

    launcher.launch = launch_then_die  # type: ignore[method-assign]
    with pytest.raises(_Killed):
        sweeper.sweep(SEARCH)
    before = _study(tmp_path / "resumed").trials
    assert TrialState.RUNNING in {t.state for t in before}

    sweeper, _ = _sweeper(tmp_path / "resumed", lambda job: None, resume=True, **settings)
    sweeper.sweep([*SEARCH, "resume=true"])
    resumed = _study(tmp_path / "resumed").trials
    assert all(t.state == TrialState.COMPLETE for t in resumed)
    assert [t.params for t in resumed] == whole  # so no setting is run twice either

    # grail-report: 6 settings, each on its 2 seeds (the report: 2 settings, n=2 each)
    csv_path = tmp_path / "stats.csv"
    assert (
        report_main([str(tmp_path / "resumed"), "--out", str(tmp_path), "--csv", str(csv_path)])
        == 0
    )
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert all((r["n_seeds"], r["done"], r["repeated"]) == ("2", "2", "0") for r in rows)


def test_rerunning_a_search_without_resume_is_refused_in_one_line(tmp_path: Path) -> None:
    sweeper, _ = _sweeper(tmp_path, lambda job: None, n_trials=1, seeds=1)
    sweeper.sweep(SEARCH)
    journal = (tmp_path / SEARCH_DIR / JOURNAL).read_bytes()
    result = grail_train(
        "-m",
        "hydra/sweeper=grail_optuna",
        *SEARCH,
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.seeds=1",
        f"hydra.sweep.dir={tmp_path}",
        timeout=60,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "resume=true" in line]
    assert len(lines) == 1 and f"hydra.sweep.dir={tmp_path}" in lines[0], out[-3000:]
    assert (tmp_path / SEARCH_DIR / JOURNAL).read_bytes() == journal  # the study is untouched
