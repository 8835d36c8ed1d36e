"""`grail-report`: a table, summary.csv and report.png for a sweep in any state (finished, still
running, with failed and killed runs) or for a single run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from helpers.run_dirs import make_run, train_record, write_hydra

from grail.core.records import write_metrics, write_summary
from grail.report.cli import main
from grail.report.load import load_runs
from grail.report.table import sort_runs, sparkline


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """A 2 x 2 sweep caught mid-way: one run done, one failed after 3 iterations, one still
    running (metrics, no summary), one that has only just started (Hydra's files only)."""
    root = tmp_path / "multirun" / "2026-11-21" / "10-30-45"
    fixed = ["train.iterations=6", "eval.interval=2"]
    make_run(
        root / "0",
        [*fixed, "train.lr=1e-5", "train.kl_coef=0"],
        iterations=6,
        done=6,
        success=lambda i: 0.1 * i,
        completed=True,
        wall_time_s=125.0,
    )
    failed = make_run(
        root / "1", [*fixed, "train.lr=1e-4", "train.kl_coef=0"], iterations=6, done=3
    )
    try:
        raise FloatingPointError("loss is NaN at iteration 3")
    except FloatingPointError as exc:
        write_summary(failed, 40.0, error=exc, environment="copy_digits")
    make_run(
        root / "2",
        [*fixed, "train.lr=1e-5", "train.kl_coef=0.05"],
        iterations=6,
        done=4,
        success=lambda i: 0.2 * i,
    )
    write_hydra(root / "3", [*fixed, "train.lr=1e-4", "train.kl_coef=0.05"], 6)
    (root / ".submitit").mkdir()  # the submitit launcher's folder is not a run
    return root


def _by_name(runs):
    return {r.name: r for r in runs}


def test_every_run_gets_its_status_and_numbers(sweep: Path) -> None:
    runs = _by_name(load_runs(sweep))
    assert sorted(runs) == ["0", "1", "2", "3"]
    assert [runs[n].status for n in "0123"] == ["done", "failed", "incomplete", "incomplete"]
    # Labels keep what tells runs apart, not the settings the whole sweep shares.
    assert runs["0"].label == "train.lr=1e-5 train.kl_coef=0"
    assert runs["1"].error.startswith("FloatingPointError: loss is NaN at iteration 3")

    done = runs["0"]
    assert (done.iterations, done.target_iterations) == (6, 6)
    assert done.final["iteration"] == 5 and done.final["success_rate"] == pytest.approx(0.6)
    assert done.best_success["success_rate"] == pytest.approx(0.6)
    assert done.time_s == pytest.approx(6 * 1.0 + 2.0)  # iterations + baseline eval
    assert done.wall_time_s == 125.0  # the summary's
    assert done.train_rewards == pytest.approx([0.1 + 0.05 * i for i in range(6)])

    running = runs["2"]  # partial results: what has been written so far
    assert running.iterations == 4 and running.final["iteration"] == 3
    assert running.final["success_rate"] == pytest.approx(0.8)
    assert running.time_s == pytest.approx(4 * 1.0 + 2.0)  # iterations so far + baseline eval

    fresh = runs["3"]
    assert fresh.iterations == 0 and fresh.final is None and fresh.time_s is None
    assert running.wall_time_s is None and fresh.wall_time_s is None


def test_plot_series_sit_at_the_policy_version_they_measured(sweep: Path) -> None:
    run = _by_name(load_runs(sweep))["2"]
    # baseline eval = version 0; the eval after iteration 1 saw 2 updates
    assert [x for x, _ in run.series["eval_success"]] == [0, 2, 4]
    # train metrics of iteration i come from rollouts of version i
    assert [x for x, _ in run.series["train_reward"]] == [0, 1, 2, 3]
    assert run.series["kl"] == [(i, 0.01) for i in range(4)]


def test_sorting_puts_best_first_and_runs_without_the_metric_last(sweep: Path) -> None:
    runs = load_runs(sweep)
    assert [r.name for r in sort_runs(runs, "final_success")] == ["2", "0", "1", "3"]
    assert [r.name for r in sort_runs(runs, "final_success", reverse=True)] == ["1", "0", "2", "3"]
    # time: fastest first; the run with no time yet is last
    assert [r.name for r in sort_runs(runs, "time")] == ["1", "2", "0", "3"]
    with pytest.raises(ValueError, match="unknown sort key 'accuracy'"):
        sort_runs(runs, "accuracy")


def test_cli_writes_table_csv_and_png_for_a_partial_sweep(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report"
    assert main([str(sweep), "--sort-by", "best_success", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "4 runs: 1 done, 1 failed, 2 incomplete" in printed
    assert "train.lr=1e-4 train.kl_coef=0" in printed
    assert "1 failed: FloatingPointError: loss is NaN" in printed

    rows = list(csv.DictReader((out / "summary.csv").open()))
    assert [r["run"] for r in rows] == ["2", "0", "1", "3"]
    first = rows[0]
    assert first["status"] == "incomplete" and first["iterations"] == "4"
    assert float(first["best_success"]) == pytest.approx(0.8)
    assert (
        first["overrides"] == "train.iterations=6 eval.interval=2 train.lr=1e-5 train.kl_coef=0.05"
    )
    assert rows[2]["error"].startswith("FloatingPointError") and rows[3]["final_success"] == ""
    png = (out / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000


def test_report_on_a_single_run_directory(tmp_path: Path) -> None:
    run = make_run(
        tmp_path / "outputs" / "2026-11-21" / "09-00-00",
        ["train.lr=3e-4"],
        iterations=4,
        done=4,
        kl=None,  # kl_coef=0: the loop records no KL
        completed=True,
    )
    runs = load_runs(run)
    assert len(runs) == 1 and runs[0].label == "train.lr=3e-4" and runs[0].series["kl"] == []
    assert main([str(run)]) == 0  # defaults to writing beside the run
    assert (run / "summary.csv").is_file() and (run / "report.png").is_file()


def test_files_being_written_or_damaged_are_skipped(tmp_path: Path) -> None:
    run = make_run(tmp_path / "0", ["train.lr=1"], iterations=4, done=2)
    metrics = run / "metrics"
    # an atomic write in progress, and a file cut short by a full disk
    (metrics / ".train_iter_002.json.abc.tmp").write_text('{"iteration": 2, "rew')
    (metrics / "train_iter_003.json").write_text('{"iteration": 3, "rew')
    loaded = load_runs(tmp_path)[0]
    assert loaded.iterations == 2 and loaded.status == "incomplete"


def test_missing_or_empty_directory_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "nope")])
    assert exit_info.value.code == 2 and "is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path)])
    assert exit_info.value.code == 2 and "no runs under" in capsys.readouterr().err


def test_failure_summary_keeps_the_progress_made(tmp_path: Path) -> None:
    run = make_run(tmp_path / "r", [], iterations=6, done=3, eval_interval=2)
    try:
        raise RuntimeError("server died")
    except RuntimeError as exc:
        summary = write_summary(run, 12.5, error=exc, environment="copy_digits")
    stored = json.loads((run / "summary.json").read_text())
    assert stored == summary
    assert summary["status"] == "failed" and summary["iterations"] == 3
    assert summary["final_eval"]["iteration"] == 1 and summary["baseline_eval"]["iteration"] == -1
    assert summary["tokens"] == {"prompt": 300, "completion": 120}
    assert (
        summary["error"]["type"] == "RuntimeError" and "server died" in summary["error"]["message"]
    )
    assert "raise RuntimeError" in summary["error"]["traceback"]


def test_a_failed_summary_must_say_why(tmp_path: Path) -> None:
    import jsonschema

    summary = {
        "schema_version": 1,
        "status": "failed",
        "iterations": 0,
        "final_eval": None,
        "best_eval": None,
        "tokens": {"prompt": 0, "completion": 0},
        "wall_time_s": 1.0,
    }
    with pytest.raises(jsonschema.ValidationError, match="'error' is a required property"):
        write_metrics(tmp_path / "summary.json", summary, "summary")
    write_metrics(
        tmp_path / "summary.json", {**summary, "error": {"type": "E", "message": "m"}}, "summary"
    )


def test_sparkline() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    flat = sparkline([3.0, 3.0, 3.0])
    assert len(flat) == 3 and len(set(flat)) == 1 and flat[0] not in "▁█"  # no fake trend
    assert sparkline([]) == ""
    long = sparkline([float(i) for i in range(100)], width=10)
    assert len(long) == 10 and long[0] == "▁" and long[-1] == "█"
    assert sparkline([1.0, 0.0]) == "█▁"


def test_train_record_helper_matches_the_schema() -> None:
    # The fixtures above are only meaningful if they are what the loop writes.
    from grail.core.records import validate_metrics

    validate_metrics(train_record(0, 0.5), "train_iteration")
