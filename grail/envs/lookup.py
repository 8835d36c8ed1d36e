"""Lookup: a tool task whose answer the prompt does not contain.

Why this task: it is the smallest episode in which a tool is necessary, not merely allowed. The
prompt names a key; the key's value is a digit drawn at random for that episode, shown nowhere
but in what the `lookup` tool returns. A policy that answers without the tool can only guess,
and no guess beats a uniform digit: 10% success. Success clearly above 10% on held-out seeds
therefore means the policy learned to call the tool with the asked key and to copy what came
back.

Episode (all randomness from `random.Random(seed)`): a table of `keys` distinct lowercase
letters, each with a uniform digit as its value; one of its keys, uniformly, is asked. The first
message is 'What is the value of key "K"? Use the lookup tool.', and the episode offers one tool,
`lookup(key)`, which returns the key's value ("7") or "no such key" for any other string (exact
match: no case folding, no stripping). Keys are single letters, quoted in the question as in a
call, because then every letter is the same one token of the tiny model's tokenizer in both
(`key "q"` and `"key": "q"` both give ` "`, `q`, `"`; unquoted, ` q` is one token for 17 of the
26 letters), so copying the key is token for token, as copying the digit back is.

Turns. A turn holding a `<tool_call>` is answered by the turn loop (grail/envs/tools.py): the
tool's result, or an `error: ...` message for a malformed call, an unknown tool or a bad
argument (counted as a tool error in the records); the episode goes on. The first turn without
a tool call is the answer: it is scored and ends the episode. An episode whose turns run out
(data.max_turns) before an answer earns 0 and counts as truncated.

Reward: the answer is scored as copy_digits scores a completion against the value digit (its
`correct`, `found` and `brevity`, weights `correct_weight` and `found_weight`,
grail/envs/copy_digits.py): 1 for exactly the digit, less for the digit among other text,
0 without it. Nothing pays for calling the tool itself. A bonus for calls would be earned by
calling and then answering anything, and the policy could settle there; paying only for the
right digit keeps the tool a means, so the reward measures what the task asks, and a policy
that never calls it keeps its 10%. Success: `correct`.

One more component, `looked_up` (1 when the episode called `lookup` with the asked key before
its answer, else 0), is reported, never rewarded: the records then tell success through the tool
from a lucky guess.

Learnability, measured on CPU: the tiny random-init model does not learn this from scratch. The
shortest call is 51 tokens of its tokenizer (52 with <|im_end|>, conf/env/lookup.yaml), each
near-uniform over the 512-token vocabulary at init: log p(call | prompt) = -326 nats (~1e-142).
In 20 iterations of conf/env/lookup.yaml (20,480 episodes) it never wrote `<tool_call>`; the
reward crept up only through digits scattered in long answers. examples/lookup_warm_start.py
demonstrates the task in three supervised stages, after which held-out success is 0.91; GRPO
from a warm start that teaches only the format stays at a guess (docs/episodes.md, "Tools").
"""

from __future__ import annotations

import random
import string

from grail.envs.base import Problem
from grail.envs.copy_digits import DIGITS, CopyDigitsEnv
from grail.envs.episodes import Step

NO_SUCH_KEY = "no such key"
_LETTERS = string.ascii_lowercase


class _Episode:
    def __init__(
        self, scorer: CopyDigitsEnv, problem: Problem, table: dict[str, str], key: str
    ) -> None:
        self.scorer, self.problem, self.table, self.key = scorer, problem, table, key
        self.looked_up = False
        # A bound method: each episode's tool reads its own table (many episodes run at once).
        self.tools = [self.lookup]

    def lookup(self, key: str) -> str:
        """Look up the value of a key in the table.

        Args:
            key: The key to look up.
        """
        self.looked_up = self.looked_up or key == self.key
        return self.table.get(key, NO_SUCH_KEY)

    def step(self, text: str) -> Step:
        # Only turns without a tool call reach here (the turn loop answers the others): the answer.
        score = self.scorer.score(Problem(self.problem.seed, [], self.table[self.key]), text)
        return Step(
            reward=score.reward,
            done=True,
            success=score.success,
            components={**score.components, "looked_up": float(self.looked_up)},
        )


class LookupEnv:
    """Look a key's value up with a tool, then answer it; see the module docstring."""

    name = "lookup"
    components: tuple[str, ...] = (*CopyDigitsEnv.components, "looked_up")

    def __init__(
        self, keys: int = 4, correct_weight: float = 1.0, found_weight: float = 1.0
    ) -> None:
        if isinstance(keys, bool) or not isinstance(keys, int) or not 1 <= keys <= len(_LETTERS):
            raise ValueError(f"keys must be an integer from 1 to {len(_LETTERS)}, got {keys!r}")
        self.keys = keys
        self.scorer = CopyDigitsEnv(1, correct_weight, found_weight)

    def reset(self, seed: int) -> _Episode:
        first = self.scorer.problem(seed)  # checks the seed as copy_digits does
        rng = random.Random(first.seed)
        table = {key: rng.choice(DIGITS) for key in rng.sample(_LETTERS, self.keys)}
        key = rng.choice(list(table))
        problem = Problem(
            seed=first.seed,
            prompt_messages=[
                {
                    "role": "user",
                    "content": f'What is the value of key "{key}"? Use the lookup tool.',
                }
            ],
            answer=table[key],
            meta={"key": key, "table": dict(table)},
        )
        return _Episode(self.scorer, problem, table, key)
