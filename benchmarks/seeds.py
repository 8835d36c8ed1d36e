"""The default job (or any config) over seeds: held-out success per seed, through a real sweep.

    uv run python benchmarks/seeds.py                          # seeds 0-13, the default job
    uv run python benchmarks/seeds.py --seeds 4 train.pipeline=true train.lr=2.5e-3
    uv run python benchmarks/seeds.py --sweep-dir outputs/seeds   # keep the runs (grail-report)

Runs `grail-train -m seed=0,...,N-1 [overrides]` (Hydra's basic launcher: one run after another,
so each has the machine to itself and its wall time means what a single run's does), then reads
each run's summary.json: held-out success at the last evaluation and the best one, and the run's
wall time (start to end, start-up included). Prints one row per seed and the mean, median, and
how many seeds reach `--threshold`; writes benchmarks/results/seeds.json.

A single seed says little about a setting on the default task: outcomes range from 0 to 1 across
seeds (README, "What the default job does"), which is why this measures all of them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import print_table, run_worker, write_results

from grail.core.records import SUMMARY, read_json
from grail.study.runs import find_runs, read_overrides
from grail.study.stats import DEFAULT_SEED, seed_of


def run_seed(run_dir: Path) -> int:
    seed = seed_of(read_overrides(run_dir))
    if seed == DEFAULT_SEED:
        raise RuntimeError(f"{run_dir}: no seed= among its overrides")
    return int(seed)


def run_row(run_dir: Path) -> dict[str, Any]:
    summary = read_json(run_dir / SUMMARY)
    if summary is None or summary.get("status") != "completed":
        raise RuntimeError(f"{run_dir} did not complete: {summary and summary.get('error')}")
    final, best = summary.get("final_eval") or {}, summary.get("best_eval") or {}
    return {
        "seed": run_seed(run_dir),
        "final_iteration": final.get("iteration"),
        "final_success": final.get("success_rate"),
        "best_success": best.get("success_rate"),
        "wall_time_s": summary["wall_time_s"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=14, help="seeds 0 .. N-1")
    p.add_argument("--threshold", type=float, default=0.6, help="success that counts as learned")
    p.add_argument("--sweep-dir", type=Path, default=None, help="keep the runs here")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole sweep")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: results/)")
    p.add_argument("overrides", nargs="*", help="grail-train overrides for every run")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")

    with tempfile.TemporaryDirectory(prefix="grail-seeds-") as tmp:
        sweep_dir = (args.sweep_dir or Path(tmp) / "sweep").absolute()
        seeds = ",".join(str(s) for s in range(args.seeds))
        cmd = [
            sys.executable, "-m", "grail.train.cli", "-m", f"seed={seeds}",
            f"hydra.sweep.dir={sweep_dir}", *args.overrides,
        ]  # fmt: skip
        sweep_dir.mkdir(parents=True, exist_ok=True)
        print(f"{args.seeds} runs into {sweep_dir}, one after another", flush=True)
        t0 = time.perf_counter()
        run_worker(cmd, dict(os.environ), sweep_dir / "sweep.log", args.timeout, "the seed sweep")
        elapsed = time.perf_counter() - t0
        rows = sorted((run_row(r) for r in find_runs(sweep_dir)), key=lambda r: r["seed"])

    finals = [r["final_success"] for r in rows]
    learned = sum(f >= args.threshold for f in finals)
    print_table(
        f"held-out success over seeds ({' '.join(args.overrides) or 'the default job'})",
        ["seed", "final iteration", "final success", "best success", "wall s"],
        [
            [
                r["seed"],
                r["final_iteration"],
                f"{r['final_success']:.3f}",
                f"{r['best_success']:.3f}",
                f"{r['wall_time_s']:.0f}",
            ]
            for r in rows
        ],  # fmt: skip
    )
    print(
        f"mean {statistics.mean(finals):.3f}, median {statistics.median(finals):.3f}, "
        f"{learned} of {len(rows)} seeds >= {args.threshold}; per seed: "
        + " ".join(f"{f:.2f}" for f in finals)
        + f"; sweep {elapsed / 60:.1f} min"
    )
    write_results(
        "seeds",
        {
            "overrides": args.overrides,
            "threshold": args.threshold,
            "runs": rows,
            "mean_final_success": statistics.mean(finals),
            "seeds_learned": learned,
            "sweep_s": elapsed,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
