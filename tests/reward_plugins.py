"""Reward plugins for tests/test_rewards.py, loaded by spec as "reward_plugins:<name>"."""

from __future__ import annotations

import threading
from typing import Any


def length_bonus(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    return [len(c) / 100 for c in completions]


def num_vars_reward(
    prompts: list[str], completions: list[str], num_vars: list[int], **kwargs: Any
) -> list[float]:
    return [float(n) for n in num_vars]


def prompt_mentions_clauses(
    prompts: list[str], completions: list[str], **kwargs: Any
) -> list[float]:
    return [1.0 if "Clauses:" in p else 0.0 for p in prompts]


def needs_foo(prompts: list[str], completions: list[str], foo: list[str], **kwargs: Any) -> list:
    return [0.0 for _ in completions]


def clears_answers(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    kwargs["answers"].clear()
    return [0.0 for _ in completions]


def no_kwargs(prompts: list[str], completions: list[str]) -> list[float]:
    return [0.0 for _ in completions]


def one_positional(completions: list[str], **kwargs: Any) -> list[float]:
    return [0.0 for _ in completions]


NOT_CALLABLE = 3.0


class Graders:
    @staticmethod
    def constant(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        return [0.5 for _ in completions]


def returns_tuple(prompts: list[str], completions: list[str], **kwargs: Any) -> tuple:
    return tuple(0.0 for _ in completions)


def returns_one_short(prompts: list[str], completions: list[str], **kwargs: Any) -> list:
    return [0.0 for _ in completions][:-1]


def nan_at_1(prompts: list[str], completions: list[str], **kwargs: Any) -> list:
    return [0.0, float("nan")] + [0.0] * (len(completions) - 2)


def inf_at_2(prompts: list[str], completions: list[str], **kwargs: Any) -> list:
    return [0.0, 0.0, float("-inf")] + [0.0] * (len(completions) - 3)


def string_at_1(prompts: list[str], completions: list[str], **kwargs: Any) -> list:
    return [0.0, "1.0"] + [0.0] * (len(completions) - 2)


def none_at_0(prompts: list[str], completions: list[str], **kwargs: Any) -> list:
    return [None] + [0.0] * (len(completions) - 1)


def raises(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    raise ZeroDivisionError("plugin bug")


def even_length(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """1 for a completion of an even number of characters: two samples tie about half the time
    (tests/test_server_rollouts.py, dynamic sampling)."""
    return [float(len(c) % 2 == 0) for c in completions]


# Set by a test to let `waits_for_release` return (so no thread of it outlives the test).
RELEASE = threading.Event()


def waits_for_release(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """A plugin stuck until a test releases it: past its deadline, it must be abandoned."""
    RELEASE.wait()
    return [0.0] * len(completions)
