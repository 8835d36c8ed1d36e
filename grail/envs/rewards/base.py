"""What every reward function shares, local or remote: its type, its error, the check of what it
returned."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

from grail.core.errors import ConfigError, UserError

RewardFn = Callable[..., list[float]]


def check_timeout(where: str, value: object) -> float:
    """A reward entry's `timeout_s` as a float, if it is a finite number > 0; a ConfigError
    starting with `where` otherwise."""
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not (math.isfinite(float(value)) and float(value) > 0)
    ):
        raise ConfigError(f"{where}: timeout_s must be a finite number > 0, got {value!r}")
    return float(value)


class RewardError(UserError):
    """A reward function is unusable or misbehaved. `spec` names it; `index` is the sample."""

    def __init__(self, spec: str, message: str, index: int | None = None) -> None:
        where = f" (sample {index})" if index is not None else ""
        super().__init__(f"reward {spec!r}{where}: {message}")
        self.spec = spec
        self.index = index


class RewardTimeout(RewardError, TimeoutError):
    """A reward function did not return within its entry's `timeout_s`."""


def check_reward_values(
    spec: str, values: object, count: int, *, offset: int = 0, where: str = ""
) -> list[float]:
    """`values` as floats if it is a list of `count` finite real numbers, else a RewardError.

    The one check of what a reward function returned, for plugins and remote scorers alike.
    `offset` is the batch index of `values[0]` (a remote scorer's chunk), so that a bad value is
    named by its sample in the batch; `where` is appended to a wrong-length message.
    """
    if not isinstance(values, list):
        hint = " (convert with .tolist())" if hasattr(values, "tolist") else ""
        raise RewardError(spec, f"returned {type(values).__name__}, expected a list{hint}")
    if len(values) != count:
        raise RewardError(spec, f"returned {len(values)} values for {count} completions{where}")
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, numbers.Real):
            raise RewardError(spec, f"value {v!r} is not a number", index=offset + i)
        f = float(v)
        if not math.isfinite(f):
            raise RewardError(spec, f"value {f} is not finite", index=offset + i)
        out.append(f)
    return out
