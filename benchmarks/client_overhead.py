"""What the completion client costs per generation batch: the default job's pattern (64 prompts x
n=16 samples, max_tokens=4, temperature 1) against the built-in server on the tiny model.

    uv run python benchmarks/client_overhead.py                 # 20 batches after 2 warm-ups
    uv run python benchmarks/client_overhead.py --batches 50 --server-threads 2

Per batch it prints the wall time (the server generating included) and the CPU time of this
process (the client alone: the server is another process), with the number of HTTP requests the
client made, and the full garbage collections over all timed batches (this process has torch and
transformers loaded, as the trainer has). Medians [min-max] over the batches; results go to
benchmarks/results/client_overhead.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from common import print_table, spread, write_results

from grail.envs import make_env
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.models.tiny import ensure_tiny_model

# The default job (conf/env/copy_digits.yaml): 64 problems per iteration, 16 rollouts each.
PROMPTS = 64
N = 16
SAMPLING = SamplingParams(max_tokens=4, temperature=1.0, top_p=1.0, top_k=-1)


def default_prompts(model_dir: Path, count: int = PROMPTS) -> list[list[int]]:
    """The default task's prompts (copy_digits, seeds 0..count-1) as chat-templated token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    env = make_env("copy_digits")
    prompts = []
    for seed in range(count):
        ids = tokenizer.apply_chat_template(
            env.problem(seed).prompt_messages, add_generation_prompt=True, tokenize=True
        )
        prompts.append([int(t) for t in (ids if isinstance(ids, list) else ids["input_ids"])])
    return prompts


async def time_batches(
    batch: Callable[[int], Awaitable[Any]], batches: int, warmup: int = 2
) -> tuple[list[float], list[float], int]:
    """Wall and process-CPU seconds of `batch(i)` for i = 0.. batches-1, after `warmup` untimed
    calls, and how many full (generation 2) garbage collections ran meanwhile: a client whose
    answers outlive young collections promotes them, and the next full collection walks the
    whole heap (torch and transformers loaded: ~0.2 s)."""
    for i in range(warmup):
        await batch(-1 - i)
    full = 0

    def count(phase: str, info: dict[str, int]) -> None:
        nonlocal full
        full += phase == "stop" and info["generation"] == 2

    gc.collect()
    gc.callbacks.append(count)
    walls, cpus = [], []
    try:
        for i in range(batches):
            w0, c0 = time.perf_counter(), time.process_time()
            await batch(i)
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
    finally:
        gc.callbacks.remove(count)
    return walls, cpus, full


def new_client_batch(
    client: CompletionClient, prompts: list[list[int]]
) -> Callable[[int], Awaitable[Any]]:
    """One generation batch as the harness runs it: `complete_many` over every prompt."""

    async def batch(i: int) -> None:
        seeds = [1000 * i + 17 * j for j in range(len(prompts))]
        groups = await client.complete_many(prompts, N, SAMPLING, seeds)
        assert len(groups) == len(prompts) and all(len(g) == N for g in groups)

    return batch


def fmt(values: list[float], scale: float = 1e3) -> str:
    s = spread(values)
    return f"{s['median'] * scale:.1f} [{s['min'] * scale:.1f}-{s['max'] * scale:.1f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument(
        "--prompts", type=int, default=PROMPTS, help="prompts per batch (the default job's)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--server-threads", type=int, default=1)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    model_dir = ensure_tiny_model()
    prompts = default_prompts(model_dir, args.prompts)
    server = BuiltinServer(
        model_dir,
        "tiny",
        log_dir=Path(tempfile.mkdtemp(prefix="grail-client-overhead-")),
        threads=args.server_threads,
        extra_args=["--max-batch-size", str(args.max_batch_size)],
    )
    with server:
        client = CompletionClient(
            server.base_url, "tiny", max_batch_sequences=args.max_batch_size, timeout=120
        )

        async def run() -> tuple[list[float], list[float], int]:
            try:
                return await time_batches(
                    new_client_batch(client, prompts), args.batches, args.warmup
                )
            finally:
                await client.aclose()

        walls, cpus, full_gcs = asyncio.run(run())
    requests = client.stats.requests / (args.batches + args.warmup)
    print_table(
        f"per batch of {args.prompts} prompts x n={N} (max_tokens={SAMPLING.max_tokens}), "
        f"median \\[min-max] of {args.batches}",
        ["requests", "wall ms", "client CPU ms", "full GCs (all batches)"],
        [[f"{requests:g}", fmt(walls), fmt(cpus), str(full_gcs)]],
    )
    write_results(
        "client_overhead",
        {
            "prompts": args.prompts,
            "n": N,
            "max_tokens": SAMPLING.max_tokens,
            "server_threads": args.server_threads,
            "requests_per_batch": requests,
            "wall_s": spread(walls),
            "client_cpu_s": spread(cpus),
            "full_gcs": full_gcs,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
