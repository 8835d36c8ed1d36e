"""Scored rollout batches for the tests of what trains on them (tests/test_trainer.py,
test_lora.py), and one policy update on them (test_packing.py, test_masked_loss.py)."""

from __future__ import annotations

import random

import torch
from torch import Tensor

from grail.envs import make_env
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train.update import UpdateSettings, policy_update


def scored_batch(rewards: list[list[float]], seed: int = 0) -> RolloutBatch:
    """Scored groups of copy_digits problems with the given rewards (a success is reward 1), as a
    rollout source delivers them: without advantages (the trainer computes them)."""
    rng = random.Random(seed)
    env = make_env("copy_digits")
    groups = []
    for g, row in enumerate(rewards):
        samples = [
            Sample(
                completion_ids=[rng.randrange(3, 60) for _ in range(rng.randint(1, 4))],
                behaviour_logprobs=[],
                finish_reason="stop",
                text="7",
                reward=r,
                components={"correct": r},
                success=r == 1.0,
            )
            for r in row
        ]
        for s in samples:
            s.behaviour_logprobs = [-2.0] * len(s.completion_ids)
        groups.append(Group(env.problem(g), [rng.randrange(3, 60) for _ in range(6)], samples))
    return RolloutBatch(groups)


def updated(
    model: torch.nn.Module,
    ref: torch.nn.Module | None,
    batch: RolloutBatch,
    settings: UpdateSettings,
    adamw: bool = False,
) -> tuple[dict[str, float | bool | None], list[Tensor]]:
    """One `policy_update` on CPU; its metrics and the gradient of every optimizer step (before
    clipping). SGD unless `adamw`."""
    optimizer: torch.optim.Optimizer
    if adamw:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    grads: list[Tensor] = []

    def clip(c: float) -> Tensor:
        grads.append(torch.cat([p.grad.flatten().clone() for p in model.parameters()]))
        return torch.nn.utils.clip_grad_norm_(model.parameters(), c)

    metrics = policy_update(
        model,
        ref,
        optimizer,
        scheduler,
        batch,
        settings,
        pad_token_id=0,
        device=torch.device("cpu"),
        backward=lambda loss: loss.backward(),
        clip_grad_norm=clip,
    )
    return metrics, grads
