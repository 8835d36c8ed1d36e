"""Where an iteration's time goes: the median of each `timings` field over a run's iterations.

    uv run python benchmarks/iteration_times.py RUN_DIR [RUN_DIR ...]

Reads `RUN_DIR/metrics/train_iter_*.json` (the loop's own timers, grail/train/loop.py) and prints,
per run, the median seconds of generation, update (train_s), weight sync, eval, checkpoint and the
whole iteration over the iterations after the first (the first pays the server's warm-up, CUDA
graph capture and compilation once), with the first iteration beside them, and which route
carried the weights (`weight_sync.transfer`).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from grail.core.records import metric_records

FIELDS = ("generation_s", "train_s", "weight_sync_s", "eval_s", "checkpoint_s", "iteration_s")


def split(records: list[dict[str, Any]]) -> dict[str, tuple[float, float | None]]:
    """field -> (first iteration's seconds, median over the later ones; None if none)."""
    out: dict[str, tuple[float, float | None]] = {}
    for field in FIELDS:
        values = [float(r["timings"].get(field) or 0.0) for r in records]
        out[field] = (values[0], statistics.median(values[1:]) if len(values) > 1 else None)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path)
    args = parser.parse_args(argv)
    for run_dir in args.run_dirs:
        records = metric_records(run_dir, "train")
        if not records:
            print(f"{run_dir}: no train_iter metrics")
            continue
        routes = sorted({str((r.get("weight_sync") or {}).get("transfer")) for r in records})
        print(f"{run_dir}: {len(records)} iterations, weights carried by {', '.join(routes)}")
        for field, (first, median) in split(records).items():
            later = f"{median:8.3f}" if median is not None else "     n/a"
            print(f"  {field:<15} median {later} s   (first iteration {first:.3f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
