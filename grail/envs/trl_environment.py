"""TRL's environment classes, run unchanged (`env=trl`): the classes TRL's GRPOTrainer takes as
`environment_factory`.

Such a class (TRL's contract, trl/trainer/grpo_trainer.py) has

    reset(**row)  -> None or str     called with the dataset row's fields; a string is appended
                                     to the last user message
    public methods                   the episode's tools: typed, with Google-style docstrings
    get_reward()  -> float           optional (sync or async): the episode's reward, from the
                                     environment's state once the policy has answered

Here the rows come from a dataset as for `env=dataset` (grail/envs/dataset.py: a file or a Hub
dataset, the same splits; the row's prompt field is passed to `reset` as the row holds it, text or
messages), one instance of the class per episode (`environment_factory()`, no arguments, as TRL
calls it), its public methods offered as tools through the chat template (grail/envs/tools.py),
and the policy's turns answered as TRL answers them: a turn with tool calls gets the tools'
results (`str(result)`, as TRL writes them), the first turn without one is the answer and ends
the episode. Its reward is `get_reward()` (0 without one) plus `data.rewards` on the answer;
success is a reward of at least `success_reward`.

Differences from TRL, both deliberate: a tool that raises or a malformed call is answered with
grail's `error: ...` message (TRL's is `{'error': '...'}`), and data.max_turns bounds the tool
rounds (TRL's max_tool_calling_iterations).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from grail.core.imports import SpecError, import_spec
from grail.envs.base import Problem, check_weight
from grail.envs.dataset import DatasetEnv, Record
from grail.envs.episodes import Step

_CONTRACT = (
    "reset(**row) and, optionally, get_reward() and tool methods (TRL's environment_factory)"
)


def _tool_methods(cls: type) -> list[str]:
    """The names of the class's tools: its public functions but `reset` and `get_reward`, as
    TRL lists them (on the class, so that properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def _as_text(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` returning `str(result)`, TRL's tool message content (grail's ToolBox would send
    a non-string result as JSON); the signature and docstring, which describe the tool, kept."""
    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(*args: Any, **kwargs: Any) -> str:
            return str(await method(*args, **kwargs))

        return run_async

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> str:
        return str(method(*args, **kwargs))

    return run


class _Episode:
    def __init__(self, problem: Problem, instance: Any, success_reward: float) -> None:
        self.problem, self.instance, self.success_reward = problem, instance, success_reward
        self.tools = [_as_text(getattr(instance, name)) for name in _tool_methods(type(instance))]

    def step(self, text: str) -> Step | Awaitable[Step]:
        # Only the answer reaches here (the turn loop answers tool calls): the episode ends.
        get_reward = getattr(self.instance, "get_reward", None)
        if get_reward is None:
            return self._ended(0.0)
        value = get_reward()
        if inspect.isawaitable(value):
            return self._ended_async(value)
        return self._ended(value)

    async def _ended_async(self, value: Awaitable[Any]) -> Step:
        return self._ended(await value)

    def _ended(self, value: Any) -> Step:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"get_reward() returned {value!r}, not a number")
        reward = float(value)
        return Step(
            reward=reward,
            done=True,
            success=reward >= self.success_reward,
            components={"env_reward": reward},
        )


class TRLEnvironment(DatasetEnv):
    """A TRL environment class over a dataset's rows; see the module docstring."""

    name = "trl"
    components: tuple[str, ...] = ("env_reward",)

    def __init__(
        self,
        environment_factory: str = "",
        path: str | Path | None = None,
        split: Literal["train", "test"] = "train",
        test_path: str | Path | None = None,
        holdout_fraction: float = 0.1,
        hub: str | None = None,
        hub_config: str | None = None,
        hub_train_split: str = "train",
        hub_test_split: str = "test",
        prompt_field: str = "prompt",
        system_prompt: str = "",
        success_reward: float = 1.0,
    ) -> None:
        if not environment_factory:
            raise ValueError(
                "environment_factory must name the class as 'package.module:Class' "
                "(data.env_kwargs.environment_factory)"
            )
        try:
            factory = import_spec(environment_factory)
        except SpecError as exc:
            raise ValueError(f"environment_factory {environment_factory!r}: {exc}") from exc
        if not callable(factory) or not callable(getattr(factory, "reset", None)):
            raise ValueError(
                f"environment_factory {environment_factory!r} is not a class with {_CONTRACT}"
            )
        self.factory: Callable[[], Any] = factory
        self.success_reward = check_weight("success_reward", success_reward)
        super().__init__(
            path=path,
            split=split,
            test_path=test_path,
            holdout_fraction=holdout_fraction,
            hub=hub,
            hub_config=hub_config,
            hub_train_split=hub_train_split,
            hub_test_split=hub_test_split,
            prompt_field=prompt_field,
            answer_field=None,
            checker="none",
            system_prompt=system_prompt,
        )

    def reset(self, seed: int) -> _Episode | Awaitable[_Episode]:
        problem, record = self.problem(seed), self.record(seed)
        instance = self.factory()
        observation = instance.reset(**self._row(record))
        if inspect.isawaitable(observation):
            return self._begun_async(problem, instance, observation)
        return self._begun(problem, instance, observation)

    def _row(self, record: Record) -> dict[str, Any]:
        """The row as TRL passes it to `reset`: its fields, the prompt as the row held it."""
        prompt: Any = [dict(m) for m in record.messages] if record.messages else record.prompt
        return {**record.fields, self.reader.prompt_field: prompt}

    async def _begun_async(
        self, problem: Problem, instance: Any, observation: Awaitable[Any]
    ) -> _Episode:
        return self._begun(problem, instance, await observation)

    def _begun(self, problem: Problem, instance: Any, observation: Any) -> _Episode:
        if observation is not None:
            if not isinstance(observation, str):
                raise TypeError(f"reset() returned {type(observation).__name__}, not None or str")
            # TRL appends it to the last (user) message's text as it is.
            last = problem.prompt_messages[-1]
            messages = [
                *problem.prompt_messages[:-1],
                {**last, "content": last["content"] + observation},
            ]
            problem = Problem(problem.seed, messages, problem.answer, problem.meta)
        return _Episode(problem, instance, self.success_reward)
