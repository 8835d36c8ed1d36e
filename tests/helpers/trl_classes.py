"""Environment classes written for TRL's GRPOTrainer (`environment_factory`), as its docs show
them: `reset(**row)`, public methods as tools, `get_reward()`. tests/test_trl_environment.py runs
them under grail (`env=trl`)."""

from __future__ import annotations

from typing import Any

RESETS: list[dict[str, Any]] = []  # every reset's keyword arguments, in order


class Counter:
    """Bring a counter from 0 to the row's target with the `increment` tool."""

    def __init__(self) -> None:
        self.value = 0
        self.target = 0

    def reset(self, target: str, **kwargs: Any) -> str:
        RESETS.append({"target": target, **kwargs})
        self.value, self.target = 0, int(target)
        return " The counter is at 0."

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.value += step
        return self.value

    def get_reward(self) -> float:
        return 1.0 if self.value == self.target else 0.0

    def _private(self) -> None:  # not a tool
        pass


class AsyncCounter(Counter):
    """The same with coroutine methods, which TRL accepts too."""

    async def reset(self, target: str, **kwargs: Any) -> str:  # type: ignore[override]
        return Counter.reset(self, target, **kwargs)

    async def increment(self, step: int) -> int:  # type: ignore[override]
        """Add to the counter.

        Args:
            step: How much to add.
        """
        return Counter.increment(self, step)

    async def get_reward(self) -> float:  # type: ignore[override]
        return Counter.get_reward(self)


class Silent:
    """No observation, no tools, no reward of its own."""

    def reset(self, **kwargs: Any) -> None:
        return None


class NoReset:
    def increment(self, step: int) -> int:
        """Add.

        Args:
            step: How much.
        """
        return step
