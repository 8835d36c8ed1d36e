"""GSM8K-style grade-school math word problems: records of `question` and `answer`.

Sources (the `answer` field ends with `#### <number>`, as in openai/gsm8k):
- a local JSONL file (one JSON object per line) or Parquet file (read with pyarrow), or
- the datasets hub (`datasets.load_dataset("openai/gsm8k", "main")`) when no path is given; this
  needs the optional `hub` extra (`uv sync --extra hub`) and network access.

Splits: `split="train"` or `"test"`.
- hub: the dataset's own train / test splits.
- `path` and `test_path`: the two files.
- `path` alone: a deterministic holdout. Distinct questions are ordered by sha256 of their text and
  the first round(holdout_fraction · N) records (at least 1, at most N - 1) form the test split;
  duplicates of a question always land on the same side, so the splits never share a question.
  The choice depends on the question text only, not on file order.
`problem(seed)` picks record `seed % len(split)`, in source order.

Answer extraction from a completion (`extract_answer`), first rule that applies:
1. the last `<answer>…</answer>` block: its content if it is a number, else the last number in it
   (a block without a number gives no answer; it does not fall through);
2. the last `#### x` line, read the same way;
3. the last number anywhere in the text.
Numbers compare exactly as fractions (`fractions.Fraction`, never float strings). Accepted forms:
sign, `$` prefix, thousands commas (`1,000`; only groups of three), decimals (`18.00` == `18`),
exponents (`1e3` == `1000`), a trailing `%` or `.` (ignored: GSM8K answers percentages as plain
numbers), and, for a whole answer only (not inside free text, where `3/4` is as likely a date),
a fraction `a/b`. A number with more than 100 digits or an exponent beyond ±50 is no answer, so
that a degenerate completion cannot make grading build huge integers.
A `-` directly after a letter or digit is a hyphen or minus sign of an expression, not a sign:
"pages 5-7" ends in 7.

Reward (components unweighted):
    correct = 1.0 if the extracted number equals the reference, else 0.0
    format  = 1.0 if the completion has an <answer>…</answer> block, else 0.0
    reward  = correct_weight·correct + format_weight·format          (defaults 1.0 and 0.1)
success = correct.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from grail.core.errors import UserError
from grail.envs.base import Problem, Score, check_seed
from grail.envs.tags import last_block

HUB_DATASET = ("openai/gsm8k", "main")

SYSTEM_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)

_MAX_EXPONENT = 50
_MAX_DIGITS = 100
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# A number inside free text; the look-behind keeps "x1", "5-7" and "3.25" from yielding "1",
# "-7" or "25", and the look-ahead keeps "1,2345" from yielding "1,234".
_NUMBER_IN_TEXT_RE = re.compile(rf"(?<![\w.])-?\$?{_DIGITS}(?:[eE][-+]?\d+)?(?!\d)")
_WHOLE_NUMBER_RE = re.compile(
    rf"(?P<sign>[-+])?\$?(?P<digits>{_DIGITS}|\.\d+)(?P<exp>[eE][-+]?\d+)?%?\.?"
)
_WHOLE_FRACTION_RE = re.compile(r"(?P<sign>[-+])?(?P<num>\d+)\s*/\s*(?P<den>\d+)")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")


class GSM8KDataError(UserError, ValueError):
    """A GSM8K source file or record is unusable (missing key, bad JSON, no `#### number`)."""


class GSM8KFileNotFoundError(UserError, FileNotFoundError):
    """The GSM8K data file (`data.env_kwargs.path` or `test_path`) does not exist."""


class HubUnavailableError(UserError, RuntimeError):
    """The datasets hub cannot be used: `datasets` is not installed or the download failed."""


def parse_number(text: str) -> Fraction | None:
    """The exact value of `text` if the whole (stripped) string is one number, else None."""
    s = text.strip()
    m = _WHOLE_NUMBER_RE.fullmatch(s)
    if m is not None:
        exp = m.group("exp") or ""
        if exp and (len(exp) > 5 or abs(int(exp[1:])) > _MAX_EXPONENT):
            return None
        if len(m.group("digits")) > _MAX_DIGITS:
            return None
        try:
            value = Fraction(Decimal(m.group("digits").replace(",", "") + exp))
        except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
            return None
        return -value if m.group("sign") == "-" else value
    m = _WHOLE_FRACTION_RE.fullmatch(s)
    if (
        m is not None
        and len(m.group("num")) + len(m.group("den")) <= _MAX_DIGITS
        and int(m.group("den")) != 0
    ):
        value = Fraction(int(m.group("num")), int(m.group("den")))
        return -value if m.group("sign") == "-" else value
    return None


def last_number(text: str) -> Fraction | None:
    """The value of the last number in free text, or None if there is none."""
    for match in reversed(list(_NUMBER_IN_TEXT_RE.finditer(text))):
        value = parse_number(match.group(0))
        if value is not None:
            return value
    return None


def _read_span(span: str) -> Fraction | None:
    whole = parse_number(span)
    return whole if whole is not None else last_number(span)


def extract_answer(completion: str) -> Fraction | None:
    """The model's final numeric answer (rules in the module docstring), or None."""
    block = last_block(completion, "answer", ignore_case=True)
    if block is not None:
        return _read_span(block)
    hashes = _HASHES_RE.findall(completion)
    if hashes:
        return _read_span(hashes[-1])
    return last_number(completion)


def format_number(value: Fraction) -> str:
    """Canonical text of a value: "18", "-2", "13.5", or "1/3" when no finite decimal exists."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return f"{value.numerator}/{value.denominator}"
    text = format(Decimal(value.numerator) / Decimal(value.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def reference_answer(answer_field: str) -> Fraction | None:
    """The number after the last `####` of a GSM8K `answer` field, or None."""
    hashes = _HASHES_RE.findall(answer_field)
    return parse_number(hashes[-1]) if hashes else None


@dataclass(frozen=True)
class Record:
    index: int  # position in its source (file line order or hub split order)
    question: str
    solution: str  # the full `answer` field: worked solution ending in `#### n`
    answer: str  # canonical reference number, see format_number


def _to_record(raw: Any, index: int, where: str) -> Record:
    if not isinstance(raw, dict):
        raise GSM8KDataError(f"{where}: expected an object, got {type(raw).__name__}")
    for key in ("question", "answer"):
        if key not in raw:
            raise GSM8KDataError(f"{where}: missing key {key!r} (has {sorted(raw)})")
        if not isinstance(raw[key], str):
            raise GSM8KDataError(
                f"{where}: {key!r} must be a string, got {type(raw[key]).__name__}"
            )
    ref = reference_answer(raw["answer"])
    if ref is None:
        raise GSM8KDataError(f"{where}: 'answer' does not end with '#### <number>'")
    return Record(index, raw["question"], raw["answer"], format_number(ref))


def load_records(path: str | Path) -> list[Record]:
    """Records of a local `.jsonl`/`.json` (JSON lines) or `.parquet` file, in file order."""
    p = Path(path)
    if not p.is_file():
        raise GSM8KFileNotFoundError(f"GSM8K data file not found: {p}")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records: list[Any] = []
        with p.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    raw = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise GSM8KDataError(f"{p}:{lineno}: invalid JSON: {exc.msg}") from None
                records.append(_to_record(raw, len(records), f"{p}:{lineno}"))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        names = pq.read_schema(p).names
        missing = [c for c in ("question", "answer") if c not in names]
        if missing:
            raise GSM8KDataError(f"{p}: missing column(s) {missing} (has {names})")
        rows = pq.read_table(p, columns=["question", "answer"]).to_pylist()
        records = [_to_record(r, i, f"{p} row {i}") for i, r in enumerate(rows)]
    else:
        raise GSM8KDataError(f"{p}: unknown file type {suffix!r}; use .jsonl, .json or .parquet")
    if not records:
        raise GSM8KDataError(f"{p}: no records")
    return records


def load_hub_records(split: str) -> list[Record]:
    """Records of one split of openai/gsm8k from the datasets hub (needs the `hub` extra)."""
    hint = (
        "pass a local JSONL/Parquet file with path=..., or install the hub extra "
        "(`uv sync --extra hub` / `pip install 'grail[hub]'`) and allow network access"
    )
    try:
        import datasets
    except ImportError as exc:
        raise HubUnavailableError(
            f"loading {HUB_DATASET[0]} from the hub needs the `datasets` package, which is not "
            f"importable ({exc}); {hint}"
        ) from exc
    try:
        rows = datasets.load_dataset(*HUB_DATASET, split=split)
    except Exception as exc:
        raise HubUnavailableError(
            f"could not load {HUB_DATASET[0]} ({HUB_DATASET[1]}, split {split!r}) from the hub: "
            f"{type(exc).__name__}: {exc}; {hint}"
        ) from exc
    where = f"{HUB_DATASET[0]}[{split}]"
    return [_to_record(dict(r), i, f"{where} row {i}") for i, r in enumerate(rows)]


def holdout_split(records: Sequence[Record], fraction: float) -> tuple[list[Record], list[Record]]:
    """(train, test) by the sha256 rule of the module docstring; both keep source order."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {fraction!r}")
    if len(records) < 2:
        raise ValueError(f"a holdout split needs at least 2 records, got {len(records)}")
    target = min(max(round(fraction * len(records)), 1), len(records) - 1)
    by_question: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_question.setdefault(r.question, []).append(i)
    order = sorted(by_question, key=lambda q: hashlib.sha256(q.encode("utf-8")).hexdigest())
    test_idx: set[int] = set()
    for q in order:
        if len(test_idx) >= target:
            break
        test_idx.update(by_question[q])
    if len(test_idx) == len(records):
        raise ValueError("holdout split left no training records (every record is one question)")
    train = [r for i, r in enumerate(records) if i not in test_idx]
    test = [r for i, r in enumerate(records) if i in test_idx]
    return train, test


class GSM8KEnv:
    """Math word problems with numeric answers; exact (fraction) comparison of the final number."""

    name = "gsm8k"
    components: tuple[str, ...] = ("correct", "format")

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
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        for wname, w in (("correct_weight", correct_weight), ("format_weight", format_weight)):
            if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w):
                raise ValueError(f"{wname} must be a finite number, got {w!r}")
        if path is None and test_path is not None:
            raise ValueError("test_path was given without path; pass both files or neither")
        if path is None:
            records = load_hub_records(split)
        elif test_path is not None:
            records = load_records(path if split == "train" else test_path)
        else:
            train, test = holdout_split(load_records(path), holdout_fraction)
            records = train if split == "train" else test
        if not records:
            raise GSM8KDataError(f"the {split} split has no records")
        self.split = split
        self.records = records
        self.correct_weight = float(correct_weight)
        self.format_weight = float(format_weight)
        self.system_prompt = system_prompt

    def __len__(self) -> int:
        return len(self.records)

    def problem(self, seed: int) -> Problem:
        s = check_seed(seed)
        rec = self.records[s % len(self.records)]
        messages = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": rec.question})
        return Problem(
            seed=s,
            prompt_messages=messages,
            answer=rec.answer,
            meta={"index": rec.index, "split": self.split, "solution": rec.solution},
        )

    def score(self, problem: Problem, completion: str) -> Score:
        reference = parse_number(problem.answer)
        if reference is None:
            raise ValueError(
                f"problem (seed {problem.seed}) has a non-numeric answer {problem.answer!r}"
            )
        got = extract_answer(completion)
        correct = 1.0 if got is not None and got == reference else 0.0
        fmt = 1.0 if last_block(completion, "answer", ignore_case=True) is not None else 0.0
        return Score(
            reward=self.correct_weight * correct + self.format_weight * fmt,
            components={"correct": correct, "format": fmt},
            success=correct == 1.0,
        )
