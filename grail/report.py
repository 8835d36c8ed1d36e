"""`grail-report <sweep or run dir>`: compare the runs of a sweep at a glance.

    uv run grail-report multirun/2026-11-21/10-30-45 [--sort-by best_success] [--out DIR]

prints a table of every run (its distinguishing overrides, status, final and best eval, the train
reward's trend, time), and writes `summary.csv` (the same table, full precision) and `report.png`
(one panel per key metric over training, one line per run) into DIR (default: the directory given).

It reads only what runs write (`.hydra/overrides.yaml`, `metrics/*.json`, `summary.json`), each
file atomically, so it works on a sweep that is still running and on runs that failed or were
killed: a run is "done" (summary says completed), "failed" (summary says failed, with the error),
"pruned" (stopped early by the pruner, grail/prune.py: its metrics up to there are shown, and it is
left out of the statistics over seeds, listed apart), or "incomplete" (no summary yet: still
running, or killed; `resume=true` continues it).

The x axis of every panel is the policy version, i.e. the number of updates applied: train metrics
of iteration i were measured on rollouts of version i, the eval after iteration i is version i + 1,
and the baseline eval is version 0. So a point always sits at the weights it measured.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grail.records import SUMMARY, atomic_write_text, metric_records, read_json
from grail.report_plots import PLOT_PANELS, grid_of, heatmap_path, plot, plot_heatmap, plot_seeds
from grail.report_stats import (
    ALPHA,
    CI_METHOD,
    CONFIDENCE,
    DEFAULT_SEED,
    DEFAULT_TEST,
    METRICS,
    TESTS,
    WILCOXON_MIN_SEEDS,
    SeedRun,
    SettingStats,
    group_by_setting,
    seed_of,
    seed_run,
    summarize,
)
from grail.runs import (
    distinguishing_overrides,
    find_runs,
    natural_key,
    read_config,
    read_overrides,
    run_status,
)

SPARK = "▁▂▃▄▅▆▇█"
CSV_NAME = "summary.csv"
PNG_NAME = "report.png"


@dataclass
class RunReport:
    """One run, reduced to what the table, the CSV and the plot show."""

    name: str
    path: Path
    overrides: list[str]
    status: str  # done | failed | pruned | incomplete
    error: str | None
    iterations: int  # train iterations with metrics
    target_iterations: int | None  # train.iterations of its config
    baseline: dict[str, Any] | None  # eval before training
    final: dict[str, Any] | None  # newest eval after training started
    best_success: dict[str, Any] | None  # trained eval with the highest success rate
    best_reward: dict[str, Any] | None  # trained eval with the highest mean reward
    train_rewards: list[float]
    time_s: float | None  # training time summed over attempts (see load_run)
    wall_time_s: float | None  # the last attempt's wall time, from its summary
    # metric name -> [(policy version, value)], for the plot
    series: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    evals: list[dict[str, Any]] = field(default_factory=list)  # its eval records, baseline first
    label: str = ""

    def value(self, key: str) -> float | None:
        """A sortable number for `key` (see SORT_KEYS); None when the run has none yet."""
        return SORT_KEYS[key][0](self)


def _get(record: dict[str, Any] | None, key: str) -> float | None:
    if record is None:
        return None
    value = record.get(key)
    return float(value) if isinstance(value, int | float) else None


def _first_last_gain(r: RunReport) -> float | None:
    return r.train_rewards[-1] - r.train_rewards[0] if len(r.train_rewards) >= 2 else None


# name -> (value of a run, higher is better)
SORT_KEYS: dict[str, tuple[Callable[[RunReport], float | None], bool]] = {
    "final_success": (lambda r: _get(r.final, "success_rate"), True),
    "best_success": (lambda r: _get(r.best_success, "success_rate"), True),
    "final_reward": (lambda r: _get(r.final, "reward_mean"), True),
    "best_reward": (lambda r: _get(r.best_reward, "reward_mean"), True),
    "train_reward": (lambda r: r.train_rewards[-1] if r.train_rewards else None, True),
    "reward_gain": (_first_last_gain, True),
    "iterations": (lambda r: float(r.iterations), True),
    "time": (lambda r: r.time_s, False),
}
# ---- reading ------------------------------------------------------------------------------------


def load_run(run_dir: Path, name: str) -> RunReport:
    """Everything the report shows about one run directory, whatever state it is in."""
    status = run_status(run_dir)
    trains = metric_records(run_dir, "train")
    evals = metric_records(run_dir, "eval")
    trained = [e for e in evals if e["iteration"] >= 0]
    baseline = next((e for e in evals if e["iteration"] == -1), None)
    # Time spent training (iterations, their evals and checkpoints, plus the baseline eval) summed
    # over every attempt: comparable between runs whatever their start-up cost or number of
    # resumes, and defined for runs still going. The last attempt's wall time is in the CSV.
    spent = [_get(t.get("timings"), "iteration_s") for t in trains] + [_get(baseline, "eval_s")]
    known = [s for s in spent if s is not None]
    summary = read_json(run_dir / SUMMARY)
    target = read_config(run_dir).get("train", {}).get("iterations")

    series: dict[str, list[tuple[int, float]]] = {name: [] for name, _ in PLOT_PANELS}
    for e in evals:  # version = updates applied before this eval
        version = e["iteration"] + 1
        for key, metric in (("eval_success", "success_rate"), ("eval_reward", "reward_mean")):
            if (v := _get(e, metric)) is not None:
                series[key].append((version, v))
    for t in trains:  # rollouts and loss of iteration i come from version i
        for key, metric in (("train_reward", "reward_mean"), ("kl", "kl"), ("entropy", "entropy")):
            if (v := _get(t, metric)) is not None and math.isfinite(v):
                series[key].append((t["iteration"], v))

    return RunReport(
        name=name,
        path=run_dir,
        overrides=read_overrides(run_dir),
        status=status.status,
        error=status.error,
        iterations=len(trains),
        target_iterations=target if isinstance(target, int) else None,
        baseline=baseline,
        final=trained[-1] if trained else None,
        best_success=max(trained, key=lambda e: (e["success_rate"], e["iteration"]))
        if trained
        else None,
        best_reward=max(trained, key=lambda e: (e["reward_mean"], e["iteration"]))
        if trained
        else None,
        train_rewards=[v for _, v in series["train_reward"]],
        time_s=sum(known) if known else None,
        wall_time_s=_get(summary, "wall_time_s"),
        series=series,
        evals=evals,
    )


def load_runs(root: Path) -> list[RunReport]:
    """Every run under `root` (or `root` itself), labelled by what sets it apart."""
    root = Path(root)
    paths = find_runs(root)
    runs = [load_run(p, p.relative_to(root).as_posix() if p != root else p.name) for p in paths]
    for run, label in zip(runs, distinguishing_overrides([r.overrides for r in runs]), strict=True):
        run.label = " ".join(label)
    return runs


# ---- pure presentation ------------------------------------------------------------------------


def sparkline(values: Sequence[float], width: int = 16) -> str:
    """Values as block characters, lowest ▁ to highest █; longer series are averaged into `width`
    buckets. A flat series is drawn mid-height."""
    if not values:
        return ""
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [
            sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:], strict=False) if b > a
        ]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(values)
    top = len(SPARK) - 1
    return "".join(SPARK[round((v - lo) / (hi - lo) * top)] for v in values)


def sort_runs(runs: list[RunReport], key: str, reverse: bool = False) -> list[RunReport]:
    """Best first by `key` (highest, or lowest for time); runs without a value last, in name
    order. `reverse` flips the order of the runs that have a value."""
    if key == "name":
        return sorted(runs, key=lambda r: natural_key(r.name), reverse=reverse)
    if key not in SORT_KEYS:
        raise ValueError(f"unknown sort key {key!r}; known: name, {', '.join(SORT_KEYS)}")
    higher_is_better = SORT_KEYS[key][1]
    have = [r for r in runs if r.value(key) is not None]
    missing = sorted((r for r in runs if r.value(key) is None), key=lambda r: natural_key(r.name))
    # Stable sorts: ties keep name order whichever way the values go.
    have.sort(key=lambda r: natural_key(r.name))
    have.sort(key=lambda r: r.value(key), reverse=higher_is_better != reverse)  # type: ignore[arg-type,return-value]
    return have + missing


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m"


def _num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _at(record: dict[str, Any] | None, key: str) -> str:
    value = _get(record, key)
    return "–" if value is None or record is None else f"{value:.3f} @{record['iteration']}"


def trend(rewards: Sequence[float]) -> str:
    if not rewards:
        return "–"
    return f"{rewards[0]:.3f}→{rewards[-1]:.3f} {sparkline(rewards)}"


_STATUS_STYLE = {"done": "green", "failed": "red", "pruned": "magenta", "incomplete": "yellow"}


def build_table(runs: Sequence[RunReport], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("run", no_wrap=True)
    table.add_column("overrides")
    table.add_column("status", no_wrap=True)
    table.add_column("iters", justify="right", no_wrap=True)
    table.add_column("final success", justify="right")
    table.add_column("best success", justify="right")
    table.add_column("final reward", justify="right")
    table.add_column("best reward", justify="right")
    table.add_column("train reward first→last", no_wrap=True)
    table.add_column("train time", justify="right", no_wrap=True)
    for r in runs:
        target = f"/{r.target_iterations}" if r.target_iterations is not None else ""
        table.add_row(
            escape(r.name),
            escape(r.label or "–"),
            f"[{_STATUS_STYLE[r.status]}]{r.status}[/]",
            f"{r.iterations}{target}",
            _num(_get(r.final, "success_rate")),
            _at(r.best_success, "success_rate"),
            _num(_get(r.final, "reward_mean")),
            _at(r.best_reward, "reward_mean"),
            trend(r.train_rewards),
            format_duration(r.time_s),
        )
    return table


CSV_COLUMNS = (
    "run",
    "overrides",
    "label",
    "status",
    "iterations",
    "target_iterations",
    "baseline_success",
    "baseline_reward",
    "final_iteration",
    "final_success",
    "final_reward",
    "best_success_iteration",
    "best_success",
    "best_reward_iteration",
    "best_reward",
    "first_train_reward",
    "last_train_reward",
    "time_s",
    "wall_time_s",
    "error",
    "path",
)


def csv_row(r: RunReport) -> dict[str, Any]:
    def iteration(record: dict[str, Any] | None) -> int | None:
        return None if record is None else record["iteration"]

    return {
        "run": r.name,
        "overrides": " ".join(r.overrides),
        "label": r.label,
        "status": r.status,
        "iterations": r.iterations,
        "target_iterations": r.target_iterations,
        "baseline_success": _get(r.baseline, "success_rate"),
        "baseline_reward": _get(r.baseline, "reward_mean"),
        "final_iteration": iteration(r.final),
        "final_success": _get(r.final, "success_rate"),
        "final_reward": _get(r.final, "reward_mean"),
        "best_success_iteration": iteration(r.best_success),
        "best_success": _get(r.best_success, "success_rate"),
        "best_reward_iteration": iteration(r.best_reward),
        "best_reward": _get(r.best_reward, "reward_mean"),
        "first_train_reward": r.train_rewards[0] if r.train_rewards else None,
        "last_train_reward": r.train_rewards[-1] if r.train_rewards else None,
        "time_s": r.time_s,
        "wall_time_s": r.wall_time_s,
        "error": r.error,
        "path": str(r.path),
    }


def write_csv(runs: Sequence[RunReport], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in runs:
            writer.writerow({k: "" if v is None else v for k, v in csv_row(r).items()})


# ---- statistics over seeds --------------------------------------------------------------------

METRIC_HELP = {
    "final": "held-out success rate at the last eval",
    "best": "highest held-out success rate after training started",
    "auc": "area under the eval curve: mean success rate over the evals after training started",
}


def seed_runs(runs: Sequence[RunReport]) -> list[SeedRun]:
    """The runs as `grail.report_stats` sees them."""
    return [seed_run(r.name, r.overrides, r.status, r.evals, r.error) for r in runs]


def seed_stats(
    runs: Sequence[RunReport], metric: str, test: str = DEFAULT_TEST
) -> tuple[dict[str, list[SeedRun]], list[SettingStats]]:
    """Runs grouped by setting (overrides minus seed), and each setting's statistics, best first,
    each compared with the best by the paired `test` (a key of grail.report_stats.TESTS)."""
    in_order = sorted(runs, key=lambda r: natural_key(r.name))  # seeds in job order
    groups = group_by_setting(seed_runs(in_order), lambda r: r.overrides)
    return groups, summarize(groups, metric, test)


def _ci(s: SettingStats) -> str:
    if s.interval.lo is None or s.interval.hi is None:
        return "n/a"
    return f"[{s.interval.lo:.3f}, {s.interval.hi:.3f}]"


def _vs_best(s: SettingStats) -> str:
    if s.is_best:
        return "[bold]best[/]"
    if s.tie is None:
        return "–"
    if s.tie.p is None:
        return f"[yellow]tied ({s.tie.reason})[/]"
    if s.tie.tied:
        return f"[cyan]tied[/] p={s.tie.p:.3g}"
    return f"worse p={s.tie.p:.3g}"


def stats_captions(stats: Sequence[SettingStats], metric: str) -> list[str]:
    """What the statistics table means: the metric, the interval's method, the test's."""
    tests = {TESTS[s.tie.test] for s in stats if s.tie is not None}
    lines = [
        f"metric {metric}: {METRIC_HELP[metric]}; only completed runs count.",
        f"{CONFIDENCE:.0%} CI: {CI_METHOD} (n/a with one seed).",
        f"tied with best: {', '.join(sorted(tests)) or TESTS[DEFAULT_TEST]}, two-sided, "
        f"p >= {ALPHA:g}; fewer than 2 shared seeds: n/a, counted as tied.",
    ]
    if any(s.pruned for s in stats):
        lines.append(
            "pruned runs (stopped early by the pruner) are not counted: a setting pruned on "
            "some seeds is averaged over the others only, which flatters it (see not counted)."
        )
    shared = [
        s.tie.n_shared
        for s in stats
        if s.tie is not None and s.tie.p is not None and s.tie.test == "wilcoxon"
    ]
    if any(n < WILCOXON_MIN_SEEDS for n in shared):
        lines.append(
            f"with fewer than {WILCOXON_MIN_SEEDS} shared seeds the smallest two-sided Wilcoxon "
            "p is 2/2^n (0.0625 with 5), so such settings cannot be told apart from the best "
            "(--test t can)."
        )
    return lines


def build_stats_table(stats: Sequence[SettingStats], metric: str, title: str) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        caption="\n".join(escape(line) for line in stats_captions(stats, metric)),
        caption_justify="left",
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("setting")
    table.add_column("n", justify="right", no_wrap=True)
    table.add_column(f"mean {metric}", justify="right", no_wrap=True)
    table.add_column(f"{CONFIDENCE:.0%} CI", justify="right", no_wrap=True)
    table.add_column("median", justify="right", no_wrap=True)
    table.add_column("min", justify="right", no_wrap=True)
    table.add_column("max", justify="right", no_wrap=True)
    table.add_column("vs best")
    table.add_column("not counted", no_wrap=True)
    for s in stats:
        left_out = [
            f"{k} {v}"
            for k, v in (("pruned", s.pruned), ("failed", s.failed), ("incomplete", s.incomplete))
            if v
        ]
        table.add_row(
            str(s.rank) if s.rank else "–",
            escape(s.label),
            str(s.n),
            _num(s.interval.mean),
            _ci(s),
            _num(s.median),
            _num(s.min),
            _num(s.max),
            _vs_best(s),
            ", ".join(left_out) or "–",
        )
    return table


STATS_CSV_COLUMNS = (
    "rank",
    "setting",
    "metric",
    "n",
    "mean",
    "ci_lo",
    "ci_hi",
    "median",
    "min",
    "max",
    "p_vs_best",
    "tied_with_best",
    "tie_reason",
    "done",
    "pruned",
    "failed",
    "incomplete",
    "seeds",
)
RUNS_CSV_COLUMNS = ("setting", "seed", "status", "final", "best", "auc", "run", "error")


def _csv_text(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def stats_csv_text(stats: Sequence[SettingStats]) -> str:
    """One row per setting (best first); confidence bounds empty with one seed, p empty for the
    best setting and where no test could be made."""
    rows = []
    for s in stats:
        rows.append(
            {
                "rank": s.rank or None,
                "setting": s.label,
                "metric": s.metric,
                "n": s.n,
                "mean": s.interval.mean,
                "ci_lo": s.interval.lo,
                "ci_hi": s.interval.hi,
                "median": s.median,
                "min": s.min,
                "max": s.max,
                "p_vs_best": s.tie.p if s.tie else None,
                "tied_with_best": "best" if s.is_best else (s.tie.tied if s.tie else None),
                "tie_reason": s.tie.reason if s.tie else None,
                "done": s.done,
                "pruned": s.pruned,
                "failed": s.failed,
                "incomplete": s.incomplete,
                "seeds": " ".join(sorted(s.values_by_seed, key=natural_key)),
            }
        )
    return _csv_text(STATS_CSV_COLUMNS, rows)


def runs_csv_text(groups: dict[str, list[SeedRun]]) -> str:
    """One row per run: its setting, seed, status and the three metrics."""
    rows = [
        {
            "setting": label,
            "seed": r.seed,
            "status": r.status,
            "final": r.final,
            "best": r.best,
            "auc": r.auc,
            "run": r.name,
            "error": r.error.splitlines()[0] if r.error else None,
        }
        for label, runs in groups.items()
        for r in runs
    ]
    return _csv_text(RUNS_CSV_COLUMNS, rows)


def print_seed_stats(
    console: Console, groups: dict[str, list[SeedRun]], stats: Sequence[SettingStats], metric: str
) -> None:
    """The statistics table, then the runs it left out (pruned, failed, incomplete) by setting."""
    title = f"statistics over seeds ({len(stats)} settings) — metric {metric}"
    console.print(build_stats_table(stats, metric, title))
    left_out = [(label, r) for label, runs in groups.items() for r in runs if r.status != "done"]
    if left_out:
        console.print(f"not in the statistics ({len(left_out)} runs):")
        for label, r in left_out:
            style = _STATUS_STYLE[r.status]
            why = f": {escape(r.error.splitlines()[0])}" if r.error else ""
            console.print(
                f"  [{style}]{r.status}[/] {escape(r.name)} "
                f"({escape(label)}, seed {escape(r.seed)}){why}"
            )


# ---- command line -----------------------------------------------------------------------------


def _counts(runs: Sequence[RunReport]) -> str:
    parts = [f"{sum(r.status == s for r in runs)} {s}" for s in ("done", "failed", "incomplete")]
    if pruned := sum(r.status == "pruned" for r in runs):  # only in sweeps with pruning on
        parts.append(f"{pruned} pruned")
    return f"{len(runs)} runs: " + ", ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="grail-report",
        description="Compare the runs of a sweep (or look at one run): a table, summary.csv "
        "and report.png.",
    )
    parser.add_argument("path", type=Path, help="a sweep directory (multirun/DATE/TIME) or a run")
    parser.add_argument(
        "--sort-by",
        default="final_success",
        choices=["name", *SORT_KEYS],
        help="order of the table and CSV, best first (default: final_success)",
    )
    parser.add_argument("--reverse", action="store_true", help="worst first")
    parser.add_argument(
        "--out", type=Path, default=None, help="where summary.csv and report.png go (default: PATH)"
    )
    parser.add_argument(
        "--metric",
        choices=METRICS,
        default=None,
        help="statistics over seeds of this metric, per setting (overrides minus seed): "
        + "; ".join(f"{k}: {v}" for k, v in METRIC_HELP.items())
        + " (default: auc; shown whenever a run has a seed override or a statistics option "
        "is given)",
    )
    parser.add_argument(
        "--csv", type=Path, default=None, help="write the statistics over seeds, one row a setting"
    )
    parser.add_argument(
        "--runs-csv",
        type=Path,
        default=None,
        help="write one row a run: setting, seed, status, final, best, auc",
    )
    parser.add_argument(
        "--test",
        choices=list(TESTS),
        default=DEFAULT_TEST,
        help="the paired test over shared seeds that marks settings tied with the best: "
        + "; ".join(f"{k}: {v}" for k, v in TESTS.items())
        + f" (default: {DEFAULT_TEST}; Wilcoxon cannot separate anything below 6 seeds)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write learning curves per setting (mean over seeds, 95%% CI band) to this PNG; "
        "when exactly two keys are swept (e.g. train.lr x train.kl_coef), also a heat map of "
        "the metric's mean and CI per setting to PLOT_heatmap.png",
    )
    args = parser.parse_args(argv)

    root: Path = args.path
    if not root.is_dir():
        parser.error(f"{root} is not a directory")
    runs = load_runs(root)
    if not runs:
        parser.error(f"no runs under {root}: a run directory has .hydra/, metrics/ or summary.json")
    runs = sort_runs(runs, args.sort_by, args.reverse)
    out: Path = args.out if args.out is not None else root
    title = f"{root} — {_counts(runs)}"

    console = Console(width=None if sys.stdout.isatty() else 160)
    console.print(build_table(runs, title))
    for r in runs:
        if r.error:
            console.print(f"[red]{escape(r.name)} failed:[/] {escape(r.error.splitlines()[0])}")
    write_csv(runs, out / CSV_NAME)
    plot(runs, out / PNG_NAME, title)
    console.print(f"wrote {out / CSV_NAME} and {out / PNG_NAME}")

    wanted = any(x is not None for x in (args.metric, args.csv, args.runs_csv, args.plot))
    if wanted or any(seed_of(r.overrides) != DEFAULT_SEED for r in runs):
        metric: str = args.metric or "auc"
        groups, stats = seed_stats(runs, metric, args.test)
        console.print()
        print_seed_stats(console, groups, stats, metric)
        written = []
        if args.csv is not None:
            atomic_write_text(args.csv, stats_csv_text(stats))
            written.append(args.csv)
        if args.runs_csv is not None:
            atomic_write_text(args.runs_csv, runs_csv_text(groups))
            written.append(args.runs_csv)
        if args.plot is not None:
            plot_seeds(stats, args.plot, f"{root} — {metric} over seeds")
            written.append(args.plot)
            if (grid := grid_of(stats)) is not None:  # a 2-D study, e.g. train.lr x train.kl_coef
                plot_heatmap(grid, heatmap_path(args.plot), f"{root} — {metric} over seeds")
                written.append(heatmap_path(args.plot))
        if written:
            console.print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
