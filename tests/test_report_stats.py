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
from grail.report.plots import seed_curves
from grail.study.stats import (
    Interval,
    SeedRun,
    censored_value,
    group_by_setting,
    mean_curve,
    metric_of,
    seed_of,
    summarize,
    t_interval,
)
from grail.study.verdicts import Outcome, VerdictSettings, kl_interval

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


def test_summarize_ranks_by_verdict_and_counts_pruned_seeds_censored() -> None:
    def run(seed: int, status: str, auc: float | None, final: float | None = None) -> SeedRun:
        return SeedRun(f"r{seed}", [f"seed={seed}"], status, final=final, auc=auc)

    groups = {
        "a": [run(0, "done", 0.2), run(1, "done", 0.4), run(2, "failed", 0.9)],
        # seed 2 pruned: its auc over the evals it had (0.8) capped at its last eval (0.3)
        "b": [run(0, "done", 0.6), run(1, "done", 0.7), run(2, "pruned", 0.8, final=0.3)],
        "c": [run(0, "failed", None), run(1, "incomplete", 0.9)],
    }
    ranked = summarize(groups, "auc")
    assert [s.label for s in ranked] == ["b", "a", "c"]
    b, a, c = ranked
    assert b.is_best and b.verdict is not None and b.verdict.outcome is Outcome.BEST
    # the pruned seed counts, censored: b is not scored on its survivors alone
    assert b.values_by_seed == {"0": 0.6, "1": 0.7, "2": 0.3} and b.censored == {"2"}
    assert (b.n, b.n_censored, b.pruned, b.interval.mean) == (3, 1, 1, pytest.approx(1.6 / 3))
    assert (b.interval.lo, b.interval.hi) == pytest.approx(kl_interval([0.6, 0.7, 0.3]))
    assert (a.n, a.interval.mean, a.failed, a.n_censored) == (2, pytest.approx(0.3), 1, 0)
    assert a.verdict is not None and a.verdict.outcome is Outcome.NOT_SEPARATED
    assert a.verdict.n_shared == 2 and a.verdict.effect == pytest.approx(-0.35)
    assert c.n == 0 and c.rank == 0 and c.verdict is None and c.interval.mean is None
    # a later completed run of a pruned seed replaces it
    resumed = summarize({"b": [*groups["b"], run(2, "done", 0.75)]}, "auc")[0]
    assert resumed.values_by_seed["2"] == 0.75 and resumed.n_censored == 0


def test_censored_value_is_at_most_the_success_where_it_stopped() -> None:
    pruned = SeedRun("p", ["seed=0"], "pruned", final=0.2, best=0.6, auc=0.4)
    assert censored_value(pruned, "auc") == 0.2
    assert censored_value(pruned, "best") == 0.2
    assert censored_value(pruned, "final") == 0.2
    low = SeedRun("q", ["seed=0"], "pruned", final=0.5, best=0.5, auc=0.1)
    assert censored_value(low, "auc") == 0.1
    assert censored_value(SeedRun("r", ["seed=0"], "pruned"), "auc") is None


def test_seed_curves_hold_a_pruned_seed_at_its_last_eval() -> None:
    done = SeedRun("d", ["seed=0"], "done", auc=0.5, curve=[(0, 0.0), (2, 0.4), (4, 0.8)])
    pruned = SeedRun("p", ["seed=1"], "pruned", auc=0.1, final=0.1, curve=[(0, 0.0), (2, 0.1)])
    failed = SeedRun("f", ["seed=2"], "failed", curve=[(0, 0.0), (2, 0.9)])
    [stats] = summarize({"x": [done, pruned, failed]}, "auc")
    curves = {r.name: curve for r, curve in seed_curves(stats)}
    assert set(curves) == {"d", "p"}  # a failed run is not counted
    assert curves["p"] == [(0, 0.0), (2, 0.1), (4, 0.1)]
    points = mean_curve(list(curves.values()))
    assert points[-1].interval.mean == pytest.approx(0.45)


def test_mean_curve_per_version_with_the_verdicts_interval() -> None:
    points = mean_curve([[(0, 0.0), (2, 0.4)], [(0, 0.2), (2, 0.6)], [(0, 0.1)]])
    assert [p.version for p in points] == [0, 2]
    assert points[0].interval.mean == pytest.approx(0.1) and points[0].interval.n == 3
    assert points[1].interval.mean == pytest.approx(0.5)
    assert (points[1].interval.lo, points[1].interval.hi) == pytest.approx(kl_interval([0.4, 0.6]))
    for p in points:  # inside [0, 1]: nothing for a plot to clip
        assert p.interval.lo is not None and p.interval.hi is not None
        assert 0.0 <= p.interval.lo <= p.interval.hi <= 1.0
    unbounded = mean_curve([[(0, 5.0)], [(0, 7.0)]], VerdictSettings(bounds=None))
    assert unbounded[0].interval.lo is not None and unbounded[0].interval.lo < 5.0


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
    assert main([*argv, "--runs-csv", str(runs_csv), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "95% CI: Chernoff-Hoeffding (KL) interval" in text
    assert "Holm over all pairs of settings" in text and "needs >= 3 shared seeds" in text
    assert "worse p=0 (-0.300)" in text  # lost by 0.3 on each of 3 seeds
    assert "not in the statistics (2 runs)" in text
    assert "CUDA OOM" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    rows = {r["setting"]: r for r in _read_csv(stats_csv)}
    hi, lo = rows["train.lr=3e-3"], rows["train.lr=1e-3"]
    assert hi["rank"] == "1" and hi["outcome"] == "best" and hi["p"] == hi["effect"] == ""
    assert (hi["n_seeds"], hi["n_censored"], hi["failed"], hi["incomplete"]) == ("3", "0", "1", "0")
    assert (lo["n_seeds"], lo["failed"], lo["incomplete"]) == ("3", "0", "1")
    # final = success after 4 iterations = level + 0.1; mean over seeds 0, 1, 2
    assert float(hi["mean"]) == pytest.approx(0.6 + 0.05)
    assert float(lo["mean"]) == pytest.approx(0.3 + 0.05)
    assert 0.0 <= float(hi["ci_lo"]) < float(hi["mean"]) < float(hi["ci_hi"]) <= 1.0
    assert lo["outcome"] == "worse" and float(lo["p"]) == 0.0
    assert float(lo["effect"]) == pytest.approx(-0.3) and lo["seeds_to_separate"] == ""
    assert hi["seeds"] == "0 1 2"  # the incomplete and failed seeds excluded

    runs = _read_csv(runs_csv)
    assert len(runs) == 8
    states = {(r["setting"], r["seed"]): r["status"] for r in runs}
    assert states[("train.lr=1e-3", "3")] == "incomplete"
    assert states[("train.lr=3e-3", "3")] == "failed"
    first = next(r for r in runs if r["run"] == "0")
    assert float(first["auc"]) == pytest.approx((0.2 + 0.3) / 2)
    assert float(first["best"]) == pytest.approx(0.3)


def test_a_study_where_nothing_learnt_says_so_with_no_best(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every run 0.000 on every eval: the table said "best" and "equivalent"; now every verdict
    and the caption say that nothing was learnt, and no setting is ranked."""
    sweep = tmp_path / "sweep"
    for job, (lr, seed) in enumerate((lr, seed) for lr in ("1e-3", "5e-3") for seed in range(4)):
        overrides = [f"train.lr={lr}", f"seed={seed}"]
        make_run(
            sweep / str(job), overrides, iterations=4, done=4, success=lambda i: 0.0, completed=True
        )
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "NOTHING LEARNT: every run of every setting has auc 0" in text
    assert text.count("nothing learnt: 0 on every seed") == 2
    assert "│ best" not in text and "equivalent within" not in text
    rows = _read_csv(tmp_path / "stats.csv")
    assert [(r["outcome"], r["rank"], r["p"]) for r in rows] == [("nothing_learnt", "", "")] * 2


def test_six_seeds_separate_a_worse_setting_and_equal_ones_are_equivalent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sweep = tmp_path / "sweep"
    levels = {"a": 0.6, "b": 0.6, "c": 0.3}  # a and b identical on every seed; c worse
    job = 0
    for name, base in levels.items():
        for seed in range(6):
            noise = 0.02 * seed + (0.01 if name == "c" and seed % 2 else 0.0)
            _run(sweep, job, [f"+tag={name}", f"seed={seed}"], base + noise)
            job += 1
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "metric auc" in text  # the default
    assert "equivalent within 0.02 (+0.000)" in text

    rows = {r["setting"]: r for r in _read_csv(tmp_path / "stats.csv")}  # written by default
    assert {r["metric"] for r in rows.values()} == {"auc"}
    assert [rows[k]["outcome"] for k in ("+tag=a", "+tag=b")] == ["best", "equivalent"]
    worse = rows["+tag=c"]
    assert worse["rank"] == "3" and worse["outcome"] == "worse"
    # Holm over the 3 pairs: c has the smallest p of the two comparisons, times 3
    a_auc = [0.6 + 0.02 * s + 0.05 for s in range(6)]
    c_auc = [0.3 + 0.02 * s + 0.01 * (s % 2) + 0.05 for s in range(6)]
    expected = 3 * scipy_stats.ttest_rel(c_auc, a_auc).pvalue
    assert float(worse["p"]) == pytest.approx(expected) and float(worse["p"]) < 0.05
    assert int(worse["n_shared"]) == 6

    # a zero margin: a and b can never be shown equivalent, nor apart
    assert main([str(sweep), "--out", str(tmp_path), "--delta", "0"]) == 0
    text = capsys.readouterr().out
    assert "not within 0 to call equivalent" in text
    assert _read_csv(tmp_path / "stats.csv")[1]["outcome"] == "not_separated"


def test_the_issues_grid_is_not_separated_yet_with_an_estimate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    finals = {"1e-3": [0.016, 0.016, 0.031], "5e-3": [1.0, 0.996, 1.0], "2e-2": [0.273, 0.824, 0]}
    job = 0
    for lr, values in finals.items():
        for seed, v in enumerate(values):
            make_run(
                tmp_path / "sweep" / str(job),
                [f"train.lr={lr}", f"seed={seed}"],
                iterations=2,
                done=2,
                success=lambda i, v=v: v,
                completed=True,
            )
            job += 1
    assert main([str(tmp_path / "sweep"), "--metric", "final"]) == 0
    text = capsys.readouterr().out
    assert "not separated yet (-0.633): ~4 more seeds" in text  # 2e-2
    assert "not separated yet (-0.978): ~1 more seed" in text  # 1e-3: 3 settings need 4 seeds
    rows = _read_csv(tmp_path / "sweep" / "stats.csv")
    assert [r["setting"] for r in rows] == ["train.lr=5e-3", "train.lr=2e-2", "train.lr=1e-3"]
    for r in rows:  # inside [0, 1], unlike the old [-0.677, 1.409]
        assert 0.0 <= float(r["ci_lo"]) <= float(r["ci_hi"]) <= 1.0


def test_bad_verdict_options_are_named(tmp_path: Path) -> None:
    _run(tmp_path / "sweep", 0, ["seed=0"], 0.2)
    with pytest.raises(SystemExit):
        main([str(tmp_path / "sweep"), "--alpha", "1.5"])
    with pytest.raises(SystemExit):
        main([str(tmp_path / "sweep"), "--delta", "-1"])


def test_plain_report_without_seeds_shows_no_statistics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path / "sweep", 0, ["train.lr=1e-3"], 0.2)
    _run(tmp_path / "sweep", 1, ["train.lr=3e-3"], 0.4)
    assert main([str(tmp_path / "sweep")]) == 0
    assert "statistics over seeds" not in capsys.readouterr().out
    assert not (tmp_path / "sweep" / "stats.csv").exists()
    assert main([str(tmp_path / "sweep"), "--metric", "best"]) == 0
    text = capsys.readouterr().out
    # one seed each: an interval all the same (valid for any distribution), but no test
    assert "statistics over seeds" in text and "0 shared seeds, a test needs 2" not in text
    assert "1 shared seeds, a test needs 2" in text


def test_a_seed_run_twice_counts_once_and_the_table_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 28: a resumed search ran each of its 2 settings twice on seeds 0 and 1; the report
    showed n=2 beside 4 finished runs, without a word on the other 2."""
    sweep = tmp_path / "sweep"
    for job, (lr, seed) in enumerate(
        (lr, seed) for _ in range(2) for lr in ("1e-3", "3e-3") for seed in (0, 1)
    ):
        _run(sweep, job, [f"train.lr={lr}", f"seed={seed}"], 0.2 + 0.1 * seed)
    csv_path = tmp_path / "stats.csv"
    assert main([str(sweep), "--out", str(tmp_path), "--csv", str(csv_path)]) == 0
    text = capsys.readouterr().out
    assert "repeated 2" in text and "each seed counts once in n" in text
    rows = {r["setting"]: r for r in _read_csv(csv_path)}
    for row in rows.values():
        assert (row["n_seeds"], row["done"], row["repeated"]) == ("2", "4", "2")
