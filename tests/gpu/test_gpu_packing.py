"""The packed update on CUDA (`train.micro_batch_tokens`, grail/train/packing.py): under bf16
autocast, as the trainer runs it, the packed pieces give the padded update's loss and gradient
within bf16 rounding, and bound the memory by the token budget."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator

from grail.algo.grpo import GRPOLossConfig
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.models.packed_attention import use_packed_sdpa
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train.update import UpdateSettings, policy_update


def _batch(groups: int, group_size: int, prompt_len: int, max_completion: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, 500, (prompt_len,), generator=gen).tolist()
        samples = []
        for _ in range(group_size):
            n = int(torch.randint(1, max_completion, (), generator=gen))
            ids = torch.randint(3, 500, (n,), generator=gen).tolist()
            logprobs = (-torch.rand(n, generator=gen) * 3).tolist()
            advantage = float(torch.randn((), generator=gen))
            samples.append(Sample(ids, logprobs, "length", "", 0.0, {}, False, advantage))
        out.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(out)


def _gradient(
    model_dir: Path, batch: RolloutBatch, tokens: int, attention: str = "sdpa"
) -> tuple[torch.Tensor, float, int]:
    """The first optimizer step's gradient, the loss, and the peak CUDA memory of one update."""
    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = load_model(model_dir, dtype="float32", device=accelerator.device)
    model.set_attn_implementation(attention)
    if tokens and attention == "sdpa":
        use_packed_sdpa(model)  # as the trainer does for packed pieces (grail/train/trainer.py)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    grads: list[torch.Tensor] = []

    def clip(c: float) -> torch.Tensor:
        grads.append(torch.cat([p.grad.flatten().float() for p in model.parameters()]))
        return accelerator.clip_grad_norm_(model.parameters(), c)

    settings = UpdateSettings(
        GRPOLossConfig(loss_type="dapo", max_completion_length=1024),
        1.0,
        batch_size=len(batch.samples),
        grad_accum_steps=1,
        grad_clip=1.0,
        micro_batch_tokens=tokens,
    )
    torch.cuda.reset_peak_memory_stats()
    metrics = policy_update(
        model,
        None,
        optimizer,
        scheduler,
        batch,
        settings,
        pad_token_id=0,
        device=accelerator.device,
        backward=accelerator.backward,
        clip_grad_norm=clip,
        autocast=accelerator.autocast,
    )
    return grads[0], float(metrics["loss_total"]), torch.cuda.max_memory_allocated()  # type: ignore[arg-type]


@pytest.mark.parametrize("model", ["tiny", "mid"])
def test_packed_update_matches_the_padded_one_on_cuda(
    model: str, tiny_model_dir: Path, mid_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grail.models import packed_attention as pa

    varlen_calls: list[int] = []
    if pa._VARLEN is not None:  # the packed pieces must reach torch's varlen kernel, not the loop
        kernel = pa._VARLEN

        def counted(*args: Any, **kwargs: Any) -> Any:
            varlen_calls.append(1)
            return kernel(*args, **kwargs)

        monkeypatch.setattr(pa, "_VARLEN", counted)
    model_dir = tiny_model_dir if model == "tiny" else mid_model_dir
    batch = _batch(groups=4, group_size=8, prompt_len=64, max_completion=512)
    padded, padded_loss, padded_peak = _gradient(model_dir, batch, tokens=0)
    assert not varlen_calls  # padded micro-batches attend with sdpa's mask
    packed, packed_loss, packed_peak = _gradient(model_dir, batch, tokens=4096)
    assert varlen_calls or pa._VARLEN is None
    # bf16 autocast: the two layouts round differently; the direction and size agree.
    cosine = float(torch.nn.functional.cosine_similarity(packed, padded, dim=0))
    assert cosine > 0.99, cosine
    assert float(packed.norm()) == pytest.approx(float(padded.norm()), rel=0.05)
    assert packed_loss == pytest.approx(padded_loss, rel=0.05, abs=1e-3)
    assert packed_peak < padded_peak, (packed_peak, padded_peak)


def test_flex_attention_packed_update_matches_the_padded_one_on_cuda(mid_model_dir: Path) -> None:
    # flex_attention builds a block mask from the pieces' position ids: attention linear in the
    # pieces' lengths instead of sdpa's dense block-diagonal mask (quadratic in the packed row).
    batch = _batch(groups=4, group_size=8, prompt_len=64, max_completion=512)
    padded, padded_loss, _ = _gradient(mid_model_dir, batch, tokens=0)
    flex, flex_loss, _ = _gradient(mid_model_dir, batch, tokens=4096, attention="flex_attention")
    cosine = float(torch.nn.functional.cosine_similarity(flex, padded, dim=0))
    assert cosine > 0.99, cosine
    assert float(flex.norm()) == pytest.approx(float(padded.norm()), rel=0.05)
    assert flex_loss == pytest.approx(padded_loss, rel=0.05, abs=1e-3)


class _Attention(torch.nn.Module):
    """What transformers' sdpa_attention_forward reads from an attention module."""

    is_causal = True

    def __init__(self, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.num_key_value_groups = heads // kv_heads


def test_varlen_kernel_attends_as_the_per_sample_loop_on_cuda() -> None:
    # On CUDA a packed row goes to torch's varlen flash kernel in one call; the loop of sdpa calls
    # (what CPU runs and the CPU tests check) is the reference, forward and backward.
    from grail.models import packed_attention as pa

    if pa._VARLEN is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    heads, kv_heads, head_dim = 14, 2, 64  # Qwen2.5-0.5B
    lengths = [1, 37, 512, 3, 900, 255, 2]
    total = sum(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)

    def leaf(h: int) -> torch.Tensor:
        x = torch.randn(1, h, total, head_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
        return x.requires_grad_(True)

    q, k, v = leaf(heads), leaf(kv_heads), leaf(kv_heads)
    module = _Attention(heads, kv_heads)
    scaling = head_dim**-0.5
    assert pa._varlen_applies(q, {"scaling": scaling, "dropout": 0.0, "sliding_window": None})
    with torch.autocast("cuda", dtype=torch.bfloat16):  # float32 queries attend in autocast's dtype
        assert pa._half_dtype(q.detach().float()) == torch.bfloat16
    assert pa._half_dtype(q.detach().float()) is None
    grad_out = torch.randn(1, total, heads, head_dim, device="cuda", generator=gen)

    def run(attend: Any) -> list[torch.Tensor]:
        out = attend()
        (out.float() * grad_out).sum().backward()
        grads = [out.detach().float()] + [x.grad.float() for x in (q, k, v)]  # type: ignore[union-attr]
        for x in (q, k, v):
            x.grad = None
        return grads

    varlen = run(lambda: pa._attend_varlen(q, k, v, lengths, scaling))
    loop = run(lambda: pa._attend(module, q, k, v, lengths, scaling=scaling))
    for name, a, b in zip(("output", "dq", "dk", "dv"), varlen, loop, strict=True):
        scale = float(b.abs().max())
        assert float((a - b).abs().max()) <= 0.02 * scale, (name, float((a - b).abs().max()), scale)
