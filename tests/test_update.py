"""One policy update (`grail.train.update`): packing and the forward passes it makes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import Tensor

from grail.algo.grpo import GRPOLossConfig, token_logprobs
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.rollouts import Group, RolloutBatch, Sample
from grail.train import update
from grail.train.update import (
    UpdateSettings,
    completion_logits,
    microbatches,
    pack_microbatch,
    policy_update,
)


def _sample(ids: list[int], logprobs: list[float], advantage: float) -> Sample:
    return Sample(ids, logprobs, "length", "", 0.0, {}, False, advantage)


def _batch(groups: int, replicas: int, seed: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, 500, (4 + g,), generator=gen).tolist()
        samples = []
        for _ in range(replicas):
            n = int(torch.randint(1, 5, (), generator=gen))
            ids = torch.randint(3, 500, (n,), generator=gen).tolist()
            logprobs = (-torch.rand(n, generator=gen) * 3).tolist()
            samples.append(_sample(ids, logprobs, float(torch.randn((), generator=gen))))
        out.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(out)


def test_pack_stores_each_prompt_once_and_right_pads_completions() -> None:
    items = [
        ([5, 6, 7], _sample([8, 9], [-0.5, -math.inf], 1.5)),
        ([5], _sample([10, 11, 12], [-0.1, -0.2, -0.3], -1.0)),
        ([5, 6, 7], _sample([13], [-0.7], 0.5)),
    ]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    assert mb.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 5]]
    assert mb.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert mb.prompt_index.tolist() == [0, 1, 0]
    assert mb.completion_ids.tolist() == [[8, 9, 0], [10, 11, 12], [13, 0, 0]]
    assert mb.completion_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    # -inf (a token the server's filter excluded) is clamped so the TIS weight stays finite.
    want = [[-0.5, -1e4, 0.0], [-0.1, -0.2, -0.3], [-0.7, 0.0, 0.0]]
    assert torch.equal(mb.behaviour_logprobs, torch.tensor(want, dtype=torch.float32))
    assert mb.advantages.tolist() == [1.5, -1.0, 0.5] and mb.num_tokens == 6


def _logprobs_and_grads(model: torch.nn.Module, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    items = microbatches(batch, batch_size=64)[0]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    logprobs = token_logprobs(completion_logits(model, mb), mb.completion_ids)
    model.zero_grad()
    (logprobs * mb.completion_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logprobs * mb.completion_mask, grads


def test_shared_prompt_pass_equals_running_every_sequence_in_full(tiny_model_dir: Path) -> None:
    """Running each prompt once and its completions on its cache gives the log-probs and the
    gradients of running every prompt + completion in full (gradient checkpointing forces the
    full path), with prompts and completions of different lengths."""
    model = load_model(tiny_model_dir).train()
    batch = _batch(groups=5, replicas=4, seed=3)
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    shared = _logprobs_and_grads(model, batch)
    assert len(calls) == 2  # the distinct prompts, then the completions on their cache
    model.gradient_checkpointing_enable()
    full = _logprobs_and_grads(model, batch)
    assert len(calls) == 3  # every row in full, in one pass
    torch.testing.assert_close(shared[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1], full[1], rtol=1e-4, atol=1e-6)
    # And the full path itself agrees with one unpadded sequence run alone.
    group = batch.groups[1]
    sample = group.samples[2]
    ids = torch.tensor([group.prompt_ids + sample.completion_ids])
    n = len(sample.completion_ids)
    with torch.no_grad():
        alone = token_logprobs(model(input_ids=ids).logits[:, -n - 1 : -1], ids[:, -n:])
    torch.testing.assert_close(full[0][1 * 4 + 2, :n], alone[0], rtol=0, atol=1e-5)


def test_a_sliding_window_model_runs_every_row_in_full(tiny_model_dir: Path) -> None:
    """A sliding-window cache drops the keys its window has passed, so it cannot stand in for the
    prompt: the rows run in full (the last forward sees whole sequences) and stay exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.update({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0})
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    widths: list[int] = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    batch = _batch(groups=3, replicas=2, seed=5)
    items = microbatches(batch, batch_size=64)[0]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    with torch.no_grad():
        logprobs = token_logprobs(completion_logits(model, mb), mb.completion_ids)
    assert widths[-1] == mb.prompt_ids.shape[1] + mb.completion_ids.shape[1]
    for row, (prompt, sample) in enumerate(items):
        ids = torch.tensor([prompt + sample.completion_ids])
        n = len(sample.completion_ids)
        with torch.no_grad():
            alone = token_logprobs(model(input_ids=ids).logits[:, -n - 1 : -1], ids[:, -n:])
        torch.testing.assert_close(logprobs[row, :n], alone[0], rtol=0, atol=1e-5)


def test_pack_refuses_log_probabilities_that_do_not_match_the_tokens() -> None:
    with pytest.raises(ValueError, match="2 completion tokens but 1 behaviour"):
        pack_microbatch([([5], _sample([8, 9], [-0.5], 1.0))], pad_token_id=0, device="cpu")


@pytest.mark.parametrize(("grad_accum", "steps"), [(4, 1), (2, 2), (1, 4)])
def test_old_logprobs_cost_one_forward_per_micro_batch_after_the_first_step(
    tiny_model_dir: Path, grad_accum: int, steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four micro-batches: each is trained with one forward; the old log-probs need one more
    forward for every micro-batch that trains after the first optimizer step (none with a single
    step: TRL's rule), and those stay exactly on-policy for the first step's micro-batches."""
    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    forwards: list[bool] = []  # grad enabled?, one per completion_logits call

    def counted(m: torch.nn.Module, mb: update.MicroBatch) -> Tensor:
        forwards.append(torch.is_grad_enabled())
        return completion_logits(m, mb)

    monkeypatch.setattr(update, "completion_logits", counted)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    settings = UpdateSettings(
        loss=GRPOLossConfig(loss_type="dapo", max_completion_length=4),
        temperature=1.0,
        batch_size=4,
        grad_accum_steps=grad_accum,
        grad_clip=1.0,
    )
    batch = _batch(4, 4, seed=1)
    metrics = policy_update(
        model,
        None,
        optimizer,
        scheduler,
        batch,
        settings,
        pad_token_id=0,
        device=torch.device("cpu"),
        backward=lambda loss: loss.backward(),
        clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c),
    )
    old_passes = 4 - grad_accum if steps > 1 else 0
    assert forwards.count(False) == old_passes  # no-grad passes: old log-probs only
    assert forwards.count(True) == 4
    assert metrics["optimizer_steps"] == steps
    # the iteration's completion tokens, not a per-micro-batch average
    assert metrics["num_tokens"] == sum(len(s.completion_ids) for s in batch.samples)
    if steps == 1:
        assert metrics["clip_frac"] == 0.0  # ratio exactly 1 everywhere
