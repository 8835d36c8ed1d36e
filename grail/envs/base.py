"""The environment interface: a seed becomes a problem, a completion becomes a score.

Environments are pure and deterministic: the same seed gives the same prompt and answer on any
machine (no global RNG, no hash randomisation), so that rollouts, evaluation seeds and resumed
runs are reproducible.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One task instance. `prompt_messages` are chat messages ({"role", "content"})."""

    seed: int
    prompt_messages: list[dict[str, str]]
    answer: str
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    """The grade of one completion: total reward, its named parts, whether it solved the task."""

    reward: float
    components: dict[str, float]
    success: bool


@runtime_checkable
class Environment(Protocol):
    name: str
    # The keys of every `Score.components` it returns, known without scoring: extra rewards must
    # not reuse them, and a config is checked against them before anything starts.
    components: tuple[str, ...]

    def problem(self, seed: int) -> Problem: ...

    def score(self, problem: Problem, completion: str) -> Score: ...


def check_seed(seed: int) -> int:
    """A problem seed as an int: a non-negative integer (TypeError / ValueError otherwise, for
    a caller that passed something else)."""
    try:
        value = operator.index(seed)
    except TypeError:
        raise TypeError(f"seed must be an integer, got {type(seed).__name__}: {seed!r}") from None
    if isinstance(seed, bool) or value < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    return int(value)


def check_weight(name: str, value: object) -> float:
    """A reward weight as a float: a finite number >= 0 (ValueError naming it otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


def problem_meta(problem: Problem, env_name: str, *keys: str) -> list[Any]:
    """The values of `keys` in the problem's meta, in order; a ValueError saying the problem was
    not made by environment `env_name` when one is missing."""
    try:
        return [problem.meta[key] for key in keys]
    except KeyError as exc:
        raise ValueError(
            f"problem (seed {problem.seed}) was not made by the {env_name} environment: "
            f"meta lacks {exc.args[0]!r}"
        ) from None
