"""Scaling of one training iteration: time and peak memory as the work per iteration doubles.

    uv run python benchmarks/scaling.py                     # defaults: a few minutes on 2 cores
    uv run python benchmarks/scaling.py --rounds 2                 # steadier on a busy machine
    uv run python benchmarks/scaling.py --problems 16 --iterations 6 --factors 1,2,4,8

Two series, each point a real `grail-train` run (`grail.train.launch.train`) of the default task
(copy_digits on the tiny model, built-in server on CPU) in a fresh subprocess:

- rollouts: rollouts per iteration x1, x2, x4 (`data.problems_per_iteration` x factor), with
  the micro-batch fixed (`train.batch_size`) and `train.grad_accum_steps` = rollouts / batch
  size, so every iteration is one optimizer step over all its rollouts whatever their number
  and only the number of micro-batches grows;
- length: completion length x1, x2, x4 (`generation.max_new_tokens` x factor).

Completions are forced to full length: each request carries the server's `ignore_eos` (patched
into the loop's completion client in the worker), so the completion tokens per iteration really
are rollouts x max_new_tokens (the measured mean length is printed; `--natural-length` turns
this off, and then copy_digits completions end at EOS, mostly after 1-2 tokens once learnt).
Evaluation is off and the only checkpoint (the loop always writes one after its last
iteration) is subtracted: the timed path per iteration is

    core_s = iteration_s - eval_s - checkpoint_s = generation + train + weight sync (+ overhead)

from the loop's own metrics files, median over the iterations after `--warmup` untimed ones
(pooled over `--rounds` runs per point; rounds interleave the points, so a slow spell on a
shared machine is spread over all of them).
Peak memory is VmHWM: the trainer's (the worker process, read after `run` returns) and the
inference server's (read from /proc just before the loop stops it: `common.ServerPeakRss`).
"run added" is the trainer's peak minus its resident memory just before `run` (torch,
transformers and Hydra imported): what the model, optimizer, rollouts and activations take.

Printed: per point the median iteration seconds with its generation / train / sync split,
seconds per rollout and per completion token, and both peaks; per series the scaling exponent
b of time ~ work^b (least squares over log-log; b <= 1 means no worse than linear) and whether
the trainer's peak stayed flat (within 10 %) over the rollouts series, where micro-batching
bounds it. Results: benchmarks/results/scaling.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from common import (
    ServerPeakRss,
    core_iteration_s,
    peak_rss_mb,
    print_table,
    rss_mb,
    run_worker,
    write_results,
)

LINEAR_SLACK = 0.1  # exponent b up to 1 + slack counts as linear (timings are noisy)
FLAT_MEMORY = 0.10  # trainer peak growth up to 10 % over the rollouts series counts as flat


@dataclass(frozen=True)
class Point:
    """One run: `series` says which quantity `factor` multiplies."""

    series: str  # "rollouts" | "length"
    factor: int
    problems: int
    rollouts_per_problem: int
    max_new_tokens: int

    @property
    def rollouts(self) -> int:
        return self.problems * self.rollouts_per_problem

    @property
    def name(self) -> str:
        return f"{self.series} x{self.factor}"


def plan_points(
    problems: int, rollouts_per_problem: int, max_new_tokens: int, factors: Sequence[int]
) -> list[Point]:
    """The rollouts series, then the length series without its x1 (the same run as rollouts
    x1, which both series share). Factors must be distinct positive ints and include 1."""
    if sorted(set(factors)) != sorted(factors) or 1 not in factors or min(factors) < 1:
        raise ValueError(f"factors must be distinct positive ints including 1, got {factors}")
    if min(problems, max_new_tokens) < 1 or rollouts_per_problem < 2:
        raise ValueError(
            "problems and max_new_tokens must be >= 1 and rollouts_per_problem >= 2, got "
            f"{problems}, {max_new_tokens}, {rollouts_per_problem}"
        )
    ordered = sorted(factors)
    points = [
        Point("rollouts", f, problems * f, rollouts_per_problem, max_new_tokens) for f in ordered
    ]
    points += [
        Point("length", f, problems, rollouts_per_problem, max_new_tokens * f)
        for f in ordered
        if f != 1
    ]
    return points


def series_points(points: Sequence[Point], series: str) -> list[Point]:
    """The points of `series` in factor order, the shared x1 run included."""
    base = [p for p in points if p.series == "rollouts" and p.factor == 1]
    own = [p for p in points if p.series == series and p.factor != 1]
    return sorted(base + own, key=lambda p: p.factor)


def overrides(point: Point, iterations: int, batch_size: int) -> list[str]:
    """`grail-train` overrides of one point: the default job (conf/offline_grpo.yaml) resized,
    without evaluation, with one checkpoint at the end, one optimizer step per iteration."""
    if iterations < 1 or batch_size < 1:
        raise ValueError(f"iterations and batch_size must be >= 1, got {iterations}, {batch_size}")
    return [
        f"data.problems_per_iteration={point.problems}",
        f"data.rollouts_per_problem={point.rollouts_per_problem}",
        f"generation.max_new_tokens={point.max_new_tokens}",
        f"train.iterations={iterations}",
        f"train.batch_size={batch_size}",
        f"train.grad_accum_steps={math.ceil(point.rollouts / batch_size)}",
        "eval.enabled=false",
        f"checkpoint.save_interval={iterations}",
        "checkpoint.keep_last_k=1",
    ]


def iteration_timings(records: Sequence[dict[str, Any]], warmup: int) -> dict[str, list[float]]:
    """Per-iteration numbers of one run (its metrics/train_iter_*.json), without the first
    `warmup` iterations.

    core_s = iteration_s - eval_s - checkpoint_s (what every iteration costs; evaluation and
    checkpoints run at intervals the user picks). Raises if no iteration is left to time.
    """
    timed = sorted(records, key=lambda r: r["iteration"])[warmup:]
    if not timed:
        raise ValueError(f"no iterations left after {warmup} warm-up ones ({len(records)} ran)")
    timings = [r["timings"] for r in timed]
    return {
        "core_s": [core_iteration_s(t) for t in timings],
        "generation_s": [t["generation_s"] for t in timings],
        "train_s": [t["train_s"] for t in timings],
        "weight_sync_s": [t["weight_sync_s"] for t in timings],
        "completion_tokens": [float(r["tokens"]["completion"]) for r in timed],
        "completion_length": [float(r["completion_length"]["mean"]) for r in timed],
    }


MEMORY_KEYS = ("trainer_peak_rss_mb", "trainer_rss_start_mb", "server_peak_rss_mb")


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One point's summary over its runs (one per round): medians over all their timed
    iterations pooled, and the highest peak of any run (the memory a user must provision)."""
    if not runs:
        raise ValueError("no runs to combine")
    pooled: dict[str, list[float]] = {}
    for run in runs:
        for key, values in run["per_iteration"].items():
            pooled.setdefault(key, []).extend(values)
    out: dict[str, Any] = {key: statistics.median(values) for key, values in pooled.items()}
    out["completion_length_mean"] = out.pop("completion_length")
    out["iterations_timed"] = len(pooled["core_s"])
    out["core_s_all"] = pooled["core_s"]
    for key in MEMORY_KEYS:
        values = [run[key] for run in runs if run.get(key) is not None]
        out[key] = max(values) if values else None
    # What the run itself added to the trainer, from the run with the highest peak.
    top = max(runs, key=lambda run: run["trainer_peak_rss_mb"])
    out["trainer_added_mb"] = top["trainer_peak_rss_mb"] - top["trainer_rss_start_mb"]
    out["wall_s"] = [run["wall_s"] for run in runs]
    return out


def scaling_exponent(work: Sequence[float], seconds: Sequence[float]) -> float:
    """b in seconds ~ a * work^b, by least squares on (log work, log seconds).

    b = 1: linear; b < 1: sub-linear (fixed costs amortised); b > 1: super-linear.
    """
    if len(work) != len(seconds) or len(work) < 2:
        raise ValueError("need at least two (work, seconds) pairs of equal length")
    if min(work) <= 0 or min(seconds) <= 0:
        raise ValueError("work and seconds must be positive")
    xs = [math.log(w) for w in work]
    ys = [math.log(s) for s in seconds]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("work must take at least two different values")
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx


def relative_growth(values: Sequence[float]) -> float:
    """(last - first) / first: how much a quantity grew over a series."""
    if not values or values[0] <= 0:
        raise ValueError("need a positive first value")
    return (values[-1] - values[0]) / values[0]


# --------------------------------------------------------------------------------------------
# worker: one point, in its own process


def worker(spec_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    from functools import partial

    import transformers
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import grail.rollouts.server as rollout_source
    from grail.core.validate import validate
    from grail.train import launch
    from grail.train.cli import CONF_DIR
    from grail.train.reporting import interrupt_on_sigterm

    signal.signal(signal.SIGTERM, interrupt_on_sigterm)  # stop_worker's SIGTERM: run() cleans up

    transformers.utils.logging.disable_progress_bar()
    if spec["ignore_eos"]:
        if not hasattr(rollout_source, "CompletionClient"):
            raise RuntimeError("grail.rollouts.server no longer builds a CompletionClient to patch")
        rollout_source.CompletionClient = partial(  # type: ignore[misc]
            rollout_source.CompletionClient, extra_body={"ignore_eos": True}
        )
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=spec["overrides"])
    config = OmegaConf.to_object(cfg)
    validate(config)  # type: ignore[arg-type]
    rss_start = rss_mb()
    with ServerPeakRss() as server:
        # as grail-train runs it: reproducible=true (the default) pins the kernels first
        launch.train(config, Path(spec["run_dir"]))  # type: ignore[arg-type]
    result = {
        "trainer_peak_rss_mb": peak_rss_mb(),
        "trainer_rss_start_mb": rss_start,
        "server_peak_rss_mb": server.peak_mb or None,
        "server_pids": server.pids,
    }
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


def run_point(
    point: Point,
    work: Path,
    *,
    iterations: int,
    warmup: int,
    batch_size: int,
    ignore_eos: bool,
    timeout: float,
) -> dict[str, Any]:
    """Run one point in a fresh worker process; return its summary (raises if it fails)."""
    tag = f"{point.series}-x{point.factor}"
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / tag
    spec = {
        "overrides": overrides(point, iterations, batch_size),
        "run_dir": str(run_dir),
        "ignore_eos": ignore_eos,
        "result": str(work / f"{tag}.result.json"),
    }
    spec_path = work / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    run_worker(
        [sys.executable, __file__, "--worker", str(spec_path)],
        {**os.environ, "PYTHONUNBUFFERED": "1"},
        work / f"{tag}.log",
        timeout,
        f"{point.name} (--timeout {timeout:g} s)",
    )
    wall = time.perf_counter() - t0
    records = [json.loads(p.read_text()) for p in sorted(run_dir.glob("metrics/train_iter_*"))]
    memory = json.loads(Path(spec["result"]).read_text())
    return {
        "overrides": spec["overrides"],
        "wall_s": wall,
        **memory,
        "per_iteration": iteration_timings(records, warmup),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--problems", type=int, default=32, help="problems per iteration at x1")
    parser.add_argument("--rollouts-per-problem", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=8, help="completion length at x1")
    parser.add_argument("--factors", default="1,2,4", help="comma list, must include 1")
    parser.add_argument("--batch-size", type=int, default=32, help="micro-batch (fixed)")
    parser.add_argument("--iterations", type=int, default=8, help="per point, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first iterations")
    parser.add_argument("--rounds", type=int, default=1, help="runs per point, interleaved")
    parser.add_argument("--natural-length", action="store_true", help="let completions end at EOS")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per point")
    parser.add_argument("--keep", type=Path, help="keep run directories and logs here")
    parser.add_argument("--out", type=Path, default=None, help="results JSON path")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)
    try:
        factors = [int(f) for f in args.factors.split(",")]
        points = plan_points(args.problems, args.rollouts_per_problem, args.max_new_tokens, factors)
        overrides(points[0], args.iterations, args.batch_size)
    except ValueError as exc:
        parser.error(str(exc))
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    if not 0 <= args.warmup < args.iterations:
        parser.error(f"--warmup must be in [0, --iterations), got {args.warmup}")

    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="grail-scaling-", dir=args.keep))
    runs: dict[str, list[dict[str, Any]]] = {point.name: [] for point in points}
    try:
        # Rounds interleave the points (x1, x2, x4, ..., x1, x2, x4, ...), so a slow spell on
        # a shared machine does not land on one point only.
        for round_index in range(args.rounds):
            for point in points:
                print(
                    f"round {round_index + 1}/{args.rounds}, {point.name}: {point.rollouts} "
                    f"rollouts x {point.max_new_tokens} tokens ..."
                )
                run = run_point(
                    point,
                    work / f"round{round_index}",
                    iterations=args.iterations,
                    warmup=args.warmup,
                    batch_size=args.batch_size,
                    ignore_eos=not args.natural_length,
                    timeout=args.timeout,
                )
                runs[point.name].append(run)
                per = run["per_iteration"]
                print(
                    f"  {statistics.median(per['core_s']):.2f} s/iteration (generation "
                    f"{statistics.median(per['generation_s']):.2f}, train "
                    f"{statistics.median(per['train_s']):.2f}); trainer peak "
                    f"{run['trainer_peak_rss_mb']:.0f} MiB, server peak "
                    f"{run['server_peak_rss_mb'] or 0:.0f} MiB; run wall {run['wall_s']:.0f} s"
                )
    finally:
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"run directories and logs kept in {work}")
    results = {
        point.name: {
            **asdict(point),
            "rollouts": point.rollouts,
            **combine_runs(runs[point.name]),
            "runs": runs[point.name],
        }
        for point in points
    }

    analysis = analyse(points, results)
    rows = []
    for point in points:
        r = results[point.name]
        rows.append(
            [
                point.name,
                r["rollouts"],
                r["max_new_tokens"],
                r["completion_length_mean"],
                r["core_s"],
                r["generation_s"],
                r["train_s"],
                1e3 * r["core_s"] / r["rollouts"],
                1e3 * r["core_s"] / r["completion_tokens"],
                r["trainer_peak_rss_mb"],
                r["trainer_added_mb"],
                r["server_peak_rss_mb"],
            ]
        )
    print_table(
        f"iteration scaling (copy_digits, tiny model, CPU; median of "
        f"{(args.iterations - args.warmup) * args.rounds} iterations per point)",
        [
            "point",
            "rollouts",
            "max tok",
            "mean len",
            "iter s",
            "gen s",
            "train s",
            "ms/rollout",
            "ms/token",
            "trainer MiB",
            "run added MiB",
            "server MiB",
        ],
        rows,
    )
    for line in analysis["verdicts"]:
        print(line)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_results("scaling", {"config": config, "points": results, "analysis": analysis}, args.out)
    return 0 if analysis["time_linear"] else 1


def analyse(points: Sequence[Point], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Exponents per series and the memory check, with the verdict lines to print."""
    out: dict[str, Any] = {"verdicts": []}
    linear = True
    for series, work_key in (("rollouts", "rollouts"), ("length", "completion_tokens")):
        chosen = [results[p.name] for p in series_points(points, series)]
        if len(chosen) < 2:
            continue
        work = [float(r[work_key]) for r in chosen]
        for part in ("core_s", "generation_s", "train_s"):
            b = scaling_exponent(work, [r[part] for r in chosen])
            out[f"{series}_exponent_{part.removesuffix('_s')}"] = b
        b = out[f"{series}_exponent_core"]
        linear &= b <= 1 + LINEAR_SLACK
        per = [1e3 * r["core_s"] / w for r, w in zip(chosen, work, strict=True)]
        unit = "rollout" if series == "rollouts" else "completion token"
        shape = (
            "sub-linear"
            if b < 1 - LINEAR_SLACK
            else "linear"
            if b <= 1 + LINEAR_SLACK
            else ("SUPER-LINEAR")
        )
        out["verdicts"].append(
            f"{series}: time ~ work^{b:.2f} ({shape}; generation ^"
            f"{out[f'{series}_exponent_generation']:.2f}, train ^"
            f"{out[f'{series}_exponent_train']:.2f}); ms per {unit}: "
            + ", ".join(f"x{r['factor']} {v:.2f}" for r, v in zip(chosen, per, strict=True))
        )
        for who in ("trainer", "server"):
            peaks = [r[f"{who}_peak_rss_mb"] for r in chosen]
            if None in peaks:
                continue
            growth = relative_growth(peaks)
            out[f"{series}_{who}_memory_growth"] = growth
            if series == "rollouts" and who == "trainer":
                out["trainer_memory_flat"] = growth <= FLAT_MEMORY
                out["rollouts_trainer_added_mb"] = [r["trainer_added_mb"] for r in chosen]
            out["verdicts"].append(
                f"  {who} peak over {series}: "
                + ", ".join(f"{p:.0f}" for p in peaks)
                + f" MiB ({growth:+.1%}"
                + (
                    f"; flat within {FLAT_MEMORY:.0%}: {'yes' if growth <= FLAT_MEMORY else 'NO'})"
                    if series == "rollouts" and who == "trainer"
                    else ")"
                )
            )
    out["time_linear"] = linear
    return out


if __name__ == "__main__":
    sys.exit(main())
