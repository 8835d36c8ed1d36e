"""MATH-style competition problems (`env=math`): a dataset task (grail/envs/dataset.py) whose rows
have a `problem` and a worked `solution` ending in \\boxed{answer}, as in Hendrycks et al.'s MATH,
graded with math-verify (the `math` extra), so that \\frac{1}{2}, 0.5 and 1/2 are one answer.

Sources as any dataset task: a local JSONL, Parquet or CSV file (`path`, with `test_path` or a
deterministic holdout), or a Hub copy of MATH with these fields (`hub`, `hub_config`; the `hub`
extra and network access). The reference is the solution as math-verify reads it (its last
\\boxed{}); so is the completion's answer, taken from its last <answer>…</answer> block if it
has one, else from the whole text.

Reward (components unweighted):
    correct = 1.0 if math-verify finds the answers equal, else 0.0
    format  = 1.0 if the completion has an <answer>…</answer> block, else 0.0
    reward  = correct_weight·correct + format_weight·format          (defaults 1.0 and 0.1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from grail.envs.dataset import DatasetEnv

SYSTEM_PROMPT = "Solve the problem. Put the final answer in \\boxed{} inside <answer>...</answer>."


class MathEnv(DatasetEnv):
    """Competition math with LaTeX answers, checked for equivalence by math-verify."""

    name = "math"

    def __init__(
        self,
        path: str | Path | None = None,
        split: Literal["train", "test"] = "train",
        test_path: str | Path | None = None,
        holdout_fraction: float = 0.1,
        hub: str | None = None,
        hub_config: str | None = None,
        correct_weight: float = 1.0,
        format_weight: float = 0.1,
        system_prompt: str = SYSTEM_PROMPT,
    ) -> None:
        super().__init__(
            path=path,
            split=split,
            test_path=test_path,
            holdout_fraction=holdout_fraction,
            hub=hub,
            hub_config=hub_config,
            prompt_field="problem",
            answer_field="solution",
            checker="math",
            system_prompt=system_prompt,
            correct_weight=correct_weight,
            format_weight=format_weight,
        )
