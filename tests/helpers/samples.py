"""Made-up samples for the tests of what stores rollouts (the codec, the study's store)."""

from __future__ import annotations

import math
import random

from grail.rollouts.batch import EpisodeStats, Sample


def awkward_sample(rng: random.Random, episode: bool = False) -> Sample:
    """A sample whose floats have every bit set, whose last log-probability is -inf and whose
    text JSON must escape: what an exact round trip has to survive. With `episode`, an
    episode's too: a mask of its sampled tokens (context, with log-prob 0.0, among them) and its
    `EpisodeStats`; without, `rng` is drawn from exactly as before episodes existed."""
    n = rng.randint(1, 4)
    reward = rng.random()
    sample = Sample(
        completion_ids=[rng.randrange(300) for _ in range(n)],
        behaviour_logprobs=[-rng.random() * 7 for _ in range(n - 1)] + [-math.inf],
        finish_reason=rng.choice(["stop", "length"]),
        text='é"\n\ud800',
        reward=reward,
        components={"correct": reward, "found": float(n)},
        success=reward > 0.5,
    )
    if episode:
        # The last token sampled (it holds the -inf), the others context or sampled at random.
        sample.sampled_mask = [rng.randrange(2) for _ in range(n - 1)] + [1]
        sample.behaviour_logprobs = [
            lp if m else 0.0
            for lp, m in zip(sample.behaviour_logprobs, sample.sampled_mask, strict=True)
        ]
        sample.episode = EpisodeStats(
            turns=rng.randint(1, 5),
            truncated=rng.random() < 0.5,
            tool_calls=rng.randint(0, 3),
            tool_errors=rng.randint(0, 2),
            env_s=rng.random() * 3,
        )
    return sample
