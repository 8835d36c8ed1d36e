"""LoRA against full fine-tuning: what a weight sync writes and costs, and the trainer's memory.

    uv run python benchmarks/lora.py                   # the ~0.47B preset, float32, CPU
    uv run python benchmarks/lora.py --model tiny --reps 5

1. Weight sync, as `grail-train` does after every optimizer step: the trainer's
   `save_pretrained` of what the server needs (the whole model, or the adapter alone), then the
   built-in server's in-place load (`BuiltinServer.sync_weights`; a server started with
   `--lora-dir` for the adapter). Printed: bytes written, save and sync seconds (median of
   `--reps`, after one warm-up).
2. Trainer peak memory (VmHWM, in a fresh process each) for one GRPO update of 8 x 8 samples of
   64 + 64 tokens, micro-batch 16, with `train.kl_coef=0.05` (so a full fine-tuning run holds a
   reference model), full against LoRA, each with and without gradient checkpointing: under
   LoRA the reference is the base with the adapter off, and AdamW keeps state and gradients for
   the adapter only; the activations (with gradients through every layer) are the same in both.

Results: benchmarks/results/lora.json. LoRA settings: `model.lora` defaults (r=16, all linear
layers of the blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from common import peak_rss_mb, print_table, synthetic_batch, write_results

from grail.core.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from grail.models.lora import with_new_adapter


def source_model(name: str, work: Path) -> Path:
    from grail.models.tiny import MID_PRESET, build_random_qwen2, ensure_tiny_model

    if name == "tiny":
        return ensure_tiny_model()
    return build_random_qwen2(work / "mid", seed=0, dtype=torch.float32, **MID_PRESET)


def bytes_in(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def perturb_(model: torch.nn.Module, seed: int, only_lora: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if only_lora and "lora_" not in name:
                continue
            param.add_(0.01 * torch.randn(param.shape, generator=generator))


def bench_sync(
    source: Path, work: Path, reps: int, threads: int, kinds: tuple[str, ...] = ("full", "adapter")
) -> dict[str, Any]:
    """Full and adapter sync of the same base, each through its own built-in server."""
    from transformers import AutoModelForCausalLM

    from grail.inference.backends.builtin import BuiltinServer

    results: dict[str, Any] = {}
    for kind in kinds:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        serve_dir = work / f"serve-{kind}"
        model.save_pretrained(serve_dir)
        lora_dir = None
        if kind == "adapter":
            model = with_new_adapter(model, LoraConfig(enabled=True))
            lora_dir = work / "adapter"
            model.save_pretrained(lora_dir)
        sync_dir = lora_dir or serve_dir
        server = BuiltinServer(
            serve_dir, "policy", log_dir=work / "logs", threads=threads, lora_dir=lora_dir
        )
        saves, syncs = [], []
        with server:
            server.wait_ready(600)
            for rep in range(reps + 1):  # the first is a warm-up
                perturb_(model, rep, only_lora=kind == "adapter")
                t0 = time.perf_counter()
                model.save_pretrained(sync_dir, safe_serialization=True)
                t1 = time.perf_counter()
                server.sync_weights(sync_dir, "in_place", fallback=False, weight_version=str(rep))
                t2 = time.perf_counter()
                if rep:
                    saves.append(t1 - t0)
                    syncs.append(t2 - t1)
        results[kind] = {
            "bytes": bytes_in(sync_dir),
            "save_s": statistics.median(saves),
            "sync_s": statistics.median(syncs),
        }
        del model
    return results


def memory_worker(source: str, lora: bool, checkpointing: bool, out: Path) -> None:
    """One trainer, one update; its peak resident memory into `out` (run in a fresh process)."""
    from grail.core.reproducible import apply_reproducible_env
    from grail.train.trainer import Trainer, setup_torch

    cfg = Config(
        model=ModelConfig(
            train_id=source,
            lora=LoraConfig(enabled=lora),
            gradient_checkpointing=checkpointing,
        ),
        data=DataConfig(
            environment="copy_digits", problems_per_iteration=8, rollouts_per_problem=8
        ),
        train=TrainConfig(batch_size=16, lr=1e-5, kl_coef=0.05),
        checkpoint=CheckpointConfig(),
    )
    if cfg.reproducible:  # the default: its kernels, before torch's first operation
        apply_reproducible_env(os.environ)
    trainer = Trainer(cfg, setup_torch(cfg), None)
    before = peak_rss_mb()
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    trainer.update(synthetic_batch(8, 8, prompt_len=64, completion_len=64, vocab=vocab))
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    out.write_text(
        json.dumps({"peak_mb": peak_rss_mb(), "after_load_mb": before, "trainable": trainable})
    )


MEMORY_RUNS = (
    ("full", False, False),
    ("lora", True, False),
    ("full, gradient checkpointing", False, True),
    ("lora, gradient checkpointing", True, True),
)


def bench_memory(
    source: Path, work: Path, runs: Sequence[tuple[str, bool, bool]] = MEMORY_RUNS
) -> dict[str, Any]:
    """Each of full and LoRA, with and without gradient checkpointing (which takes the
    activations, the same in both, out of the comparison)."""
    results = {}
    for kind, lora, checkpointing in runs:
        out = work / f"memory-{len(results)}.json"
        worker = ["--memory-worker", str(source), str(int(lora)), str(int(checkpointing)), str(out)]
        subprocess.run([sys.executable, __file__, *worker], check=True, timeout=1800)
        results[kind] = json.loads(out.read_text())
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["mid", "tiny"], default="mid")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default: results/)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="the adapter's sync once and the LoRA memory run alone: the script end to end in "
        "seconds (the test suite's), its numbers no comparison",
    )
    parser.add_argument("--memory-worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_worker:
        source, lora, checkpointing, out = args.memory_worker
        memory_worker(source, lora == "1", checkpointing == "1", Path(out))
        return
    with tempfile.TemporaryDirectory(prefix="grail-lora-bench-") as tmp:
        work = Path(tmp)
        source = source_model(args.model, work)
        if args.smoke:
            sync = bench_sync(source, work, 1, args.threads, ("adapter",))
            memory = bench_memory(source, work, MEMORY_RUNS[1:2])
        else:
            sync = bench_sync(source, work, args.reps, args.threads)
            memory = bench_memory(source, work)
    print_table(
        f"weight sync ({args.model}, float32, in place, median of {args.reps})",
        ["sync", "bytes written", "save s", "server load s"],
        [[k, f"{v['bytes'] / 2**20:.1f} MiB", v["save_s"], v["sync_s"]] for k, v in sync.items()],
    )
    print_table(
        "trainer peak memory, one update of 8 x 8 samples, kl_coef=0.05",
        ["fine-tuning", "trainable parameters", "peak RSS MiB"],
        [[k, v["trainable"], f"{v['peak_mb']:.0f}"] for k, v in memory.items()],
    )
    write_results("lora", {"model": args.model, "sync": sync, "memory": memory}, args.out)


if __name__ == "__main__":
    main()
