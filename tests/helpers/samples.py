"""Made-up samples for the tests of what stores rollouts (the codec, the study's store)."""

from __future__ import annotations

import math
import random

from grail.rollouts.batch import Sample


def awkward_sample(rng: random.Random) -> Sample:
    """A sample whose floats have every bit set, whose last log-probability is -inf and whose
    text JSON must escape: what an exact round trip has to survive."""
    n = rng.randint(1, 4)
    reward = rng.random()
    return Sample(
        completion_ids=[rng.randrange(300) for _ in range(n)],
        behaviour_logprobs=[-rng.random() * 7 for _ in range(n - 1)] + [-math.inf],
        finish_reason=rng.choice(["stop", "length"]),
        text='é"\n\ud800',
        reward=reward,
        components={"correct": reward, "found": float(n)},
        success=reward > 0.5,
    )
