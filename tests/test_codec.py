"""The JSON codec of rollouts (grail/rollouts/codec.py): exact round trips, and decoding that names
what is wrong."""

from __future__ import annotations

import json
import random
from dataclasses import asdict
from typing import Any

import pytest
from helpers.samples import awkward_sample

from grail.envs import make_env
from grail.rollouts import codec
from grail.rollouts.batch import (
    EpisodeStats,
    GeneratedBatch,
    Group,
    Resampling,
    Reused,
    RolloutBatch,
)

_SAMPLE_KEYS = [
    "completion_ids",
    "behaviour_logprobs",
    "finish_reason",
    "text",
    "reward",
    "components",
    "success",
]


def _generated(episodes: bool = False) -> GeneratedBatch:
    """Floats with every bit set, a -inf log-probability, text that JSON must escape, and every
    field a GeneratedBatch can carry; with `episodes`, the middle sample of each group is an
    episode (a mask with context tokens, and its stats) beside single completions."""
    rng = random.Random(0)
    env = make_env("copy_digits")
    groups = []
    for seed in (3, 1, 4):
        samples = [awkward_sample(rng, episode=episodes and j == 1) for j in range(3)]
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


def test_an_episode_round_trips_to_the_bit_beside_single_completions() -> None:
    original = _generated(episodes=True)
    data = codec.to_json(original)
    loaded = _round_trip(data)
    assert loaded == original  # the masks and the episode stats included
    for group, stored in zip(loaded.batch.groups, data["groups"], strict=True):
        episode, *plain = group.samples[1], group.samples[0], group.samples[2]
        assert episode.sampled_mask is not None and episode.episode is not None
        assert all(s.sampled_mask is None and s.episode is None for s in plain)
        # Only the episode carries the new keys: a single completion is stored as before.
        assert list(stored["samples"][1]) == [*_SAMPLE_KEYS, "sampled_mask", "episode"]
        assert [list(s) for s in stored["samples"][::2]] == [_SAMPLE_KEYS, _SAMPLE_KEYS]
    masks = [s.sampled_mask for s in original.batch.samples if s.sampled_mask is not None]
    assert any(0 in m for m in masks)  # context tokens among them, not all-ones masks
    for a, b in zip(loaded.batch.samples, original.batch.samples, strict=True):
        if b.episode is not None:
            assert a.episode is not None and a.episode.env_s.hex() == b.episode.env_s.hex()


def test_a_file_written_before_episodes_loads_and_is_written_again_byte_for_byte() -> None:
    """A stored rollout (the study's store, a checkpoint's pending batch) from before episodes
    existed: it loads as single completions, and encoding it again gives the same bytes."""
    text = json.dumps(
        {
            "groups": [
                {
                    "seed": 7,
                    "prompt_ids": [1, 2, 3],
                    "samples": [
                        {
                            "completion_ids": [5, 6],
                            "behaviour_logprobs": [-0.25, -1.5],
                            "finish_reason": "stop",
                            "text": "7",
                            "reward": 1.0,
                            "components": {"correct": 1.0},
                            "success": True,
                        }
                    ],
                }
            ],
            "policy_version": 2,
            "generation_s": 0.5,
            "started": 10.0,
            "finished": 10.5,
            "resampling": None,
            "reused": None,
            "service": None,
        }
    )
    loaded = codec.from_json(json.loads(text), make_env("copy_digits").problem)
    sample = loaded.batch.samples[0]
    assert sample.sampled_mask is None and sample.episode is None and sample.num_sampled == 2
    assert json.dumps(codec.to_json(loaded)) == text


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
        # An episode's fields: the mask must be one 0 or 1 per completion id ...
        (lambda d: _sample_of(d, 2, 0).update(sampled_mask=[1] * (_n(d, 2, 0) + 1)),
         "groups[2].samples[0].sampled_mask is not"),
        (lambda d: _sample_of(d, 0, 1).update(sampled_mask=[0] * (_n(d, 0, 1) - 1) + [2]),
         "groups[0].samples[1].sampled_mask is not"),
        (lambda d: _sample_of(d, 1, 0).update(sampled_mask=[True] * _n(d, 1, 0)),
         "groups[1].samples[0].sampled_mask is not"),
        (lambda d: _sample_of(d, 1, 2).update(sampled_mask=[1.0] * _n(d, 1, 2)),
         "groups[1].samples[2].sampled_mask is not"),
        (lambda d: _sample_of(d, 1, 1).update(sampled_mask="1"),
         "groups[1].samples[1].sampled_mask is not"),
        # ... and the episode's stats, every field present and of its kind.
        (lambda d: _sample_of(d, 2, 1).update(episode=[]),
         "groups[2].samples[1].episode is not a JSON object"),
        (lambda d: _episode_of(d, 0, 1).pop("tool_errors"),
         "groups[0].samples[1].episode.tool_errors is missing"),
        (lambda d: _episode_of(d, 1, 1).update(truncated=0),
         "groups[1].samples[1].episode.truncated is 0, not true or false"),
        (lambda d: _episode_of(d, 2, 1).update(turns=2.0),
         "groups[2].samples[1].episode.turns is 2.0, not an integer"),
        (lambda d: _episode_of(d, 2, 1).update(tool_calls=-1),
         "groups[2].samples[1].episode.tool_calls is -1, not a count"),
        (lambda d: _episode_of(d, 0, 1).update(env_s="0.5"),
         "groups[0].samples[1].episode.env_s is '0.5', not a number"),
        (lambda d: _episode_of(d, 0, 1).update(env_s=-0.5),
         "groups[0].samples[1].episode.env_s is -0.5, not a duration"),
    ],
)  # fmt: skip
def test_decoding_names_what_is_wrong(damage: Any, message: str) -> None:
    data = json.loads(json.dumps(codec.to_json(_generated(episodes=True))))
    damage(data)
    with pytest.raises(codec.CodecError) as err:
        codec.from_json(data, make_env("copy_digits").problem)
    assert message in str(err.value)


def _sample_of(data: dict[str, Any], group: int, sample: int) -> dict[str, Any]:
    sample_data: dict[str, Any] = data["groups"][group]["samples"][sample]
    return sample_data


def _n(data: dict[str, Any], group: int, sample: int) -> int:
    return len(_sample_of(data, group, sample)["completion_ids"])


def _episode_of(data: dict[str, Any], group: int, sample: int) -> dict[str, Any]:
    episode: dict[str, Any] = _sample_of(data, group, sample)["episode"]
    return episode


def test_every_field_of_the_episode_stats_is_stored() -> None:
    """A field added to EpisodeStats later must reach the file (or this test says so)."""
    stats = EpisodeStats(turns=3, truncated=True, tool_calls=2, tool_errors=1, env_s=0.25)
    assert codec.episode_from_json(json.loads(json.dumps(asdict(stats)))) == stats
    assert set(EpisodeStats.__dataclass_fields__) == {
        "turns", "truncated", "tool_calls", "tool_errors", "env_s"
    }  # fmt: skip
