"""Sampled tokens per second of multi-turn episodes against single-turn groups of the same
number of sampled tokens, on the built-in server with the tiny model (issue 41's target: the
episodes at least 0.8x).

    uv run python benchmarks/episodes.py                    # 16 problems x 16 episodes of 4 turns
    uv run python benchmarks/episodes.py --turn-tokens 64   # shorter turns: see docs/episodes.md
    python3 benchmarks/episodes.py --device cuda --turn-tokens 32   # on a GPU: the graph decoder

Episodes: copy_turns (grail/envs/copy_turns.py) with `--turns` turns, every turn exactly
`--turn-tokens` tokens (ignore_eos), through the harness's turn loop (grail/rollouts/episodes.py),
twice: each turn's prompt sent as one chunk (generation.prefix_cache=false, the default), and
with its sampled spans, continued from the server's prefix cache (generation.prefix_cache=true;
grail/inference/builtin/prefix_cache.py), with the cache's hits and misses.
Single-turn: copy_digits problems through the same harness (prompts rendered, n samples of 16
prompts a request, completions scored), each completion exactly turns x turn-tokens tokens. Both
sample the same tokens per batch; the episodes also prefill the environment's turns. The three run
in turns (a round: one batch of each), so that a noisy machine slows each alike; walls are medians
[min-max] over the rounds after one warm-up, ratios the median of each round's ratio;
results go to benchmarks/results/episodes.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path

from client_overhead import fmt
from common import print_table, spread, write_results

from grail.core.heap import frozen_heap
from grail.envs import make_env
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.models.loading import load_tokenizer
from grail.models.tiny import ensure_tiny_model
from grail.rollouts.episodes import EpisodeLimits
from grail.rollouts.generation import RolloutGenerator


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--problems", type=int, default=16)
    parser.add_argument("--episodes", type=int, default=16, help="episodes (samples) per problem")
    parser.add_argument("--turns", type=int, default=4)
    # 128: the turn length the 0.8x target is held to (docs/episodes.md, "Speed": shorter turns
    # are bounded below it by their environment's tokens, which single-turn groups do not have).
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--server-threads", type=int, default=1, help="CPU only")
    parser.add_argument("--device", default="cpu", help="the server's: cpu | cuda | cuda:N")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)

    model_dir = ensure_tiny_model()
    tokenizer = load_tokenizer(str(model_dir))
    per_turn = SamplingParams(max_tokens=args.turn_tokens, ignore_eos=True)
    whole = SamplingParams(max_tokens=args.turns * args.turn_tokens, ignore_eos=True)
    sampled = args.problems * args.episodes * args.turns * args.turn_tokens
    server = BuiltinServer(
        model_dir,
        "tiny",
        log_dir=Path(tempfile.mkdtemp(prefix="grail-episodes-")),
        device=args.device,
        threads=None if args.device.startswith("cuda") else args.server_threads,
    )
    with server:
        client = CompletionClient(server.base_url, "tiny", timeout=600)

        def episode_batches(prefix_cache: bool) -> Callable[[int], Awaitable[None]]:
            generator = RolloutGenerator(
                make_env("copy_turns", turns=args.turns),
                tokenizer,
                client,
                per_turn,
                episodes=EpisodeLimits(args.turns, 4096, 60.0),
                prefix_cache=prefix_cache,
            )

            async def batch(i: int) -> None:
                out = await generator.generate(
                    list(range(args.problems)), args.episodes, round_index=i
                )
                assert sum(s.num_sampled for s in out.samples) == sampled

            return batch

        chunked_batch, continued_batch = episode_batches(False), episode_batches(True)

        # The single-turn groups go through the harness as a single-turn run's do (prompts
        # rendered, completions scored), as the episodes do.
        single_turn = RolloutGenerator(make_env("copy_digits"), tokenizer, client, whole)

        async def single_batch(i: int) -> None:
            out = await single_turn.generate(
                list(range(args.problems)), args.episodes, round_index=i
            )
            assert sum(len(s.completion_ids) for s in out.samples) == sampled

        async def all_three() -> tuple[list[float], list[float], list[float]]:
            """The three kinds of batch in turns, so that a noisy machine slows each alike."""
            kinds = (single_batch, chunked_batch, continued_batch)
            walls: tuple[list[float], list[float], list[float]] = ([], [], [])
            try:
                for run in kinds:
                    await run(-1)  # warm-up
                for i in range(args.batches):
                    for run, wall in zip(kinds, walls, strict=True):
                        t0 = time.perf_counter()
                        await run(i)
                        wall.append(time.perf_counter() - t0)
                return walls
            finally:
                await client.aclose()

        with frozen_heap():  # as grail-train runs its iterations
            single, multi, cached = asyncio.run(all_three())
        card = json.loads(urllib.request.urlopen(f"{server.base_url}/models", timeout=10).read())
        cache = card["data"][0].get("prefix_cache") or {}
    rate = {"single_turn": sampled / spread(single)["median"]}
    rate["episodes"] = sampled / spread(multi)["median"]
    rate["episodes_prefix_cache"] = sampled / spread(cached)["median"]
    ratio = statistics.median(s / m for s, m in zip(single, multi, strict=True))
    ratio_cached = statistics.median(s / c for s, c in zip(single, cached, strict=True))
    print_table(
        f"{args.problems} problems x {args.episodes} samples, {sampled} sampled tokens per batch "
        f"({args.turns} turns x {args.turn_tokens} tokens), median \\[min-max] of {args.batches}",
        ["", "wall ms", "sampled tokens/s"],
        [
            ["single-turn groups", fmt(single), f"{rate['single_turn']:.0f}"],
            [
                f"{args.turns}-turn episodes, one chunk a turn",
                fmt(multi),
                f"{rate['episodes']:.0f}",
            ],
            [
                f"{args.turns}-turn episodes, prefix cache",
                fmt(cached),
                f"{rate['episodes_prefix_cache']:.0f}",
            ],
            ["episodes / single-turn", "", f"{ratio:.2f}x"],
            ["prefix-cached episodes / single-turn", "", f"{ratio_cached:.2f}x"],
        ],
    )
    print(
        f"prefix cache: {cache.get('hits')} hits, {cache.get('misses')} misses "
        f"(every turn after an episode's first should hit)"
    )
    write_results(
        "episodes",
        {
            "device": args.device,
            "problems": args.problems,
            "episodes_per_problem": args.episodes,
            "turns": args.turns,
            "turn_tokens": args.turn_tokens,
            "sampled_tokens_per_batch": sampled,
            "single_turn_wall_s": spread(single),
            "episodes_wall_s": spread(multi),
            "episodes_prefix_cache_wall_s": spread(cached),
            "sampled_tokens_per_s": rate,
            "ratio": ratio,
            "ratio_prefix_cache": ratio_cached,
            "prefix_cache": cache,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
