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
    CI_METHOD,
    REPORT_SETTINGS,
    SeedRun,
    SettingStats,
    group_by_setting,
    seed_run,
    summarize,
)
from grail.study.verdicts import Outcome, VerdictSettings, min_seeds_to_decide

METRIC_HELP = {
    "final": "held-out success rate at the last eval",
    "best": "highest held-out success rate after training started",
    "auc": "area under the eval curve: mean success rate over the evals after training started",
}


def seed_runs(runs: Sequence[RunReport]) -> list[SeedRun]:
    """The runs as `grail.study.stats` sees them."""
    return [seed_run(r.name, r.overrides, r.status, r.evals, r.error) for r in runs]


def seed_stats(
    runs: Sequence[RunReport], metric: str, settings: VerdictSettings = REPORT_SETTINGS
) -> tuple[dict[str, list[SeedRun]], list[SettingStats]]:
    """Runs grouped by setting (overrides minus seed), and each setting's statistics and verdict
    against the best (grail.study.verdicts), best first."""
    in_order = sorted(runs, key=lambda r: natural_key(r.name))  # seeds in job order
    groups = group_by_setting(seed_runs(in_order), lambda r: r.overrides)
    return groups, summarize(groups, metric, settings)


def _ci(s: SettingStats) -> str:
    if s.interval.lo is None or s.interval.hi is None:
        return "n/a"
    return f"[{s.interval.lo:.3f}, {s.interval.hi:.3f}]"


def verdict_text(s: SettingStats, settings: VerdictSettings = REPORT_SETTINGS) -> str:
    """The verdict as the table words it, e.g. "worse p=0.003 (-0.97)", "not separated yet: ~5
    more seeds", "equivalent within 0.02"; "–" for a setting without values."""
    v = s.verdict
    if v is None:
        return "–"
    if v.outcome is Outcome.NOTHING_LEARNT:
        return "nothing learnt: 0 on every seed"
    if v.outcome is Outcome.BEST:
        return "best"
    if v.outcome is Outcome.WORSE:
        return f"worse p={v.p:.2g} ({v.effect:+.3f})"
    if v.outcome is Outcome.EQUIVALENT:
        return f"equivalent within {settings.delta:g} ({v.effect:+.3f})"
    if v.n_shared < 2:
        return f"not separated yet: {v.n_shared} shared seeds, a test needs 2"
    if v.seeds_to_separate is not None:
        more = v.seeds_to_separate - v.n_shared
        return f"not separated yet ({v.effect:+.3f}): ~{more} more seed{'s' if more != 1 else ''}"
    if v.seeds_to_equivalence is not None:
        more = v.seeds_to_equivalence - v.n_shared
        return (
            f"not separated ({v.effect:+.3f} ~ 0): equivalence within {settings.delta:g} "
            f"needs ~{more} more seeds"
        )
    return (
        f"not separated ({v.effect:+.3f}): too small for its spread to separate, "
        f"not within {settings.delta:g} to call equivalent"
    )


def stats_captions(
    stats: Sequence[SettingStats], metric: str, settings: VerdictSettings = REPORT_SETTINGS
) -> list[str]:
    """What the statistics table means: the metric, the interval's method, the verdicts'."""
    n_min = min_seeds_to_decide(len([s for s in stats if s.verdict]), settings.alpha)
    lines = [
        f"metric {metric}: {METRIC_HELP[metric]}.",
        f"{settings.confidence:.0%} CI: {CI_METHOD}.",
        f"verdict vs best, paired over shared seeds: worse = paired t, two-sided, Holm over all "
        f"pairs of settings, p <= {settings.alpha:g} (effect: mean difference); equivalent = "
        f"TOST within +-{settings.delta:g}; either needs >= {n_min} shared seeds with this many "
        f"settings; not separated yet: estimated seeds more to separate it, at "
        f"{settings.power:.0%} power.",
    ]
    if any(s.verdict and s.verdict.outcome is Outcome.NOTHING_LEARNT for s in stats):
        lines.insert(
            0,
            f"NOTHING LEARNT: every run of every setting has {metric} 0 (no held-out problem "
            "solved after training started), so no setting is best and none is equivalent: the "
            "runs cannot tell the settings apart. Train longer (train.iterations) or try other "
            "values.",
        )
    if any(s.repeated for s in stats):
        lines.append(
            "repeated: runs of a seed their setting already had (the same experiment again, not "
            "another replicate): each seed counts once in n, with its last run."
        )
    if any(s.pruned for s in stats):
        lines.append(
            "pruned runs count, censored: with their value where the pruner stopped them, at most "
            "their success rate there (column censored)."
        )
    return lines


def build_stats_table(
    stats: Sequence[SettingStats],
    metric: str,
    title: str,
    settings: VerdictSettings = REPORT_SETTINGS,
) -> Table:
    table = Table(
        title=title,
        title_justify="left",
        caption="\n".join(escape(line) for line in stats_captions(stats, metric, settings)),
        caption_justify="left",
    )
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("setting")
    table.add_column("n", justify="right", no_wrap=True)
    table.add_column("censored", justify="right", no_wrap=True)
    table.add_column(f"mean {metric}", justify="right", no_wrap=True)
    table.add_column(f"{settings.confidence:.0%} CI", justify="right", no_wrap=True)
    table.add_column("median", justify="right", no_wrap=True)
    table.add_column("min", justify="right", no_wrap=True)
    table.add_column("max", justify="right", no_wrap=True)
    table.add_column("verdict vs best")
    table.add_column("not counted", no_wrap=True)
    for s in stats:
        left_out = [
            f"{k} {v}"
            for k, v in (
                ("failed", s.failed),
                ("incomplete", s.incomplete),
                ("repeated", s.repeated),
            )
            if v
        ]
        table.add_row(
            str(s.rank) if s.rank else "–",
            escape(s.label),
            str(s.n),
            str(s.n_censored) if s.n_censored else "–",
            _num(s.interval.mean),
            _ci(s),
            _num(s.median),
            _num(s.min),
            _num(s.max),
            escape(verdict_text(s, settings)),
            ", ".join(left_out) or "–",
        )
    return table


STATS_CSV_NAME = "stats.csv"  # beside summary.csv
STATS_CSV_COLUMNS = (
    "rank",
    "setting",
    "metric",
    "outcome",
    "n_seeds",
    "n_censored",
    "mean",
    "ci_lo",
    "ci_hi",
    "p",
    "effect",
    "seeds_to_separate",
    "seeds_to_equivalence",
    "n_shared",
    "median",
    "min",
    "max",
    "done",
    "pruned",
    "failed",
    "incomplete",
    "repeated",
    "seeds",
    "censored_seeds",
)


# Runs the statistics leave out: failed ones, and those without a summary yet (running or killed).
LEFT_OUT = ("failed", "incomplete")

RUNS_CSV_COLUMNS = ("setting", "seed", "status", "final", "best", "auc", "run", "error")


def csv_text(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return buffer.getvalue()


def stats_csv_text(stats: Sequence[SettingStats]) -> str:
    """One row per setting (best first): its verdict (outcome, Holm-adjusted p and effect against
    the best, seeds to separate), n and censored seeds, mean and interval; p and effect empty for
    the best, seeds_to_separate empty unless not separated."""
    return csv_text(STATS_CSV_COLUMNS, stats_csv_rows(stats))


def stats_csv_rows(stats: Sequence[SettingStats]) -> list[dict[str, Any]]:
    """stats_csv_text's rows."""
    rows = []
    for s in stats:
        v = s.verdict
        rows.append(
            {
                "rank": s.rank or None,
                "setting": s.label,
                "metric": s.metric,
                "outcome": v.outcome.value if v else None,
                "n_seeds": s.n,
                "n_censored": s.n_censored,
                "mean": s.interval.mean,
                "ci_lo": s.interval.lo,
                "ci_hi": s.interval.hi,
                "p": v.p if v else None,
                "effect": v.effect if v else None,
                "seeds_to_separate": v.seeds_to_separate if v else None,
                "seeds_to_equivalence": v.seeds_to_equivalence if v else None,
                "n_shared": v.n_shared if v and v.outcome is not Outcome.BEST else None,
                "median": s.median,
                "min": s.min,
                "max": s.max,
                "done": s.done,
                "pruned": s.pruned,
                "failed": s.failed,
                "incomplete": s.incomplete,
                "repeated": s.repeated,
                "seeds": " ".join(sorted(s.values_by_seed, key=natural_key)),
                "censored_seeds": " ".join(sorted(s.censored, key=natural_key)),
            }
        )
    return rows


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
    return csv_text(RUNS_CSV_COLUMNS, rows)


def print_seed_stats(
    console: Console,
    groups: dict[str, list[SeedRun]],
    stats: Sequence[SettingStats],
    metric: str,
    settings: VerdictSettings = REPORT_SETTINGS,
) -> None:
    """The statistics table, then the runs it left out (failed, incomplete) by setting."""
    title = f"statistics over seeds ({len(stats)} settings) — metric {metric}"
    console.print(build_stats_table(stats, metric, title, settings))
    left_out = [(label, r) for label, runs in groups.items() for r in runs if r.status in LEFT_OUT]
    if left_out:
        console.print(f"not in the statistics ({len(left_out)} runs):")
        for label, r in left_out:
            style = _STATUS_STYLE[r.status]
            why = f": {escape(r.error.splitlines()[0])}" if r.error else ""
            console.print(
                f"  [{style}]{r.status}[/] {escape(r.name)} "
                f"({escape(label)}, seed {escape(r.seed)}){why}"
            )
