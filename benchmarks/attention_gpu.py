"""Attention over one packed row on a GPU: forward + backward time of ways to keep samples apart.

    python benchmarks/attention_gpu.py                    # T = 4096 and 16384, Qwen2.5-0.5B heads
    python benchmarks/attention_gpu.py --tokens 4096 --heads 12 --kv-heads 2 --head-dim 128

One row of T tokens holding samples of random lengths (uniform in [--min-len, --max-len], the
last one filling the row), bf16 query [1, heads, T, d] and key/value [1, kv-heads, T, d], as a
Qwen2 layer's attention sees a packed piece (grail/train/packing.py). Timed per way, median of
--reps forward + backward passes after warm-up, with the largest difference from the dense
reference (bf16: about 1e-2):
  dense    sdpa with the [T, T] block-diagonal causal mask (what transformers builds for sdpa)
  packed   grail's packed sdpa (grail/models/packed_attention.py): sdpa per sample, causal
  varlen   torch.nn.attention.varlen.varlen_attn (flash varlen; only where this torch has it)
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from grail.models.packed_attention import packed_sdpa_forward


class _Layer(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads from the attention module."""

    is_causal = True

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads


def _lengths(total: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    lengths: list[int] = []
    while total - sum(lengths) > high:
        lengths.append(int(torch.randint(low, high + 1, (), generator=gen)))
    return [*lengths, total - sum(lengths)]


def time_row(total: int, args: argparse.Namespace, gen: torch.Generator) -> None:
    """Print each way's forward + backward time on one packed row of `total` tokens."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        varlen_attn = None
    dev, dtype = "cuda", torch.bfloat16
    layer = _Layer(args.heads, args.kv_heads)
    lengths = _lengths(total, args.min_len, args.max_len, gen)
    q = torch.randn(1, args.heads, total, args.head_dim, device=dev, dtype=dtype)
    k = torch.randn(1, args.kv_heads, total, args.head_dim, device=dev, dtype=dtype)
    v = torch.randn(1, args.kv_heads, total, args.head_dim, device=dev, dtype=dtype)
    for x in (q, k, v):
        x.requires_grad_(True)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev)
    causal = torch.ones(total, total, dtype=torch.bool, device=dev).tril()
    mask = ((sample[:, None] == sample[None, :]) & causal)[None, None]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32).to(dev)

    def dense() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def packed() -> torch.Tensor:
        out, _ = packed_sdpa_forward(layer, q, k, v, None, segment_lengths=lengths)
        return out.transpose(1, 2)

    ways: dict[str, Callable[[], torch.Tensor]] = {"dense": dense, "packed": packed}
    if varlen_attn is not None:
        causal_kw: dict[str, Any] = (
            {"is_causal": True}
            if "is_causal" in inspect.signature(varlen_attn).parameters
            else {"window_size": (-1, 0)}
        )
        rep = args.heads // args.kv_heads

        def varlen() -> torch.Tensor:
            qt = q[0].transpose(0, 1)
            kt = k.repeat_interleave(rep, 1)[0].transpose(0, 1)
            vt = v.repeat_interleave(rep, 1)[0].transpose(0, 1)
            out = varlen_attn(qt, kt, vt, cu, cu, max(lengths), max(lengths), **causal_kw)
            return out.transpose(0, 1)[None]

        ways["varlen"] = varlen
    reference = dense().float()
    print(f"T={total}: {len(lengths)} samples, {min(lengths)}-{max(lengths)} tokens")
    for name, way in ways.items():
        try:
            diff = (way().float() - reference).abs().max().item()
            for _ in range(3):
                way().sum().backward()
            times = []
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                way().sum().backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            print(f"  {name:<7} forward+backward {ms:8.2f} ms   max |diff| vs dense {diff:.3g}")
        except Exception as exc:  # a way this torch or GPU cannot run: say so, go on
            print(f"  {name:<7} failed: {exc!r}"[:300])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--heads", type=int, default=14)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1280)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_gpu.py times CUDA kernels; torch sees no CUDA device", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for total in args.tokens:
        time_row(total, args, gen)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
