"""IFEval's verifiable instructions (Zhou et al. 2023, "Instruction-Following Evaluation for Large
Language Models"): the 25 instruction ids of google/IFEval, each a checker of a response.

Each checker follows the definition of Google's reference implementation
(google-research/instruction_following_eval/instructions.py, Apache-2.0), which TorchRL's and
lm-eval's IFEval scorers copy; written here without its NLTK data (punkt cannot be downloaded on
every machine) and without its random defaults: every argument an instruction takes must be in
the row's kwargs (None counts as missing), so a row grades the same way everywhere.

Strict and loose (the paper, section 2.2):
- strict: the instruction is followed by the response as it is; an empty (or all-whitespace)
  response follows nothing;
- loose: it is followed by any of 8 variants of the response: as it is, without its first line,
  without its last line, without both, and each of those four with every `*` removed (markdown
  emphasis). Lines are cut at "\\n" and the cut variants are stripped, as in the reference.

Text units, where the reference needs NLTK:
- words (length_constraints:number_words): runs of `\\w` characters, as the reference's
  RegexpTokenizer(r"\\w+") (no data needed, so the same count);
- sentences (length_constraints:number_sentences): punkt is replaced by a documented rule. A
  sentence ends at a run of `.`, `!` or `?` (with any closing quotes or brackets after it) that is
  followed by whitespace or the end of the text, except a single `.` after a title (Mr, Mrs, Ms,
  Dr, Prof, St, Jr, Sr, vs) or after letters joined by dots (an initial "J.", "e.g.", "i.e.",
  "U.S."); a sentence must hold a letter or digit; newlines alone end nothing. How it differs
  from punkt: punkt learned many more abbreviations from a corpus and looks at the next word's
  case ("etc. and" may stay one sentence in punkt, two here); an ellipsis followed by a space
  ends a sentence here and may not in punkt; "3.5" and "file.txt" are one sentence in both;
- capital words (change_case:capital_word_frequency): the reference counts upper-case tokens of
  nltk.word_tokenize; here tokens are `\\w` runs joined by hyphens, so "WELL-KNOWN" is one word
  (as in NLTK) and "DON'T" two ("DON", "T"; NLTK: "DO", "N'T", also two), while "U.S." is two
  here and one in NLTK.

Other deviations from the reference: keywords, forbidden words, keyword-frequency words,
postscript markers and section splitters are matched as literal text (the reference puts them
into regexes unescaped, where "C++" raises); bad arguments raise a ValueError naming them instead
of being replaced by random ones; JSON nested too deep to decode is not JSON (the reference
raises RecursionError). Placeholders, titles, bullets and postscripts are found without the
reference's regexes, which take quadratic time on degenerate text (many "[" or "<<", long runs of
blank lines or spaces), but with the same results (tests/test_instructions.py compares them).

Language (language:response_language, change_case:english_capital, change_case:english_lowercase)
is detected with langdetect, seeded to 0 as in the reference so that it is deterministic; as in
the reference, a text whose language cannot be detected (no letters) counts as followed. It is an
optional dependency: without it these three raise LanguageDetectionUnavailableError, saying how
to install it (`uv sync --extra ifeval`).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import json
import re
import string
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grail.core.errors import UserError

Check = Callable[[str], bool]

RELATIONS = ("less than", "at least")
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
LANGDETECT_HINT = "uv sync --extra ifeval (or pip install 'grail[ifeval]')"


class LanguageDetectionUnavailableError(UserError, ImportError):
    """An instruction that detects a language was met without langdetect installed."""


# --- Text units (the module docstring says how they differ from NLTK's) ---------------------------

_WORD = re.compile(r"\w+")
_CAPITAL_TOKEN = re.compile(r"\w+(?:-\w+)*")
# Only from the start of a run, and possessive: a long run of "!" or "." stays linear.
_SENTENCE_END = re.compile(r"(?<![.!?])[.!?]++[\"'\u201d\u2019)\]]*+(?=\s|$)")
_DOTTED_LETTERS = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]")
_TITLES = frozenset({"mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "vs"})
_ASCII_LETTERS = frozenset(string.ascii_letters)


def count_words(text: str) -> int:
    """The number of `\\w+` runs, as the reference's RegexpTokenizer counts words."""
    return len(_WORD.findall(text))


def _is_abbreviation(before: str) -> bool:
    """Whether the text before a lone "." ends with a title or dotted letters ("e.g")."""
    # Walked back by hand: re.search(r"[A-Za-z.]+$") is quadratic on a long word.
    start = len(before)
    while start and (before[start - 1] == "." or before[start - 1] in _ASCII_LETTERS):
        start -= 1
    word = before[start:].lstrip(".")
    return bool(word) and (word.lower() in _TITLES or _DOTTED_LETTERS.fullmatch(word) is not None)


def split_sentences(text: str) -> list[str]:
    """The sentences of `text` by the rule of the module docstring (punkt's stand-in)."""
    pieces, start = [], 0
    for end in _SENTENCE_END.finditer(text):
        if end.group() == "." and _is_abbreviation(text[start : end.start()]):
            continue
        pieces.append(text[start : end.end()])
        start = end.end()
    pieces.append(text[start:])
    return [p.strip() for p in pieces if _WORD.search(p)]


def count_sentences(text: str) -> int:
    return len(split_sentences(text))


def capital_words(text: str) -> list[str]:
    """The words written in capitals (hyphenated words are one word, as in NLTK)."""
    return [w for w in _CAPITAL_TOKEN.findall(text) if w.isupper()]


# --- Language detection -------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _language_detector() -> Callable[[str], str | None]:
    try:
        # import_module: langdetect ships no type information and may be absent, and a
        # `type: ignore` would have to name which of the two it hides.
        langdetect = importlib.import_module("langdetect")
    except ImportError as exc:
        raise LanguageDetectionUnavailableError(
            "IFEval's language instructions (language:response_language, "
            "change_case:english_capital, change_case:english_lowercase) need langdetect, which "
            f"is not importable ({exc}): {LANGDETECT_HINT}"
        ) from exc
    # Unseeded, langdetect's sampling gives different answers for one short text across calls.
    langdetect.DetectorFactory.seed = 0
    failure = langdetect.LangDetectException

    def detect(text: str) -> str | None:
        try:
            return str(langdetect.detect(text))
        except failure:
            return None

    return detect


def require_language_detection() -> None:
    """Nothing when langdetect is importable; LanguageDetectionUnavailableError otherwise."""
    _language_detector()


def _in_language(text: str, language: str) -> bool:
    detected = _language_detector()(text)
    # Undetectable text (no letters) counts as followed, as in the reference.
    return detected is None or detected == language


# --- The checkers, one builder each: the instruction's arguments in, a check of a response out ----


def _compare(relation: str, count: int, threshold: int) -> bool:
    return count < threshold if relation == "less than" else count >= threshold


def _keywords_existence(keywords: list[str]) -> Check:
    patterns = [re.compile(re.escape(k), re.IGNORECASE) for k in keywords]
    return lambda r: all(p.search(r) for p in patterns)


def _keywords_frequency(keyword: str, frequency: int, relation: str) -> Check:
    pattern = re.compile(re.escape(keyword.strip()), re.IGNORECASE)
    return lambda r: _compare(relation, len(pattern.findall(r)), frequency)


def _forbidden_words(forbidden_words: list[str]) -> Check:
    patterns = [re.compile(rf"\b{re.escape(w)}\b", re.IGNORECASE) for w in forbidden_words]
    return lambda r: not any(p.search(r) for p in patterns)


def _letter_frequency(letter: str, let_frequency: int, let_relation: str) -> Check:
    target = letter.lower()
    return lambda r: _compare(let_relation, Counter(r.lower())[target], let_frequency)


def _response_language(language: str) -> Check:
    return lambda r: _in_language(r, language)


def _number_sentences(num_sentences: int, relation: str) -> Check:
    return lambda r: _compare(relation, count_sentences(r), num_sentences)


def _number_paragraphs(num_paragraphs: int) -> Check:
    def check(response: str) -> bool:
        paragraphs = re.split(r"\s?\*\*\*\s?", response)
        count = len(paragraphs)
        for i, paragraph in enumerate(paragraphs):
            if not paragraph.strip():
                # A divider at either end adds no paragraph; two dividers in a row are wrong.
                if i in (0, len(paragraphs) - 1):
                    count -= 1
                else:
                    return False
        return count == num_paragraphs

    return check


def _number_words(num_words: int, relation: str) -> Check:
    return lambda r: _compare(relation, count_words(r), num_words)


def _nth_paragraph_first_word(num_paragraphs: int, nth_paragraph: int, first_word: str) -> Check:
    expected = first_word.lower()

    def check(response: str) -> bool:
        paragraphs = response.split("\n\n")
        count = sum(1 for p in paragraphs if p.strip())
        if nth_paragraph > count:
            return False
        # Indexed among all pieces, empty ones included, as in the reference.
        paragraph = paragraphs[nth_paragraph - 1].strip()
        if not paragraph:
            return False
        word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
        first = ""
        for char in word:
            if char in ".,?!'\"":
                break
            first += char.lower()
        return count == num_paragraphs and first == expected

    return check


def _placeholders(text: str) -> int:
    r"""How many matches re.findall(r"\[.*?\]", text) gives (the reference's count), without its
    quadratic time on many unclosed brackets: each "[" pairs with the nearest "]" on its line."""
    count = 0
    for line in text.split("\n"):
        pos = 0
        while (start := line.find("[", pos)) >= 0 and (end := line.find("]", start + 1)) >= 0:
            count, pos = count + 1, end + 1
    return count


def _number_placeholders(num_placeholders: int) -> Check:
    return lambda r: _placeholders(r) >= num_placeholders


def _postscript(postscript_marker: str) -> Check:
    marker = postscript_marker.strip()
    # The reference's two special patterns let the dots be spaced ("P. S."). Its patterns also
    # had r"\s*" before and r".*$" after (MULTILINE), which match anything, so a search without
    # them finds the same texts (and stays linear in long runs of spaces).
    if marker == "P.P.S":
        pattern = r"p\.\s?p\.\s?s"
    elif marker == "P.S.":
        pattern = r"p\.\s?s\."
    else:
        pattern = re.escape(marker.lower())
    compiled = re.compile(pattern)
    return lambda r: compiled.search(r.lower()) is not None


def _number_bullet_lists(num_bullets: int) -> Check:
    # The reference's r"^\s*" lets a match start on a blank line before the bullet, which counts
    # the same bullets but is quadratic in blank lines; the indent of the bullet's own line is
    # enough.
    stars = re.compile(r"^[^\S\n]*\*[^\*].*$", re.MULTILINE)
    dashes = re.compile(r"^[^\S\n]*-.*$", re.MULTILINE)
    return lambda r: len(stars.findall(r)) + len(dashes.findall(r)) == num_bullets


def _constrained_response() -> Check:
    return lambda r: any(option in r.strip() for option in CONSTRAINED_RESPONSES)


def _number_highlighted_sections(num_highlights: int) -> Check:
    def check(response: str) -> bool:
        single = [h for h in re.findall(r"\*[^\n\*]*\*", response) if h.strip("*").strip()]
        double = [
            h
            for h in re.findall(r"\*\*[^\n\*]*\*\*", response)
            if h.removeprefix("**").removesuffix("**").strip()
        ]
        return len(single) + len(double) >= num_highlights

    return check


def _multiple_sections(section_spliter: str, num_sections: int) -> Check:
    pattern = re.compile(r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?")
    return lambda r: len(pattern.split(r)) - 1 >= num_sections


def _json_format() -> Check:
    def check(response: str) -> bool:
        text = (
            response.strip()
            .removeprefix("```json")
            .removeprefix("```Json")
            .removeprefix("```JSON")
            .removeprefix("```")
            .removesuffix("```")
            .strip()
        )
        try:
            json.loads(text)
        except (ValueError, RecursionError):  # deep nesting ("[[[[…") overflows the decoder
            return False
        return True

    return check


def _titles(text: str) -> list[str]:
    r"""What re.findall(r"<<[^\n]+>>", text) gives, in linear time: on each line, at most one
    match, from the first "<<" to the last ">>" at least one character after it."""
    found = []
    for line in text.split("\n"):
        start = line.find("<<")
        end = line.rfind(">>")
        if start >= 0 and end >= start + 3:
            found.append(line[start : end + 2])
    return found


def _title() -> Check:
    return lambda r: any(t.lstrip("<").rstrip(">").strip() for t in _titles(r))


def _two_responses() -> Check:
    def check(response: str) -> bool:
        parts = response.split("******")
        answers = []
        for i, part in enumerate(parts):
            if part.strip():
                answers.append(part.strip())
            elif i not in (0, len(parts) - 1):
                return False
        return len(answers) == 2 and answers[0] != answers[1]

    return check


def _repeat_prompt(prompt_to_repeat: str) -> Check:
    prefix = prompt_to_repeat.strip().lower()
    return lambda r: r.strip().lower().startswith(prefix)


def _end_checker(end_phrase: str) -> Check:
    suffix = end_phrase.strip().lower()
    return lambda r: r.strip().strip('"').lower().endswith(suffix)


def _quotation() -> Check:
    def check(response: str) -> bool:
        text = response.strip()
        return len(text) > 1 and text[0] == '"' and text[-1] == '"'

    return check


def _capital_word_frequency(capital_frequency: int, capital_relation: str) -> Check:
    return lambda r: _compare(capital_relation, len(capital_words(r)), capital_frequency)


def _english_capital() -> Check:
    return lambda r: r.isupper() and _in_language(r, "en")


def _english_lowercase() -> Check:
    return lambda r: r.islower() and _in_language(r, "en")


def _no_comma() -> Check:
    return lambda r: "," not in r


@dataclass(frozen=True)
class InstructionSpec:
    """An instruction's arguments (all required) and the builder of its check."""

    arguments: tuple[str, ...]
    build: Callable[..., Check]
    detects_language: bool = False


INSTRUCTIONS: dict[str, InstructionSpec] = {
    "keywords:existence": InstructionSpec(("keywords",), _keywords_existence),
    "keywords:frequency": InstructionSpec(
        ("keyword", "frequency", "relation"), _keywords_frequency
    ),
    "keywords:forbidden_words": InstructionSpec(("forbidden_words",), _forbidden_words),
    "keywords:letter_frequency": InstructionSpec(
        ("letter", "let_frequency", "let_relation"), _letter_frequency
    ),
    "language:response_language": InstructionSpec(
        ("language",), _response_language, detects_language=True
    ),
    "length_constraints:number_sentences": InstructionSpec(
        ("num_sentences", "relation"), _number_sentences
    ),
    "length_constraints:number_paragraphs": InstructionSpec(
        ("num_paragraphs",), _number_paragraphs
    ),
    "length_constraints:number_words": InstructionSpec(("num_words", "relation"), _number_words),
    "length_constraints:nth_paragraph_first_word": InstructionSpec(
        ("num_paragraphs", "nth_paragraph", "first_word"), _nth_paragraph_first_word
    ),
    "detectable_content:number_placeholders": InstructionSpec(
        ("num_placeholders",), _number_placeholders
    ),
    "detectable_content:postscript": InstructionSpec(("postscript_marker",), _postscript),
    "detectable_format:number_bullet_lists": InstructionSpec(
        ("num_bullets",), _number_bullet_lists
    ),
    "detectable_format:constrained_response": InstructionSpec((), _constrained_response),
    "detectable_format:number_highlighted_sections": InstructionSpec(
        ("num_highlights",), _number_highlighted_sections
    ),
    "detectable_format:multiple_sections": InstructionSpec(
        ("section_spliter", "num_sections"), _multiple_sections
    ),
    "detectable_format:json_format": InstructionSpec((), _json_format),
    "detectable_format:title": InstructionSpec((), _title),
    "combination:two_responses": InstructionSpec((), _two_responses),
    "combination:repeat_prompt": InstructionSpec(("prompt_to_repeat",), _repeat_prompt),
    "startend:end_checker": InstructionSpec(("end_phrase",), _end_checker),
    "startend:quotation": InstructionSpec((), _quotation),
    "change_case:capital_word_frequency": InstructionSpec(
        ("capital_frequency", "capital_relation"), _capital_word_frequency
    ),
    "change_case:english_capital": InstructionSpec((), _english_capital, detects_language=True),
    "change_case:english_lowercase": InstructionSpec((), _english_lowercase, detects_language=True),
    "punctuation:no_comma": InstructionSpec((), _no_comma),
}

# --- Arguments ----------------------------------------------------------------------------------

# The least value of each count; a negative one made the reference draw a random count.
_COUNTS = {
    "num_sentences": 0,
    "num_paragraphs": 1,
    "num_words": 0,
    "nth_paragraph": 1,
    "num_placeholders": 0,
    "num_bullets": 0,
    "num_highlights": 0,
    "num_sections": 0,
    "frequency": 0,
    "let_frequency": 0,
    "capital_frequency": 0,
}
_WORD_LISTS = ("keywords", "forbidden_words")
_RELATIONS = ("relation", "let_relation", "capital_relation")


def _argument(instruction_id: str, name: str, value: Any) -> Any:
    """`value` as argument `name` takes it; a ValueError naming both otherwise."""
    what = f"instruction {instruction_id!r}: argument {name!r}"
    if name in _COUNTS:
        # Parquet and pandas may hold integers as floats (a column with nulls).
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < _COUNTS[name]:
            raise ValueError(f"{what} must be an integer >= {_COUNTS[name]}, got {value!r}")
        return value
    if name in _RELATIONS:
        if value not in RELATIONS:
            raise ValueError(
                f"{what} must be one of {', '.join(map(repr, RELATIONS))}, got {value!r}"
            )
        return value
    if name in _WORD_LISTS:
        if (
            isinstance(value, str)
            or not isinstance(value, Sequence)
            or not value
            or not all(isinstance(w, str) and w.strip() for w in value)
        ):
            raise ValueError(f"{what} must be a non-empty list of words, got {value!r}")
        return [w.strip() for w in value]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{what} must be non-empty text, got {value!r}")
    if name == "letter" and not (len(value) == 1 and value.isascii() and value.isalpha()):
        raise ValueError(f"{what} must be one letter a-z, got {value!r}")
    return value


def build(instruction_id: str, kwargs: Mapping[str, Any] | None = None) -> Check:
    """The check of instruction `instruction_id` with its arguments `kwargs` (None values are
    absent, as in google/IFEval, whose rows carry every instruction's keys).

    Raises ValueError naming an unknown id, a missing or unusable argument, or an argument the
    instruction does not take (empty text or an empty list there counts as absent)."""
    spec = INSTRUCTIONS.get(instruction_id)
    if spec is None:
        close = difflib.get_close_matches(str(instruction_id), list(INSTRUCTIONS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown IFEval instruction id {instruction_id!r}{hint}")
    given = {str(k): v for k, v in (kwargs or {}).items() if v is not None}
    extra = sorted(k for k in given if k not in spec.arguments and given[k] not in ("", []))
    if extra:
        takes = ", ".join(spec.arguments) if spec.arguments else "no arguments"
        raise ValueError(
            f"instruction {instruction_id!r} does not take argument(s) {extra} (it takes {takes})"
        )
    missing = [a for a in spec.arguments if a not in given]
    if missing:
        raise ValueError(f"instruction {instruction_id!r} needs argument(s) {missing}")
    arguments = {a: _argument(instruction_id, a, given[a]) for a in spec.arguments}
    if "nth_paragraph" in arguments and arguments["nth_paragraph"] > arguments["num_paragraphs"]:
        raise ValueError(
            f"instruction {instruction_id!r}: nth_paragraph {arguments['nth_paragraph']} is past "
            f"num_paragraphs {arguments['num_paragraphs']}"
        )
    return spec.build(**arguments)


def detects_language(instruction_id: str) -> bool:
    """Whether the instruction needs langdetect (False for an unknown id)."""
    spec = INSTRUCTIONS.get(instruction_id)
    return spec is not None and spec.detects_language


# --- Strict and loose ---------------------------------------------------------------------------


def loose_variants(response: str) -> tuple[str, ...]:
    """The paper's 8 variants of a response, in the reference's order (itself first)."""
    lines = response.split("\n")
    cut = (
        "\n".join(lines[1:]).strip(),
        "\n".join(lines[:-1]).strip(),
        "\n".join(lines[1:-1]).strip(),
    )
    return (response, response.replace("*", ""), *cut, *(c.replace("*", "") for c in cut))


def follows(check: Check, response: str, *, loose: bool = False) -> bool:
    """Whether `response` follows the instruction `check` tests, strictly or loosely."""
    candidates = loose_variants(response) if loose else (response,)
    return any(text.strip() and check(text) for text in candidates)


@dataclass(frozen=True)
class Verdict:
    """Which of a prompt's instructions a response follows, strictly and loosely."""

    strict: tuple[bool, ...]
    loose: tuple[bool, ...]

    @property
    def all_strict(self) -> bool:  # the paper's prompt-level strict accuracy for one prompt
        return all(self.strict)

    @property
    def all_loose(self) -> bool:
        return all(self.loose)

    @property
    def fraction_strict(self) -> float:  # instruction-level strict accuracy within one prompt
        return sum(self.strict) / len(self.strict) if self.strict else 1.0

    @property
    def fraction_loose(self) -> float:
        return sum(self.loose) / len(self.loose) if self.loose else 1.0


def evaluate(checks: Sequence[Check], response: str) -> Verdict:
    """Each check applied strictly and loosely to `response`."""
    strict = tuple(follows(c, response) for c in checks)
    # The response itself is the first loose variant: what passes strictly passes loosely.
    loose = tuple(
        s or follows(c, response, loose=True) for c, s in zip(checks, strict, strict=True)
    )
    return Verdict(strict=strict, loose=loose)
