"""The JSON codec of rollouts (grail/rollouts/codec.py): exact round trips, and decoding that names
what is wrong."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from helpers.samples import awkward_sample

from grail.envs import make_env
from grail.rollouts import codec
from grail.rollouts.batch import GeneratedBatch, Group, Resampling, Reused, RolloutBatch


def _generated() -> GeneratedBatch:
    """Floats with every bit set, a -inf log-probability, text that JSON must escape, and every
    field a GeneratedBatch can carry."""
    rng = random.Random(0)
    env = make_env("copy_digits")
    groups = []
    for seed in (3, 1, 4):
        samples = [awkward_sample(rng) for _ in range(3)]
        groups.append(Group(env.problem(seed), [rng.randrange(300) for _ in range(5)], samples))
    return GeneratedBatch(
        RolloutBatch(groups),
        policy_version=4,
        generation_s=rng.random(),
        started=rng.random() * 1e5,
        finished=rng.random() * 1e5,
        resampling=Resampling(extra_rounds=1, generated_groups=5, dropped_groups=2, kept_groups=3),
        reused=Reused("ab" * 32, rng.random()),
        service={"groups": [{"id": "g1", "source": "client", "policy_version": 3}], "taken": 3},
    )


def _round_trip(data: dict[str, Any]) -> GeneratedBatch:
    return codec.from_json(json.loads(json.dumps(data)), make_env("copy_digits").problem)


def test_a_generated_batch_round_trips_to_the_bit() -> None:
    original = _generated()
    loaded = _round_trip(codec.to_json(original))
    assert loaded == original
    pairs = zip(loaded.batch.samples, original.batch.samples, strict=True)
    for a, b in pairs:
        assert [x.hex() for x in a.behaviour_logprobs] == [x.hex() for x in b.behaviour_logprobs]
        assert a.reward.hex() == b.reward.hex()
    plain = GeneratedBatch(original.batch, 0, 1.0)  # no resampling, reuse or service
    assert _round_trip(codec.to_json(plain)) == plain


def test_advantages_are_not_stored() -> None:
    original = _generated()
    original.batch.samples[0].advantage = 0.5  # set by a trainer: not part of the rollout
    assert "advantage" not in codec.to_json(original)["groups"][0]["samples"][0]
    assert all(s.advantage == 0.0 for s in _round_trip(codec.to_json(original)).batch.samples)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d["groups"][1]["samples"][2].update(behaviour_logprobs=["x"]),
         "groups[1].samples[2].behaviour_logprobs is not"),
        (lambda d: d["groups"][0]["samples"][0].pop("success"),
         "groups[0].samples[0].success is missing"),
        (lambda d: d["groups"][0]["samples"][1].update(success=1),
         "samples[1].success is 1, not true or false"),
        (lambda d: d["groups"][2].update(prompt_ids=[1, True]),
         "groups[2].prompt_ids is not a list of integers"),
        (lambda d: d["groups"][2].update(samples=[]), "groups[2].samples is empty"),
        (lambda d: d.update(policy_version="4"), "policy_version is '4', not an integer"),
        (lambda d: d.update(resampling={"extra_rounds": 1}), "resampling.generated_groups is"),
        (lambda d: d.update(reused=[]), "reused is not a JSON object"),
        (lambda d: d.update(groups=None), "groups is None, not a list"),
    ],
)  # fmt: skip
def test_decoding_names_what_is_wrong(damage: Any, message: str) -> None:
    data = json.loads(json.dumps(codec.to_json(_generated())))
    damage(data)
    with pytest.raises(codec.CodecError) as err:
        codec.from_json(data, make_env("copy_digits").problem)
    assert message in str(err.value)
