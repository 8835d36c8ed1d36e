"""The cases of tests/test_distributed_update.py and the process that runs them as one rank.

`run_case` is one `policy_update` on a fixed batch: in the test's own process without
torch.distributed (the 1-rank reference), and here, as `python distributed_update.py RANK WORLD
PORT MODEL_DIR OUT_DIR [BACKEND]`, on a gloo rank of a CPU world (or, BACKEND=nccl, an NCCL rank
on GPU RANK: tests/gpu/test_gpu_distributed.py) with the models sharded by FSDP2 (per decoder
layer, then the root: what grail/train/fsdp.py does). Each rank saves what its updates
returned and the updated parameters (full tensors) to OUT_DIR/rank<R>.pt.
"""

from __future__ import annotations

import copy
import datetime
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from grail.algo.grpo import GRPOLossConfig
from grail.algo.kl_control import AdaptiveKL
from grail.core.config import LoraConfig
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.models.lora import AdapterOff, with_new_adapter
from grail.models.packed_attention import use_packed_sdpa
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train.update import UpdateSettings, policy_update

# Longest completion: dr_grpo's normaliser.
MAX_COMPLETION = 6


@dataclass(frozen=True)
class Case:
    name: str
    loss_type: str = "grpo"
    batch_size: int = 5  # micro-batch, in samples (13 samples: micro-batches of 5, 5, 3)
    grad_accum: int = 1
    micro_batch_tokens: int = 0  # > 0: padding-free pieces
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    importance_sampling_level: str = "token"
    is_correction: str = "none"
    adaptive_kl: bool = False  # kl_coef adapts after each step (to a KL it always exceeds)
    zero_advantages: bool = False
    lora: bool = False


CASES = [
    Case("grpo"),
    Case("bnpo_packed", "bnpo", micro_batch_tokens=24),
    Case(
        "dr_grpo_adaptive_kl_accum",
        "dr_grpo",
        grad_accum=2,
        kl_coef=0.05,
        entropy_coef=0.01,
        adaptive_kl=True,
    ),
    Case("dapo_kl_packed_accum", "dapo", grad_accum=2, micro_batch_tokens=24, kl_coef=0.05),
    # 3 steps: the later micro-batches see ratios away from 1.
    Case(
        "grpo_sequence_level",
        importance_sampling_level="sequence",
        is_correction="sequence_truncate",
    ),
    # Micro-batches of 1 sample: rank 1 runs only dummy passes, padded and packed.
    Case("bnpo_microbatch_of_one", "bnpo", batch_size=1, grad_accum=4, kl_coef=0.05),
    Case("dapo_microbatch_of_one_packed", "dapo", batch_size=1, micro_batch_tokens=24),
    Case("zero_gradient", zero_advantages=True, grad_accum=2),
    Case("lora_kl_packed", micro_batch_tokens=24, kl_coef=0.05, lora=True),
    Case("lora_grpo", lora=True, grad_accum=2),
]


def make_batch(zero_advantages: bool) -> RolloutBatch:
    """13 samples in 4 groups: prompts of 4-7 tokens, completions of 1-6 (some micro-batches
    with a 1-token longest completion on one rank only)."""
    gen = torch.Generator().manual_seed(7)
    groups = []
    for g, replicas in enumerate((4, 3, 4, 2)):
        prompt = torch.randint(3, 500, (4 + g,), generator=gen).tolist()
        samples = []
        for _ in range(replicas):
            n = int(torch.randint(1, MAX_COMPLETION + 1, (), generator=gen))
            ids = torch.randint(3, 500, (n,), generator=gen).tolist()
            behaviour = (-torch.rand(n, generator=gen) * 3).tolist()
            advantage = 0.0 if zero_advantages else float(torch.randn((), generator=gen))
            samples.append(Sample(ids, behaviour, "length", "", 0.0, {}, False, advantage))
        groups.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(groups)


def settings_of(case: Case) -> UpdateSettings:
    loss = GRPOLossConfig(
        loss_type=case.loss_type,  # type: ignore[arg-type]  # a LossType's value
        importance_sampling_level=case.importance_sampling_level,  # type: ignore[arg-type]
        is_correction=case.is_correction,  # type: ignore[arg-type]
        kl_coef=case.kl_coef,
        entropy_coef=case.entropy_coef,
        max_completion_length=MAX_COMPLETION,
    )
    return UpdateSettings(
        loss, 0.9, case.batch_size, case.grad_accum, 1.0, micro_batch_tokens=case.micro_batch_tokens
    )


CPU = torch.device("cpu")


def models_of(
    case: Case, model_dir: Path, device: torch.device = CPU
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (LoRA: the tiny model under a nonzero adapter) and the KL reference (LoRA: the
    adapter off), the same weights in every process, on `device`."""
    torch.manual_seed(0)
    model: torch.nn.Module = load_model(model_dir).to(device)
    if case.micro_batch_tokens > 0:
        use_packed_sdpa(model)
    if case.lora:
        model = with_new_adapter(model, LoraConfig(enabled=True, r=4))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # B = 0 would make the reference the policy
                torch.nn.init.normal_(p, std=0.2)
    ref: torch.nn.Module | None = None
    if case.kl_coef > 0:
        ref = AdapterOff(model) if case.lora else copy.deepcopy(model).eval().requires_grad_(False)
    return model, ref


def run_case(
    case: Case, model: torch.nn.Module, ref: torch.nn.Module | None, device: torch.device = CPU
) -> tuple[dict[str, Any], dict[str, torch.Tensor], int]:
    """One policy_update with SGD (lr 0.1, clipped at 1.0): what it returns, the updated
    parameters as full tensors, and the tokens this process's forward passes ran (the policy's
    and the reference's, padding included)."""
    tokens = [0]

    def count(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        tokens[0] += args[0].numel()

    # A LoRA reference (AdapterOff) runs the policy's own modules: counted there.
    for m in (model, ref):
        if m is not None and not isinstance(m, AdapterOff):
            m.get_input_embeddings().register_forward_pre_hook(count)  # type: ignore[operator]
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    metrics = policy_update(
        model,
        ref,
        optimizer,
        scheduler,
        make_batch(case.zero_advantages),
        settings_of(case),
        pad_token_id=0,
        device=device,
        backward=lambda loss: loss.backward(),
        clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(trainable, c),
        kl_control=AdaptiveKL(case.kl_coef, 1e-9, 1.5, 1e-3, 1.0) if case.adaptive_kl else None,
    )
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
        for name, p in model.named_parameters()
    }
    return metrics, params, tokens[0]


def shard(model: torch.nn.Module) -> None:
    """FSDP2 over the world: each decoder layer, then the root (embeddings, final norm and the
    tied output layer)."""
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if type(module).__name__ == "Qwen2DecoderLayer":
            fully_shard(module)
    fully_shard(model)


def main(
    rank: int, world_size: int, port: int, model_dir: Path, out_dir: Path, backend: str = "gloo"
) -> None:
    torch.set_num_threads(1)  # two ranks on a 2-core machine
    device = CPU
    extra: dict[str, Any] = {}
    if backend == "nccl":  # one GPU per rank, as grail/train/sharded.py's setup_rank does
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        extra["device_id"] = device
    torch.distributed.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),  # a collective left waiting fails, not hangs
        **extra,
    )
    results: dict[str, Any] = {}
    try:
        for case in CASES:
            model, ref = models_of(case, model_dir, device)
            shard(model)
            if ref is not None and not case.lora:  # a LoRA reference is the policy, sharded
                shard(ref)
            metrics, params, tokens = run_case(case, model, ref, device)
            results[case.name] = {
                "metrics": metrics,
                "params": params if rank == 0 else {},
                "tokens": tokens,
            }
    finally:
        torch.distributed.destroy_process_group()
    torch.save(results, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    rank, world, port, model_dir, out_dir, *backend = sys.argv[1:]
    main(int(rank), int(world), int(port), Path(model_dir), Path(out_dir), *backend)
