"""Environments by name: `make_env("sat", difficulty=0.5)`.

Every environment implements `grail.envs.base.Environment` (`name`, `components`,
`problem(seed)`, `score(problem, completion)`); `ENVIRONMENTS` maps each name to its factory (the
class), whose keyword arguments are what `data.env_kwargs` may set (declared, with their defaults,
in conf/env/NAME.yaml).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from grail.core.errors import ConfigError, UserError
from grail.core.validate import closest
from grail.envs.base import Environment, Problem, Score
from grail.envs.competition_math import MathEnv
from grail.envs.copy_digits import CopyDigitsEnv
from grail.envs.copy_turns import CopyTurnsEnv
from grail.envs.countdown import CountdownEnv
from grail.envs.dataset import DatasetEnv
from grail.envs.episodes import AnyEnvironment
from grail.envs.gsm8k import GSM8KEnv
from grail.envs.ifeval import IFEvalEnv
from grail.envs.lookup import LookupEnv
from grail.envs.open_env import OpenEnvEnv
from grail.envs.sat import SATEnv
from grail.envs.trl_environment import TRLEnvironment
from grail.envs.verifiers_env import VerifiersEnv

ENVIRONMENTS: dict[str, type[AnyEnvironment]] = {
    SATEnv.name: SATEnv,
    CountdownEnv.name: CountdownEnv,
    GSM8KEnv.name: GSM8KEnv,
    # Any dataset of prompts and answers on disk or on the Hub (grail/envs/dataset.py).
    DatasetEnv.name: DatasetEnv,
    # MATH-style problems graded with math-verify: a dataset task with MATH's fields.
    MathEnv.name: MathEnv,
    # IFEval's verifiable instructions, graded as TorchRL's GRPO grades them.
    IFEvalEnv.name: IFEvalEnv,
    # A class TRL's GRPOTrainer takes as environment_factory, over a dataset's rows.
    TRLEnvironment.name: TRLEnvironment,
    # An OpenEnv environment: a server's URL, or a class served in-process.
    OpenEnvEnv.name: OpenEnvEnv,
    # A verifiers taskset and harness, run by verifiers' own rollout code against grail's server.
    VerifiersEnv.name: VerifiersEnv,
    # The learnable toy task (the default job's environment, grail/envs/copy_digits.py).
    CopyDigitsEnv.name: CopyDigitsEnv,
    # The same over several turns: the multi-turn episode the tiny model learns on CPU.
    CopyTurnsEnv.name: CopyTurnsEnv,
    # A tool task: the answer is only in what the episode's lookup tool returns.
    LookupEnv.name: LookupEnv,
}


def env_factory(name: str) -> type[AnyEnvironment]:
    """The class registered as `name`; a ConfigError listing the known ones otherwise."""
    if name not in ENVIRONMENTS:
        raise ConfigError(
            f"unknown environment {name!r} (data.environment); known: "
            f"{', '.join(sorted(ENVIRONMENTS))}"
        )
    return ENVIRONMENTS[name]


def env_arguments(name: str) -> dict[str, Any]:
    """The keyword arguments environment `name` takes, in order, with their defaults: what
    `data.env_kwargs` may set (conf/env/NAME.yaml declares exactly these)."""
    params = inspect.signature(env_factory(name)).parameters.values()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {p.name: p.default for p in params if p.kind in keyword}


def check_env_kwargs(name: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse an argument environment `name` does not take, naming it, the closest accepted one
    and all of them; checked before anything loads."""
    accepted = list(env_arguments(name))
    for key in kwargs:
        if key not in accepted:
            close = closest(str(key), accepted)
            hint = f" (did you mean {close!r}?)" if close else ""
            raise ConfigError(
                f"environment {name!r} has no argument {key!r} (data.env_kwargs.{key}){hint}; "
                f"it accepts {', '.join(accepted)}"
            )


def make_env(name: str, **kwargs: Any) -> AnyEnvironment:
    """Build the environment registered as `name` with keyword arguments checked up front.

    Raises ConfigError for an unknown name or argument and for a value the environment refuses
    (its constructor's ValueError), so that `grail-train` reports them as configuration errors.
    """
    factory = env_factory(name)
    check_env_kwargs(name, kwargs)
    try:
        return factory(**kwargs)
    except UserError:
        raise  # already says what to fix (a missing data file, the hub unreachable)
    except ValueError as exc:
        raise ConfigError(f"environment {name!r} (data.env_kwargs): {exc}") from exc


__all__ = [
    "ENVIRONMENTS",
    "AnyEnvironment",
    "CopyDigitsEnv",
    "CopyTurnsEnv",
    "CountdownEnv",
    "DatasetEnv",
    "Environment",
    "GSM8KEnv",
    "IFEvalEnv",
    "MathEnv",
    "OpenEnvEnv",
    "Problem",
    "SATEnv",
    "Score",
    "TRLEnvironment",
    "VerifiersEnv",
    "check_env_kwargs",
    "env_arguments",
    "env_factory",
    "make_env",
]
