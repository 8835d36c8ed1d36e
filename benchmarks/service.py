"""Round trips through the trainer as a service: completions + rewards per second, with latencies.

    uv run python benchmarks/service.py                       # the default job, 8 clients
    uv run python benchmarks/service.py --workers 16 train.iterations=10

Starts `grail-train mode=service service.port=0 [overrides]` (the default job unless overridden:
64 groups of 16 samples per iteration) and, in this process, `--workers` client threads that
each loop: POST /v1/completions (one group, the copy_digits prompt as chat messages), score it,
POST /v1/rewards (the whole group). The trainer trains, syncs and evaluates meanwhile on the same
machine, as it does for real clients. Prints groups, samples and rewards per second over the
run, and the latency percentiles of each route; writes benchmarks/results/service.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from common import print_table, stop_worker, write_results

from grail.envs import make_env

REPO = Path(__file__).resolve().parents[1]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def client(
    url: str, key: str, number: int, workers: int, latencies: dict[str, list[float]]
) -> None:
    env = make_env("copy_digits")
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=url, headers=headers, timeout=300) as http:
        seed = number
        while True:
            problem = env.problem(seed)
            seed += workers
            t0 = time.perf_counter()
            try:
                answer = http.post("/v1/completions", json={"messages": problem.prompt_messages})
                if answer.status_code == 503:  # the run has taken all its batches
                    return
                answer.raise_for_status()
                t1 = time.perf_counter()
                rewards = [
                    {"id": c["id"], "reward": env.score(problem, c["text"]).reward}
                    for c in answer.json()["choices"]
                ]
                t2 = time.perf_counter()
                sent = http.post("/v1/rewards", json={"rewards": rewards})
            except httpx.TransportError:
                return  # the service stopped: the run is over
            t3 = time.perf_counter()
            if sent.status_code == 409:
                continue  # too stale: not a round trip that counts
            sent.raise_for_status()
            latencies["completions"].append(t1 - t0)
            latencies["rewards"].append(t3 - t2)
            latencies["samples"].append(len(rewards))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8, help="client threads")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: results/)")
    parser.add_argument("overrides", nargs="*", help="grail-train overrides")
    args = parser.parse_args(argv)
    overrides = args.overrides or ["train.iterations=20"]

    with tempfile.TemporaryDirectory(prefix="grail-service-bench-") as tmp:
        run_dir = Path(tmp) / "run"
        log = Path(tmp) / "trainer.log"
        command = [sys.executable, "-m", "grail.train.cli", "mode=service", "service.port=0"]
        with log.open("wb") as out:
            trainer = subprocess.Popen(
                [*command, *overrides, f"hydra.run.dir={run_dir}"],
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            endpoint = run_dir / "service" / "endpoint.json"
            deadline = time.monotonic() + 300
            while not endpoint.exists():
                if trainer.poll() is not None or time.monotonic() > deadline:
                    sys.exit(f"the trainer did not start its service:\n{log.read_text()[-3000:]}")
                time.sleep(0.1)
            service = json.loads(endpoint.read_text())
            latencies: dict[str, list[float]] = {"completions": [], "rewards": [], "samples": []}
            threads = [
                threading.Thread(
                    target=client,
                    args=(service["url"], service["api_key"], k, args.workers, latencies),
                    daemon=True,
                )
                for k in range(args.workers)
            ]
            t0 = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(args.timeout)
            seconds = time.perf_counter() - t0
            code = trainer.wait(120)
        finally:
            stop_worker(trainer)
        if code != 0:
            sys.exit(f"the trainer failed (exit {code}):\n{log.read_text()[-3000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())

    groups = len(latencies["completions"])
    samples = sum(latencies["samples"])
    ms = {
        route: {q: 1e3 * percentile(latencies[route], q) for q in (0.5, 0.95)}
        for route in ("completions", "rewards")
    }
    print_table(
        f"service round trips ({args.workers} clients, {' '.join(overrides)})",
        ["groups", "samples", "seconds", "groups/s", "samples/s", "completions p50/p95 ms",
         "rewards p50/p95 ms"],
        [[groups, samples, seconds, groups / seconds, samples / seconds,
          f"{ms['completions'][0.5]:.0f} / {ms['completions'][0.95]:.0f}",
          f"{ms['rewards'][0.5]:.1f} / {ms['rewards'][0.95]:.1f}"]],
    )  # fmt: skip
    results: dict[str, Any] = {
        "workers": args.workers,
        "overrides": overrides,
        "groups": groups,
        "samples": samples,
        "seconds": seconds,
        "groups_per_s": groups / seconds,
        "samples_per_s": samples / seconds,
        "latency_ms": ms,
        "mean_completion_s": statistics.fmean(latencies["completions"]),
        "final_success": summary.get("final_eval", {}).get("success_rate"),
    }
    write_results("service", results, args.out)


if __name__ == "__main__":
    main()
