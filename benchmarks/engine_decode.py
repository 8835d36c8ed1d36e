"""Completion tokens per second of the built-in engine: the eager decode path against the static
one (static KV cache, host reads every few steps, CUDA graphs on CUDA).

    uv run python benchmarks/engine_decode.py --preset tiny                  # CPU, a few minutes
    uv run python benchmarks/engine_decode.py --preset mid --device cuda     # ~0.47B, bf16

Each shape PxNxT is P prompts of `--prompt-len` random tokens, N samples each (seeded), T
completion tokens each (``ignore_eos``, so every sample is exactly T tokens long), submitted to
`grail.inference.builtin.engine.Engine` at once (one ``submit_many``, as the harness's
requests arrive together) and timed from submission to the last result. Shapes: 8x8x256 and
64x16x512 (1024 sequences: with the default ``--max-batch-size`` 256 the engine runs 256 at a
time and admits the rest as rows free up). Sampling as the trainer asks: temperature 1, no
top-k / top-p, the chosen token's logprob.

Per mode and shape: one untimed warm-up run of the same shape (CUDA graph capture, allocator
and kernel warm-up), then ``--reps`` timed runs; printed: median seconds, completion tok/s,
milliseconds per decode step (seconds / decode steps, where a step advances every running
sequence by one token) and the speed-up over eager. The static path's tokens are compared with
eager's (equal on CPU in float32; on CUDA in bf16 they may part after a near-tie).
Results: benchmarks/results/engine_decode.json.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from common import machine, print_profile, print_table, write_results

from grail.inference.builtin.engine import Engine
from grail.inference.builtin.sampling import SamplingParams


def parse_shape(text: str) -> tuple[int, int, int]:
    """'8x8x256' -> (prompts, samples per prompt, completion tokens)."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is PROMPTSxNxTOKENS, e.g. 8x8x256; got {text!r}")
    prompts, n, tokens = (int(p) for p in parts)
    return prompts, n, tokens


def decode_steps(prompts: int, n: int, tokens: int, max_batch_size: int) -> int:
    """Decode steps the run needs at the least: waves of max_batch_size sequences, each
    T - 1 steps (token 0 comes from the prefill)."""
    return math.ceil(prompts * n / max_batch_size) * (tokens - 1)


def make_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Ids from 3 on: the tiny tokenizer's 0-2 are special tokens.
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


def run_once(engine: Engine, prompts: list[list[int]], n: int, tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    start = time.perf_counter()
    futures = engine.submit_many(prompts, params, n=n, seeds=list(range(len(prompts))))
    outs = [f.result() for f in futures]
    seconds = time.perf_counter() - start
    if any(len(o.token_ids) != tokens for o in outs):
        raise RuntimeError("a sample ended before max_tokens despite ignore_eos")
    return seconds, [o.token_ids for o in outs]


def model_dir(preset: str, work: Path) -> Path:
    from grail.models.tiny import MID_PRESET, build_random_qwen2, ensure_tiny_model

    if preset == "tiny":
        return ensure_tiny_model()
    print("building the ~0.47B random Qwen2 (MID_PRESET) ...", flush=True)
    return build_random_qwen2(work / "mid", seed=0, dtype=torch.float32, **MID_PRESET)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=["tiny", "mid"], default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--modes", default="eager,graph", help="decode modes, comma-separated")
    parser.add_argument(
        "--shapes",
        type=lambda s: [parse_shape(x) for x in s.split(",")],
        default="8x8x256,64x16x512",
    )
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=1, help="timed runs per mode and shape")
    parser.add_argument(
        "--profile", action="store_true", help="one more run per shape under torch.profiler"
    )
    parser.add_argument("--no-warmup", action="store_true", help="time the first run too")
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--out", type=Path, help="results JSON (default benchmarks/results/)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(args.preset, Path(tmp))
        tokens_by_shape: dict[tuple[int, int, int], list] = {}
        for mode in args.modes.split(","):
            engine = Engine(
                path,
                device=args.device,
                dtype=args.dtype,
                max_batch_size=args.max_batch_size,
                decode=mode,
            )
            engine.start()
            try:
                for shape in args.shapes:
                    prompts_n, n, tokens = shape
                    prompts = make_prompts(prompts_n, args.prompt_len, engine.vocab_size)
                    if not args.no_warmup:
                        run_once(engine, prompts, n, tokens)
                    timed = [run_once(engine, prompts, n, tokens) for _ in range(args.reps)]
                    if args.profile:
                        print(f"profile of {mode} {shape}:", file=sys.stderr)
                        on_cuda = str(args.device).startswith("cuda")
                        print_profile(partial(run_once, engine, prompts, n, tokens), on_cuda)
                    seconds = statistics.median(s for s, _ in timed)
                    completion = prompts_n * n * tokens
                    steps = decode_steps(prompts_n, n, tokens, args.max_batch_size)
                    same = None
                    if mode != "eager" and shape in tokens_by_shape:
                        ref = tokens_by_shape[shape]
                        same = sum(a == b for a, b in zip(ref, timed[0][1], strict=True))
                    if mode == "eager":
                        tokens_by_shape[shape] = timed[0][1]
                    row = {
                        "mode": mode,
                        "shape": "x".join(map(str, shape)),
                        "seconds": seconds,
                        "all_seconds": [s for s, _ in timed],
                        "completion_tokens": completion,
                        "tok_per_s": completion / seconds,
                        "ms_per_step": 1000 * seconds / steps,
                        "same_tokens_as_eager": same,
                        "sequences": prompts_n * n,
                    }
                    if engine._static is not None:  # what the static path did, for diagnosis
                        row["decoder_stats"] = dict(engine._static.stats)
                    results.append(row)
                    print(
                        f"{mode:6s} {row['shape']:>10s}: {seconds:8.2f} s  "
                        f"{row['tok_per_s']:10.1f} tok/s  {row['ms_per_step']:8.2f} ms/step",
                        flush=True,
                    )
                if engine._static is not None:
                    print(f"{mode}: {dict(engine._static.stats)}", flush=True)
            finally:
                engine.stop()

    eager = {r["shape"]: r["tok_per_s"] for r in results if r["mode"] == "eager"}
    rows = []
    for r in results:
        speedup = r["tok_per_s"] / eager[r["shape"]] if r["shape"] in eager else None
        r["speedup_vs_eager"] = speedup
        same = r["same_tokens_as_eager"]
        rows.append(
            [
                r["mode"],
                r["shape"],
                f"{r['seconds']:.2f}",
                f"{r['tok_per_s']:.0f}",
                f"{r['ms_per_step']:.2f}",
                "" if speedup is None else f"{speedup:.2f}x",
                "" if same is None else f"{same}/{r['sequences']}",
            ]
        )
    where = machine()
    title = f"engine decode, {args.preset} preset on {args.device} ({where['cuda'] or 'CPU'})"
    columns = ["mode", "shape", "s", "tok/s", "ms/step", "vs eager", "same tokens"]
    print_table(title, columns, rows)
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "shapes")}
    settings["shapes"] = ["x".join(map(str, s)) for s in args.shapes]
    write_results("engine_decode", {"settings": settings, "results": results}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
