"""Scored rollout batches for the tests of what trains on them (tests/test_trainer.py,
test_lora.py)."""

from __future__ import annotations

import random

from grail.envs import make_env
from grail.rollouts.batch import Group, RolloutBatch, Sample


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
