"""GSM8K-style grade-school math word problems: a dataset task (grail/envs/dataset.py) whose rows
have a `question` and an `answer` ending with `#### <number>`, as in openai/gsm8k.

Sources: a local JSONL, Parquet or CSV file (`path`, with `test_path` or a deterministic holdout
of `holdout_fraction`), or, with no path, openai/gsm8k (config `main`) from the datasets hub (the
optional `hub` extra and network access). The number after the last `####` is the reference; the
completion's final number is read by GSM8K's rules (grail/envs/answers.py `extract_answer`) and
compared exactly, as fractions.

Reward (components unweighted):
    correct = 1.0 if the extracted number equals the reference, else 0.0
    format  = 1.0 if the completion has an <answer>…</answer> block, else 0.0
    reward  = correct_weight·correct + format_weight·format          (defaults 1.0 and 0.1)
success = correct. Problem meta: `index` (the row in its source), `split`, `solution` (the
worked `answer` field).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from grail.envs.answers import (
    extract_answer,
    format_number,
    last_number,
    parse_number,
    reference_answer,
)
from grail.envs.dataset import (
    DataFileNotFoundError,
    DatasetEnv,
    DatasetError,
    HubUnavailableError,
    Record,
    RowReader,
    holdout_split,
)

HUB_DATASET = ("openai/gsm8k", "main")

SYSTEM_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)

GSM8K_ROWS = RowReader(
    prompt_field="question", answer_field="answer", answer_after="####", checker="number"
)


# The names GSM8K's loader had before it was a dataset task.
GSM8KDataError = DatasetError
GSM8KFileNotFoundError = DataFileNotFoundError


class GSM8KEnv(DatasetEnv):
    """Math word problems with numeric answers; exact (fraction) comparison of the final number."""

    name = "gsm8k"

    def __init__(
        self,
        path: str | Path | None = None,
        split: Literal["train", "test"] = "train",
        test_path: str | Path | None = None,
        holdout_fraction: float = 0.1,
        correct_weight: float = 1.0,
        format_weight: float = 0.1,
        system_prompt: str = SYSTEM_PROMPT,
    ) -> None:
        super().__init__(
            path=path,
            split=split,
            test_path=test_path,
            holdout_fraction=holdout_fraction,
            hub=HUB_DATASET[0] if path is None and test_path is None else None,
            hub_config=HUB_DATASET[1],
            prompt_field=GSM8K_ROWS.prompt_field,
            answer_field=GSM8K_ROWS.answer_field,
            answer_after=GSM8K_ROWS.answer_after,
            checker=GSM8K_ROWS.checker,
            system_prompt=system_prompt,
            correct_weight=correct_weight,
            format_weight=format_weight,
        )

    def meta(self, record: Record) -> dict[str, Any]:
        return {"index": record.index, "split": self.split, "solution": record.fields["answer"]}


def load_records(path: str | Path) -> list[Record]:
    """The GSM8K records of a local file, in file order (no split)."""
    return GSM8K_ROWS.load(path)


__all__ = [
    "HUB_DATASET",
    "SYSTEM_PROMPT",
    "GSM8KDataError",
    "GSM8KEnv",
    "GSM8KFileNotFoundError",
    "HubUnavailableError",
    "extract_answer",
    "format_number",
    "holdout_split",
    "last_number",
    "load_records",
    "parse_number",
    "reference_answer",
]
