"""The environment interface: a seed becomes a problem, a completion becomes a score.

Environments are pure and deterministic: the same seed gives the same prompt and answer on any
machine (no global RNG, no hash randomisation), so that rollouts, evaluation seeds and resumed
runs are reproducible.
"""

from __future__ import annotations

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
