"""Tasks from a dataset: one row a problem, its prompt and its reference answer (`env=dataset`).

Sources:
- a file on disk: JSON lines (`.jsonl`, `.json`), Parquet or CSV, in file order. Read with pyarrow
  (a dependency already, and what Hugging Face `datasets` reads such files with) and JSON lines
  line by line, so that a bad line is named; `datasets.load_dataset` took ~1 s more on a small
  file and writes a cache under ~/.cache/huggingface (measured: docs/environments.md);
- a Hugging Face Hub dataset (`hub`, with `hub_config`), through `datasets.load_dataset`: needs
  the optional `hub` extra (`uv sync --extra hub`) and network access.

Splits: `split="train"` or `"test"` (the evaluation takes the test split).
- hub: the dataset's own splits (`hub_train_split`, `hub_test_split`).
- `path` and `test_path`: the two files; a prompt found in both is refused (the evaluation would
  score what was trained on).
- `path` alone: a deterministic holdout. Distinct prompts are ordered by sha256 of their text and
  the first round(holdout_fraction · N) rows (at least 1, at most N - 1) form the test split;
  duplicates of a prompt always land on the same side, so the splits never share a prompt. The
  choice depends on the prompt text only, not on file order.
`problem(seed)` picks row `seed % len(split)`, in source order.

A row's prompt is its `prompt_field` (text, or a conversation in TRL's format: a list of
{"role", "content"} messages ending with the user's), or `prompt_template` filled with the row's
fields (`"Solve: {question}"`); the system prompt goes first unless the conversation has one.
Its reference is `answer_field` (the text after the last `answer_after` when that is set:
GSM8K's `#### 42`), read as the `checker` reads answers (grail/envs/answers.py).

Reward (components unweighted):
    correct = 1.0 if the checker accepts the completion's answer, else 0.0
    format  = 1.0 if the completion has an <answer>…</answer> block, else 0.0
    reward  = correct_weight·correct + format_weight·format
success = correct. With `checker=none` correct is 0: the reward is format's and `data.rewards`'.

Problem meta: `row` (the row's position in its source), `split`, then the row's other fields
(strings, numbers and lists as they are; anything else as text), which reward functions receive
as keyword arguments as TRL's do; fields named like a reward function's own arguments (`prompts`,
`completions`, `answers`) are left out.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from grail.core.errors import UserError
from grail.envs.answers import Checker, canonical_reference, check, require
from grail.envs.base import Problem, Score, check_seed
from grail.envs.tags import last_block

FILE_TYPES = (".jsonl", ".json", ".parquet", ".csv")
_RESERVED = ("prompts", "completions", "answers")  # a reward function's own arguments


class DatasetError(UserError, ValueError):
    """A data source or row is unusable (missing field, bad JSON, an answer the checker cannot
    read); the message names the file and line or row."""


class DataFileNotFoundError(UserError, FileNotFoundError):
    """A data file (`data.env_kwargs.path` or `test_path`) does not exist."""


class HubUnavailableError(UserError, RuntimeError):
    """The datasets hub cannot be used: `datasets` is not installed or the download failed."""


@dataclass(frozen=True)
class Record:
    index: int  # position in its source (file line order or hub split order)
    prompt: str  # the user message (a conversation's messages: their JSON, which splits compare)
    answer: str  # the reference as the checker compares it
    fields: dict[str, Any]  # the row's other fields
    # A conversational prompt (TRL's format: [{"role": "user", "content": "..."}, ...]), or None
    messages: tuple[dict[str, str], ...] | None = None


def read_rows(path: str | Path) -> list[tuple[str, Any]]:
    """The rows of a local file as (where, row) pairs in file order; `where` names the file
    and line (JSON lines) or row (Parquet, CSV) for error messages."""
    p = Path(path)
    if not p.is_file():
        raise DataFileNotFoundError(f"data file not found: {p}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows: list[tuple[str, Any]] = []
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    rows.append((f"{p}:{lineno}", json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise DatasetError(f"{p}:{lineno}: invalid JSON: {exc.msg}") from None
        return rows
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(p)
    elif suffix == ".csv":
        import pyarrow as pa
        import pyarrow.csv as pcsv

        try:
            # Every column as text: "007" and "1.50" stay what the file says.
            types = {name: pa.string() for name in pcsv.open_csv(p).schema.names}
            table = pcsv.read_csv(p, convert_options=pcsv.ConvertOptions(column_types=types))
        except pa.ArrowInvalid as exc:
            raise DatasetError(f"{p}: not a CSV file pyarrow can read: {exc}") from None
    else:
        raise DatasetError(f"{p}: unknown file type {suffix!r}; use {', '.join(FILE_TYPES)}")
    return [(f"{p} row {i}", row) for i, row in enumerate(table.to_pylist())]


def hub_rows(name: str, config: str | None, split: str) -> list[tuple[str, Any]]:
    """One split of a Hub dataset as (where, row) pairs (needs the `hub` extra)."""
    hint = (
        "pass a local JSONL/Parquet/CSV file with path=..., or install the hub extra "
        "(`uv sync --extra hub` / `pip install 'grail[hub]'`) and allow network access"
    )
    try:
        import datasets
    except ImportError as exc:
        raise HubUnavailableError(
            f"loading {name} from the hub needs the `datasets` package, which is not "
            f"importable ({exc}); {hint}"
        ) from exc
    try:
        rows = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise HubUnavailableError(
            f"could not load {name} ({config or 'default'}, split {split!r}) from the hub: "
            f"{type(exc).__name__}: {exc}; {hint}"
        ) from exc
    return [(f"{name}[{split}] row {i}", dict(row)) for i, row in enumerate(rows)]


def holdout_split(records: Sequence[Record], fraction: float) -> tuple[list[Record], list[Record]]:
    """(train, test) by the sha256 rule of the module docstring; both keep source order."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {fraction!r}")
    if len(records) < 2:
        raise ValueError(f"a holdout split needs at least 2 records, got {len(records)}")
    target = min(max(round(fraction * len(records)), 1), len(records) - 1)
    by_prompt: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_prompt.setdefault(r.prompt, []).append(i)
    order = sorted(by_prompt, key=lambda q: hashlib.sha256(q.encode("utf-8")).hexdigest())
    test_idx: set[int] = set()
    for q in order:
        if len(test_idx) >= target:
            break
        test_idx.update(by_prompt[q])
    if len(test_idx) == len(records):
        raise ValueError("holdout split left no training records (every record is one prompt)")
    train = [r for i, r in enumerate(records) if i not in test_idx]
    test = [r for i, r in enumerate(records) if i in test_idx]
    return train, test


def _plain(value: Any) -> Any:
    """A field's value as JSON has it (what a problem's meta may hold)."""
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _template_fields(template: str) -> list[str]:
    """The field names `template` uses; a ValueError for anything but plain `{name}`s."""
    names = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(
                f"prompt_template may only name fields as {{field}}, got {{{name}}} "
                "(no attributes, indexes, conversions or format specs)"
            )
        names.append(name)
    return names


@dataclass(frozen=True)
class RowReader:
    """How a row becomes a `Record`: which fields hold the prompt (or the template that makes
    it) and the answer, and the checker the reference must suit."""

    prompt_field: str = "prompt"
    prompt_template: str | None = None
    answer_field: str | None = "answer"  # None: no reference (checker none)
    answer_after: str | None = None
    checker: Checker = "exact"

    def __post_init__(self) -> None:
        require(self.checker)
        if self.answer_field is None and self.checker != "none":
            raise ValueError(f"checker {self.checker!r} needs an answer_field to check against")
        _ = self._template  # parsed and checked here, once for every row

    @functools.cached_property
    def _template(self) -> list[str]:
        """The field names `prompt_template` uses ([] without one)."""
        return _template_fields(self.prompt_template) if self.prompt_template else []

    def load(self, path: str | Path) -> list[Record]:
        """The records of a local file, in file order."""
        records = self.records(read_rows(path))
        if not records:
            raise DatasetError(f"{path}: no records")
        return records

    def records(self, rows: Sequence[tuple[str, Any]]) -> list[Record]:
        return [self.record(row, i, where) for i, (where, row) in enumerate(rows)]

    def record(self, row: Any, index: int, where: str) -> Record:
        """Row `index` of its source (`where` names it in errors) as a Record."""
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected an object, got {type(row).__name__}")
        template = self._template
        needed = [
            *(template or [self.prompt_field]),
            *([self.answer_field] if self.answer_field else []),
        ]
        missing = [name for name in dict.fromkeys(needed) if name not in row]
        if missing:
            raise DatasetError(
                f"{where}: missing field(s) {missing} (has {sorted(row)}; "
                "data.env_kwargs.prompt_field / prompt_template / answer_field name them)"
            )
        messages = None
        if self.prompt_template is not None:
            prompt = self.prompt_template.format_map({k: row[k] for k in template})
        else:
            prompt = row[self.prompt_field]
            if isinstance(prompt, list):
                messages = _conversation(prompt, f"{where}: {self.prompt_field!r}")
                prompt = json.dumps(messages, ensure_ascii=False, sort_keys=True)
            elif not isinstance(prompt, str):
                raise DatasetError(
                    f"{where}: {self.prompt_field!r} must be a string or a list of messages, got "
                    f"{type(prompt).__name__}"
                )
        reference = self._reference(row, where)
        fields = {
            k: _plain(v)
            for k, v in row.items()
            if k != self.prompt_field or self.prompt_template is not None
        }
        return Record(index, prompt, reference, fields, messages)

    def _reference(self, row: dict[str, Any], where: str) -> str:
        """The row's reference answer as the checker compares it ("" without an answer field)."""
        if self.answer_field is None:
            return ""
        answer = row[self.answer_field]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise DatasetError(
                f"{where}: {self.answer_field!r} must be a string or a number, got "
                f"{type(answer).__name__}"
            )
        text = str(answer)
        if self.answer_after is not None:
            cut = text.rfind(self.answer_after)
            if cut < 0:
                raise DatasetError(
                    f"{where}: {self.answer_field!r} does not end with "
                    f"'{self.answer_after} <answer>' (data.env_kwargs.answer_after)"
                )
            text = text[cut + len(self.answer_after) :].split("\n", 1)[0]
        reference = canonical_reference(self.checker, text)
        if reference is None:
            raise DatasetError(
                f"{where}: {self.answer_field!r} gives {text.strip()[:80]!r}, which the "
                f"{self.checker} checker cannot read as an answer"
            )
        return reference


def _conversation(value: list[Any], what: str) -> tuple[dict[str, str], ...]:
    """A conversational prompt's messages, each {"role", "content"} with text content."""
    out = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise DatasetError(
                f'{what}[{i}] must be a message {{"role": ..., "content": "text"}}, got '
                f"{str(message)[:80]}"
            )
        out.append({"role": message["role"], "content": message["content"]})
    if not out or out[-1]["role"] != "user":
        raise DatasetError(f"{what} must end with a user message")
    return tuple(out)


def _check_disjoint(
    train: Sequence[Record], test: Sequence[Record], path: str | Path, test_path: str | Path
) -> None:
    shared = {r.prompt for r in train} & {r.prompt for r in test}
    if shared:
        example = min(shared)[:80]
        raise DatasetError(
            f"{len(shared)} prompt(s) are in both {path} and {test_path} (e.g. {example!r}): "
            "the evaluation would score what the run trained on; remove them from one file"
        )


class DatasetEnv:
    """Prompts and reference answers from a dataset; the checker grades the final answer."""

    name = "dataset"
    components: tuple[str, ...] = ("correct", "format")

    def __init__(
        self,
        path: str | Path | None = None,
        split: Literal["train", "test"] = "train",
        test_path: str | Path | None = None,
        holdout_fraction: float = 0.1,
        hub: str | None = None,
        hub_config: str | None = None,
        hub_train_split: str = "train",
        hub_test_split: str = "test",
        prompt_field: str = "prompt",
        prompt_template: str | None = None,
        answer_field: str | None = "answer",
        answer_after: str | None = None,
        checker: str = "exact",
        system_prompt: str = "",
        correct_weight: float = 1.0,
        format_weight: float = 0.0,
    ) -> None:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        for wname, w in (("correct_weight", correct_weight), ("format_weight", format_weight)):
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
                raise ValueError(f"{wname} must be a finite number, got {w!r}")
        if path is None and test_path is not None:
            raise ValueError("test_path was given without path; pass both files or neither")
        if path is not None and hub is not None:
            raise ValueError(f"path and hub are both set ({path!r}, {hub!r}); name one source")
        if path is None and hub is None:
            raise ValueError("name the data: path (a JSONL, Parquet or CSV file) or hub")
        self.reader = RowReader(
            prompt_field, prompt_template, answer_field, answer_after, require(checker)
        )
        if path is None:
            assert hub is not None
            hub_split = hub_train_split if split == "train" else hub_test_split
            records = self.reader.records(hub_rows(hub, hub_config, hub_split))
        elif test_path is not None:
            train, test = self.reader.load(path), self.reader.load(test_path)
            _check_disjoint(train, test, path, test_path)
            records = train if split == "train" else test
        else:
            train, test = holdout_split(self.reader.load(path), holdout_fraction)
            records = train if split == "train" else test
        if not records:
            raise DatasetError(f"the {split} split has no records")
        self.split = split
        self.records = records
        self.correct_weight = float(correct_weight)
        self.format_weight = float(format_weight)
        self.system_prompt = system_prompt

    def __len__(self) -> int:
        return len(self.records)

    def meta(self, record: Record) -> dict[str, Any]:
        """What a problem's meta holds for `record` (the module docstring)."""
        meta: dict[str, Any] = {"row": record.index, "split": self.split}
        meta.update((k, v) for k, v in record.fields.items() if k not in _RESERVED)
        return meta

    def record(self, seed: int) -> Record:
        """The record problem `seed` is made from: row `seed % len(self)` of the split."""
        return self.records[check_seed(seed) % len(self.records)]

    def problem(self, seed: int) -> Problem:
        s = check_seed(seed)
        rec = self.record(s)
        own = list(rec.messages) if rec.messages else [{"role": "user", "content": rec.prompt}]
        messages = []
        if self.system_prompt and own[0]["role"] != "system":
            messages.append({"role": "system", "content": self.system_prompt})
        messages += own
        return Problem(seed=s, prompt_messages=messages, answer=rec.answer, meta=self.meta(rec))

    def score(self, problem: Problem, completion: str) -> Score:
        correct = 1.0 if check(self.reader.checker, problem.answer, completion) else 0.0
        fmt = 1.0 if last_block(completion, "answer", ignore_case=True) is not None else 0.0
        return Score(
            reward=self.correct_weight * correct + self.format_weight * fmt,
            components={"correct": correct, "format": fmt},
            success=correct == 1.0,
        )
