"""Environments by name: `make_env("sat", difficulty=0.5)`.

Every environment implements `grail.envs.base.Environment` (`name`, `problem(seed)`,
`score(problem, completion)`); `ENVIRONMENTS` maps each name to its factory (the class).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from grail.envs.base import Environment, Problem, Score
from grail.envs.copy_digits import CopyDigitsEnv
from grail.envs.gsm8k import GSM8KEnv
from grail.envs.sat import SATEnv

ENVIRONMENTS: dict[str, Callable[..., Environment]] = {
    SATEnv.name: SATEnv,
    GSM8KEnv.name: GSM8KEnv,
    # The learnable toy task (the default job's environment, grail/envs/copy_digits.py).
    CopyDigitsEnv.name: CopyDigitsEnv,
}


def make_env(name: str, **kwargs: Any) -> Environment:
    """Build the environment registered as `name` with keyword arguments checked up front."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS))}")
    factory = ENVIRONMENTS[name]
    try:
        inspect.signature(factory).bind(**kwargs)
    except TypeError as exc:
        params = [p for p in inspect.signature(factory).parameters if p != "self"]
        raise TypeError(
            f"bad arguments for environment {name!r}: {exc}; it accepts {params}"
        ) from None
    return factory(**kwargs)


__all__ = [
    "ENVIRONMENTS",
    "CopyDigitsEnv",
    "Environment",
    "GSM8KEnv",
    "Problem",
    "SATEnv",
    "Score",
    "make_env",
]
