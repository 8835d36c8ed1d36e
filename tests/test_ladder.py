"""Multi-fidelity racing (hydra.sweeper.ladder): the rungs and their shorthands, promotion and
overturned verdicts (grail/study/ladder.py), and the climb through the sweeper with the fake
launcher and judge of tests/test_race.py (grail/study/ladder_runner.py): each rung a race in its
own directory over what the rung below promoted, verdict.json, exact resume. A real ladder through
grail-train is the last test."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
import yaml
from helpers.run_dirs import TINY_RUN, grail_train
from test_race import LRS, FakeLauncher, default_values, make_sweeper

from grail.report.cli import main as report_main
from grail.study.ladder import TOP, Rung, overturned, parse_ladder, promoted
from grail.study.ladder_runner import LADDER_RECORD
from grail.study.race_runner import VERDICT
from grail.study.race_sweeper import RACE_RECORD
from grail.study.sweep import SweepError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import fingerprint  # noqa: E402  (scripts/fingerprint.py: a run's metrics without its timings)

BASE = {"train.iterations": 200, "data.problems_per_iteration": 16}

# ---- the rungs ----------------------------------------------------------------------------------


def test_a_ladder_is_its_rungs_cheapest_first_then_the_command_itself() -> None:
    rungs = parse_ladder(["model=tiny iterations=0.33", "iterations=0.5 problems=0.5"], BASE)
    assert rungs == [
        Rung(0, "model=tiny iterations=0.33", ("model=tiny", "train.iterations=66")),
        Rung(
            1,
            "iterations=0.5 problems=0.5",
            ("train.iterations=100", "data.problems_per_iteration=8"),
        ),
        Rung(2, TOP, ()),
    ]
    assert [r.directory for r in rungs] == ["r0", "r1", "r2"]
    assert parse_ladder(["iterations=0.001"], BASE)[0].overrides == ("train.iterations=1",)
    assert parse_ladder(["iterations=1/3"], BASE)[0].overrides == ("train.iterations=67",)
    assert parse_ladder([], BASE) == [Rung(0, TOP, ())]


@pytest.mark.parametrize(
    ("ladder", "message"),
    [
        ("iterations=0.5", "must be a list of rungs"),
        ([""], r"ladder\[0\].*at least one override"),
        (["full"], "top rung's name"),
        (["iterations=1.5"], r"iterations=1.5 must be a fraction in \(0, 1\) of train.iterations"),
        (["iterations=half"], "must be a fraction"),
        (["iterations=1/0"], "must be a fraction"),
        (["model=tiny", "model=tiny"], "lists a rung twice"),
        (["train.lr"], "'train.lr' is not key=value"),
        (["iterations=0.5 train.iterations=3"], "a key is set twice"),
        (["'model=tiny'"], "without quotes"),
    ],
)
def test_a_bad_rung_is_named(ladder: object, message: str) -> None:
    with pytest.raises(SweepError, match=message):
        parse_ladder(ladder, BASE)  # type: ignore[arg-type]


def test_settings_not_shown_worse_go_up() -> None:
    settings = ["a", "b", "c", "d", "e"]
    outcomes = {"a": "best", "b": "worse", "c": "equivalent", "d": "not_separated"}  # e failed
    assert promoted(outcomes, settings) == ["a", "c", "d"]
    # a rung where nothing was learnt told no setting apart: all go up
    assert promoted({"a": "nothing_learnt", "b": "nothing_learnt"}, settings) == ["a", "b"]


def test_the_top_overturns_only_what_a_rung_claimed() -> None:
    lower = [
        ("iterations=0.33", {"a": "best", "b": "not_separated", "c": "equivalent", "d": "worse"}),
        ("model=tiny", {"a": "best", "b": "not_separated", "c": "equivalent"}),
    ]
    top = {"a": "worse", "b": "best", "c": "equivalent"}
    found = overturned(lower, top)
    assert [(f.fidelity, f.setting, f.was, f.now) for f in found] == [
        ("iterations=0.33", "a", "best", "worse"),
        ("model=tiny", "a", "best", "worse"),
    ]


# ---- the climb ----------------------------------------------------------------------------------

LADDER = ["iterations=0.5"]  # of LRS' train.iterations=2: one iteration


def ladder_values(kv: dict[str, str]) -> float:
    """At the cheap rung 2e-2 leads 5e-3 by 0.1 on every seed (not separated by the fake judge)
    and 1e-3 is far behind; at the top, default_values: 5e-3 best, 2e-2 and 1e-3 worse."""
    if kv["fidelity"] == "'full'":
        assert kv["train.iterations"] == "2"
        return default_values(kv)
    assert kv["fidelity"] == "'iterations=0.5'" and kv["train.iterations"] == "1"
    return {"0.001": 0.02, "0.005": 0.5, "0.02": 0.6}[kv["train.lr"]]


def test_each_rung_races_what_the_rung_below_did_not_show_worse(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path, ladder_values)
    make_sweeper(launcher, ladder=LADDER).sweep(LRS)
    runs = launcher.runs()
    cheap = [r for r in runs if r.startswith("r0/")]
    top = [r for r in runs if r.startswith("r1/")]
    assert runs == cheap + top  # the top starts once the cheap rung's race is over
    assert cheap[:9] == [f"r0/s{i}_seed{s}" for s in range(3) for i in range(3)]
    assert sorted(cheap[9:]) == sorted(f"r0/s{i}_seed{s}" for s in range(3, 6) for i in (1, 2))
    assert top[:6] == [f"r1/s{i}_seed{s}" for s in range(3) for i in (1, 2)]
    assert not any(r.startswith("r1/s0_") for r in top)  # 1e-3 was shown worse: it stays below
    first_top = next(ov for _, ov in launcher.calls if "hydra.sweep.subdir=r1/s1_seed0" in ov)
    assert first_top == [
        "train.iterations=2",
        "fidelity='full'",
        "train.lr=0.005",
        "seed=0",
        "hydra.sweep.subdir=r1/s1_seed0",
    ]

    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["ladder"] == ["iterations=0.5", "full"]
    assert verdict["best"] == {"train.lr": "0.005"} and verdict["decided"] is True
    assert verdict["runs"] == len(runs)
    assert verdict["overturned"] == [
        {
            "fidelity": "iterations=0.5",
            "overrides": {"train.lr": "0.02"},
            "was": "best",
            "now": "worse",
        }
    ]
    r0, r1 = verdict["rungs"]
    assert r0["fidelity"] == "iterations=0.5" and r0["overrides"] == ["train.iterations=1"]
    assert r0["promoted"] == [{"train.lr": "0.005"}, {"train.lr": "0.02"}]
    assert r0["best"] == {"train.lr": "0.02"} and r0["decided"] is False
    assert r1["fidelity"] == "full" and r1["promoted"] is None
    assert verdict["settings"] == r1["settings"]
    # every rung is a race directory of its own: grail-report and --transfer read it as one
    for rung in ("r0", "r1"):
        assert (tmp_path / rung / RACE_RECORD).is_file()
        assert json.loads((tmp_path / rung / VERDICT).read_text())["runs"] == len(
            [r for r in runs if r.startswith(f"{rung}/")]
        )
    assert json.loads((tmp_path / LADDER_RECORD).read_text())["ladder"][0] == {
        "fidelity": "iterations=0.5",
        "overrides": ["train.iterations=1"],
    }


def test_a_lone_setting_promoted_runs_its_initial_seeds_at_the_top(tmp_path: Path) -> None:
    def values(kv: dict[str, str]) -> float:
        return {"0.001": 0.02, "0.005": 0.95, "0.02": 0.2}[kv["train.lr"]]

    launcher = FakeLauncher(tmp_path, values)
    make_sweeper(launcher, ladder=LADDER).sweep(LRS)
    top = [r for r in launcher.runs() if r.startswith("r1/")]
    assert top == ["r1/s1_seed0", "r1/s1_seed1", "r1/s1_seed2"]
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["best"] == {"train.lr": "0.005"} and verdict["overturned"] == []
    assert [e["outcome"] for e in verdict["settings"]] == ["best"]


def test_an_interrupted_ladder_resumes_without_losing_or_repeating_a_run(tmp_path: Path) -> None:
    whole = FakeLauncher(tmp_path / "whole", ladder_values)
    make_sweeper(whole, ladder=LADDER).sweep(LRS)
    first_top = whole.runs().index("r1/s1_seed0")

    cut = FakeLauncher(tmp_path / "cut", ladder_values, interrupt_after=first_top + 2)
    with pytest.raises(SystemExit, match="130"):
        make_sweeper(cut, ladder=LADDER).sweep(LRS)
    killed = tmp_path / "cut" / cut.runs()[-1]  # a top run killed before its summary
    (killed / "summary.json").unlink()

    with pytest.raises(SweepError, match="resume=true"):
        make_sweeper(FakeLauncher(tmp_path / "cut"), ladder=LADDER).sweep(LRS)
    with pytest.raises(SweepError, match="holds another multi-fidelity race"):
        make_sweeper(FakeLauncher(tmp_path / "cut"), resume=True, ladder=["iterations=0.25"]).sweep(
            LRS
        )
    with pytest.raises(SweepError, match="holds a multi-fidelity race"):
        make_sweeper(FakeLauncher(tmp_path / "cut"), resume=True).sweep(LRS)
    again = FakeLauncher(tmp_path / "cut", ladder_values)
    make_sweeper(again, resume=True, ladder=LADDER).sweep([*LRS, "resume=true"])
    assert again.runs()[0] == killed.relative_to(tmp_path / "cut").as_posix()
    assert set(cut.runs()[:-1]).isdisjoint(again.runs())  # the cheap rung is read, not rerun
    assert sorted(cut.runs()[:-1] + again.runs()) == sorted(whole.runs())
    assert json.loads((tmp_path / "cut" / VERDICT).read_text()) == json.loads(
        (tmp_path / "whole" / VERDICT).read_text()
    )


def test_a_plain_race_directory_is_not_climbed(tmp_path: Path) -> None:
    make_sweeper(FakeLauncher(tmp_path), max_seeds=3).sweep(LRS)
    with pytest.raises(SweepError, match="race without a ladder"):
        make_sweeper(FakeLauncher(tmp_path), resume=True, ladder=LADDER).sweep(LRS)


def test_grail_report_groups_a_ladder_by_fidelity_and_transfers_each_rung_to_the_top(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    make_sweeper(FakeLauncher(tmp_path, ladder_values), ladder=LADDER).sweep(LRS)
    assert report_main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "fidelity iterations=0.5" in out and "fidelity full" in out
    assert "transfer: fidelity iterations=0.5 -> full" in out
    with (tmp_path / "stats.csv").open() as f:
        rows = list(csv.DictReader(f))
    # one label per setting at every fidelity: the rung's train.iterations=1 is not in it
    # (the report's verdicts are the real judge's, not the race's fake one)
    assert [(r["fidelity"], r["setting"], r["n_seeds"]) for r in rows] == [
        ("iterations=0.5", "train.lr=0.02", "6"),
        ("iterations=0.5", "train.lr=0.005", "6"),
        ("iterations=0.5", "train.lr=0.001", "3"),
        ("full", "train.lr=0.005", "4"),
        ("full", "train.lr=0.02", "4"),
    ]
    assert rows[0]["outcome"] == rows[3]["outcome"] == "best"
    with (tmp_path / "transfer_0.csv").open() as f:
        transfer = {r["setting"]: r for r in csv.DictReader(f)}
    assert set(transfer) == {"train.lr=0.001", "train.lr=0.005", "train.lr=0.02"}
    assert (tmp_path / "transfer_0.png").is_file()


# ---- through grail-train ------------------------------------------------------------------------


def test_a_real_ladder_through_grail_train(tmp_path: Path) -> None:
    """Two settings, two seeds, a rung at half the iterations under real training: each
    run's config records its fidelity, and a promoted setting's top run continues its cheap run
    to the metrics a fresh run has."""
    result = grail_train(
        "-m",
        "hydra/sweeper=grail_race",
        "train.lr=1e-3,5e-3",
        "hydra.sweeper.initial_seeds=2",
        "hydra.sweeper.max_seeds=2",
        'hydra.sweeper.ladder=["iterations=1/2"]',
        "train.iterations=2",
        *TINY_RUN,
        "eval.interval=2",  # the cheap run's last eval (iteration 0) is not one of the top's
        f"hydra.sweep.dir={tmp_path}",
        timeout=300,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert verdict["ladder"] == ["iterations=1/2", "full"] and verdict["runs"] >= 6
    for run in sorted((tmp_path / "r0").glob("s*_seed*")):
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        assert config["fidelity"] == "iterations=1/2" and config["train"]["iterations"] == 1
        summary = json.loads((run / "summary.json").read_text())
        assert summary["config"]["fidelity"] == "iterations=1/2"
    top = sorted((tmp_path / "r1").glob("s*_seed*"))
    assert top, "no setting promoted"
    for run in top:
        config = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
        assert config["fidelity"] == "full" and config["train"]["iterations"] == 2
        assert "fidelity='full'" in yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
        # it continued the cheap rung's run of its setting and seed: one part there, one here
        parts = json.loads((run / "summary.json").read_text())["parts"]
        assert [p["first_iteration"] for p in parts] == [0, 1], parts
    assert f"{top[0]} continues {tmp_path / 'r0' / top[0].name}" in out
    cheap = json.loads((tmp_path / "r0" / top[0].name / "summary.json").read_text())
    assert cheap["status"] == "completed" and cheap["iterations"] == 1  # left as it was

    # and its metrics are a fresh two-iteration run's, bitwise (the cheap run's last eval gone)
    overrides = yaml.safe_load((top[0] / ".hydra" / "overrides.yaml").read_text())
    fresh = tmp_path / "fresh"
    result = grail_train(*overrides, f"hydra.run.dir={fresh}", timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert fingerprint.run_metrics(top[0]) == fingerprint.run_metrics(fresh)
