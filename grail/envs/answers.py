"""Reading a final answer out of a completion and checking it against a reference: the checkers
of dataset tasks (grail/envs/dataset.py, `data.env_kwargs.checker`).

    number  the last number, read exactly as a fraction (GSM8K's rules, below)
    exact   the answer text, whitespace collapsed, equal to the reference's
    math    math-verify (the `math` extra): equivalent forms such as \\frac{1}{2}, 0.5 and 1/2
            are one answer; LaTeX, \\boxed{...} and plain expressions are read
    none    no check: the reward comes from `data.rewards` alone

Where the answer is (`answer_text`): the last `<answer>…</answer>` block when there is one, else
the whole completion (the number checker has its own order, `extract_answer`).

Number rules (`extract_answer`), first rule that applies:
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
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal

from grail.core.errors import ConfigError
from grail.envs.tags import last_block

Checker = Literal["number", "exact", "math", "none"]
CHECKERS: tuple[str, ...] = ("number", "exact", "math", "none")

_MAX_EXPONENT = 50
_MAX_DIGITS = 100
# math-verify reads at most this much of an answer: its parser has no deadline of its own here
# (its timeouts are SIGALRM, main thread only; rewards run in worker threads under the reward
# deadline instead), and a degenerate completion is no answer anyway.
MATH_MAX_CHARS = 2000
_DIGITS = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
# A number inside free text; the look-behind keeps "x1", "5-7" and "3.25" from yielding "1",
# "-7" or "25", and the look-ahead keeps "1,2345" from yielding "1,234".
_NUMBER_IN_TEXT_RE = re.compile(rf"(?<![\w.])-?\$?{_DIGITS}(?:[eE][-+]?\d+)?(?!\d)")
_WHOLE_NUMBER_RE = re.compile(
    rf"(?P<sign>[-+])?\$?(?P<digits>{_DIGITS}|\.\d+)(?P<exp>[eE][-+]?\d+)?%?\.?"
)
_WHOLE_FRACTION_RE = re.compile(r"(?P<sign>[-+])?(?P<num>\d+)\s*/\s*(?P<den>\d+)")
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")


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


def answer_text(completion: str) -> str:
    """The last `<answer>…</answer>` block's content, or the whole completion."""
    block = last_block(completion, "answer", ignore_case=True)
    return completion if block is None else block


def _collapsed(text: str) -> str:
    return " ".join(text.split())


def canonical_reference(checker: Checker, text: str) -> str | None:
    """The reference as `checker` compares it (a number's canonical form, the collapsed text),
    or None where `checker` cannot read it as a reference (not a number, no math)."""
    if checker == "number":
        value = parse_number(text)
        return None if value is None else format_number(value)
    if checker == "math":
        return text.strip() if _math_parse(text.strip()) else None
    return _collapsed(text)


def check(checker: Checker, reference: str, completion: str) -> bool:
    """Whether `completion` gives the answer `reference` (as `canonical_reference` made it)."""
    if checker == "number":
        got = extract_answer(completion)
        return got is not None and got == parse_number(reference)
    if checker == "exact":
        return _collapsed(answer_text(completion)) == reference
    if checker == "math":
        gold = _math_parse(reference)
        answer = _math_parse(answer_text(completion)[-MATH_MAX_CHARS:])
        return bool(gold and answer) and bool(_math_verify()[1](gold, answer, timeout_seconds=None))
    return False


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """math-verify's `parse` and `verify`, or a ConfigError saying how to install it."""
    try:
        from math_verify import parse, verify  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ConfigError(
            "data.env_kwargs.checker=math needs math-verify, which is not importable "
            f"({exc}): uv sync --extra math (or pip install 'grail[math]')"
        ) from exc
    for name in ("math_verify.parser", "math_verify.grader"):
        # It warns on every call that its timeout is off, which is on purpose here (above).
        logging.getLogger(name).setLevel(logging.ERROR)
    return parse, verify


@lru_cache(maxsize=4096)
def _math_parse_cached(text: str) -> tuple[Any, ...]:
    return tuple(_math_verify()[0](text, parsing_timeout=None))


def _math_parse(text: str) -> list[Any]:
    return list(_math_parse_cached(text))


def require(checker: str) -> Checker:
    """`checker` if it is one of CHECKERS (and, for math, math-verify is importable); a
    ValueError naming the accepted ones otherwise."""
    if checker not in CHECKERS:
        raise ValueError(f"checker must be one of {', '.join(CHECKERS)}, got {checker!r}")
    if checker == "math":
        _math_verify()
    return checker  # type: ignore[return-value]
