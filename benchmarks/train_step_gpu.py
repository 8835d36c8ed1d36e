"""Training-step throughput and model-FLOPs utilisation of the GRPO update on one GPU.

    uv run python benchmarks/train_step_gpu.py                 # ~0.5B random Qwen2, defaults
    uv run python benchmarks/train_step_gpu.py --batch-size 8 --completion-len 512

What is timed is what `grail-train` runs per iteration: `policy_update` (GRPO loss, backward in
bf16 autocast over float32 master weights via accelerate, gradient clipping, AdamW step) on a
synthetic rollout batch of `--groups` x `--group-size` samples, each a `--prompt-len`-token prompt
plus a `--completion-len`-token completion. The model is a random-initialised Qwen2 built offline
(default shape: ~0.47B parameters at the tiny tokenizer's 512-token vocabulary), so nothing is
downloaded and the numbers depend only on the shape.

Numbers printed:
  tokens/s      (prompt + completion tokens in the batch) / seconds per update
  model TFLOP/s FLOPs per update / seconds, with FLOPs per token (PaLM, Chowdhery et al. 2022,
                appendix B) = 6 N + 12 L d S for a forward+backward pass, N = parameters outside
                the embedding, L layers, d hidden size, S sequence length. With one optimizer step
                per iteration the update makes exactly one forward and one backward pass.
  MFU           model TFLOP/s / the GPU's peak dense bf16 TFLOP/s (table below, or --peak-tflops)
Gradient checkpointing (`--gradient-checkpointing`) recomputes the forward and is not counted as
model FLOPs, as usual for MFU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from grail.models.tiny import MID_PRESET

# Peak dense bf16 tensor-core TFLOP/s (vendor datasheets, without sparsity), by a fragment of
# torch.cuda.get_device_name(). First match wins, so the more specific names come first.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.4),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),  # SXM / HBM3
    ("GH200", 989.4),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("A10G", 70.0),  # the AWS part, lower clocks than A10
    ("A10", 125.0),
    ("L4", 121.0),
    ("RTX 4090", 165.2),
)


def peak_tflops(device_name: str) -> float | None:
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops
    return None


def flops_per_token(non_embedding_params: int, layers: int, hidden: int, seq_len: int) -> float:
    """Forward + backward FLOPs per token: 6 N + 12 L d S (PaLM's estimate, attention included)."""
    return 6.0 * non_embedding_params + 12.0 * layers * hidden * seq_len


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Defaults: grail.models.tiny.MID_PRESET (~0.47B), the shape the GPU tests use.
    parser.add_argument("--hidden-size", type=int, default=MID_PRESET["hidden_size"])
    parser.add_argument("--layers", type=int, default=MID_PRESET["num_layers"])
    parser.add_argument("--heads", type=int, default=MID_PRESET["num_heads"])
    parser.add_argument("--kv-heads", type=int, default=MID_PRESET["num_kv_heads"])
    parser.add_argument("--intermediate-size", type=int, default=MID_PRESET["intermediate_size"])
    parser.add_argument("--groups", type=int, default=8, help="problems per iteration")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per problem")
    parser.add_argument("--batch-size", type=int, default=16, help="micro-batch, in samples")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    parser.add_argument("--steps", type=int, default=5, help="timed updates")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the table")
    parser.add_argument(
        "--device", default="cuda:0", help="cpu runs the same code (a smoke test, no MFU)"
    )
    args = parser.parse_args(argv)

    import torch

    on_cuda = not args.device.startswith("cpu")
    if on_cuda and not torch.cuda.is_available():
        print(
            "train_step_gpu.py measures a GPU training step, and torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on a machine "
            "with an NVIDIA GPU; on CPU, `uv run grail-train` reports its own tokens/s.",
            file=sys.stderr,
        )
        return 2

    from accelerate import Accelerator

    from grail.algo.grpo import GRPOLossConfig
    from grail.envs.base import Problem
    from grail.models.loading import load_model
    from grail.models.tiny import build_random_qwen2
    from grail.rollouts import Group, RolloutBatch, Sample
    from grail.train.update import UpdateSettings, policy_update

    device = torch.device(args.device)
    if on_cuda:
        torch.cuda.set_device(device)
    accelerator = Accelerator(cpu=not on_cuda, mixed_precision="bf16" if on_cuda else "no")

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_qwen2(
            Path(tmp) / "model",
            hidden_size=args.hidden_size,
            num_layers=args.layers,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=max(2048, args.prompt_len + args.completion_len),
        )
        model = load_model(str(model_dir), dtype="float32", device=device)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    settings = UpdateSettings(
        loss=GRPOLossConfig(max_completion_length=args.completion_len),
        temperature=1.0,
        batch_size=args.batch_size,
        grad_accum_steps=max(1, -(-args.groups * args.group_size // args.batch_size)),
        grad_clip=1.0,
    )

    gen = torch.Generator().manual_seed(0)

    def batch() -> RolloutBatch:
        groups = []
        for g in range(args.groups):
            prompt = torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist()
            samples = []
            for _ in range(args.group_size):
                ids = torch.randint(3, vocab, (args.completion_len,), generator=gen).tolist()
                advantage = float(torch.randn((), generator=gen))
                samples.append(
                    Sample(ids, [-6.0] * len(ids), "length", "", 0.0, {}, False, advantage)
                )
            groups.append(Group(Problem(g, [], ""), prompt, samples))
        return RolloutBatch(groups)

    def update() -> float:
        data = batch()
        sync()
        t0 = time.perf_counter()
        policy_update(
            model,
            None,
            optimizer,
            scheduler,
            data,
            settings,
            pad_token_id=0,
            device=accelerator.device,
            backward=accelerator.backward,
            clip_grad_norm=lambda c: accelerator.clip_grad_norm_(model.parameters(), c),
        )
        sync()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        update()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    seconds = [update() for _ in range(args.steps)]

    seq = args.prompt_len + args.completion_len
    tokens = args.groups * args.group_size * seq
    per_update = statistics.median(seconds)
    flops = flops_per_token(params - embedding, args.layers, args.hidden_size, seq) * tokens
    achieved = flops / per_update / 1e12
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if on_cuda else None)
    print(f"device            {name}, torch {torch.__version__}")
    print(
        f"model             Qwen2 d={args.hidden_size} L={args.layers} heads={args.heads}/"
        f"{args.kv_heads} ffn={args.intermediate_size}: {params / 1e6:.1f} M parameters "
        f"({(params - embedding) / 1e6:.1f} M outside the embedding)"
    )
    print(
        f"batch             {args.groups} x {args.group_size} samples of {args.prompt_len} + "
        f"{args.completion_len} tokens, micro-batch {args.batch_size}, "
        f"grad accumulation {settings.grad_accum_steps}, "
        f"{'bf16 autocast' if on_cuda else 'float32'}, "
        f"gradient checkpointing {'on' if args.gradient_checkpointing else 'off'}"
    )
    print(
        f"update            median {per_update:.3f} s over {args.steps} "
        f"(min {min(seconds):.3f}, max {max(seconds):.3f})"
    )
    print(f"throughput        {tokens / per_update:,.0f} tokens/s")
    print(f"model TFLOP/s     {achieved:.1f}")
    if peak:
        print(f"MFU               {100 * achieved / peak:.1f} % of {peak:g} peak bf16 TFLOP/s")
    elif on_cuda:
        print("MFU               unknown peak for this GPU: pass --peak-tflops")
    else:
        print("MFU               n/a on CPU")
    if on_cuda:
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30
        print(f"peak memory       {peak_mem:.1f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
