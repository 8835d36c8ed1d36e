"""One study on the default task, run twice: without pruning and with it. What pruning saved, and
whether it changed the answer.

    uv run python benchmarks/study.py                               # 3 lr x 2 kl_coef x 5 seeds
    uv run python benchmarks/study.py --lrs 2e-3,5e-3 --kl-coefs 0 --seeds 3 train.iterations=60
    uv run python benchmarks/study.py --out-dir outputs/study   # keep both sweeps

Each study is one `grail-train -m train.lr=... train.kl_coef=... seed=...` (Hydra's basic
launcher: one run after another, so wall times are comparable), the second with `+prune=<pruner>`
added. Prints, for each: runs completed and pruned, iterations trained, wall time, grail-report's
statistics table (ranked by --metric, verdicts of grail/study/verdicts.py); then
whether both name the same best setting and the same set of settings tied with it, and the
compute pruning saved. Writes benchmarks/results/study.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import print_table, run_worker, write_results
from rich.console import Console

from grail.core.records import METRICS_DIR
from grail.report.load import load_runs
from grail.report.seeds import seed_stats
from grail.study.stats import METRICS, SettingStats
from grail.study.verdicts import Outcome


@dataclass(frozen=True)
class StudyOutcome:
    """What one study cost and concluded."""

    name: str
    runs: int
    statuses: dict[str, int]  # status -> runs
    iterations_trained: int  # train metrics files written, over every run
    wall_s: float
    best: str | None  # label of the best setting
    tied: frozenset[str]  # settings not shown worse than the best (best included)
    stats: list[SettingStats]


def tied_set(stats: Sequence[SettingStats]) -> frozenset[str]:
    """The best setting and every setting the report does not call worse than it (not separated
    yet, or equivalent)."""
    return frozenset(
        s.label for s in stats if s.verdict is not None and s.verdict.outcome is not Outcome.WORSE
    )


def iterations_trained(sweep_dir: Path) -> int:
    """Iterations the study trained: one train metrics file per iteration of every run."""
    return sum(1 for _ in sweep_dir.glob(f"*/{METRICS_DIR}/train_iter_*.json"))


def outcome(name: str, sweep_dir: Path, wall_s: float, metric: str) -> StudyOutcome:
    runs = load_runs(sweep_dir)
    _, stats = seed_stats(runs, metric)
    statuses: dict[str, int] = {}
    for r in runs:
        statuses[r.status] = statuses.get(r.status, 0) + 1
    best = next((s.label for s in stats if s.is_best), None)
    return StudyOutcome(
        name=name,
        runs=len(runs),
        statuses=statuses,
        iterations_trained=iterations_trained(sweep_dir),
        wall_s=wall_s,
        best=best,
        tied=tied_set(stats),
        stats=stats,
    )


def agreement(full: StudyOutcome, pruned: StudyOutcome) -> dict[str, Any]:
    """Whether pruning changed the study's answer, and what it saved."""
    return {
        "same_best": full.best == pruned.best,
        "same_tied_set": full.tied == pruned.tied,
        "best_in_pruned_tied_set": full.best in pruned.tied,
        "iterations_saved_frac": 1 - pruned.iterations_trained / max(1, full.iterations_trained),
        "wall_saved_frac": 1 - pruned.wall_s / full.wall_s if full.wall_s > 0 else None,
    }


def run_study(sweep_dir: Path, grid: list[str], extra: list[str], timeout_s: float) -> float:
    cmd = [sys.executable, "-m", "grail.train.cli", "-m", *grid, f"hydra.sweep.dir={sweep_dir}"]
    cmd += extra
    sweep_dir.mkdir(parents=True, exist_ok=True)
    print(f"{' '.join(cmd[3:])}", flush=True)
    t0 = time.perf_counter()
    run_worker(cmd, dict(os.environ), sweep_dir.with_suffix(".log"), timeout_s, sweep_dir.name)
    return time.perf_counter() - t0


def show(o: StudyOutcome, metric: str) -> None:
    from grail.report.seeds import build_stats_table

    Console(width=None if sys.stdout.isatty() else 160).print(
        build_stats_table(o.stats, metric, f"{o.name}: statistics over seeds — {metric}")
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lrs", default="2e-3,5e-3,1e-2", help="train.lr values")
    p.add_argument("--kl-coefs", default="0,0.05", help="train.kl_coef values")
    p.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 per setting")
    p.add_argument("--prune", default="asha", help="the prune config group for the second study")
    p.add_argument("--metric", choices=METRICS, default="auc")
    p.add_argument("--out-dir", type=Path, default=None, help="keep both sweeps here")
    p.add_argument("--timeout", type=float, default=4 * 3600.0, help="seconds per study")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: results/)")
    p.add_argument("overrides", nargs="*", help="grail-train overrides for every run")
    args = p.parse_args(argv)
    if args.seeds < 2:
        p.error("--seeds must be >= 2: statistics over seeds need two")

    grid = [
        f"train.lr={args.lrs}",
        f"train.kl_coef={args.kl_coefs}",
        f"seed={','.join(str(s) for s in range(args.seeds))}",
    ]
    with tempfile.TemporaryDirectory(prefix="grail-study-") as tmp:
        root = (args.out_dir or Path(tmp)).absolute()
        full_dir, pruned_dir = root / "full", root / f"prune-{args.prune}"
        full_s = run_study(full_dir, grid, args.overrides, args.timeout)
        prune_args = [f"+prune={args.prune}", *args.overrides]
        pruned_s = run_study(pruned_dir, grid, prune_args, args.timeout)
        full = outcome("without pruning", full_dir, full_s, args.metric)
        pruned = outcome(f"with +prune={args.prune}", pruned_dir, pruned_s, args.metric)
        for o in (full, pruned):
            show(o, args.metric)

    verdict = agreement(full, pruned)
    print_table(
        "compute and answer",
        ["study", "runs", "statuses", "iterations trained", "wall min", "best", "tied with best"],
        [
            [
                o.name,
                o.runs,
                " ".join(f"{k} {v}" for k, v in sorted(o.statuses.items())),
                o.iterations_trained,
                f"{o.wall_s / 60:.1f}",
                o.best or "-",
                len(o.tied),
            ]
            for o in (full, pruned)
        ],
    )
    print(
        f"same best: {verdict['same_best']}; same tied set: {verdict['same_tied_set']}; "
        f"pruning saved {verdict['iterations_saved_frac']:.0%} of the iterations and "
        f"{(verdict['wall_saved_frac'] or 0):.0%} of the wall time"
    )
    write_results(
        "study",
        {
            "overrides": args.overrides,
            "grid": grid,
            "prune": args.prune,
            "metric": args.metric,
            "studies": [
                {
                    "name": o.name,
                    "runs": o.runs,
                    "statuses": o.statuses,
                    "iterations_trained": o.iterations_trained,
                    "wall_s": o.wall_s,
                    "best": o.best,
                    "tied": sorted(o.tied),
                    "settings": [
                        {
                            "label": s.label,
                            "n": s.n,
                            "mean": s.interval.mean,
                            "lo": s.interval.lo,
                            "hi": s.interval.hi,
                        }
                        for s in o.stats
                    ],  # fmt: skip
                }
                for o in (full, pruned)
            ],
            **verdict,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
