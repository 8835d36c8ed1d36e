"""OpenEnv environments written as OpenEnv's template writes them (an Environment subclass with
pydantic Action and Observation classes): tests/test_openenv.py serves them with OpenEnv's own
server and runs them under grail (`env=openenv`)."""

from __future__ import annotations

import random
import time
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field


class GuessAction(Action):
    guess: str = Field(..., description="A number, as text")


class GuessObservation(Observation):
    prompt: str = Field(default="", description="What the player is told")


class Guess(Environment):
    """Guess a number from 1 to 9 drawn from the reset's seed; told "higher" or "lower" after a
    wrong guess; reward 1 for the right one, the game over after three guesses."""

    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(step_count=0)
        self.secret = 0

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self.secret = random.Random(seed).randint(1, 9)
        return GuessObservation(prompt="Guess a number from 1 to 9.", done=False, reward=0.0)

    def step(self, action: GuessAction, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        try:
            guess = int(action.guess.strip())
        except ValueError:
            guess = 0
        if guess == self.secret:
            return GuessObservation(prompt="Right.", done=True, reward=1.0)
        over = self._state.step_count >= 3
        hint = "higher" if guess < self.secret else "lower"
        return GuessObservation(prompt=hint, done=over, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class SlowGuess(Guess):
    """Takes 1 s to answer a guess: a server that hangs, for a client that waits less."""

    def step(self, action: GuessAction, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        time.sleep(1)
        return super().step(action)


class BrokenGuess(Guess):
    """Raises on every guess: OpenEnv's server answers the step with an error."""

    def step(self, action: GuessAction, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        raise RuntimeError("the board is on fire")


class TwoFieldAction(Action):
    guess: str = ""
    note: str = ""


class TwoFields(Guess):
    """An action with two string fields: which one gets the text must be named."""

    def step(self, action: TwoFieldAction, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        return super().step(GuessAction(guess=action.guess))


class Unannotated(Guess):
    def step(self, action, **kwargs):  # type: ignore[no-untyped-def,override]
        return super().step(action)


class NotAnEnvironment:
    def reset(self) -> None:
        pass
