"""Countdown: reach a target number with arithmetic over given numbers (TinyZero's task, one of
TorchRL's GRPO tasks), procedural from seeds like SAT, so every instance is solvable.

Generation (all randomness from `random.Random(seed)`: a seed is the same instance on any machine
and in any process): draw `num_numbers` numbers uniformly from [min_number, max_number], then
combine them in random order with random operations (+, -, *, and / where it divides exactly)
into one expression that uses every number once; its value is the target when it is an integer
in [min_target, max_target], else the combination is drawn again (up to `MAX_DRAWS` times, then
the numbers too). The planted expression is the problem's `answer`; any other expression that
reaches the target counts as much.

Answer: an arithmetic expression inside <answer>...</answer> (the last block counts), using each
given number at most once (exactly once with `use_all_numbers`, TinyZero's rule), with +, -, *,
/ and parentheses; text after a "=" is ignored ("(3 + 5) * 2 = 16"). It is evaluated exactly
(fractions) by walking its syntax tree, never with `eval`: numbers, the four operations and
parentheses only (no unary minus, names, calls or powers), at most `MAX_ANSWER_CHARS` characters.

Reward (components unweighted, each in [0, 1]):

    format  = 1.0 if the answer block holds a well-formed expression, 0.5 if the tags are there
              but their content is not one, 0.0 without the tags
    numbers = 1.0 if the expression uses the given numbers as the rule says, else 0.0
    solved  = 1.0 if it also equals the target, else 0.0
    reward  = format_weight·format + numbers_weight·numbers + solved_weight·solved

Default weights 0.1 / 0.0 / 0.9 (TinyZero's 0.1 for the format, 1.0 for a solution, here scaled
into [0, 1]); success = solved.
"""

from __future__ import annotations

import ast
import random
from collections import Counter
from fractions import Fraction

from grail.envs.base import Problem, Score, check_seed, check_weight, problem_meta
from grail.envs.tags import last_block

SYSTEM_PROMPT = (
    "You solve arithmetic puzzles. Reason briefly, then give the final expression inside "
    "<answer></answer>."
)
MAX_DRAWS = 200  # combinations of one draw of numbers tried for a target in range
MAX_ANSWER_CHARS = 200  # a longer answer is not graded (not a well-formed expression)
_OPERATIONS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def _combine(a: Fraction, b: Fraction, op: str) -> Fraction | None:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return a / b if b != 0 else None


def plant(rng: random.Random, numbers: list[int]) -> tuple[str, Fraction] | None:
    """A random expression over all of `numbers` (each once) and its value; None when a
    division did not come out exact."""
    terms: list[tuple[str, Fraction]] = [(str(n), Fraction(n)) for n in numbers]
    rng.shuffle(terms)
    while len(terms) > 1:
        (left, a), (right, b) = terms.pop(), terms.pop()
        op = rng.choice("+-*/")
        value = _combine(a, b, op)
        if value is None or (op == "/" and value.denominator != 1):
            return None
        terms.append((f"({left} {op} {right})", value))
        rng.shuffle(terms)
    text, value = terms[0]
    return (text[1:-1] if text.startswith("(") else text), value


def evaluate(text: str) -> tuple[Fraction, list[int]] | None:
    """The exact value of an arithmetic expression and the numbers it uses, or None when it is
    not one (other syntax, a division by zero, too long)."""
    if len(text) > MAX_ANSWER_CHARS:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    used: list[int] = []

    def value(node: ast.expr) -> Fraction | None:
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, int):
                return None
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATIONS:
            left, right = value(node.left), value(node.right)
            if left is None or right is None:
                return None
            return _combine(left, right, _OPERATIONS[type(node.op)])
        return None

    result = value(tree.body)
    return None if result is None else (result, used)


class CountdownEnv:
    """Numbers and a target from seeds; reward for an expression over the numbers that hits it."""

    name = "countdown"
    components: tuple[str, ...] = ("format", "numbers", "solved")

    def __init__(
        self,
        num_numbers: int = 4,
        min_number: int = 1,
        max_number: int = 100,
        min_target: int = 1,
        max_target: int = 100,
        use_all_numbers: bool = True,
        format_weight: float = 0.1,
        numbers_weight: float = 0.0,
        solved_weight: float = 0.9,
    ) -> None:
        for key, value, least in (
            ("num_numbers", num_numbers, 2),
            ("min_number", min_number, 1),
            ("max_number", max_number, 1),
            ("min_target", min_target, 0),
            ("max_target", max_target, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key} must be an integer >= {least}, got {value!r}")
        if min_number > max_number:
            raise ValueError(f"min_number={min_number} is above max_number={max_number}")
        if min_target > max_target:
            raise ValueError(f"min_target={min_target} is above max_target={max_target}")
        if not isinstance(use_all_numbers, bool):
            raise ValueError(f"use_all_numbers must be true or false, got {use_all_numbers!r}")
        self.num_numbers, self.use_all_numbers = num_numbers, use_all_numbers
        self.min_number, self.max_number = min_number, max_number
        self.min_target, self.max_target = min_target, max_target
        self.format_weight = check_weight("format_weight", format_weight)
        self.numbers_weight = check_weight("numbers_weight", numbers_weight)
        self.solved_weight = check_weight("solved_weight", solved_weight)

    def instance(self, seed: int) -> tuple[list[int], int, str]:
        """The numbers, the target and a planted solution of problem `seed`."""
        rng = random.Random(check_seed(seed))
        for _ in range(MAX_DRAWS):
            numbers = [
                rng.randint(self.min_number, self.max_number) for _ in range(self.num_numbers)
            ]
            for _ in range(MAX_DRAWS):
                planted = plant(rng, numbers)
                if planted is None:
                    continue
                text, value = planted
                if value.denominator == 1 and self.min_target <= value <= self.max_target:
                    return numbers, int(value), text
        raise ValueError(
            f"no target in [{self.min_target}, {self.max_target}] found for seed {seed} from "
            f"{self.num_numbers} numbers in [{self.min_number}, {self.max_number}]: widen the "
            "target range (data.env_kwargs.min_target / max_target)"
        )

    def problem(self, seed: int) -> Problem:
        numbers, target, planted = self.instance(seed)
        rule = "exactly once" if self.use_all_numbers else "at most once"
        user = (
            f"Using the numbers {numbers}, create an expression that equals {target}. You may "
            f"use +, -, * and / and parentheses, and each number {rule}. Give the expression "
            "inside <answer></answer>, for example <answer>(1 + 2) / 3</answer>."
        )
        return Problem(
            seed=int(seed),
            prompt_messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": user},
            ],
            answer=planted,
            meta={"numbers": numbers, "target": target},
        )

    def score(self, problem: Problem, completion: str) -> Score:
        numbers, target = problem_meta(problem, self.name, "numbers", "target")
        block = last_block(completion, "answer")
        result = None if block is None else evaluate(block.split("=", 1)[0])
        fmt = 1.0 if result is not None else (0.5 if block is not None else 0.0)
        uses, solved = 0.0, 0.0
        if result is not None:
            value, used = result
            given, taken = Counter(numbers), Counter(used)
            if (taken == given) if self.use_all_numbers else not (taken - given):
                uses = 1.0
                solved = 1.0 if value == int(target) else 0.0
        reward = self.format_weight * fmt + self.numbers_weight * uses + self.solved_weight * solved
        return Score(
            reward=reward,
            components={"format": fmt, "numbers": uses, "solved": solved},
            success=solved == 1.0,
        )
