"""Racing over seeds (hydra/sweeper=grail_race): the race's schedule (grail/study/race.py) on
synthetic per-seed values with a small fake judge (real Verdicts, made-up rules), the sweeper
(grail/study/race_sweeper.py, race_runner.py) driven by fake launchers that write run
directories (slots, job numbers, verdict.json, resume), and the config through Hydra. The
statistics themselves (grail/study/verdicts.py) are tested in tests/test_verdicts.py;
tests/test_race_simulation.py races them on simulated studies.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.run_dirs import TINY_RUN, grail_train, make_run
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext
from omegaconf import OmegaConf

from grail.core.records import atomic_write_text, metric_records
from grail.study.race import Race, RaceOptions, Run
from grail.study.race_runner import VERDICT, read_result
from grail.study.race_sweeper import RACE_RECORD, RaceSweeper, parse_settings
from grail.study.stats import metric_of
from grail.study.sweep import SUBMITIT_LOCAL, SweepError
from grail.study.verdicts import Outcome, Verdict
from grail.train.cli import CONF_DIR

# ---- a fake judge -------------------------------------------------------------------------------


def fake_judge(values: Mapping[str, Mapping[str, float]]) -> list[Verdict]:
    """Best = highest mean. Another setting, over >= 3 seeds shared with the best: worse when it
    lost on every one by more than 0.1 (or, from 4 seeds on, by more than 0.1 on average),
    equivalent when within 0.02 on every one; else not separated. Crude, but deterministic and
    enough to drive the schedule."""
    means = {label: sum(v.values()) / len(v) for label, v in values.items()}
    order = sorted(values, key=lambda label: -means[label])
    best = order[0]
    verdicts = []
    for label in order:
        by_seed = values[label]
        n = len(by_seed)
        ci = (min(by_seed.values()), max(by_seed.values()))
        if label == best:
            verdicts.append(Verdict(label, Outcome.BEST, n, means[label], ci, None, None, None))
            continue
        shared = sorted(set(by_seed) & set(values[best]))
        diffs = [by_seed[s] - values[best][s] for s in shared]
        outcome = Outcome.NOT_SEPARATED
        mean_diff = sum(diffs) / len(diffs) if diffs else 0.0
        if len(shared) >= 3 and max(diffs) < -0.1 or len(shared) >= 4 and mean_diff < -0.1:
            outcome = Outcome.WORSE
        elif len(shared) >= 3 and max(abs(d) for d in diffs) <= 0.02:
            outcome = Outcome.EQUIVALENT
        effect = mean_diff if diffs else None
        p = 0.01 if outcome == Outcome.WORSE else 0.5
        more = 2 if outcome == Outcome.NOT_SEPARATED else None
        verdicts.append(Verdict(label, outcome, n, means[label], ci, p, effect, more))
    return verdicts


def fake_decided(verdicts: Sequence[Verdict]) -> bool:
    return all(v.outcome != Outcome.NOT_SEPARATED for v in verdicts)


def race(settings: Sequence[str], **options: Any) -> Race:
    return Race(list(settings), RaceOptions(**options), fake_judge, fake_decided)


def play(r: Race, value: Callable[[str, int], float | None]) -> list[Run]:
    """Run the race one run at a time to its end; the runs in the order they started."""
    order = []
    while (run := r.next_run()) is not None:
        r.start(run)
        order.append(run)
        r.end(run, value(*run))
    assert r.over()
    return order


# ---- the schedule -------------------------------------------------------------------------------


def test_the_initial_round_runs_every_setting_on_its_seeds_seed_major() -> None:
    r = race(["a", "b", "c"], initial_seeds=2, max_seeds=4)
    order = []
    for _ in range(6):
        run = r.next_run()
        assert run is not None
        r.start(run)
        order.append(run)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("a", 1), ("b", 1), ("c", 1)]
    # nothing ended yet, and the next round waits for results (at most one round ahead)
    assert r.next_run() is None and not r.over()


def test_seeds_go_only_to_settings_not_yet_separated_from_the_best() -> None:
    values = {"a": [0.9, 0.8, 0.95, 0.9, 0.85, 0.9], "b": [0.1, 0.0, 0.05], "c": [0.8, 0.9, 0.7]}
    values["c"] += [0.6, 0.65, 0.7]  # c wins seed 1: not separated after the first round
    r = race(list(values), initial_seeds=3, max_seeds=6)
    order = play(r, lambda label, seed: values[label][seed])
    # b lost every seed by > 0.1 in the first round: dropped; a (best) and c race on until
    # seed 3 shows c worse
    assert [run for run in order if run[0] == "b"] == [("b", 0), ("b", 1), ("b", 2)]
    assert [s for label, s in order if label == "a"] == [0, 1, 2, 3]
    assert [s for label, s in order if label == "c"] == [0, 1, 2, 3]
    outcomes = {v.label: v.outcome for v in r.verdicts()}
    assert outcomes == {"a": "best", "b": "worse", "c": "worse"} and r.is_decided()
    assert r.runs == r.ended == len(order) == 11


def test_a_decided_race_adds_no_seed_and_an_undecided_one_stops_at_max_seeds() -> None:
    decided = race(["a", "b"], initial_seeds=3, max_seeds=10)
    assert len(play(decided, lambda label, seed: 1.0 if label == "a" else 0.0)) == 6
    assert decided.is_decided()

    # a coin flip: never separated, so every setting goes to max_seeds
    undecided = race(["a", "b"], initial_seeds=3, max_seeds=4)
    order = play(undecided, lambda label, seed: float((seed + (label == "b")) % 2))
    assert len(order) == 8 and not undecided.is_decided()
    assert {v.outcome for v in undecided.verdicts()} == {"best", "not_separated"}


def test_max_runs_is_a_budget_over_the_whole_race() -> None:
    r = race(["a", "b", "c"], initial_seeds=2, max_seeds=10, max_runs=8)
    order = play(r, lambda label, seed: float((seed + ord(label)) % 2))
    assert len(order) == 8 and r.runs == 8


def test_equivalent_settings_are_dropped_and_the_race_ends() -> None:
    values = {"a": [0.5, 0.6, 0.7], "b": [0.49, 0.59, 0.69]}
    r = race(["a", "b"], initial_seeds=3)
    assert len(play(r, lambda label, seed: values[label][seed])) == 6
    assert [v.outcome for v in r.verdicts()] == ["best", "equivalent"] and r.is_decided()


def test_free_slots_are_filled_one_round_ahead_of_the_results_at_most() -> None:
    r = race(["a", "b"], initial_seeds=2, max_seeds=6)
    for run in [("a", 0), ("b", 0), ("a", 1), ("b", 1)]:
        assert r.next_run() == run
        r.start(run)
    r.end(("a", 0), 0.5)
    r.end(("b", 0), 0.4)
    # seed 1 of both still running: seed 2 may start (one round ahead), seed 3 may not
    assert r.next_run() == ("a", 2)
    r.start(("a", 2))
    assert r.next_run() == ("b", 2)
    r.start(("b", 2))
    assert r.next_run() is None
    r.end(("a", 1), 0.6)
    assert r.next_run() is None  # b's seed 1 is still out
    r.end(("b", 1), 0.5)
    assert r.next_run() == ("a", 3)


def test_a_failed_run_ends_without_a_value_and_is_not_run_again() -> None:
    r = race(["a", "b"], initial_seeds=3, max_seeds=3)
    order = play(r, lambda label, seed: None if (label, seed) == ("b", 1) else 0.5)
    assert len(order) == 6 and r.values["b"] == {0: 0.5, 2: 0.5}
    assert [v.n_seeds for v in r.verdicts()] == [3, 2]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"initial_seeds": 1}, "initial_seeds must be an int >= 2"),
        ({"max_seeds": 2, "initial_seeds": 3}, "max_seeds=2 is below"),
        ({"max_runs": "ten"}, "max_runs must be an int or null"),
    ],
)
def test_bad_options_name_the_key(options: dict[str, Any], message: str) -> None:
    with pytest.raises(SweepError, match=message):
        RaceOptions(**options)


def test_a_race_needs_two_settings() -> None:
    with pytest.raises(SweepError, match=r"at least two settings to compare, got 1 \(a\)"):
        race(["a"])


@pytest.mark.parametrize(
    ("arguments", "one"),
    [
        # a plain value is one setting, as one value listed is: both counted 1, and named
        (["train.lr=5e-3", "resume=true"], "train.lr=5e-3"),
        (["train.lr=choice(5e-3)", "train.iterations=50"], "train.lr=0.005"),
        ([], "the config as composed"),
    ],
)
def test_a_race_of_one_setting_is_refused_counting_and_naming_it(
    arguments: list[str], one: str
) -> None:
    with pytest.raises(SweepError) as err:
        parse_settings({}, arguments, OverridesParser.create())
    assert str(err.value).startswith(
        f"a race needs at least two settings to compare, got 1 ({one}): sweep a key over"
    )


# ---- settings from the command line -------------------------------------------------------------


def test_settings_are_the_product_of_the_swept_values() -> None:
    settings, fixed = parse_settings(
        {"train.kl_coef": "0,0.05"},
        ["train.lr=1e-3,5e-3", "train.iterations=50", "resume=true", "hydra.verbose=true"],
        OverridesParser.create(),
    )
    assert [s.overrides for s in settings] == [
        ["train.kl_coef=0", "train.lr=0.001"],
        ["train.kl_coef=0", "train.lr=0.005"],
        ["train.kl_coef=0.05", "train.lr=0.001"],
        ["train.kl_coef=0.05", "train.lr=0.005"],
    ]  # values as Hydra's grid writes them (its basic sweeper's overrides read the same)
    assert [s.index for s in settings] == [0, 1, 2, 3]
    assert fixed == ["train.iterations=50", "resume=true"]


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        ("seed=0,1,2", "sets the seed"),
        ("train.lr=interval(1e-3, 1e-2)", "a race compares listed values"),
        ("train.lr=[1e-3", "cannot parse"),
    ],
)
def test_bad_arguments_name_the_entry(argument: str, message: str) -> None:
    with pytest.raises(SweepError, match=message):
        parse_settings({}, [argument], OverridesParser.create())


def test_a_pruned_run_counts_censored_as_the_report_counts_it(tmp_path: Path) -> None:
    rising, falling = tmp_path / "rising", tmp_path / "falling"
    make_run(rising, ["seed=0"], iterations=8, done=4, success=lambda i: 0.1 * i)
    make_run(falling, ["seed=0"], iterations=8, done=4, success=lambda i: 0.8 - 0.15 * i)
    for run in (rising, falling):
        atomic_write_text(run / "summary.json", json.dumps({"status": "pruned"}))
    result = read_result(rising, "final")
    assert result.ended and result.status == "pruned" and result.value == pytest.approx(0.4)
    assert read_result(rising, "auc").value == pytest.approx(0.3)  # (0.2 + 0.4) / 2
    # evals 0.5 then 0.2: its auc (0.35) would flatter it; at most where it was stopped
    assert read_result(falling, "auc").value == pytest.approx(0.2)
    # a completed run counts with its metric as it is
    make_run(
        tmp_path / "done",
        ["seed=0"],
        iterations=4,
        done=4,
        success=lambda i: 0.8 - 0.15 * i,
        completed=True,
    )
    assert read_result(tmp_path / "done", "auc").value == pytest.approx(0.35)


# ---- the sweeper with fake launchers ------------------------------------------------------------

Values = Callable[[dict[str, str]], float | None]  # a job's overrides -> its value (None: failed)


def default_values(kv: dict[str, str]) -> float:
    """train.lr=1e-3 is far worse than 5e-3; 2e-2 is close to it on some seeds only."""
    seed = int(kv["seed"])
    lr = kv["train.lr"]
    return {"0.001": 0.02, "0.005": 0.95, "0.02": [0.9, 0.3, 0.6, 0.2, 0.5][seed % 5]}[lr]


def write_run(sweep_dir: Path, overrides: Sequence[str], values: Values) -> Path:
    kv = dict(o.split("=", 1) for o in overrides)
    run_dir = sweep_dir / kv.pop("hydra.sweep.subdir")
    value = values(kv)
    task = [f"{k}={v}" for k, v in kv.items()]
    make_run(
        run_dir,
        task,
        iterations=2,
        done=2,
        success=lambda i: value or 0.0,
        completed=value is not None,
    )
    if value is None:
        atomic_write_text(run_dir / "summary.json", json.dumps({"status": "failed"}))
    return run_dir


class FakeLauncher(Launcher):
    """Writes each job's run directory (the value from `values`) after `delay(job)` seconds;
    records (job number, overrides) of every launch, and the slots of the jobs alive together."""

    def __init__(
        self,
        sweep_dir: Path,
        values: Values = default_values,
        *,
        parallel: int = 1,
        delay: Callable[[list[str]], float] = lambda overrides: 0.0,
        interrupt_after: int | None = None,
    ) -> None:
        self.sweep_dir = sweep_dir
        self.values = values
        self.parallel = parallel
        self.delay = delay
        self.interrupt_after = interrupt_after
        self.calls: list[tuple[int, list[str]]] = []
        self.alive: set[int] = set()  # slots of the jobs running now
        self.max_alive = 0
        self.times: dict[str, tuple[float, float]] = {}  # run directory -> (start, end)
        self.lock = threading.Lock()

    def setup(self, **kwargs: Any) -> None:
        pass

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[JobReturn]:
        (overrides,) = job_overrides  # the race hands one job at a time
        slot = initial_job_idx % self.parallel
        with self.lock:
            if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
                raise KeyboardInterrupt
            assert slot not in self.alive, f"slot {slot} given twice"
            self.alive.add(slot)
            self.max_alive = max(self.max_alive, len(self.alive))
            self.calls.append((initial_job_idx, list(overrides)))
        start = time.monotonic()
        time.sleep(self.delay(list(overrides)))
        run_dir = write_run(self.sweep_dir, overrides, self.values)
        with self.lock:
            self.alive.discard(slot)
            self.times[run_dir.name] = (start, time.monotonic())
        ret = JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED)
        ret.return_value = None
        return [ret]

    def runs(self) -> list[str]:
        return [dict(o.split("=", 1) for o in ov)["hydra.sweep.subdir"] for _, ov in self.calls]


LRS = ["train.lr=1e-3,5e-3,2e-2", "train.iterations=2"]


def make_sweeper(
    launcher: FakeLauncher,
    *,
    resume: bool = False,
    launcher_target: str | None = None,
    **options: Any,
) -> RaceSweeper:
    """The sweeper as Hydra sets it up, with the fake launcher and judge, no composition check."""
    sweeper = RaceSweeper(**{"initial_seeds": 3, "max_seeds": 6, **options})
    sweeper.launcher = launcher
    sweeper.hydra_context = HydraContext(config_loader=None, callbacks=None)  # type: ignore[arg-type]
    sweeper.config = OmegaConf.create(
        {
            "resume": resume,
            "hydra": {
                "sweep": {"dir": str(launcher.sweep_dir), "subdir": "${hydra.job.num}"},
                "launcher": {"_target_": launcher_target},
            },
        }
    )
    sweeper.validate_batch_is_legal = lambda batch: None  # type: ignore[method-assign]
    sweeper._judge = lambda: (fake_judge, fake_decided)  # type: ignore[method-assign]
    return sweeper


def test_one_run_at_a_time_with_the_basic_launcher_and_verdict_json(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    make_sweeper(launcher).sweep(LRS)
    runs = launcher.runs()
    # the initial round seed-major, then 1e-3 (worse) is dropped and the others race on
    assert runs[:9] == [f"s{i}_seed{s}" for s in range(3) for i in range(3)]
    assert all(not r.startswith("s0_") for r in runs[9:]) and len(runs) == len(set(runs))
    assert [job for job, _ in launcher.calls] == list(range(len(runs)))
    first = launcher.calls[0][1]
    assert first == [
        "train.iterations=2",
        "train.lr=0.001",
        "seed=0",
        "hydra.sweep.subdir=s0_seed0",
    ]

    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert set(verdict) == {"best", "decided", "nothing_learnt", "runs", "settings"}
    assert verdict["nothing_learnt"] is False
    assert verdict["best"] == {"train.lr": "0.005"} and verdict["runs"] == len(runs)
    keys = {"overrides", "outcome", "n_seeds", "mean", "ci", "p", "seeds_to_separate"}
    assert all(set(entry) == keys for entry in verdict["settings"])
    by_lr = {e["overrides"]["train.lr"]: e for e in verdict["settings"]}
    assert by_lr["0.005"]["outcome"] == "best" and by_lr["0.005"]["p"] is None
    assert by_lr["0.001"]["outcome"] == "worse" and by_lr["0.001"]["n_seeds"] == 3
    assert by_lr["0.02"]["n_seeds"] == by_lr["0.005"]["n_seeds"] == 4
    assert verdict["decided"] is True and by_lr["0.02"]["outcome"] == "worse"
    assert by_lr["0.005"]["mean"] == pytest.approx(0.95)
    record = json.loads((tmp_path / RACE_RECORD).read_text())
    assert record["settings"] == [["train.lr=0.001"], ["train.lr=0.005"], ["train.lr=0.02"]]


def test_a_race_where_nothing_learnt_says_so_and_adds_no_seeds(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every run 0.000 (the real judge): no best is named and none is called equivalent, and the
    race stops after its first round instead of running every setting to max_seeds."""
    launcher = FakeLauncher(tmp_path, lambda kv: 0.0)
    sweeper = make_sweeper(launcher, initial_seeds=4, max_seeds=8)
    del sweeper._judge  # grail/study/verdicts.py's, not the fake
    with caplog.at_level("INFO", logger="grail.study.race"):
        sweeper.sweep(LRS)
    assert len(launcher.runs()) == 3 * 4  # the first round only
    assert sweeper.race is not None and sweeper.race.nothing_learnt()
    assert sweeper.race.next_run() is None and not sweeper.race.is_decided()
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["nothing_learnt"] is True and verdict["decided"] is False
    assert verdict["best"] is None
    assert {e["outcome"] for e in verdict["settings"]} == {"nothing_learnt"}
    assert all(e["mean"] == 0.0 and e["p"] is None for e in verdict["settings"])
    said = [r.getMessage() for r in caplog.records if "nothing learnt" in r.getMessage()]
    assert len(said) == 1 and "no setting is best and none is equivalent" in said[0]


def test_free_slots_are_refilled_at_once_with_job_numbers_that_name_the_slot(
    tmp_path: Path,
) -> None:
    """Submitit launchers: one thread per running job. 1e-3 runs are slow, so the other slots
    must go on without them (no batch barrier), and no slot is ever given twice."""

    def delay(overrides: list[str]) -> float:
        return 0.8 if "train.lr=0.001" in overrides else 0.02

    launcher = FakeLauncher(tmp_path, parallel=3, delay=delay)
    make_sweeper(launcher, launcher_target=SUBMITIT_LOCAL, max_batch_size=3).sweep(LRS)
    assert launcher.max_alive == 3
    runs = launcher.runs()
    assert len(runs) == len(set(runs))
    # the fourth run started while the first (slow) one was still going: no batch barrier
    assert launcher.times[runs[3]][0] < launcher.times[runs[0]][1]
    assert runs[:4] == ["s0_seed0", "s1_seed0", "s2_seed0", "s0_seed1"]
    # a slot's job numbers are slot, slot + 3, slot + 6, ...
    by_slot: dict[int, list[int]] = {}
    for job, _ in launcher.calls:
        by_slot.setdefault(job % 3, []).append(job)
    assert all(jobs == list(range(slot, 3 * len(jobs), 3)) for slot, jobs in by_slot.items())
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["decided"] and verdict["best"] == {"train.lr": "0.005"}


def test_a_job_that_raises_stops_the_race_after_the_runs_going(tmp_path: Path) -> None:
    """A job that raises (not a failed run, which ends in its summary) is a sweep error, e.g. a
    run directory of another sweep point: no new run starts, the others end, the error is raised
    in the main thread."""

    def broken(kv: dict[str, str]) -> float:
        if (kv["train.lr"], kv["seed"]) == ("0.005", "1"):
            raise SweepError("this run directory was made by a different sweep point")
        return default_values(kv)

    launcher = FakeLauncher(tmp_path, broken, parallel=3, delay=lambda overrides: 0.05)
    sweeper = make_sweeper(launcher, launcher_target=SUBMITIT_LOCAL, max_batch_size=3)
    with pytest.raises(SweepError, match="different sweep point"):
        sweeper.sweep(LRS)
    runs = launcher.runs()
    assert runs.index("s1_seed1") >= len(runs) - 3  # at most the two other slots' runs after it
    assert json.loads((tmp_path / VERDICT).read_text())["runs"] == len(runs)


def test_an_interrupted_race_resumes_without_losing_or_repeating_a_run(tmp_path: Path) -> None:
    whole = FakeLauncher(tmp_path / "whole")
    make_sweeper(whole).sweep(LRS)

    cut = FakeLauncher(tmp_path / "cut", interrupt_after=10)
    with pytest.raises(SystemExit, match="130"):
        make_sweeper(cut).sweep(LRS)
    # a run killed before its summary: started, never ended
    killed = tmp_path / "cut" / cut.runs()[-1]
    (killed / "summary.json").unlink()
    assert json.loads((tmp_path / "cut" / VERDICT).read_text())["runs"] == 10

    with pytest.raises(SweepError, match="resume=true"):
        make_sweeper(FakeLauncher(tmp_path / "cut")).sweep(LRS)
    again = FakeLauncher(tmp_path / "cut")
    make_sweeper(again, resume=True).sweep([*LRS, "resume=true"])
    assert again.runs()[0] == killed.name  # the unfinished run first, in its own directory
    assert set(cut.runs()[:-1]).isdisjoint(again.runs())
    assert sorted(cut.runs()[:-1] + again.runs()) == sorted(whole.runs())
    assert json.loads((tmp_path / "cut" / VERDICT).read_text()) == json.loads(
        (tmp_path / "whole" / VERDICT).read_text()
    )


def test_a_resume_with_other_settings_is_refused(tmp_path: Path) -> None:
    make_sweeper(FakeLauncher(tmp_path), max_seeds=3).sweep(LRS)
    with pytest.raises(SweepError, match="holds another race"):
        make_sweeper(FakeLauncher(tmp_path), resume=True).sweep(["train.lr=1e-3,2e-2"])


def test_a_resume_reads_every_run_of_the_race_whatever_max_seeds_is_now(tmp_path: Path) -> None:
    first = FakeLauncher(tmp_path)
    make_sweeper(first).sweep(LRS)
    runs = json.loads((tmp_path / VERDICT).read_text())["runs"]
    assert runs == len(first.runs()) > 9  # seeds beyond the initial 3
    again = FakeLauncher(tmp_path)
    make_sweeper(again, resume=True, max_seeds=3).sweep([*LRS, "resume=true"])
    assert again.runs() == [] and json.loads((tmp_path / VERDICT).read_text())["runs"] == runs


def test_a_failed_run_is_retried_by_a_resume(tmp_path: Path) -> None:
    def failing(kv: dict[str, str]) -> float | None:
        return None if (kv["train.lr"], kv["seed"]) == ("0.02", "1") else default_values(kv)

    first = FakeLauncher(tmp_path, failing)
    make_sweeper(first, max_seeds=3).sweep(LRS)
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert {e["overrides"]["train.lr"]: e["n_seeds"] for e in verdict["settings"]}["0.02"] == 2
    again = FakeLauncher(tmp_path)
    make_sweeper(again, resume=True, max_seeds=3).sweep([*LRS, "resume=true"])
    assert again.runs() == ["s2_seed1"]


def test_a_setting_that_always_fails_leaves_the_race_undecided(tmp_path: Path) -> None:
    def failing(kv: dict[str, str]) -> float | None:
        return None if kv["train.lr"] == "0.001" else default_values(kv)

    launcher = FakeLauncher(tmp_path, failing)
    make_sweeper(launcher).sweep(LRS)
    assert [r for r in launcher.runs() if r.startswith("s0_")] == [
        "s0_seed0",
        "s0_seed1",
        "s0_seed2",
    ]
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["decided"] is False and verdict["best"] == {"train.lr": "0.005"}
    last = verdict["settings"][-1]
    assert last["overrides"] == {"train.lr": "0.001"} and last["n_seeds"] == 0
    assert last["mean"] is None and last["outcome"] == "not_separated"


def test_bad_sweeper_settings_name_the_key(tmp_path: Path) -> None:
    for options, message in [
        ({"metric": "best"}, "metric='best' is not one of auc, final"),
        ({"alpha": 1.5}, "alpha must be in"),
        ({"max_seeds": 1}, "max_seeds must be an int >= 2"),
    ]:
        with pytest.raises(SweepError, match=message):
            make_sweeper(FakeLauncher(tmp_path), **options).sweep(LRS)
    sweeper = make_sweeper(FakeLauncher(tmp_path))
    assert sweeper.config is not None
    sweeper.config.hydra.sweep.subdir = "${hydra.job.id}"
    with pytest.raises(SweepError, match="hydra.sweep.subdir"):
        sweeper.sweep(LRS)


# ---- through Hydra ------------------------------------------------------------------------------


def test_the_sweeper_config_composes_typed() -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            config_name="offline_grpo",
            overrides=["hydra/sweeper=grail_race", "hydra.sweeper.max_seeds=8"],
            return_hydra_config=True,
        )
        assert cfg.hydra.sweeper._target_ == "hydra_plugins.grail_race.race_sweeper.RaceSweeper"
        assert cfg.hydra.sweeper.max_seeds == 8 and cfg.hydra.sweeper.initial_seeds == 3
        assert cfg.hydra.sweeper.max_batch_size is None  # the basic launcher: one at a time
        with pytest.raises(Exception, match="max_seed"):
            compose(
                config_name="offline_grpo",
                overrides=["hydra/sweeper=grail_race", "hydra.sweeper.max_seed=3"],
                return_hydra_config=True,
            )


def test_the_plugin_is_the_sweeper() -> None:
    from hydra_plugins.grail_race.race_sweeper import RaceSweeper as Plugin

    assert issubclass(Plugin, RaceSweeper)
    text = (Path(CONF_DIR) / "hydra" / "sweeper" / "grail_race.yaml").read_text()
    conf = yaml.safe_load(text)
    assert conf["initial_seeds"] == 3 and conf["metric"] == "auc"


def test_a_misspelt_key_fails_before_the_race_starts(tmp_path: Path) -> None:
    result = grail_train(
        "-m",
        "hydra/sweeper=grail_race",
        "train.lrr=1e-3,5e-3",
        f"hydra.sweep.dir={tmp_path}",
        timeout=60,
    )
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "lrr" in out, out[-3000:]
    assert not (tmp_path / RACE_RECORD).exists()


def test_a_real_race_through_grail_train(tmp_path: Path) -> None:
    """Two settings on two seeds of real training (tiny model, CPU), one run at a time: run
    directories per setting and seed, the same metric as grail-report's, verdict.json."""
    result = grail_train(
        "-m",
        "hydra/sweeper=grail_race",
        "train.lr=1e-3,5e-3",
        "hydra.sweeper.initial_seeds=2",
        "hydra.sweeper.max_seeds=2",
        "train.iterations=2",
        *TINY_RUN,
        "eval.interval=1",
        f"hydra.sweep.dir={tmp_path}",
        timeout=240,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["runs"] == 4 and len(verdict["settings"]) == 2
    for entry in verdict["settings"]:
        lr = entry["overrides"]["train.lr"]
        index = ["0.001", "0.005"].index(lr)
        values = []
        for seed in (0, 1):
            run = tmp_path / f"s{index}_seed{seed}"
            overrides = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
            assert f"train.lr={lr}" in overrides and f"seed={seed}" in overrides
            assert json.loads((run / "summary.json").read_text())["status"] == "completed"
            values.append(metric_of(metric_records(run, "eval"), "auc"))
        assert entry["n_seeds"] == 2 and entry["mean"] == pytest.approx(sum(values) / 2)
    assert "race" in out and "all 4 runs completed" in out  # ours, then SweepOutcome's
