"""Settings compared over seeds: the statistics table, its captions and its CSV files."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grail.report.load import RunReport
from grail.report.table import _STATUS_STYLE, _num
from grail.study.runs import (
    natural_key,
)
from grail.study.stats import (
    ALPHA,
    CI_METHOD,
    CONFIDENCE,
    DEFAULT_TEST,
    TESTS,
    WILCOXON_MIN_SEEDS,
    SeedRun,
    SettingStats,
    group_by_setting,
    seed_run,
    summarize,
)

METRIC_HELP = {
    "final": "held-out success rate at the last eval",
    "best": "highest held-out success rate after training started",
    "auc": "area under the eval curve: mean success rate over the evals after training started",
}


def seed_runs(runs: Sequence[RunReport]) -> list[SeedRun]:
    """The runs as `grail.study.stats` sees them."""
    return [seed_run(r.name, r.overrides, r.status, r.evals, r.error) for r in runs]


def seed_stats(
    runs: Sequence[RunReport], metric: str, test: str = DEFAULT_TEST
) -> tuple[dict[str, list[SeedRun]], list[SettingStats]]:
    """Runs grouped by setting (overrides minus seed), and each setting's statistics, best first,
    each compared with the best by the paired `test` (a key of grail.study.stats.TESTS)."""
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
