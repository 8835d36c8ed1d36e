"""Procedural k-SAT (3-SAT by default) with a planted solution, so every instance is satisfiable.

Generation (all randomness from `random.Random(seed)`, so a seed is the same instance on any
machine and in any process):

1. draw a hidden assignment a ∈ {0,1}^n uniformly;
2. draw clauses one at a time: k distinct variables, each negated with probability 1/2; a clause
   whose k literals are all false under a is redrawn (so each clause is uniform over the
   2^k - 1 sign patterns that a satisfies), and a clause already drawn is redrawn too.

Step 2 guarantees a satisfies every clause, so the instance is satisfiable. Other satisfying
assignments usually exist and count exactly as much: the grader checks clauses, not a match
with the planted bits.

Difficulty: `difficulty` d ∈ [0, 1] sets n = round(4 + 12·d) variables (4..16) and
m = round(n · (3.0 + 1.3·d)) clauses, i.e. the clause/variable ratio rises from 3.0 towards
4.3, the ratio near which random 3-SAT is hardest. `num_vars` / `num_clauses` override either.

Reward (components are unweighted, each in [0, 1]):

    format    = 1.0 if a <SOLUTION>…</SOLUTION> block holds exactly n bits (whitespace ignored),
                0.5 if the tags are there but the content is not n bits, 0.0 without the tags
    satisfied = fraction of clauses the given bits satisfy (0.0 when the bits are unusable)
    solved    = 1.0 if every clause is satisfied, else 0.0
    reward    = format_weight·format + satisfied_weight·satisfied + solved_weight·solved

Default weights 0.1 / 0.4 / 0.5, so reward ∈ [0, 1] and only a full solution scores 1.0.
A random assignment satisfies about 1 - 2^-k of the clauses (7/8 for 3-SAT), so `satisfied`
alone is a weak signal; the `solved` bonus is what separates solving from guessing.
success = solved. When the completion has several SOLUTION blocks the last one counts (models
often restate the required format before answering); see `grail.envs.tags.last_block`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from grail.envs.base import Problem, Score, check_seed, check_weight, problem_meta
from grail.envs.tags import last_block

SYSTEM_PROMPT = (
    "You solve Boolean satisfiability problems. Reason briefly, then give the final assignment "
    "inside <SOLUTION></SOLUTION>."
)


def format_clause(clause: list[int]) -> str:
    """Render a DIMACS-style clause ([1, -3, 4]) as "(x1 OR ~x3 OR x4)"."""
    return "(" + " OR ".join(f"~x{-lit}" if lit < 0 else f"x{lit}" for lit in clause) + ")"


def clauses_satisfied(clauses: list[list[int]], bits: str) -> int:
    """Number of clauses satisfied by `bits` (character i is variable i+1; "1" = true)."""
    count = 0
    for clause in clauses:
        for lit in clause:
            value = bits[abs(lit) - 1] == "1"
            if value == (lit > 0):
                count += 1
                break
    return count


def parse_solution(completion: str, num_vars: int) -> tuple[bool, str | None]:
    """Return (tags_present, bits): bits is the last SOLUTION block's n-bit string, or None."""
    block = last_block(completion, "SOLUTION")
    if block is None:
        return False, None
    content = "".join(block.split())
    if len(content) == num_vars and set(content) <= {"0", "1"}:
        return True, content
    return True, None


@dataclass(frozen=True)
class SATInstance:
    num_vars: int
    clauses: list[list[int]]
    planted: str


def generate_instance(seed: int, num_vars: int, num_clauses: int, clause_size: int) -> SATInstance:
    """Planted k-SAT instance for `seed` (see the module docstring for the construction)."""
    rng = random.Random(check_seed(seed))
    planted = [rng.random() < 0.5 for _ in range(num_vars)]
    variables = range(1, num_vars + 1)
    seen: set[tuple[int, ...]] = set()
    clauses: list[list[int]] = []
    while len(clauses) < num_clauses:
        chosen = sorted(rng.sample(variables, clause_size))
        clause = [v if rng.random() < 0.5 else -v for v in chosen]
        if not any(planted[abs(lit) - 1] == (lit > 0) for lit in clause):
            continue
        key = tuple(clause)
        if key in seen:
            continue
        seen.add(key)
        clauses.append(clause)
    return SATInstance(num_vars, clauses, "".join("1" if v else "0" for v in planted))


class SATEnv:
    """Satisfiable k-SAT instances from seeds; graded reward with format/satisfied/solved parts."""

    name = "sat"
    components: tuple[str, ...] = ("format", "satisfied", "solved")

    def __init__(
        self,
        difficulty: float = 0.3,
        num_vars: int | None = None,
        num_clauses: int | None = None,
        clause_size: int = 3,
        format_weight: float = 0.1,
        satisfied_weight: float = 0.4,
        solved_weight: float = 0.5,
    ) -> None:
        if (
            isinstance(difficulty, bool)
            or not isinstance(difficulty, int | float)
            or not 0.0 <= difficulty <= 1.0
        ):
            raise ValueError(f"difficulty must be a number in [0, 1], got {difficulty!r}")
        if isinstance(clause_size, bool) or not isinstance(clause_size, int) or clause_size < 1:
            raise ValueError(f"clause_size must be an integer >= 1, got {clause_size!r}")
        n = round(4 + 12 * difficulty) if num_vars is None else num_vars
        if isinstance(n, bool) or not isinstance(n, int) or n < clause_size:
            raise ValueError(
                f"num_vars must be an integer >= clause_size ({clause_size}), got {n!r}"
            )
        m = round(n * (3.0 + 1.3 * difficulty)) if num_clauses is None else num_clauses
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_clauses must be an integer >= 1, got {m!r}")
        # Distinct clauses that a fixed assignment satisfies: C(n, k) variable sets × (2^k - 1)
        # sign patterns. Asking for more would make the generator loop forever.
        most = math.comb(n, clause_size) * (2**clause_size - 1)
        if m > most:
            raise ValueError(
                f"num_clauses={m} is more than the {most} distinct clauses that {n} variables "
                f"with clause_size={clause_size} allow under a planted assignment"
            )
        self.difficulty = float(difficulty)
        self.num_vars = n
        self.num_clauses = m
        self.clause_size = clause_size
        self.format_weight = check_weight("format_weight", format_weight)
        self.satisfied_weight = check_weight("satisfied_weight", satisfied_weight)
        self.solved_weight = check_weight("solved_weight", solved_weight)

    def problem(self, seed: int) -> Problem:
        inst = generate_instance(seed, self.num_vars, self.num_clauses, self.clause_size)
        n = inst.num_vars
        example = ("01" * n)[:n]
        clause_lines = "\n".join(
            f"{i}. {format_clause(clause)}" for i, clause in enumerate(inst.clauses, start=1)
        )
        user = (
            f"Find values for the variables x1 to x{n} (each 0 for false or 1 for true) that make "
            "every clause below true. A clause is true when at least one of its literals is "
            "true; ~x3 means NOT x3.\n\n"
            f"Clauses:\n{clause_lines}\n\n"
            f"Give the values of x1..x{n} in order as a string of exactly {n} bits inside "
            f"<SOLUTION></SOLUTION>, in the form <SOLUTION>{example}</SOLUTION>."
        )
        return Problem(
            seed=int(seed),
            prompt_messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": user},
            ],
            answer=inst.planted,
            meta={"num_vars": n, "clauses": inst.clauses},
        )

    def score(self, problem: Problem, completion: str) -> Score:
        num_vars, clauses = problem_meta(problem, self.name, "num_vars", "clauses")
        n = int(num_vars)
        tags, bits = parse_solution(completion, n)
        fmt = 1.0 if bits is not None else (0.5 if tags else 0.0)
        count = clauses_satisfied(clauses, bits) if bits is not None else 0
        satisfied = count / len(clauses)
        solved = 1.0 if count == len(clauses) else 0.0
        reward = (
            self.format_weight * fmt
            + self.satisfied_weight * satisfied
            + self.solved_weight * solved
        )
        return Score(
            reward=reward,
            components={"format": fmt, "satisfied": satisfied, "solved": solved},
            success=solved == 1.0,
        )
