"""IFEval (`env=ifeval`): prompts with verifiable instructions (Zhou et al. 2023), graded as
TorchRL's GRPO grades them (torchrl.envs.llm.IFEvalEnv with its IfEvalScorer).

Rows are google/IFEval's: `key`, `prompt`, `instruction_id_list` (the instruction ids, see
grail/envs/instructions.py) and `kwargs` (one dict of arguments per instruction; the keys an
instruction does not use are null). Sources as any dataset task (grail/envs/dataset.py): a local
JSONL, Parquet or CSV file (`path`, with `test_path` or a deterministic holdout; in a CSV the two
list fields are JSON text), or a Hub dataset (`hub`; the `hub` extra and network access), by
default google/IFEval when neither is set. google/IFEval has a single split (`train`, 541
prompts): with `hub_test_split` unset the hub split is held out as a file is (`holdout_fraction`,
by prompt), so the evaluation never scores a prompt the run trained on. Every row of the split is
checked at construction: a missing field, an unknown instruction id or an unusable argument is
refused in one line naming the row (and its key) and the id; so is a row with a language
instruction when langdetect is missing (`uv sync --extra ifeval`).

The graded response (`answer_block`, default on, as in TorchRL) is the content of the first
<answer>…</answer> block of the completion, "" without one (which follows no instruction); with
`answer_block=false` it is the whole completion (the paper's evaluation). Blocks are found as
TorchRL's `re.findall(r"<answer>(.*?)</answer>")` finds them (case-sensitive), in linear time.

Reward (components unweighted, each in [0, 1]; `instructions.py` defines strict and loose):
    all_followed                = 1.0 if the response strictly follows every instruction
    instructions_followed       = the fraction of instructions strictly followed
    all_followed_loose          = 1.0 if it loosely follows every instruction
    instructions_followed_loose = the fraction loosely followed
    answer_format               = 1.0 if the completion has exactly one <answer> block
    think_format                = 1.0 if it has exactly one <think> block
    reward = Σ weight·component, weights 0.4, 0.3, 0.2, 0.1, 0.1, 0.05 by default
TorchRL's default aggregator exactly: its prompt- and instruction-level strict and loose accuracies
weighted [0.4, 0.3, 0.2, 0.1], plus 0.1 for a single answer block and 0.05 for a single think
block (reward in [0, 1.15]). success = all_followed (the paper's prompt-level strict accuracy, so
the evaluation's success rate is that accuracy).

Problem meta: `row`, `split`, then the row's fields (`key`, `instruction_id_list`, `kwargs`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from grail.envs import instructions
from grail.envs.base import Problem, Score, check_weight, problem_meta
from grail.envs.dataset import DatasetEnv, DatasetError, Record, holdout_split

HUB_DATASET = "google/IFEval"

# TorchRL's IFEvalEnv.SYSTEM_PROMPT, word for word, so that runs compare with TorchRL's.
SYSTEM_PROMPT = """You are a helpful AI assistant that follows instructions extremely well.

IMPORTANT: You must respond in a specific format for every task:

1. First, think through the problem step by step and write your reasoning between <think> and </think> tags
2. Then, provide your final answer between <answer> and </answer> tags

CRITICAL RULES:
- ALWAYS use <think>...</think> and <answer>...</answer> tags exactly as shown
- Do NOT use <thought>, <reasoning>, or any other tag variations
- Your <answer> section will be evaluated, so make it complete and accurate
- Follow ALL specific requirements in the user's request (formatting, content, etc.)
- If the user asks for placeholders like [restaurant], include them exactly as requested
- Pay attention to capitalization, punctuation, and other formatting requirements

Example format:
<think>
I need to analyze what the user is asking for...
[Your reasoning here]
</think>
<answer>
[Your final answer here, following all user requirements]
</answer>"""  # noqa: E501

COMPONENTS = (
    "all_followed",
    "instructions_followed",
    "all_followed_loose",
    "instructions_followed_loose",
    "answer_format",
    "think_format",
)


def blocks(text: str, tag: str) -> list[str]:
    """The contents of `text`'s <tag>…</tag> blocks, as re.findall(r"<tag>(.*?)</tag>", DOTALL)
    gives them: each opening tag pairs with the nearest closing tag after it, and the search goes
    on after that closing tag. str.find makes it linear where the regex is quadratic on many
    unclosed opening tags (grail/envs/tags.py)."""
    opening, closing = f"<{tag}>", f"</{tag}>"
    found, pos = [], 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        found.append(text[start + len(opening) : end])
        pos = end + len(closing)
    return found


def _listed(value: Any, field: str) -> Any:
    """A field as its list: CSV holds lists as JSON text."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            raise ValueError(f"{field!r} is text but not JSON: {value[:80]!r}") from None
    return value


def row_checks(instruction_ids: Any, kwargs: Any) -> list[tuple[str, instructions.Check]]:
    """The (id, check) pairs of a row's `instruction_id_list` and `kwargs`; a ValueError naming
    what is wrong otherwise."""
    ids = _listed(instruction_ids, "instruction_id_list")
    arguments = _listed(kwargs, "kwargs")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
        raise ValueError(
            f"'instruction_id_list' must be a non-empty list of instruction ids, got {ids!r}"
        )
    if not isinstance(arguments, list) or len(arguments) != len(ids):
        raise ValueError(
            f"'kwargs' must be a list of {len(ids)} dict(s), one per instruction, got "
            f"{str(arguments)[:80]}"
        )
    checks = []
    for instruction_id, given in zip(ids, arguments, strict=True):
        if given is not None and not isinstance(given, dict):
            raise ValueError(
                f"the kwargs of {instruction_id!r} must be a dict, got {str(given)[:80]}"
            )
        checks.append((instruction_id, instructions.build(instruction_id, given)))
    return checks


class IFEvalEnv(DatasetEnv):
    """Prompts with verifiable instructions, graded strictly and loosely (module docstring)."""

    name = "ifeval"
    components: tuple[str, ...] = COMPONENTS

    def __init__(
        self,
        path: str | Path | None = None,
        split: Literal["train", "test"] = "train",
        test_path: str | Path | None = None,
        holdout_fraction: float = 0.1,
        hub: str | None = None,
        hub_config: str | None = None,
        hub_train_split: str = "train",
        hub_test_split: str | None = None,
        prompt_field: str = "prompt",
        system_prompt: str = SYSTEM_PROMPT,
        answer_block: bool = True,
        all_followed_weight: float = 0.4,
        instructions_followed_weight: float = 0.3,
        all_followed_loose_weight: float = 0.2,
        instructions_followed_loose_weight: float = 0.1,
        answer_format_weight: float = 0.1,
        think_format_weight: float = 0.05,
    ) -> None:
        if not isinstance(answer_block, bool):
            raise ValueError(f"answer_block must be true or false, got {answer_block!r}")
        weights = {
            "all_followed": all_followed_weight,
            "instructions_followed": instructions_followed_weight,
            "all_followed_loose": all_followed_loose_weight,
            "instructions_followed_loose": instructions_followed_loose_weight,
            "answer_format": answer_format_weight,
            "think_format": think_format_weight,
        }
        self.weights = {k: check_weight(f"{k}_weight", w) for k, w in weights.items()}
        if path is None and hub is None and test_path is None:
            hub = HUB_DATASET
        held_out = hub is not None and hub_test_split is None
        super().__init__(
            path=path,
            split=split,
            test_path=test_path,
            holdout_fraction=holdout_fraction,
            hub=hub,
            hub_config=hub_config,
            hub_train_split=hub_train_split,
            # One hub split to hold out from: both sides read it (once, for this side).
            hub_test_split=hub_train_split if hub_test_split is None else hub_test_split,
            prompt_field=prompt_field,
            answer_field=None,
            checker="none",
            system_prompt=system_prompt,
        )
        if held_out:
            train, test = holdout_split(self.records, holdout_fraction)
            self.records = train if split == "train" else test
        self.answer_block = answer_block
        if hub is not None:
            chosen = hub_train_split if split == "train" or held_out else hub_test_split
            source = f"{hub}[{chosen}]"
        else:
            source = str(test_path if split == "test" and test_path is not None else path)
        self._check_rows(source)

    def _check_rows(self, source: str) -> None:
        """Refuse, naming the row, one whose instructions cannot be graded (module docstring)."""
        needs_language = False
        for record in self.records:
            where = self._where(source, record)
            missing = [f for f in ("instruction_id_list", "kwargs") if f not in record.fields]
            if missing:
                raise DatasetError(
                    f"{where}: missing field(s) {missing} (has {sorted(record.fields)}); "
                    "IFEval rows have instruction_id_list and kwargs"
                )
            try:
                checks = row_checks(record.fields["instruction_id_list"], record.fields["kwargs"])
            except ValueError as exc:
                raise DatasetError(f"{where}: {exc}") from None
            needs_language = needs_language or any(
                instructions.detects_language(i) for i, _ in checks
            )
        if needs_language:
            # Refused now rather than at the first such prompt, minutes into a run.
            instructions.require_language_detection()

    @staticmethod
    def _where(source: str, record: Record) -> str:
        key = record.fields.get("key")
        return f"{source} row {record.index}" + (f" (key {key})" if key is not None else "")

    def response(self, completion: str) -> str:
        """The text the instructions are checked on (module docstring)."""
        if not self.answer_block:
            return completion
        answers = blocks(completion, "answer")
        return answers[0] if answers else ""

    def score(self, problem: Problem, completion: str) -> Score:
        ids, kwargs = problem_meta(problem, self.name, "instruction_id_list", "kwargs")
        checks = [check for _, check in row_checks(ids, kwargs)]
        verdict = instructions.evaluate(checks, self.response(completion))
        components = {
            "all_followed": float(verdict.all_strict),
            "instructions_followed": verdict.fraction_strict,
            "all_followed_loose": float(verdict.all_loose),
            "instructions_followed_loose": verdict.fraction_loose,
            "answer_format": 1.0 if len(blocks(completion, "answer")) == 1 else 0.0,
            "think_format": 1.0 if len(blocks(completion, "think")) == 1 else 0.0,
        }
        return Score(
            reward=sum(self.weights[k] * v for k, v in components.items()),
            components=components,
            success=verdict.all_strict,
        )
