"""Copy turns: the default task over several turns, the episode a tiny model learns on CPU.

Why this task: it proves multi-turn GRPO end to end on CPU from random weights, as copy_digits
does for one turn. Each turn asks for one digit; the model must copy the digit of the newest
message, not one from earlier in the conversation, and stop, `turns` times in one episode. The
loss covers the model's answers only; the questions between them are context.

Episode (all randomness from `random.Random(seed)`): digits d_1 .. d_n (n = `turns`); the first
message is "Repeat: d_1"; after each answer the environment says "Repeat: d_{i+1}", and after
the n-th it ends the episode. Answer i is scored as copy_digits scores a completion against d_i
(its `correct`, `found` and `brevity`, grail/envs/copy_digits.py); the turn's reward is that
score divided by n, so the episode's reward is the mean over its turns, in [0, 1]. Success: every
answer exactly right. A wrong answer does not end the episode: later turns still teach.

A constant policy succeeds on 10^-n of the seeds.
"""

from __future__ import annotations

import random

from grail.envs.base import Problem
from grail.envs.copy_digits import DIGITS, CopyDigitsEnv
from grail.envs.episodes import Step


class _Episode:
    def __init__(self, scorer: CopyDigitsEnv, problem: Problem, digits: str) -> None:
        self.scorer, self.problem, self.digits = scorer, problem, digits
        self.turn = 0
        self.all_correct = True

    def step(self, text: str) -> Step:
        target = self.digits[self.turn]
        question = Problem(self.problem.seed, [], target)
        score = self.scorer.score(question, text)
        self.all_correct = self.all_correct and score.success
        self.turn += 1
        n = len(self.digits)
        done = self.turn == n
        return Step(
            messages=[]
            if done
            else [{"role": "user", "content": f"Repeat: {self.digits[self.turn]}"}],
            reward=score.reward / n,
            done=done,
            success=done and self.all_correct,
            components={k: v / n for k, v in score.components.items()},
        )


class CopyTurnsEnv:
    """Copy one digit per turn for `turns` turns; see the module docstring."""

    name = "copy_turns"
    components: tuple[str, ...] = CopyDigitsEnv.components

    def __init__(
        self, turns: int = 3, correct_weight: float = 1.0, found_weight: float = 1.0
    ) -> None:
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise ValueError(f"turns must be an integer >= 1, got {turns!r}")
        self.turns = turns
        self.scorer = CopyDigitsEnv(1, correct_weight, found_weight)

    def reset(self, seed: int) -> _Episode:
        first = self.scorer.problem(seed)  # checks the seed as copy_digits does
        rng = random.Random(first.seed)
        digits = "".join(rng.choice(DIGITS) for _ in range(self.turns))
        problem = Problem(
            seed=first.seed,
            prompt_messages=[{"role": "user", "content": f"Repeat: {digits[0]}"}],
            answer=digits,
            meta={"turns": self.turns},
        )
        return _Episode(self.scorer, problem, digits)
