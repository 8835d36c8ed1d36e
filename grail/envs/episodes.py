"""Episodes: environments that answer the policy's turns.

A single-turn environment (grail/envs/base.py) gives a prompt and scores one completion. An
episode environment talks back: after each assistant turn it may answer (a tool's result,
feedback, the next question, a game move) until it says the episode is done, in the shape of gym
and OpenEnv:

    episode = env.reset(seed)            # deterministic in the seed, like `problem(seed)`
    episode.problem.prompt_messages      # the conversation's first messages
    step = episode.step(assistant_text)  # Step(messages, reward, done, success, components)
    ...                                  # until step.done, or a budget ends the episode

`step` may be a plain method or an `async def`; the turn loop (grail/rollouts/episodes.py) runs a
plain one in a worker thread under a deadline, so a slow environment does not stall the others.
One `Episode` object per episode: many are in flight at once, each with its own state. `reset`
may be an `async def` too. An episode holding something (a connection, a session) may have a
`close()`, plain or async, which the turn loop calls once when the episode ends, however it ends;
an environment whose episodes share a limited resource may cap how many are in flight at once
with an int attribute `max_episodes` (an OpenEnv server's sessions).

The episode's reward is the sum of its steps' rewards (an environment that pays only at the end
returns 0 before); its success is the last step's; its components are summed like the reward.
An episode that a budget ends (data.max_turns, data.max_episode_tokens) keeps what its steps
earned and counts as truncated.

Tools: an episode may offer `tools` (typed Python functions with docstrings, grail/envs/tools.py).
The turn loop describes them to the model through the chat template, runs the calls it finds in
a turn, and sends the results back as the template's tool messages; the environment's `step`
sees only the turns without a tool call (its answers).

An adapter makes any single-turn environment an episode of one turn (`SingleTurn`), and
`Reprompt` is TorchRL's "think again": when a turn's reward is at or below a threshold and
turns remain, the model is asked to try again.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from grail.envs.base import Environment, Problem


@dataclass(frozen=True)
class Step:
    """The environment's answer to one assistant turn."""

    # What the environment says next, as chat messages ({"role": "user" | "tool" | ..., "content"})
    # appended to the conversation; ignored when done.
    messages: Sequence[Mapping[str, Any]] = ()
    reward: float = 0.0  # this turn's reward; the episode's is the sum over its turns
    done: bool = False
    success: bool = False  # read from the step that ends the episode
    components: Mapping[str, float] = field(default_factory=dict)  # summed over the turns


@runtime_checkable
class Episode(Protocol):
    """One episode's state: its first messages, and the environment's side of each turn."""

    problem: Problem  # seed, the first messages (prompt_messages), answer and meta for records

    def step(self, text: str) -> Step | Awaitable[Step]: ...


@runtime_checkable
class EpisodeEnvironment(Protocol):
    name: str
    # The keys of every `Step.components` it returns, known without running it (as for
    # single-turn environments: extra rewards must not reuse them).
    components: tuple[str, ...]

    def reset(self, seed: int) -> Episode | Awaitable[Episode]: ...


# Either kind: what `data.environment` names.
AnyEnvironment = Environment | EpisodeEnvironment


def is_episodic(env: object) -> bool:
    """Whether `env` is an episode environment (has `reset`) rather than a single-turn one."""
    return callable(getattr(env, "reset", None))


def problem_maker(env: AnyEnvironment) -> Callable[[int], Problem]:
    """`seed -> Problem` of either kind of environment (an episode's is its first messages):
    what a stored group is rebuilt with (grail/rollouts/codec.py)."""
    if is_episodic(env):
        episodic: EpisodeEnvironment = env  # type: ignore[assignment]
        return lambda seed: opening(episodic, seed)[0]
    return env.problem  # type: ignore[union-attr]


def opening(env: EpisodeEnvironment, seed: int) -> tuple[Problem, Sequence[Callable[..., Any]]]:
    """An episode's first messages and its tools, read outside the turn loop (no event loop
    running): the episode is reset (awaited if `reset` is async) and closed again."""

    async def opened() -> tuple[Problem, Sequence[Callable[..., Any]]]:
        episode = env.reset(seed)
        if inspect.isawaitable(episode):
            episode = await episode
        try:
            return episode.problem, tools_of(episode)
        finally:
            await close_episode(episode)

    return asyncio.run(opened())


async def close_episode(episode: Episode) -> None:
    """The episode's `close()` when it has one (awaited if async)."""
    close = getattr(episode, "close", None)
    if close is not None:
        result = close()
        if inspect.isawaitable(result):
            await result


def tools_of(episode: Episode) -> Sequence[Callable[..., Any]]:
    """The tools an episode offers (its optional `tools` attribute), none by default."""
    return tuple(getattr(episode, "tools", None) or ())


def check_step(step: object, where: str) -> Step:
    """`step` if it is a well-formed Step; a ValueError naming `where` otherwise (an environment
    that returns junk fails the run in one line, like a reward plugin)."""
    if not isinstance(step, Step):
        raise ValueError(f"{where} returned {type(step).__name__}, not grail.envs.episodes.Step")
    if isinstance(step.reward, bool) or not isinstance(step.reward, int | float):
        raise ValueError(f"{where} returned reward {step.reward!r}, not a number")
    if not math.isfinite(step.reward):
        raise ValueError(f"{where} returned reward {step.reward!r}, not a finite number")
    for message in step.messages if not step.done else ():
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where} returned message {message!r} without a string 'role'")
    for key, value in step.components.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{where} returned component {key}={value!r}, not a number")
    return step


class _OneTurn:
    def __init__(self, env: Environment, problem: Problem) -> None:
        self.env, self.problem = env, problem

    def step(self, text: str) -> Step:
        score = self.env.score(self.problem, text)
        return Step(
            reward=score.reward, done=True, success=score.success, components=score.components
        )


class SingleTurn:
    """A single-turn environment as an episode of one turn: its prompt, then its score."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.name = env.name
        self.components = env.components

    def reset(self, seed: int) -> Episode:
        return _OneTurn(self.env, self.env.problem(seed))


class _Retrying:
    def __init__(self, env: Environment, problem: Problem, reprompt: Reprompt) -> None:
        self.env, self.problem, self.reprompt = env, problem, reprompt
        self.attempts_left = reprompt.attempts

    def step(self, text: str) -> Step:
        score = self.env.score(self.problem, text)
        self.attempts_left -= 1
        if score.reward > self.reprompt.threshold or self.attempts_left == 0:
            return Step(
                reward=score.reward, done=True, success=score.success, components=score.components
            )
        # A failed attempt earns nothing: the episode's reward is its last attempt's.
        return Step(messages=[{"role": "user", "content": self.reprompt.message}])


class Reprompt:
    """TorchRL's re-prompt as a wrapper of a single-turn environment: when an answer scores at
    or below `threshold` and attempts remain, the model is told `message` and answers again,
    seeing its earlier answers; the episode's reward, success and components are those of its
    last answer."""

    def __init__(
        self,
        env: Environment,
        threshold: float = 0.0,
        attempts: int = 2,
        message: str = "That is not right. Think again and answer once more.",
    ) -> None:
        if is_episodic(env):
            raise ValueError(f"Reprompt wraps a single-turn environment; {env.name!r} has reset()")
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ValueError(f"attempts must be an integer >= 1, got {attempts!r}")
        self.env = env
        self.threshold, self.attempts, self.message = float(threshold), attempts, message
        self.name = f"reprompt({env.name})"
        self.components = env.components

    def reset(self, seed: int) -> Episode:
        return _Retrying(self.env, self.env.problem(seed), self)
