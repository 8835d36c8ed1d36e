"""The default job's iteration on an idle machine and beside CPU hogs: how gracefully it degrades.

    uv run python benchmarks/under_load.py                    # one hog per core, 2 rounds
    uv run python benchmarks/under_load.py --hogs 1 --env OMP_WAIT_POLICY=PASSIVE

Each round runs `grail-train` (the default job's config, evaluation off, no checkpoints but the
last) twice: alone, then with `--hogs` busy-looping processes beside it (other users' jobs on a
shared machine). The hogs are plain Python loops, each wanting one core, started before the run
and killed after it. Counted per run: the median of the iterations' generation + training + weight
sync time (`common.core_iteration_s`), the first `--warmup` and the last iteration left out.

The fair share: the run computes on every core (c threads), each hog on one, so c + h threads
want c cores; shared evenly the run keeps c / (c + h) of its cores and its fair slowdown is
(c + h) / c (2x with one hog per core). Near that is graceful; far above it means threads that
wait at barriers for a core another process holds (OpenMP threads spinning instead of sleeping:
grail.core.placement.prefer_passive_openmp).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import core_iteration_s, print_table, run_worker, spread, stop_worker, write_results

HOG = "while True: pass"


PARTS = ("generation_s", "train_s", "weight_sync_s")


def run_once(
    run_dir: Path, args: argparse.Namespace, env: dict[str, str]
) -> list[dict[str, float]]:
    """One `grail-train` run; the counted iterations' core times and their parts."""
    cmd = [
        sys.executable, "-m", "grail.train.cli",
        f"train.iterations={args.iterations}", "eval.enabled=false",
        f"checkpoint.save_interval={args.iterations}", f"hydra.run.dir={run_dir}",
        *args.overrides,
    ]  # fmt: skip
    run_worker(cmd, env, run_dir.with_suffix(".log"), args.timeout, f"grail-train in {run_dir}")
    records = [
        json.loads(p.read_text()) for p in sorted((run_dir / "metrics").glob("train_iter_*.json"))
    ]
    counted = records[args.warmup : -1]
    if not counted:
        raise RuntimeError(f"{run_dir}: no iterations left to count; raise --iterations")
    return [
        {"core_s": core_iteration_s(r["timings"]), **{k: r["timings"][k] for k in PARTS}}
        for r in counted
    ]


def with_hogs(count: int, run: Any) -> Any:
    hogs = [
        subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(count)
    ]
    try:
        return run()
    finally:
        for hog in hogs:
            stop_worker(hog, grace_s=5)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    cores = len(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hogs", type=int, default=cores, help="busy processes beside the run")
    p.add_argument("--rounds", type=int, default=2, help="idle + loaded pairs")
    p.add_argument("--iterations", type=int, default=14, help="per run")
    p.add_argument("--warmup", type=int, default=2, help="first iterations not counted")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment"
    )
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: results/)")
    p.add_argument("overrides", nargs="*", help="extra grail-train overrides")
    args = p.parse_args(argv)
    env = {**os.environ, **dict(item.split("=", 1) for item in args.env)}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path: the one a shared CPU machine runs

    times: dict[str, list[dict[str, float]]] = {"idle": [], "loaded": []}
    with tempfile.TemporaryDirectory(prefix="grail-under-load-") as tmp:
        for r in range(args.rounds):
            for condition in ("idle", "loaded"):
                run_dir = Path(tmp) / f"{condition}_{r}"
                hogs = args.hogs if condition == "loaded" else 0
                values = with_hogs(hogs, lambda d=run_dir: run_once(d, args, env))
                times[condition] += values
                print(f"round {r + 1}/{args.rounds} {condition:6s}: median iteration "
                      f"{statistics.median(v['core_s'] for v in values):.3f}s")  # fmt: skip
    idle, loaded = (spread([v["core_s"] for v in times[c]]) for c in ("idle", "loaded"))
    parts = {
        c: {k: statistics.median(v[k] for v in times[c]) for k in PARTS} for c in ("idle", "loaded")
    }
    slowdown = loaded["median"] / idle["median"]
    fair = (cores + args.hogs) / cores
    print_table(
        f"default iteration alone and beside {args.hogs} CPU hog(s), {cores} cores "
        f"(median s of {idle['n']} iterations each)",
        ["condition", "median s", "IQR", "slowdown", "fair share", "generation / train / sync s"],
        [
            [
                "idle",
                f"{idle['median']:.3f}",
                f"{idle['iqr']:.3f}",
                "1",
                "",
                " / ".join(f"{parts['idle'][k]:.3f}" for k in PARTS),
            ],
            [
                "loaded",
                f"{loaded['median']:.3f}",
                f"{loaded['iqr']:.3f}",
                f"{slowdown:.2f}",
                f"{fair:.2f}",
                " / ".join(f"{parts['loaded'][k]:.3f}" for k in PARTS),
            ],
        ],  # fmt: skip
    )
    write_results(
        "under_load",
        {
            "hogs": args.hogs,
            "cores": cores,
            "env": dict(item.split("=", 1) for item in args.env),
            "overrides": args.overrides,
            "idle": idle,
            "loaded": loaded,
            "slowdown": slowdown,
            "parts_median_s": parts,
            "fair_share": fair,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
