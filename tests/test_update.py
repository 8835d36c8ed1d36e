"""One policy update (`grail.train.update`): packing and the forward passes it makes."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from grail.algo.grpo import GRPOLossConfig
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.rollouts import Group, RolloutBatch, Sample
from grail.train.update import UpdateSettings, pack_microbatch, policy_update


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


def test_pack_left_pads_and_aligns_completions_to_the_right() -> None:
    items = [
        ([5, 6, 7], _sample([8, 9], [-0.5, -math.inf], 1.5)),
        ([5], _sample([10, 11, 12], [-0.1, -0.2, -0.3], -1.0)),
    ]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    assert mb.input_ids.tolist() == [[5, 6, 7, 8, 9], [0, 5, 10, 11, 12]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
    assert mb.completion_ids.tolist() == [[7, 8, 9], [10, 11, 12]]
    assert mb.completion_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    # -inf (a token the server's filter excluded) is clamped so the TIS weight stays finite.
    want = torch.tensor([[0.0, -0.5, -1e4], [-0.1, -0.2, -0.3]], dtype=torch.float32)
    assert torch.equal(mb.behaviour_logprobs, want)
    assert mb.advantages.tolist() == [1.5, -1.0] and mb.num_tokens == 5


@pytest.mark.parametrize(("grad_accum", "steps"), [(4, 1), (2, 2), (1, 4)])
def test_old_logprobs_cost_one_forward_per_micro_batch_after_the_first_step(
    tiny_model_dir: Path, grad_accum: int, steps: int
) -> None:
    """Four micro-batches: each is trained with one forward; the old log-probs need one more
    forward for every micro-batch that trains after the first optimizer step (none with a single
    step: TRL's rule), and those stay exactly on-policy for the first step's micro-batches."""
    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(torch.is_grad_enabled()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    settings = UpdateSettings(
        loss=GRPOLossConfig(loss_type="dapo", max_completion_length=4),
        temperature=1.0,
        batch_size=4,
        grad_accum_steps=grad_accum,
        grad_clip=1.0,
    )
    metrics = policy_update(
        model,
        None,
        optimizer,
        scheduler,
        _batch(4, 4, seed=1),
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
    if steps == 1:
        assert metrics["clip_frac"] == 0.0  # ratio exactly 1 everywhere
