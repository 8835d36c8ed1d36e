"""Statistics over seeds in grail-report: the pure functions on hand-made numbers, then the CLI on
synthetic sweeps written like real runs."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest
from helpers.run_dirs import eval_record, make_run
from scipy import stats as scipy_stats

from grail.report.cli import main
from grail.study.stats import (
    Interval,
    SeedRun,
    group_by_setting,
    mean_curve,
    metric_of,
    paired_tie,
    seed_of,
    summarize,
    t_interval,
)

# ---- pure statistics ----------------------------------------------------------------------------


def test_t_interval_matches_a_hand_computation() -> None:
    values = [0.2, 0.4, 0.6]  # mean 0.4, sample sd 0.2, sem 0.2 / sqrt(3)
    t = 4.302652729911275  # t_{0.975, 2}, from statistical tables
    got = t_interval(values)
    half = t * 0.2 / math.sqrt(3)
    assert got.n == 3
    assert got.mean == pytest.approx(0.4)
    assert got.lo == pytest.approx(0.4 - half)
    assert got.hi == pytest.approx(0.4 + half)
    # and against scipy's own interval routine
    lo, hi = scipy_stats.t.interval(0.95, 2, loc=0.4, scale=scipy_stats.sem(values))
    assert (got.lo, got.hi) == pytest.approx((lo, hi))


def test_t_interval_without_spread_or_values() -> None:
    assert t_interval([0.5]) == Interval(1, 0.5, None, None)  # one seed: no interval ("n/a")
    assert t_interval([]) == Interval(0, None, None, None)
    flat = t_interval([0.3, 0.3, 0.3])
    assert flat.lo == pytest.approx(0.3) and flat.hi == pytest.approx(0.3)


def _evals(*points: tuple[int, float]) -> list[dict[str, Any]]:
    return [eval_record(i, s, s) for i, s in points]


def test_metric_of_excludes_the_baseline() -> None:
    evals = _evals((-1, 0.9), (1, 0.2), (3, 0.6), (5, 0.4))
    assert metric_of(evals, "final") == pytest.approx(0.4)
    assert metric_of(evals, "best") == pytest.approx(0.6)  # not the baseline's 0.9
    assert metric_of(evals, "auc") == pytest.approx((0.2 + 0.6 + 0.4) / 3)
    assert metric_of(_evals((-1, 0.5)), "auc") is None  # only a baseline
    with pytest.raises(ValueError, match="unknown metric"):
        metric_of(evals, "median")


def test_grouping_drops_the_seed_and_labels_by_what_differs() -> None:
    runs = [
        ["train.lr=1e-3", "seed=0", "env=copy"],
        ["seed=1", "train.lr=1e-3", "env=copy"],
        ["train.lr=3e-3", "seed=0", "env=copy"],
        ["train.lr=3e-3", "env=copy"],  # no seed override: its own (default) seed
        ["train.lr=3e-3", "env=copy", "resume=true", "seed=1"],
    ]
    groups = group_by_setting(runs, lambda r: r)
    assert list(groups) == ["train.lr=1e-3", "train.lr=3e-3"]
    assert len(groups["train.lr=1e-3"]) == 2
    assert [seed_of(r) for r in groups["train.lr=3e-3"]] == ["0", "default", "1"]
    assert list(group_by_setting([["seed=0"], ["seed=1"]], lambda r: r)) == ["(defaults)"]


def test_paired_tie_agrees_with_scipy_and_handles_degenerate_cases() -> None:
    best = {str(s): 0.5 + 0.01 * s for s in range(6)}
    worse = {str(s): v - 0.1 - 0.001 * i for i, (s, v) in enumerate(best.items())}
    tie = paired_tie(best, worse, test="wilcoxon")
    expected = scipy_stats.wilcoxon(list(best.values()), list(worse.values())).pvalue
    assert tie.p == pytest.approx(expected)
    assert tie.p == pytest.approx(2 / 2**6)  # exact: every difference has the same sign
    assert not tie.tied and tie.n_shared == 6

    five = {k: best[k] for k in list(best)[:5]}
    # 5 shared seeds: p >= 0.0625, cannot be separated
    tie5 = paired_tie(five, worse, test="wilcoxon")
    assert tie5.p == pytest.approx(0.0625) and tie5.tied

    same = paired_tie(best, dict(best))
    assert same.tied and same.p == 1.0 and "identical" in same.reason

    one = paired_tie(best, {"0": 0.0, "99": 1.0})
    assert one.tied and one.p is None and one.reason.startswith("n/a")


def test_paired_t_test_matches_its_closed_form_and_separates_few_seeds() -> None:
    # differences 0.05, 0.1, 0.05: mean 1/15, sd 0.05/sqrt(3), t = 4 with 2 degrees of freedom,
    # where the two-sided p is exactly 1 - t / sqrt(t^2 + 2)
    best, other = {"0": 0.5, "1": 0.6, "2": 0.7}, {"0": 0.45, "1": 0.5, "2": 0.65}
    tie = paired_tie(best, other)  # the default test
    assert tie.test == "t" and tie.n_shared == 3
    assert tie.p == pytest.approx(1 - 4 / math.sqrt(18))
    assert tie.p == pytest.approx(scipy_stats.ttest_rel([0.5, 0.6, 0.7], [0.45, 0.5, 0.65]).pvalue)
    assert tie.tied  # 0.057 >= 0.05
    # the same setting worse by 0.3 on each of 3 seeds: Wilcoxon cannot tell (p = 0.25), t can
    worse = {k: v - 0.3 - 0.01 * int(k) for k, v in best.items()}
    assert paired_tie(best, worse, test="wilcoxon").tied
    assert not paired_tie(best, worse).tied
    # no spread in the differences: a consistent difference, p = 0
    assert paired_tie(best, {k: v - 0.1 for k, v in best.items()}).p == 0.0
    with pytest.raises(ValueError, match="unknown test"):
        paired_tie(best, other, test="bootstrap")


def test_summarize_ranks_by_mean_and_only_counts_completed_runs() -> None:
    def run(seed: int, status: str, auc: float | None) -> SeedRun:
        return SeedRun(f"r{seed}", [f"seed={seed}"], status, auc=auc)

    groups = {
        "a": [run(0, "done", 0.2), run(1, "done", 0.4), run(2, "failed", 0.9)],
        "b": [run(0, "done", 0.6), run(1, "done", 0.7), run(2, "incomplete", 0.0)],
        "c": [run(0, "failed", None)],
    }
    a, b, c = sorted(summarize(groups, "auc"), key=lambda s: s.label)
    ranked = summarize(groups, "auc")
    assert [s.label for s in ranked] == ["b", "a", "c"]
    assert ranked[0].is_best and ranked[0].tie is None
    assert (b.n, b.interval.mean, b.failed, b.incomplete) == (2, pytest.approx(0.65), 0, 1)
    assert (a.n, a.interval.mean, a.failed) == (2, pytest.approx(0.3), 1)
    # differences 0.4 and 0.3: paired t = 7 with 1 degree of freedom, p = 1 - 2 atan(7) / pi
    assert a.tie is not None and a.tie.n_shared == 2 and a.tie.tied
    assert a.tie.p == pytest.approx(1 - 2 * math.atan(7) / math.pi)
    assert c.n == 0 and c.rank == 0 and c.interval.mean is None


def test_mean_curve_per_version() -> None:
    points = mean_curve([[(0, 0.0), (2, 0.4)], [(0, 0.2), (2, 0.6)], [(0, 0.1)]])
    assert [p.version for p in points] == [0, 2]
    assert points[0].interval.mean == pytest.approx(0.1) and points[0].interval.n == 3
    assert points[1].interval.mean == pytest.approx(0.5)


# ---- the CLI on run directories -----------------------------------------------------------------


def _run(
    root: Path, job: int, overrides: list[str], level: float, *, completed: bool = True
) -> None:
    """4 iterations, evals after 2 and 4: success `level` then `level` + 0.1."""
    make_run(
        root / str(job),
        overrides,
        iterations=4,
        done=4 if completed else 2,
        success=lambda i: min(1.0, level + 0.1 * (i // 2 - 1)),
        completed=completed,
    )


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_report_over_seeds_with_failed_and_incomplete_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    job = 0
    for lr, base in (("1e-3", 0.2), ("3e-3", 0.5)):
        for seed in range(3):
            _run(sweep, job, [f"train.lr={lr}", f"seed={seed}"], base + 0.05 * seed)
            job += 1
    _run(sweep, job, ["train.lr=1e-3", "seed=3"], 0.9, completed=False)  # incomplete
    failed = make_run(sweep / str(job + 1), ["train.lr=3e-3", "seed=3"], iterations=4, done=4)
    (failed / "summary.json").write_text(
        '{"status": "failed", "error": {"type": "RuntimeError", "message": "CUDA OOM"}}'
    )

    out = tmp_path / "out"
    stats_csv, runs_csv, png = out / "stats.csv", out / "runs.csv", out / "curves.png"
    argv = [str(sweep), "--out", str(out), "--metric", "final", "--csv", str(stats_csv)]
    argv += ["--test", "wilcoxon"]
    assert main([*argv, "--runs-csv", str(runs_csv), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "95% CI: Student t over seeds" in text
    assert "Wilcoxon signed-rank over shared seeds" in text
    assert "0.0625" in text  # few seeds: the caption says why nothing can be separated
    assert "not in the statistics (2 runs)" in text
    assert "CUDA OOM" in text
    assert png.stat().st_size > 0

    rows = {r["setting"]: r for r in _read_csv(stats_csv)}
    hi, lo = rows["train.lr=3e-3"], rows["train.lr=1e-3"]
    assert hi["rank"] == "1" and hi["tied_with_best"] == "best"
    assert (hi["n"], hi["failed"], hi["incomplete"]) == ("3", "1", "0")
    assert (lo["n"], lo["failed"], lo["incomplete"]) == ("3", "0", "1")
    # final = success after 4 iterations = level + 0.1; mean over seeds 0, 1, 2
    assert float(hi["mean"]) == pytest.approx(0.6 + 0.05)
    assert float(lo["mean"]) == pytest.approx(0.3 + 0.05)
    assert float(hi["ci_lo"]) < float(hi["mean"]) < float(hi["ci_hi"])
    assert lo["tied_with_best"] == "True"  # 3 seeds: Wilcoxon p = 0.25
    assert float(lo["p_vs_best"]) == pytest.approx(0.25)
    assert hi["seeds"] == "0 1 2"  # the incomplete and failed seeds excluded

    runs = _read_csv(runs_csv)
    assert len(runs) == 8
    states = {(r["setting"], r["seed"]): r["status"] for r in runs}
    assert states[("train.lr=1e-3", "3")] == "incomplete"
    assert states[("train.lr=3e-3", "3")] == "failed"
    first = next(r for r in runs if r["run"] == "0")
    assert float(first["auc"]) == pytest.approx((0.2 + 0.3) / 2)
    assert float(first["best"]) == pytest.approx(0.3)


def test_six_seeds_separate_a_clearly_better_setting_and_equal_ones_tie(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    levels = {"a": 0.6, "b": 0.6, "c": 0.3}  # a and b identical on every seed; c worse
    job = 0
    for name, base in levels.items():
        for seed in range(6):
            _run(sweep, job, [f"+tag={name}", f"seed={seed}"], base + 0.02 * seed)
            job += 1
    stats_csv = tmp_path / "stats.csv"
    argv = [str(sweep), "--out", str(tmp_path), "--csv", str(stats_csv), "--test", "wilcoxon"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "metric auc" in text  # the default
    assert "Wilcoxon signed-rank over shared seeds" in text
    assert "0.0625" not in text  # 6 shared seeds: the caption on few seeds is not needed

    rows = {r["setting"]: r for r in _read_csv(stats_csv)}
    assert {r["metric"] for r in rows.values()} == {"auc"}
    best = rows["+tag=a"] if rows["+tag=a"]["rank"] == "1" else rows["+tag=b"]
    other = rows["+tag=b"] if best is rows["+tag=a"] else rows["+tag=a"]
    assert best["tied_with_best"] == "best"
    assert other["tied_with_best"] == "True" and float(other["p_vs_best"]) == 1.0
    worse = rows["+tag=c"]
    assert worse["rank"] == "3" and worse["tied_with_best"] == "False"
    # the same p as scipy on the same numbers: auc = level + 0.05 for each seed
    a_auc = [0.6 + 0.02 * s + 0.05 for s in range(6)]
    c_auc = [0.3 + 0.02 * s + 0.05 for s in range(6)]
    assert float(worse["p_vs_best"]) == pytest.approx(scipy_stats.wilcoxon(a_auc, c_auc).pvalue)
    assert float(worse["p_vs_best"]) < 0.05


def test_plain_report_without_seeds_shows_no_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path / "sweep", 0, ["train.lr=1e-3"], 0.2)
    _run(tmp_path / "sweep", 1, ["train.lr=3e-3"], 0.4)
    assert main([str(tmp_path / "sweep")]) == 0
    assert "statistics over seeds" not in capsys.readouterr().out
    assert main([str(tmp_path / "sweep"), "--metric", "best"]) == 0
    text = capsys.readouterr().out
    assert "statistics over seeds" in text and "n/a" in text  # one seed each: no interval
