"""Training-step throughput and model-FLOPs utilisation of the GRPO update on one GPU.

    uv run python benchmarks/train_step_gpu.py          # Qwen2.5-0.5B shape, 151,936-token vocab
    uv run python benchmarks/train_step_gpu.py --micro-batch-tokens 32768 --batch-size 64 --compile
    uv run python benchmarks/train_step_gpu.py --micro-batch-tokens 0 --batch-size 16   # padded
    uv run python benchmarks/train_step_gpu.py --device cpu --shape tiny --vocab-size 512 \\
        --groups 2 --group-size 2                        # CPU smoke test: same fields, no MFU

What is timed is what `grail-train` runs per iteration: `policy_update` (GRPO loss, backward in
bf16 autocast over float32 master weights via accelerate, gradient clipping, AdamW step) on a
synthetic rollout batch of `--groups` x `--group-size` samples. Each group shares one random
`--prompt-len`-token prompt (as in GRPO: G completions of one problem); each sample's completion
length is drawn by `--completion-spread` around `--completion-len`, seeded by `--seed`:
  uniform  an integer uniformly from [1, 2 * mean - 1] (mean exactly `--completion-len`)
  none     every completion exactly `--completion-len` tokens
A new batch (new lengths) is drawn for every update, warm-up included; building it is not timed.
The model is a random-initialised Qwen2 of `--shape` (built offline by
`grail.models.tiny.build_random_qwen2`, so nothing is downloaded): `qwen2.5-0.5b` (hidden 896,
24 layers, 14 heads, 2 KV heads, intermediate 4864, tied embeddings), `mid` (the ~0.47B
MID_PRESET) or `tiny` (TINY_PRESET); `--hidden-size` etc. override single dimensions. The
builder's vocabulary is its tokenizer's (512 tokens); the embedding is then resized to
`--vocab-size` (new rows drawn from N(0, 0.02), still tied), and token ids are drawn from
[3, vocab-size).

The update runs as the trainer runs it: `--micro-batch-tokens` is `train.micro_batch_tokens`
(0: padded micro-batches that run each distinct prompt once and its completions on its cache;
N > 0: padding-free pieces of at most N tokens, grail/train/packing.py; default: the trainer's,
4096 on CUDA and 0 on CPU), `--batch-size` is `train.batch_size` (the micro-batch in samples;
the packed pieces of one micro-batch never mix with the next one's, so pieces bigger than a
micro-batch's tokens need a bigger `--batch-size`), `accelerator.autocast` is passed as the
trainer passes it, `--compile` compiles the transformer body as `train.compile` does, and
`--gradient-checkpointing` is `model.gradient_checkpointing`. Gradient accumulation covers the
whole batch, so one update is one optimizer step. Attention is what grail-train runs: packed
pieces attend per sample (grail/models/packed_attention.py), compiled or not, else sdpa;
`--attn-implementation` overrides it as a diagnostic (`sdpa`: the dense block-diagonal mask of
packed pieces, as before packed sdpa); `--threads` sets torch's CPU threads.

Numbers printed (one line per measurement; `--json`: one JSON object instead):
  layout        padded or packed, and the padding fraction: padded token slots / all token slots
                of the transformer-body forward passes (padded: [distinct prompts x longest
                prompt] + [samples x (longest completion - 1)] per micro-batch, or
                [samples x (longest prompt + longest completion)] with gradient checkpointing,
                which turns the prompt cache off; packed: 0 by construction)
  tokens/s      prompt + completion tokens of all samples (a group's prompt counted once per
                sample) / seconds, summed over the timed updates
  model FLOPs   per sample, with S = its prompt + completion length and c = its completion length:
                  6 N_body S + 12 L d S^2 + 6 d V c
                forward + backward (PaLM, Chowdhery et al. 2022, appendix B: 6 N per token plus
                attention 12 L d S per token), N_body = parameters outside the input embedding
                and the output layer, L layers, d hidden size, and the output layer (d x V
                weights, counted once: tied to the embedding) on the c positions whose logits
                the loss needs (the ones predicting completion tokens). These FLOPs do not
                depend on the layout: the padded layout, which runs a shared prompt once, is
                credited with it per sample, like tokens/s; recomputation (gradient
                checkpointing, the packed output layer's checkpointed chunks) is not counted.
                Also printed: the same with the output layer on every token (6 N S with N
                including it once, the convention of plain-forward MFU figures).
  MFU           model TFLOP/s / the GPU's peak dense bf16 TFLOP/s (table below, or
                --peak-tflops); on CPU only with --peak-tflops
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import print_profile

from grail.models.tiny import MID_PRESET, TINY_PRESET

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

QWEN25_VOCAB_SIZE = 151936


def _preset(p: dict[str, Any]) -> dict[str, int]:
    keys = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")
    return {k: int(p[k]) for k in keys}


# Model shapes (`--shape`), all with tied embeddings. qwen2.5-0.5b is Qwen/Qwen2.5-0.5B's
# config.json (its attention biases are Qwen2's, as in every Qwen2 this builder makes).
SHAPES: dict[str, dict[str, int]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
    },
    # Qwen/Qwen2.5-1.5B's config.json (tied embeddings too)
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "num_layers": 28,
        "num_heads": 12,
        "num_kv_heads": 2,
        "intermediate_size": 8960,
    },
    "mid": _preset(MID_PRESET),
    "tiny": _preset(TINY_PRESET),
}


def peak_tflops(device_name: str) -> float | None:
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment.lower() in device_name.lower():
            return tflops
    return None


def completion_lengths(n: int, mean: int, spread: str, gen: Any) -> list[int]:
    """`n` completion lengths of mean `mean`: `none` all equal, `uniform` integers uniformly
    from [1, 2 * mean - 1], drawn from the torch.Generator `gen`."""
    import torch

    if mean < 1:
        raise ValueError(f"completion length must be >= 1, got {mean}")
    if spread == "none":
        return [mean] * n
    if spread == "uniform":
        return torch.randint(1, 2 * mean, (n,), generator=gen).tolist()
    raise ValueError(f"unknown completion spread {spread!r}: none | uniform")


def max_completion_len(mean: int, spread: str) -> int:
    return mean if spread == "none" else 2 * mean - 1


def synthetic_batch(
    groups: int,
    group_size: int,
    prompt_len: int,
    lengths: Sequence[int],
    vocab: int,
    gen: Any,
) -> Any:
    """A RolloutBatch of `groups` groups, each one random prompt shared by `group_size`
    samples whose completions have `lengths` (group-major), token ids in [3, vocab), random
    normal advantages and behaviour log-probabilities of -6."""
    import torch

    from grail.envs.base import Problem
    from grail.rollouts.batch import Group, RolloutBatch, Sample

    if len(lengths) != groups * group_size:
        raise ValueError(f"{len(lengths)} lengths for {groups} x {group_size} samples")
    made = []
    for g in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        samples = []
        for n in lengths[g * group_size : (g + 1) * group_size]:
            ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
            advantage = float(torch.randn((), generator=gen))
            samples.append(Sample(ids, [-6.0] * n, "length", "", 0.0, {}, False, advantage))
        made.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(made)


def model_flops(
    samples: Sequence[tuple[int, int]], body_params: int, head_params: int, layers: int, hidden: int
) -> tuple[float, float]:
    """Forward + backward model FLOPs of (prompt, completion) length pairs (module docstring):
    (output layer on the completion-predicting positions, output layer on every token)."""
    body = sum(
        6.0 * body_params * (p + c) + 12.0 * layers * hidden * (p + c) ** 2 for p, c in samples
    )
    completion = sum(c for _, c in samples)
    every = sum(p + c for p, c in samples)
    return body + 6.0 * head_params * completion, body + 6.0 * head_params * every


@dataclass
class Layout:
    """What the forward passes of one update run: token slots and real tokens in them."""

    slots: int
    tokens: int
    passes: int  # forward calls of the transformer body
    largest: int  # tokens (slots) of the largest forward call

    @property
    def padding_frac(self) -> float:
        return 1.0 - self.tokens / self.slots if self.slots else 0.0


def padded_layout(micro_batches: Sequence[Sequence[tuple[list[int], Any]]], shared: bool) -> Layout:
    """The body's forward passes of padded micro-batches (grail.train.microbatch.completion_logits):
    with `shared`, each distinct prompt once, left-padded to the longest, then every completion
    but its last token, right-padded to the longest minus one, on the prompt's cache; without
    (gradient checkpointing), every row in full, prompt then completion, each padded."""
    slots = tokens = passes = largest = 0
    for items in micro_batches:
        prompts = {tuple(p) for p, _ in items}
        width = max(len(p) for p in prompts)
        lengths = [len(s.completion_ids) for _, s in items]
        k = max(*lengths, 1)
        calls: list[tuple[int, int]] = []  # (slots, tokens) per forward call
        if shared:
            calls.append((len(prompts) * width, sum(len(p) for p in prompts)))
            if k > 1:
                calls.append((len(items) * (k - 1), sum(min(n, k - 1) for n in lengths)))
        else:
            calls.append((len(items) * (width + k), sum(len(p) for p, _ in items) + sum(lengths)))
        for s, t in calls:
            slots, tokens, passes, largest = slots + s, tokens + t, passes + 1, max(largest, s)
    return Layout(slots, tokens, passes, largest)


def packed_layout(micro_batches: Sequence[Sequence[tuple[list[int], Any]]], budget: int) -> Layout:
    """The padding-free pieces (grail.train.packing.split_by_tokens) of the micro-batches."""
    from grail.train.packing import split_by_tokens

    sizes = [
        sum(len(p) + len(s.completion_ids) for p, s in piece)
        for items in micro_batches
        for piece in split_by_tokens(items, budget)
    ]
    return Layout(sum(sizes), sum(sizes), len(sizes), max(sizes))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--vocab-size", type=int, default=QWEN25_VOCAB_SIZE)
    for dim in SHAPES["tiny"]:  # override one dimension of --shape
        flag = "--" + dim.replace("num_", "").replace("_", "-")
        parser.add_argument(flag, dest=dim, type=int, default=None, help="default: --shape's")
    parser.add_argument("--groups", type=int, default=8, help="problems per iteration")
    parser.add_argument("--group-size", type=int, default=8, help="rollouts per problem")
    parser.add_argument(
        "--batch-size", type=int, default=32, help="micro-batch in samples (train.batch_size)"
    )
    parser.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=None,
        help="train.micro_batch_tokens: 0 padded, N packed pieces of <= N tokens; "
        "default: the trainer's (4096 on CUDA, 0 on CPU)",
    )
    parser.add_argument("--compile", action="store_true", help="train.compile: compile the body")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--prompt-len", type=int, default=256, help="one prompt per group")
    parser.add_argument("--completion-len", type=int, default=512, help="mean completion length")
    parser.add_argument("--completion-spread", choices=("uniform", "none"), default="uniform")
    parser.add_argument("--seed", type=int, default=0, help="batches (lengths, tokens)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed updates first")
    parser.add_argument("--steps", type=int, default=5, help="timed updates")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the table")
    parser.add_argument(
        "--attn-implementation",
        default=None,
        help="transformers attention (sdpa, flex_attention, flash_attention_2, eager); default: "
        "what grail-train runs (packed sdpa, sdpa per sample, for packed pieces; sdpa "
        "otherwise); sdpa here gives packed pieces the dense block-diagonal mask",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed updates, profile one more and print its top operators to stderr",
    )
    parser.add_argument(
        "--device", default="cuda:0", help="cpu runs the same code (a smoke test, no MFU)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shape = {k: getattr(args, k) or v for k, v in SHAPES[args.shape].items()}
    if args.vocab_size <= 3:
        raise SystemExit("--vocab-size must be > 3 (token ids are drawn from [3, vocab-size))")
    if args.prompt_len < 1 or args.batch_size < 1:
        raise SystemExit("--prompt-len and --batch-size must be >= 1")
    if args.micro_batch_tokens is not None and args.micro_batch_tokens < 0:
        raise SystemExit("--micro-batch-tokens must be >= 0 (0: padded)")

    import torch

    on_cuda = not args.device.startswith("cpu")
    if on_cuda and not torch.cuda.is_available():
        print(
            "train_step_gpu.py measures a GPU training step, and torch sees no CUDA device "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda}). Run it on a machine "
            "with an NVIDIA GPU, or pass --device cpu (e.g. --shape tiny --vocab-size 512) for a "
            "smoke test.",
            file=sys.stderr,
        )
        return 2

    from accelerate import Accelerator

    from grail.algo.grpo import GRPOLossConfig
    from grail.models.loading import load_model
    from grail.models.packed_attention import use_packed_sdpa
    from grail.models.tiny import build_random_qwen2
    from grail.train.microbatch import microbatches
    from grail.train.packing import decoder_and_head, resolve_micro_batch_tokens
    from grail.train.update import UpdateSettings, policy_update

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if on_cuda:
        torch.cuda.set_device(device)
    accelerator = Accelerator(cpu=not on_cuda, mixed_precision="bf16" if on_cuda else "no")

    def sync() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    longest = args.prompt_len + max_completion_len(args.completion_len, args.completion_spread)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_random_qwen2(
            Path(tmp) / "model",
            **shape,
            max_position_embeddings=max(2048, longest),
            tie_word_embeddings=True,
        )
        model = load_model(str(model_dir), dtype="float32", device="cpu")
    if model.config.vocab_size != args.vocab_size:
        torch.manual_seed(args.seed)
        model.resize_token_embeddings(args.vocab_size, mean_resizing=False)
    budget = resolve_micro_batch_tokens(args.micro_batch_tokens, torch.device(args.device))
    if args.attn_implementation:
        model.set_attn_implementation(args.attn_implementation)
    elif budget:
        use_packed_sdpa(model)  # as the trainer does (grail/train/trainer.py)
    model = model.to(device)
    # As the trainer does (grail/train/trainer.py): compile the body, then checkpointing.
    if args.compile:
        decoder_and_head(model)[0].compile()
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head is embedding
    params = sum(p.numel() for p in model.parameters())  # a tied weight is listed once
    head_params = head.numel()
    body_params = params - embedding.numel() - (0 if tied else head_params)
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    samples_per_update = args.groups * args.group_size
    settings = UpdateSettings(
        loss=GRPOLossConfig(
            max_completion_length=max_completion_len(args.completion_len, args.completion_spread)
        ),
        temperature=1.0,
        batch_size=args.batch_size,
        grad_accum_steps=math.ceil(samples_per_update / args.batch_size),
        grad_clip=1.0,
        micro_batch_tokens=args.micro_batch_tokens,
    )

    gen = torch.Generator().manual_seed(args.seed)

    def update() -> tuple[float, Any]:
        lengths = completion_lengths(
            samples_per_update, args.completion_len, args.completion_spread, gen
        )
        data = synthetic_batch(args.groups, args.group_size, args.prompt_len, lengths, vocab, gen)
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
            autocast=accelerator.autocast,
        )
        sync()
        return time.perf_counter() - t0, data

    for _ in range(args.warmup):
        update()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    timed = [update() for _ in range(args.steps)]
    if args.profile:
        print_profile(update, on_cuda)

    seconds = [s for s, _ in timed]
    total_s = sum(seconds)
    pairs = [(len(g.prompt_ids), len(s.completion_ids)) for _, b in timed for g, s in _pairs(b)]
    tokens = sum(p + c for p, c in pairs)
    flops, flops_every = model_flops(
        pairs, body_params, head_params, shape["num_layers"], shape["hidden_size"]
    )
    layouts = [
        packed_layout(microbatches(b, args.batch_size), budget)
        if budget
        else padded_layout(microbatches(b, args.batch_size), not args.gradient_checkpointing)
        for _, b in timed
    ]
    slots = sum(x.slots for x in layouts)
    padding = 1.0 - sum(x.tokens for x in layouts) / slots
    name = torch.cuda.get_device_name(device) if on_cuda else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if on_cuda else None)
    achieved = flops / total_s / 1e12
    achieved_every = flops_every / total_s / 1e12
    if on_cuda:
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        from common import peak_rss_mb

        peak_mem = peak_rss_mb() / 1024
    c_all = [c for _, c in pairs]
    result: dict[str, Any] = {
        "device": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": args.shape,
        **shape,
        "vocab_size": vocab,
        "tied_embeddings": tied,
        "params": params,
        "body_params": body_params,
        "head_params": head_params,
        "groups": args.groups,
        "group_size": args.group_size,
        "prompt_len": args.prompt_len,
        "completion_len": args.completion_len,
        "completion_spread": args.completion_spread,
        "completion_len_min": min(c_all),
        "completion_len_max": max(c_all),
        "completion_len_mean": sum(c_all) / len(c_all),
        "batch_size": args.batch_size,
        "grad_accum_steps": settings.grad_accum_steps,
        "micro_batch_tokens": budget,
        "layout": "packed" if budget else "padded",
        "padding_frac": padding,
        "forward_passes_per_update": sum(x.passes for x in layouts) / len(layouts),
        "largest_forward_tokens": max(x.largest for x in layouts),
        "precision": "bf16 autocast" if on_cuda else "float32",
        "gradient_checkpointing": args.gradient_checkpointing,
        "compile": args.compile,
        "attn_implementation": model.config._attn_implementation,
        "steps": args.steps,
        "update_s_median": statistics.median(seconds),
        "update_s_min": min(seconds),
        "update_s_max": max(seconds),
        "tokens_per_update": tokens / len(timed),
        "tokens_per_s": tokens / total_s,
        "model_tflop_per_update": flops / len(timed) / 1e12,
        "model_tflops": achieved,
        "model_tflops_head_every_token": achieved_every,
        "peak_tflops": peak,
        "mfu": achieved / peak if peak else None,
        "mfu_head_every_token": achieved_every / peak if peak else None,
        "peak_memory_gib": peak_mem,
        "peak_memory_kind": "torch.cuda.max_memory_allocated" if on_cuda else "process RSS",
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_text(result)
    return 0


def _pairs(batch: Any) -> list[tuple[Any, Any]]:
    return [(g, s) for g in batch.groups for s in g.samples]


def _millions(n: int) -> str:
    return f"{n / 1e6:.4g} M"


def print_text(r: dict[str, Any]) -> None:
    """One line per measurement, `name  value`."""
    lines = [
        ("device", f"{r['device']}, torch {r['torch']}"),
        (
            "model",
            f"{r['shape']}: Qwen2 d={r['hidden_size']} L={r['num_layers']} heads="
            f"{r['num_heads']}/{r['num_kv_heads']} ffn={r['intermediate_size']} vocab="
            f"{r['vocab_size']}, {_millions(r['params'])} parameters ("
            f"{_millions(r['body_params'])} body, {_millions(r['head_params'])} output layer"
            f"{', tied to the embedding' if r['tied_embeddings'] else ''})",
        ),
        (
            "batch",
            f"{r['groups']} x {r['group_size']} samples, {r['prompt_len']}-token prompt per group,"
            f" completions {r['completion_spread']} mean {r['completion_len']} (drawn "
            f"{r['completion_len_min']}-{r['completion_len_max']}, mean "
            f"{r['completion_len_mean']:.1f}), {r['tokens_per_update']:,.0f} tokens per update",
        ),
        (
            "settings",
            f"micro-batch {r['batch_size']} samples, grad accumulation {r['grad_accum_steps']}, "
            f"micro_batch_tokens {r['micro_batch_tokens']}, {r['precision']}, gradient "
            f"checkpointing {'on' if r['gradient_checkpointing'] else 'off'}, compile "
            f"{'on' if r['compile'] else 'off'}, attention {r['attn_implementation']}",
        ),
        (
            "layout",
            f"{r['layout']}: {r['forward_passes_per_update']:g} body forward passes per update, "
            f"largest {r['largest_forward_tokens']:,} token slots",
        ),
        (
            "padding",
            f"{r['padding_frac']:.3f} of body token slots"
            + (" (packed: none by construction)" if r["layout"] == "packed" else ""),
        ),
        (
            "update",
            f"median {r['update_s_median']:.3f} s over {r['steps']} (min "
            f"{r['update_s_min']:.3f}, max {r['update_s_max']:.3f})",
        ),
        ("throughput", f"{r['tokens_per_s']:,.0f} tokens/s (prompt + completion of every sample)"),
        (
            "model TFLOP/s",
            f"{r['model_tflops']:.3g} (6 N_body S + 12 L d S^2 + 6 d V c per sample: output "
            f"layer on completion positions); {r['model_tflops_head_every_token']:.3g} with the "
            "output layer on every token",
        ),
    ]
    if r["mfu"] is not None:
        lines.append(
            (
                "MFU",
                f"{100 * r['mfu']:.1f} % of {r['peak_tflops']:g} peak bf16 TFLOP/s "
                f"({100 * r['mfu_head_every_token']:.1f} % with the output layer on every token)",
            )
        )
    elif r["device"] != "cpu":
        lines.append(("MFU", "unknown peak for this GPU: pass --peak-tflops"))
    else:
        lines.append(("MFU", "n/a on CPU (no peak; --peak-tflops to set one)"))
    lines.append(("peak memory", f"{r['peak_memory_gib']:.2f} GiB ({r['peak_memory_kind']})"))
    for name, value in lines:
        print(f"{name:<17} {value}")


if __name__ == "__main__":
    sys.exit(main())
