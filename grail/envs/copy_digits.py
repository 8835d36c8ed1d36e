"""Copy digits: the default task, learnable from scratch by a tiny random-initialised model.

Why this task: the default job must show GRPO working end to end on CPU in minutes, starting
from random weights (`grail.models.tiny`). Copying a digit from the prompt is the simplest
behaviour whose correct answer depends on the prompt, so no constant output can score well:
the model must learn to read the digit (an attention pattern to a fixed offset) and to stop.

Problem (all randomness from `random.Random(seed)`): a string of `num_digits` uniform digits d;
prompt "Repeat: d" as a single user message; answer d. Digits are one token each in byte-level
BPE tokenizers that split numbers per digit (Qwen2, the tiny model), so copying is
token-for-token.

Score of a completion c (text after the first <|im_end|> ignored, then stripped of whitespace);
every component is in [0, 1]:

    correct = 1 if c == d else 0
    digits  = (number of digit characters in c) / len(c)            (0 for empty c)
    length  = 1 / (1 + |len(c) - len(d)|) if c else 0                 (stops promptly)
    reward  = (w_c·correct + w_d·digits + w_l·length) / (w_c + w_d + w_l)

Default weights w_c, w_d, w_l = 1.0, 0.25, 0.25, so reward ∈ [0, 1], only the exact answer
scores 1, and the order is: exact answer > right-length digits (wrong value) > digits with extra
characters > garbage > empty. The shaping components give a random model signal: a few
percent of random tokens are digits, and shorter outputs (an early eos) score higher, so
"emit digits, then stop" is learnt first, then which digit. success = correct.

With num_digits = n a constant completion succeeds on 10^-n of the seeds (10% for the default
n = 1); `num_digits` is the difficulty knob.
"""

from __future__ import annotations

import operator
import random

from grail.envs.base import Problem, Score

DIGITS = "0123456789"
# Text a generator may leave in the completion when it does not strip special tokens: the turn
# ends there, so what follows is not part of the answer.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


class CopyDigitsEnv:
    """Repeat the digits in the prompt; see the module docstring for prompt and reward."""

    name = "copy_digits"

    def __init__(
        self,
        num_digits: int = 1,
        correct_weight: float = 1.0,
        digits_weight: float = 0.25,
        length_weight: float = 0.25,
    ) -> None:
        if isinstance(num_digits, bool) or not isinstance(num_digits, int) or num_digits < 1:
            raise ValueError(f"num_digits must be an integer >= 1, got {num_digits!r}")
        weights = {
            "correct_weight": correct_weight,
            "digits_weight": digits_weight,
            "length_weight": length_weight,
        }
        for key, w in weights.items():
            if isinstance(w, bool) or not isinstance(w, int | float) or not w >= 0:
                raise ValueError(f"{key} must be a number >= 0, got {w!r}")
        if correct_weight <= 0:
            raise ValueError(f"correct_weight must be > 0, got {correct_weight!r}")
        self.num_digits = num_digits
        self.correct_weight = float(correct_weight)
        self.digits_weight = float(digits_weight)
        self.length_weight = float(length_weight)

    def problem(self, seed: int) -> Problem:
        try:
            seed = operator.index(seed)
        except TypeError:
            raise TypeError(f"seed must be an integer, got {type(seed).__name__}") from None
        rng = random.Random(seed)
        answer = "".join(rng.choice(DIGITS) for _ in range(self.num_digits))
        return Problem(
            seed=seed,
            prompt_messages=[{"role": "user", "content": f"Repeat: {answer}"}],
            answer=answer,
            meta={"num_digits": self.num_digits},
        )

    def score(self, problem: Problem, completion: str) -> Score:
        text = completion
        for marker in _END_OF_TURN:
            text = text.split(marker, 1)[0]
        text = text.strip()
        target = problem.answer
        correct = 1.0 if text == target else 0.0
        digits = sum(ch in DIGITS for ch in text) / len(text) if text else 0.0
        length = 1.0 / (1.0 + abs(len(text) - len(target))) if text else 0.0
        total = self.correct_weight + self.digits_weight + self.length_weight
        reward = (
            self.correct_weight * correct
            + self.digits_weight * digits
            + self.length_weight * length
        ) / total
        return Score(
            reward=reward,
            components={"correct": correct, "digits": digits, "length": length},
            success=bool(correct),
        )
