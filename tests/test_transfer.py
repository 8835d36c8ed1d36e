"""Transfer verdicts (grail/study/transfer.py, `grail-report CHEAP --transfer EXPENSIVE`): the cheap
study's best judged among the expensive runs, the settings' rank agreement with its interval, and
the files written; on run directories written by the test (no training)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from helpers.run_dirs import make_run

from grail.report.cli import main as report_main
from grail.report.load import load_runs
from grail.report.seeds import seed_stats
from grail.report.transfer import fidelity_names
from grail.study.transfer import Transfer, transfer
from grail.study.verdicts import Outcome

LRS = ("1e-3", "5e-3", "2e-2")
SEEDS = range(6)


def _study(root: Path, means: dict[str, float], fixed: list[str]) -> Path:
    """A grid over LRS x SEEDS whose final success is the setting's mean plus a seed's wobble."""
    for i, lr in enumerate(LRS):
        for seed in SEEDS:
            value = means[lr] + 0.02 * ((seed * 7 + i * 3) % 5 - 2)
            make_run(
                root / f"{i}_{seed}",
                [*fixed, f"train.lr={lr}", f"seed={seed}"],
                iterations=4,
                done=4,
                success=lambda _, v=value: v,
                completed=True,
            )
    return root


def _transfer(cheap: Path, expensive: Path) -> tuple[Transfer, tuple[str, str]]:
    cheap_runs, expensive_runs = load_runs(cheap), load_runs(expensive)
    result = transfer(seed_stats(cheap_runs, "final")[1], seed_stats(expensive_runs, "final")[1])
    return result, fidelity_names(cheap_runs, expensive_runs)


def test_a_cheap_answer_that_holds_is_best_there_with_the_same_order(tmp_path: Path) -> None:
    cheap = _study(
        tmp_path / "cheap", {"1e-3": 0.2, "5e-3": 0.5, "2e-2": 0.3}, ["train.iterations=67"]
    )
    expensive = _study(tmp_path / "full", {"1e-3": 0.4, "5e-3": 0.9, "2e-2": 0.6}, [])
    result, names = _transfer(cheap, expensive)
    assert names == ("train.iterations=67", "(defaults)")
    assert result.cheap_best == "train.lr=5e-3" and result.outcome is Outcome.BEST
    assert result.tau == pytest.approx(1.0) and result.shared == 3
    lo, hi = result.tau_interval
    assert -1.0 <= lo <= hi <= 1.0 and hi == pytest.approx(1.0)


def test_a_cheap_answer_that_does_not_hold_is_worse_there_and_the_order_reversed(
    tmp_path: Path,
) -> None:
    cheap = _study(tmp_path / "cheap", {"1e-3": 0.2, "5e-3": 0.5, "2e-2": 0.3}, ["model=tiny"])
    expensive = _study(tmp_path / "full", {"1e-3": 0.9, "5e-3": 0.2, "2e-2": 0.6}, ["model=wide"])
    result, names = _transfer(cheap, expensive)
    assert names == ("model=tiny", "model=wide")
    assert result.cheap_best == "train.lr=5e-3" and result.outcome is Outcome.WORSE
    assert result.tau == pytest.approx(-1.0)
    assert result.tau_interval is not None and result.tau_interval[1] < 0


def test_the_command_prints_the_table_and_writes_csv_and_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cheap = _study(
        tmp_path / "cheap", {"1e-3": 0.2, "5e-3": 0.5, "2e-2": 0.3}, ["train.iterations=67"]
    )
    expensive = _study(tmp_path / "full", {"1e-3": 0.4, "5e-3": 0.9, "2e-2": 0.6}, [])
    out = tmp_path / "out"
    out.mkdir()
    assert (
        report_main(
            [str(cheap), "--transfer", str(expensive), "--metric", "final", "--out", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "transfer — metric final: train.iterations=67 → (defaults)" in printed
    assert "the cheap study's best, train.lr=5e-3, is best at the expensive fidelity" in printed
    assert "Kendall's tau +1.00 over 3 settings" in printed
    rows = list(csv.DictReader((out / "transfer.csv").open()))
    assert [r["setting"] for r in rows] == ["train.lr=5e-3", "train.lr=2e-2", "train.lr=1e-3"]
    assert [r["cheap_best"] for r in rows] == ["True", "False", "False"]
    assert (out / "transfer.png").stat().st_size > 0


def test_the_same_studies_give_the_same_interval(tmp_path: Path) -> None:
    cheap = _study(
        tmp_path / "cheap", {"1e-3": 0.3, "5e-3": 0.35, "2e-2": 0.32}, ["train.iterations=67"]
    )
    expensive = _study(tmp_path / "full", {"1e-3": 0.5, "5e-3": 0.52, "2e-2": 0.49}, [])
    first, _ = _transfer(cheap, expensive)
    again, _ = _transfer(cheap, expensive)
    assert first.tau_interval == again.tau_interval
