"""Copy digits: the default task, learnable from scratch by a tiny random-initialised model.

Why this task: the default job must show GRPO working end to end on CPU in minutes, starting
from random weights (`grail.models.tiny`). Copying a digit from the prompt is the simplest
behaviour whose correct answer depends on the prompt, so no constant output scores well: the
model has to learn to read the digit (attention to a fixed offset) and to stop after it.

Problem (all randomness from `random.Random(seed)`): a string d of `num_digits` uniform digits;
a single user message "Repeat: d"; answer d. Digits are one token each in byte-level BPE
tokenizers that split numbers per digit (Qwen2's, the tiny model's), so copying is
token-for-token.

Score of a completion. Let c be the completion up to the first end-of-turn marker
(<|im_end|> or <|endoftext|>, in case the generator left it in the text), whitespace stripped,
and n = len(d). Components, each in [0, 1]:

    correct = 1 if c == d else 0
    found   = 1 if d occurs in c else 0                      (the answer is there)
    brevity = n / max(len(c), n)                             (1 when c is no longer than d)
    reward  = (w_c·correct + w_f·found·brevity) / (w_c + w_f)

Defaults w_c = w_f = 1, so reward ∈ [0, 1]; the exact answer scores 1, the answer with extra
characters 0.5·n/len(c) (less the more it adds), and anything without the answer 0.
success = correct.

Why the shaping is shaped this way (each choice was measured with GRPO from random weights):
- `found` rewards the answer anywhere in the completion, so a random model gets signal from
  max_new_tokens chances per sample instead of one; `brevity` then favours stopping after it,
  and `correct` pays for stopping exactly.
- Nothing rewards a wrong digit or "looks like a number". A reward that does not depend on the
  prompt's digit pays every sampled digit alike, and policy-gradient noise then concentrates
  the policy on one constant digit (right 10% of the time) before copying is learnt; with all
  completions equal, groups carry no signal and training stalls there.
- `found` is multiplied by `brevity` so that hedging ("0123456789" contains any digit) or
  repeating the digit to the token limit scores less than answering and stopping.
- Stopping is the hard part, not copying. Once the digit is copied, every completion that
  does not stop scores the same, so nothing steers the tokens after the digit: with Adam, noise
  alone concentrates them on some junk token, and then <|im_end|> or whitespace is never
  sampled and `correct` never paid. The default job (conf/env/copy_digits.yaml) therefore
  allows 2 new tokens (the digit and a stop) rather than 4, and adds a small entropy bonus that
  keeps the second token's distribution open until stopping is found.

With num_digits = n a constant completion succeeds on 10^-n of the seeds (10% for the default
n = 1); `num_digits` is the difficulty knob.
"""

from __future__ import annotations

import random

from grail.envs.base import Problem, Score, check_seed, check_weight

DIGITS = "0123456789"
# Text a generator may leave in the completion when it does not strip special tokens: the turn
# ends there, so what follows is not part of the answer.
END_OF_TURN = ("<|im_end|>", "<|endoftext|>")


class CopyDigitsEnv:
    """Repeat the digits in the prompt; see the module docstring for prompt and reward."""

    name = "copy_digits"
    components: tuple[str, ...] = ("correct", "found", "brevity")

    def __init__(
        self, num_digits: int = 1, correct_weight: float = 1.0, found_weight: float = 1.0
    ) -> None:
        if isinstance(num_digits, bool) or not isinstance(num_digits, int) or num_digits < 1:
            raise ValueError(f"num_digits must be an integer >= 1, got {num_digits!r}")
        self.num_digits = num_digits
        self.correct_weight = check_weight("correct_weight", correct_weight)
        self.found_weight = check_weight("found_weight", found_weight)
        if self.correct_weight <= 0:
            raise ValueError(f"correct_weight must be > 0, got {correct_weight!r}")

    def problem(self, seed: int) -> Problem:
        value = check_seed(seed)
        rng = random.Random(value)
        answer = "".join(rng.choice(DIGITS) for _ in range(self.num_digits))
        return Problem(
            seed=value,
            prompt_messages=[{"role": "user", "content": f"Repeat: {answer}"}],
            answer=answer,
            meta={"num_digits": self.num_digits},
        )

    def score(self, problem: Problem, completion: str) -> Score:
        text = completion
        for marker in END_OF_TURN:
            text = text.split(marker, 1)[0]
        text = text.strip()
        target = problem.answer
        correct = 1.0 if text == target else 0.0
        found = 1.0 if target in text else 0.0
        brevity = len(target) / max(len(text), len(target))
        reward = (self.correct_weight * correct + self.found_weight * found * brevity) / (
            self.correct_weight + self.found_weight
        )
        return Score(
            reward=reward,
            components={"correct": correct, "found": found, "brevity": brevity},
            success=bool(correct),
        )
