"""The one JSON form of rollouts: `Sample`, `Group`, `RolloutBatch` and `GeneratedBatch` to plain
JSON-able data (for `json.dumps`) and back, for the study's store of iteration-0 batches
(grail/rollouts/shared.py) and for what a checkpoint keeps of a rollout source (a pipelined run's
pending batch, grail/rollouts/server.py `ServerRollouts.state`).

JSON, never a pickle: a pickle ties a file to module paths and can run code when it loads.
Floats survive exactly: `json` writes the shortest repr that reads back to the same bits (and,
unless told `allow_nan=False`, -inf, a possible log-probability, as `-Infinity`), so a run that
loads a batch trains on exactly the numbers of the run that generated it.

A single completion's sample is stored as it always was; an episode's (several turns) adds
`sampled_mask` (1 where the policy sampled the token, 0 on the environment's context) and
`episode` (its `EpisodeStats`), so that files written before episodes existed still load.

What is not stored:
- a sample's advantage: the trainer computes it from the rewards (grail/train/trainer.py);
- a group's `Problem`: its seed is, and the caller rebuilds it (`problem(seed)`, usually
  `env.problem`), so that the problem is the environment's own, with its own types.

Decoding checks every field and raises `CodecError` naming the first one that is wrong (as a path,
e.g. `groups[2].samples[0].behaviour_logprobs`): a file cut short or edited by hand must not train.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, TypeGuard

from grail.envs.base import Problem
from grail.rollouts.batch import (
    EpisodeStats,
    GeneratedBatch,
    Group,
    Resampling,
    Reused,
    RolloutBatch,
    Sample,
)

# Rebuilds the problem of a stored group from its seed (usually `env.problem`).
ProblemFor = Callable[[int], Problem]


class CodecError(ValueError):
    """Data that does not decode to a rollout; the message names the field and what is wrong."""


# ---- encoding -------------------------------------------------------------------------------


def sample_to_json(sample: Sample) -> dict[str, Any]:
    data: dict[str, Any] = {
        "completion_ids": sample.completion_ids,
        "behaviour_logprobs": sample.behaviour_logprobs,
        "finish_reason": sample.finish_reason,
        "text": sample.text,
        "reward": sample.reward,
        "components": sample.components,
        "success": sample.success,
    }
    # An episode's fields only where there is one: a single completion's sample is written as it
    # was before episodes existed, byte for byte.
    if sample.sampled_mask is not None:
        data["sampled_mask"] = sample.sampled_mask
    if sample.episode is not None:
        data["episode"] = asdict(sample.episode)
    return data


def group_to_json(group: Group) -> dict[str, Any]:
    return {
        "seed": group.problem.seed,
        "prompt_ids": group.prompt_ids,
        "samples": [sample_to_json(s) for s in group.samples],
    }


def batch_to_json(batch: RolloutBatch) -> dict[str, Any]:
    return {"groups": [group_to_json(g) for g in batch.groups]}


def to_json(generated: GeneratedBatch) -> dict[str, Any]:
    """A generated batch with where it came from (policy version, timings, dynamic sampling,
    the study's store, the service)."""
    return {
        **batch_to_json(generated.batch),
        "policy_version": generated.policy_version,
        "generation_s": generated.generation_s,
        "started": generated.started,
        "finished": generated.finished,
        "resampling": None if generated.resampling is None else asdict(generated.resampling),
        "reused": None if generated.reused is None else asdict(generated.reused),
        "service": generated.service,
    }


# ---- decoding -------------------------------------------------------------------------------


def sample_from_json(data: Any, where: str = "sample") -> Sample:
    obj = _object(data, where)
    ids = _ints(obj, "completion_ids", where)
    logprobs = _field(obj, "behaviour_logprobs", where)
    if (
        not isinstance(logprobs, list)
        or len(logprobs) != len(ids)
        or not all(is_number(x) and not math.isnan(x) for x in logprobs)
    ):
        raise CodecError(
            f"{where}.behaviour_logprobs is not {len(ids)} numbers (one per completion id)"
        )
    components = _field(obj, "components", where)
    if not isinstance(components, dict) or not all(
        isinstance(k, str) and is_number(v) for k, v in components.items()
    ):
        raise CodecError(f"{where}.components is not an object of numbers")
    sampled_mask = obj.get("sampled_mask")
    if sampled_mask is not None and (
        not isinstance(sampled_mask, list)
        or len(sampled_mask) != len(ids)
        or not all(type(m) is int and m in (0, 1) for m in sampled_mask)
    ):
        raise CodecError(
            f"{where}.sampled_mask is not {len(ids)} zeros and ones (one per completion id)"
        )
    episode = obj.get("episode")
    return Sample(
        completion_ids=ids,
        behaviour_logprobs=logprobs,
        finish_reason=_typed(obj, "finish_reason", str, where),
        text=_typed(obj, "text", str, where),
        reward=_typed_number(obj, "reward", where),
        components=components,
        success=_typed(obj, "success", bool, where),
        sampled_mask=sampled_mask,
        episode=None if episode is None else episode_from_json(episode, f"{where}.episode"),
    )


def episode_from_json(data: Any, where: str = "episode") -> EpisodeStats:
    obj = _object(data, where)
    counts = {k: _typed(obj, k, int, where) for k in ("turns", "tool_calls", "tool_errors")}
    for key, count in counts.items():
        if count < 0:
            raise CodecError(f"{where}.{key} is {count}, not a count (>= 0)")
    env_s = _typed_number(obj, "env_s", where)
    if not (math.isfinite(env_s) and env_s >= 0):
        raise CodecError(f"{where}.env_s is {env_s!r}, not a duration in seconds (>= 0)")
    return EpisodeStats(truncated=_typed(obj, "truncated", bool, where), env_s=env_s, **counts)


def group_from_json(data: Any, problem: ProblemFor, where: str = "group") -> Group:
    obj = _object(data, where)
    seed = _typed(obj, "seed", int, where)
    prompt_ids = _ints(obj, "prompt_ids", where)
    samples = _typed(obj, "samples", list, where)
    if not samples:
        raise CodecError(f"{where}.samples is empty")
    return Group(
        problem(seed),
        prompt_ids,
        [sample_from_json(s, f"{where}.samples[{j}]") for j, s in enumerate(samples)],
    )


def batch_from_json(data: Any, problem: ProblemFor, where: str = "batch") -> RolloutBatch:
    obj = _object(data, where)
    groups = _typed(obj, "groups", list, where)
    if not groups:
        raise CodecError(f"{where}.groups is empty")
    return RolloutBatch(
        [group_from_json(g, problem, f"{where}.groups[{i}]") for i, g in enumerate(groups)]
    )


def resampling_from_json(data: Any, where: str = "resampling") -> Resampling:
    obj = _object(data, where)
    return Resampling(**{k: _typed(obj, k, int, where) for k in Resampling.__dataclass_fields__})


def from_json(data: Any, problem: ProblemFor, where: str = "batch") -> GeneratedBatch:
    """The inverse of `to_json`; `problem(seed)` rebuilds each group's problem."""
    obj = _object(data, where)
    resampling, reused, service = (obj.get(k) for k in ("resampling", "reused", "service"))
    if reused is not None:
        fields = _object(reused, f"{where}.reused")
        reused = Reused(
            _typed(fields, "key", str, f"{where}.reused"),
            _typed_number(fields, "generation_s", f"{where}.reused"),
        )
    if service is not None and not isinstance(service, dict):
        raise CodecError(f"{where}.service is not an object")
    return GeneratedBatch(
        batch_from_json(obj, problem, where),
        policy_version=_typed(obj, "policy_version", int, where),
        generation_s=_typed_number(obj, "generation_s", where),
        started=_typed_number(obj, "started", where),
        finished=_typed_number(obj, "finished", where),
        resampling=(
            None if resampling is None else resampling_from_json(resampling, f"{where}.resampling")
        ),
        reused=reused,
        service=service,
    )


def is_number(value: Any) -> TypeGuard[int | float]:
    """A JSON number (true and false are not)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _object(data: Any, where: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise CodecError(f"{where} is not a JSON object")
    return data


def _field(obj: dict[str, Any], key: str, where: str) -> Any:
    if key not in obj:
        raise CodecError(f"{where}.{key} is missing")
    return obj[key]


_KIND_NAMES = {int: "an integer", str: "a string", bool: "true or false", list: "a list"}


def _typed(obj: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = _field(obj, key, where)
    # bool is an int to Python, never to a reader of the file.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise CodecError(f"{where}.{key} is {value!r:.60}, not {_KIND_NAMES[kind]}")
    return value


def _typed_number(obj: dict[str, Any], key: str, where: str) -> float:
    value = _field(obj, key, where)
    if not is_number(value):
        raise CodecError(f"{where}.{key} is {value!r:.60}, not a number")
    return value


def _ints(obj: dict[str, Any], key: str, where: str) -> list[int]:
    value = _field(obj, key, where)
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise CodecError(f"{where}.{key} is not a list of integers")
    return value
