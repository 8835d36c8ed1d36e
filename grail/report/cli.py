"""`grail-report <sweep or run dir>`: compare the runs of a sweep at a glance.

    uv run grail-report multirun/2026-11-21/10-30-45 [--sort-by best_success] [--out DIR]

prints a table of every run (its distinguishing overrides, status, final and best eval, the train
reward's trend, time), and writes `summary.csv` (the same table, full precision) and `report.png`
(one panel per key metric over training, one line per run) into DIR (default: the directory given).

When the runs have seeds (or a statistics option is given), it adds the statistics over seeds:
per setting (overrides minus seed) n, mean, an interval inside [0, 1] and a verdict against the
best (best / worse / not separated yet / equivalent; nothing learnt, for every setting, when
every run is at 0: grail/study/verdicts.py), written to
`stats.csv` beside summary.csv (or `--csv PATH`).

`--html [PATH]` also writes all of it as one self-contained page (default OUT/report.html;
grail/report/html.py), the one a race rewrites after every run.

A multi-fidelity race (runs with a `fidelity=`, grail/study/ladder.py) is reported per fidelity:
the statistics of each (stats.csv gets a `fidelity` column), then each cheaper fidelity's transfer
to the top one (`transfer_<k>.csv` and `.png`, as `--transfer` words it); --runs-csv, --plot and
the page show the top fidelity.

It reads only what runs write (`.hydra/overrides.yaml`, `metrics/*.json`, `summary.json`), each
file atomically, so it works on a sweep that is still running and on runs that failed or were
killed: a run is "done" (summary says completed), "failed" (summary says failed, with the error),
"pruned" (stopped early by the pruner, grail/study/prune.py: its metrics up to there are shown, and
it counts in the statistics over seeds as censored, at its value where it stopped), or
"incomplete" (no summary yet: still running, or killed; `resume=true` continues it).

The x axis of every panel is the policy version, i.e. the number of updates applied: train metrics
of iteration i were measured on rollouts of version i, the eval after iteration i is version i + 1,
and the baseline eval is version 0. So a point always sits at the weights it measured.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from grail.core.records import atomic_write_text
from grail.report.fidelity import by_fidelity, report_fidelities
from grail.report.html import REPORT_HTML, write_report
from grail.report.load import SORT_KEYS, RunReport, load_runs
from grail.report.plots import grid_of, heatmap_path, plot, plot_heatmap, plot_seeds
from grail.report.seeds import (
    METRIC_HELP,
    STATS_CSV_NAME,
    print_seed_stats,
    runs_csv_text,
    seed_stats,
    stats_csv_text,
)
from grail.report.table import CSV_NAME, build_table, sort_runs, write_csv
from grail.report.transfer import fidelity_names, report_transfer
from grail.study.stats import DEFAULT_SEED, METRICS, REPORT_SETTINGS, SettingStats, seed_of
from grail.study.transfer import transfer
from grail.study.verdicts import VerdictSettings

PNG_NAME = "report.png"


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
        "--csv",
        type=Path,
        default=None,
        help="where the statistics over seeds go, one row a setting "
        f"(default: OUT/{STATS_CSV_NAME})",
    )
    parser.add_argument(
        "--runs-csv",
        type=Path,
        default=None,
        help="write one row a run: setting, seed, status, final, best, auc",
    )
    parser.add_argument(
        "--alpha",
        type=float,
        default=REPORT_SETTINGS.alpha,
        help="error rate of the verdicts: of calling any setting worse than the best when it is "
        f"not (Holm over all pairs), and of each equivalence (default: {REPORT_SETTINGS.alpha:g})",
    )
    parser.add_argument(
        "--delta",
        type=float,
        default=REPORT_SETTINGS.delta,
        help="equivalence margin in the metric's units: a setting shown within +-DELTA of the "
        f"best is 'equivalent' (default: {REPORT_SETTINGS.delta:g})",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="write learning curves per setting (each seed thin, the mean over seeds bold with "
        "the table's interval as its band) to this PNG; "
        "when exactly two keys are swept (e.g. train.lr x train.kl_coef), also a heat map of "
        "the metric's mean and CI per setting to PLOT_heatmap.png",
    )
    parser.add_argument(
        "--html",
        type=Path,
        nargs="?",
        const=True,  # `--html` alone: OUT/report.html
        default=None,
        help="write the study as one self-contained HTML page (tables with what each statistic "
        "means, the learning curves, a race's rounds, a search's trials), to this path "
        f"(default: OUT/{REPORT_HTML})",
    )
    parser.add_argument(
        "--transfer",
        type=Path,
        default=None,
        metavar="EXPENSIVE",
        help="PATH is a cheap study (fewer iterations, a smaller model, LoRA...); EXPENSIVE the "
        "same settings at the expensive fidelity: say whether the cheap best holds there (its "
        "verdict among the expensive runs, paired by seed) and how well the settings' order "
        "agrees (Kendall's tau, bootstrap interval over seeds); writes transfer.csv and "
        "transfer.png",
    )
    args = parser.parse_args(argv)
    try:
        settings = VerdictSettings(
            alpha=args.alpha, delta=args.delta, bounds=REPORT_SETTINGS.bounds
        )
    except ValueError as e:
        parser.error(str(e).replace("VerdictSettings.", "--"))

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

    stats: list[SettingStats] | None = None  # the HTML page shows them when the table does
    options = (args.metric, args.csv, args.runs_csv, args.plot)
    wanted = any(x is not None for x in options) or settings != REPORT_SETTINGS
    # a multi-fidelity race: its statistics per fidelity, and each cheaper one's transfer to the top
    fidelities = by_fidelity(runs, root)
    if fidelities or wanted or any(seed_of(r.overrides) != DEFAULT_SEED for r in runs):
        metric: str = args.metric or "auc"
        stats_csv: Path = args.csv if args.csv is not None else out / STATS_CSV_NAME
        if fidelities:
            written = report_fidelities(console, fidelities, metric, settings, out, stats_csv)
            # --runs-csv, --plot and the page: the top fidelity's, the study's verdict
            groups, stats = seed_stats(fidelities[-1][1], metric, settings)
        else:
            groups, stats = seed_stats(runs, metric, settings)
            console.print()
            print_seed_stats(console, groups, stats, metric, settings)
            atomic_write_text(stats_csv, stats_csv_text(stats))
            written = [stats_csv]
        if args.runs_csv is not None:
            atomic_write_text(args.runs_csv, runs_csv_text(groups))
            written.append(args.runs_csv)
        if args.plot is not None:
            plot_seeds(stats, args.plot, f"{root} — {metric} over seeds", settings)
            written.append(args.plot)
            if (grid := grid_of(stats)) is not None:  # a 2-D study, e.g. train.lr x train.kl_coef
                plot_heatmap(grid, heatmap_path(args.plot), f"{root} — {metric} over seeds")
                written.append(heatmap_path(args.plot))
        console.print("wrote " + ", ".join(str(p) for p in written))
    if args.transfer is not None:
        metric = args.metric or "auc"
        expensive = load_runs(args.transfer) if args.transfer.is_dir() else []
        if not expensive:
            parser.error(f"--transfer {args.transfer}: no runs there")
        cheap_stats = stats if stats is not None else seed_stats(runs, metric, settings)[1]
        result = transfer(cheap_stats, seed_stats(expensive, metric, settings)[1])
        console.print()
        written = report_transfer(
            console, result, metric, fidelity_names(runs, expensive), out, settings
        )
        console.print("wrote " + ", ".join(str(p) for p in written))
    if args.html is not None:
        html_path: Path = out / REPORT_HTML if args.html is True else args.html
        write_report(root, html_path, runs=runs, stats=stats, settings=settings)
        console.print(f"wrote {html_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
