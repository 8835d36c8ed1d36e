"""IFEval's instruction checkers (grail/envs/instructions.py): each of the 25 with a response that
follows it and one that does not, the reference's edge cases, strict against loose, the text
units that replace NLTK's, and arguments refused by name."""

from __future__ import annotations

import random
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from grail.envs import instructions
from grail.envs.instructions import (
    INSTRUCTIONS,
    LanguageDetectionUnavailableError,
    build,
    capital_words,
    count_words,
    evaluate,
    follows,
    loose_variants,
    split_sentences,
)

IDS = [
    "keywords:existence",
    "keywords:frequency",
    "keywords:forbidden_words",
    "keywords:letter_frequency",
    "language:response_language",
    "length_constraints:number_sentences",
    "length_constraints:number_paragraphs",
    "length_constraints:number_words",
    "length_constraints:nth_paragraph_first_word",
    "detectable_content:number_placeholders",
    "detectable_content:postscript",
    "detectable_format:number_bullet_lists",
    "detectable_format:constrained_response",
    "detectable_format:number_highlighted_sections",
    "detectable_format:multiple_sections",
    "detectable_format:json_format",
    "detectable_format:title",
    "combination:two_responses",
    "combination:repeat_prompt",
    "startend:end_checker",
    "startend:quotation",
    "change_case:capital_word_frequency",
    "change_case:english_capital",
    "change_case:english_lowercase",
    "punctuation:no_comma",
]
LANGUAGE_IDS = {i for i in IDS if INSTRUCTIONS[i].detects_language}

AT_LEAST, LESS_THAN = "at least", "less than"
# (instruction id, kwargs, response, strictly followed)
CASES: list[tuple[str, dict[str, Any], str, bool]] = [
    ("keywords:existence", {"keywords": ["cat", "dog"]}, "The Cat chased the DOG.", True),
    ("keywords:existence", {"keywords": ["cat", "dog"]}, "The cat slept.", False),
    # substrings count, as in the reference
    ("keywords:existence", {"keywords": ["cat", "dog"]}, "category and dogma", True),
    ("keywords:existence", {"keywords": ["C++"]}, "I write c++ daily", True),  # literal, no regex
    ("keywords:frequency", {"keyword": "data", "frequency": 3, "relation": AT_LEAST},
     "Data, data and more DATA.", True),
    ("keywords:frequency", {"keyword": "data", "frequency": 3, "relation": AT_LEAST},
     "data and data", False),
    ("keywords:frequency", {"keyword": "data", "frequency": 2, "relation": LESS_THAN},
     "one data point", True),
    ("keywords:frequency", {"keyword": "data", "frequency": 2, "relation": LESS_THAN},
     "data and metadata", False),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "ugly"]}, "A good day.", True),
    ("keywords:forbidden_words", {"forbidden_words": ["bad", "ugly"]}, "That was BAD.", False),
    # whole words only
    ("keywords:forbidden_words", {"forbidden_words": ["bad"]}, "A badge.", True),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": AT_LEAST},
     "Zoe zips zebras", True),
    ("keywords:letter_frequency", {"letter": "z", "let_frequency": 3, "let_relation": AT_LEAST},
     "A zoo", False),
    ("keywords:letter_frequency", {"letter": "A", "let_frequency": 2, "let_relation": LESS_THAN},
     "hello", True),
    ("keywords:letter_frequency", {"letter": "A", "let_frequency": 2, "let_relation": LESS_THAN},
     "a cat", False),
    ("language:response_language", {"language": "fr"},
     "Bonjour, je suis très heureux de vous rencontrer aujourd'hui à Paris.", True),
    ("language:response_language", {"language": "fr"},
     "Hello, I am very happy to meet you today in London.", False),
    # no letters: the language cannot be detected, which counts as followed
    ("language:response_language", {"language": "fr"}, "12345 678", True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS_THAN},
     "One thing. Two things!", True),
    ("length_constraints:number_sentences", {"num_sentences": 3, "relation": LESS_THAN},
     "One. Two? Three.", False),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": AT_LEAST},
     "Dr. Smith came. He left.", True),
    ("length_constraints:number_sentences", {"num_sentences": 2, "relation": AT_LEAST},
     "Dr. Smith paid 3.50 dollars, e.g. for tea.", False),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "A\n***\nB\n***\nC", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 3}, "A\n***\nB", False),
    # a divider at either end adds no paragraph; two in a row fail
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "***\nA\n***\nB\n***", True),
    ("length_constraints:number_paragraphs", {"num_paragraphs": 2}, "A\n***\n***\nB", False),
    ("length_constraints:number_words", {"num_words": 5, "relation": AT_LEAST},
     "one two-three four, five", True),
    ("length_constraints:number_words", {"num_words": 5, "relation": AT_LEAST},
     "one two three", False),
    ("length_constraints:number_words", {"num_words": 3, "relation": LESS_THAN}, "hi there", True),
    ("length_constraints:number_words", {"num_words": 3, "relation": LESS_THAN},
     "it's here", False),  # "it", "s", "here"
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "However"},
     "First part.\n\nHowever, the second.", True),
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     "First part.\n\nBut the second.", False),
    # the right word, but three paragraphs
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "however"},
     "A.\n\nHowever b.\n\nC.", False),
    # leading quotes and trailing punctuation are not part of the word
    ("length_constraints:nth_paragraph_first_word",
     {"num_paragraphs": 2, "nth_paragraph": 1, "first_word": "well"},
     "\"Well!\" she said.\n\nThen more.", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2},
     "Dear [name], see you at [address].", True),
    ("detectable_content:number_placeholders", {"num_placeholders": 2}, "Dear [name].", False),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi.\nP.S. Bye.", True),
    ("detectable_content:postscript", {"postscript_marker": "P.S."}, "Hi. PS bye.", False),
    ("detectable_content:postscript", {"postscript_marker": "P.P.S"}, "Hi.\np. p. s. more", True),
    ("detectable_content:postscript", {"postscript_marker": "Note:"}, "Text.\nNOTE: x", True),
    ("detectable_content:postscript", {"postscript_marker": "Note:"}, "Text.\nNote x", False),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b", True),
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "* a\n* b\n- c", False),
    # "**bold**" starts with two stars: not a bullet
    ("detectable_format:number_bullet_lists", {"num_bullets": 2}, "**Bold**\n- a\n  * b", True),
    ("detectable_format:constrained_response", {}, "Thinking... My answer is yes.", True),
    ("detectable_format:constrained_response", {}, "Yes.", False),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2},
     "*one* and **two**", True),
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* only", False),
    # an empty highlight does not count
    ("detectable_format:number_highlighted_sections", {"num_highlights": 2}, "*one* * *", False),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nfoo\nSection 2\nbar", True),
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "Section 1\nfoo", False),
    # the splitter's case matters, as in the reference
    ("detectable_format:multiple_sections", {"section_spliter": "Section", "num_sections": 2},
     "SECTION 1\nfoo\nSECTION 2\nbar", False),
    ("detectable_format:json_format", {}, '```json\n{"a": [1, 2]}\n```', True),
    ("detectable_format:json_format", {}, '{"a": 1} and more', False),
    ("detectable_format:title", {}, "<<Ode to Joy>>\nRoses are red.", True),
    ("detectable_format:title", {}, "<<   >> no title", False),
    ("detectable_format:title", {}, "<<broken\ntitle>>", False),
    ("combination:two_responses", {}, "Answer one.\n******\nAnswer two.", True),
    ("combination:two_responses", {}, "Same.\n******\nSame.", False),
    ("combination:two_responses", {}, "A\n******\n******\nB", False),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem about cats."},
     "write a poem about cats. Cats nap all day.", True),
    ("combination:repeat_prompt", {"prompt_to_repeat": "Write a poem about cats."},
     "Sure! Write a poem about cats.", False),
    ("startend:end_checker", {"end_phrase": "Any other questions?"},
     "Done. Any other questions?", True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"},
     '"Done. any other questions?"', True),  # a closing quote may follow
    ("startend:end_checker", {"end_phrase": "Any other questions?"},
     "Any other questions? Bye.", False),
    ("startend:quotation", {}, '  "All of it."  ', True),
    ("startend:quotation", {}, 'Not "all" of it.', False),
    ("startend:quotation", {}, '"', False),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": AT_LEAST},
     "THIS is VERY important", True),
    ("change_case:capital_word_frequency", {"capital_frequency": 2, "capital_relation": AT_LEAST},
     "This is WELL-KNOWN", False),  # a hyphenated word is one word
    ("change_case:capital_word_frequency",
     {"capital_frequency": 2, "capital_relation": LESS_THAN}, "Only ONE here", True),
    ("change_case:capital_word_frequency",
     {"capital_frequency": 2, "capital_relation": LESS_THAN}, "I DON'T", False),
    ("change_case:english_capital", {},
     "THIS IS AN ENGLISH SENTENCE ABOUT THE WEATHER TODAY.", True),
    ("change_case:english_capital", {}, "This is not all in capitals.", False),
    # in capitals but German (langdetect, as in the reference, takes capital French for English)
    ("change_case:english_capital", {},
     "DAS IST EIN DEUTSCHER SATZ ÜBER DAS WETTER HEUTE.", False),
    ("change_case:english_lowercase", {},
     "this is an english sentence about the weather today.", True),
    ("change_case:english_lowercase", {}, "This one has a Capital.", False),
    ("punctuation:no_comma", {}, "No commas here.", True),
    ("punctuation:no_comma", {}, "One, two.", False),
]  # fmt: skip


@pytest.fixture
def without_langdetect(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """langdetect unimportable (None in sys.modules makes `import` raise ImportError)."""
    instructions._language_detector.cache_clear()
    monkeypatch.setitem(sys.modules, "langdetect", None)
    yield
    instructions._language_detector.cache_clear()


def _strict(instruction_id: str, kwargs: dict[str, Any], response: str) -> bool:
    return follows(build(instruction_id, kwargs), response)


def test_the_registry_is_ifevals_25_instructions() -> None:
    assert sorted(INSTRUCTIONS) == sorted(IDS)
    assert {i for i in IDS if instructions.detects_language(i)} == {
        "language:response_language",
        "change_case:english_capital",
        "change_case:english_lowercase",
    }


def test_every_instruction_has_a_followed_and_an_unfollowed_case() -> None:
    for instruction_id in IDS:
        outcomes = {expected for i, _, _, expected in CASES if i == instruction_id}
        assert outcomes == {True, False}, instruction_id


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "response", "expected"),
    CASES,
    ids=[f"{c[0]}-{n}" for n, c in enumerate(CASES)],
)
def test_a_response_is_graded_as_the_paper_defines(
    instruction_id: str, kwargs: dict[str, Any], response: str, expected: bool
) -> None:
    if instruction_id in LANGUAGE_IDS:
        pytest.importorskip("langdetect")
    assert _strict(instruction_id, kwargs, response) is expected


@pytest.mark.parametrize("instruction_id", IDS)
def test_an_empty_response_follows_nothing(instruction_id: str) -> None:
    kwargs = next(k for i, k, _, _ in CASES if i == instruction_id)
    check = build(instruction_id, kwargs)
    for response in ("", "  \n "):
        assert not follows(check, response)
        assert not follows(check, response, loose=True)


def test_loose_tries_the_papers_eight_variants_in_order() -> None:
    assert loose_variants("first\n**mid**\nlast") == (
        "first\n**mid**\nlast",
        "first\nmid\nlast",
        "**mid**\nlast",
        "first\n**mid**",
        "**mid**",
        "mid\nlast",
        "first\nmid",
        "mid",
    )
    assert loose_variants("") == ("", "", "", "", "", "", "", "")


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "response"),
    [
        # a preamble line ("Sure, here it is:") is dropped
        ("punctuation:no_comma", {}, "Sure, here it is:\nNo commas at all."),
        # a closing remark after the answer is dropped
        ("startend:quotation", {}, '"All of it."\nHope this helps!'),
        # markdown emphasis around the phrase is removed
        ("startend:end_checker", {"end_phrase": "Is there anything else?"},
         "Done. **Is there anything else?**"),
        # both ends, with stars
        ("detectable_format:json_format", {}, 'Here:\n**{"a": 1}**\nThanks'),
    ],
)  # fmt: skip
def test_loose_forgives_what_strict_does_not(
    instruction_id: str, kwargs: dict[str, Any], response: str
) -> None:
    check = build(instruction_id, kwargs)
    assert not follows(check, response)
    assert follows(check, response, loose=True)


def test_a_verdict_has_the_prompt_and_instruction_levels() -> None:
    checks = [
        build("punctuation:no_comma"),
        build("startend:end_checker", {"end_phrase": "Bye."}),
        build("detectable_format:title"),
    ]
    # the comma is on the middle line, which every loose variant keeps
    verdict = evaluate(checks, "Hi there\nHello, <<Title>> Bye.\n**")
    assert verdict.strict == (False, False, True)
    assert verdict.loose == (False, True, True)
    assert not verdict.all_strict and not verdict.all_loose
    assert verdict.fraction_strict == pytest.approx(1 / 3)
    assert verdict.fraction_loose == pytest.approx(2 / 3)
    assert evaluate(checks[1:], "<<T>> Bye.").all_strict


@pytest.mark.parametrize(
    ("text", "sentences"),
    [
        ("", []),
        ("no end mark", ["no end mark"]),
        ("Hi! How are you? Fine.", ["Hi!", "How are you?", "Fine."]),
        ("Dr. Smith came home. He slept.", ["Dr. Smith came home.", "He slept."]),
        ("J. K. Rowling wrote it, e.g. this. Yes.", ["J. K. Rowling wrote it, e.g. this.", "Yes."]),
        ("The U.S. is big. It costs 3.50 dollars.", ["The U.S. is big.", "It costs 3.50 dollars."]),
        ('He said "stop." Then left.', ['He said "stop."', "Then left."]),
        ("Wait... what?!", ["Wait...", "what?!"]),
        ("* item one\n* item two", ["* item one\n* item two"]),  # newlines end nothing
        ("... !!", []),  # no letter or digit: no sentence
    ],
)
def test_sentences_are_split_by_the_documented_rule(text: str, sentences: list[str]) -> None:
    assert split_sentences(text) == sentences


def test_words_and_capital_words() -> None:
    assert count_words("it's a well-known fact_1, 42 times") == 8
    assert capital_words("I DON'T know the WELL-KNOWN U.S. a1 A1 123") == [
        "I",
        "DON",
        "T",
        "WELL-KNOWN",
        "U",
        "S",
        "A1",
    ]


def test_arguments_google_ifeval_leaves_null_are_absent() -> None:
    """google/IFEval's rows carry every instruction's keys, null where unused."""
    kwargs = {"num_highlights": None, "relation": None, "num_placeholders": 1, "keywords": []}
    assert follows(build("detectable_content:number_placeholders", kwargs), "[x]")
    # Parquet may hold integer columns as floats
    assert follows(
        build("detectable_content:number_placeholders", {"num_placeholders": 1.0}), "[x]"
    )


@pytest.mark.parametrize(
    ("instruction_id", "kwargs", "message"),
    [
        ("keywords:existance", {}, r"unknown IFEval instruction id 'keywords:existance' "
         r"\(did you mean 'keywords:existence'\?\)"),
        ("detectable_format:title", {"num_bullets": 3},
         r"'detectable_format:title' does not take argument\(s\) \['num_bullets'\]"),
        ("keywords:frequency", {"keyword": "a", "relation": "at least"},
         r"'keywords:frequency' needs argument\(s\) \['frequency'\]"),
        ("keywords:frequency", {"keyword": "a", "frequency": 2, "relation": "at most"},
         "argument 'relation' must be one of 'less than', 'at least', got 'at most'"),
        ("length_constraints:number_words", {"num_words": -1, "relation": "at least"},
         "argument 'num_words' must be an integer >= 0, got -1"),
        ("detectable_format:number_bullet_lists", {"num_bullets": True},
         "'num_bullets' must be an integer"),
        ("detectable_format:number_bullet_lists", {"num_bullets": 2.5},
         "'num_bullets' must be an integer"),
        ("keywords:letter_frequency", {"letter": "ab", "let_frequency": 1,
                                       "let_relation": "at least"},
         "argument 'letter' must be one letter a-z, got 'ab'"),
        ("keywords:existence", {"keywords": []},
         "'keywords' must be a non-empty list of words, got \\[\\]"),
        ("keywords:forbidden_words", {"forbidden_words": "bad"},
         "'forbidden_words' must be a non-empty list of words"),
        ("startend:end_checker", {"end_phrase": "  "}, "'end_phrase' must be non-empty text"),
        ("length_constraints:nth_paragraph_first_word",
         {"num_paragraphs": 2, "nth_paragraph": 3, "first_word": "so"},
         "nth_paragraph 3 is past num_paragraphs 2"),
    ],
)  # fmt: skip
def test_bad_ids_and_arguments_are_refused_by_name(
    instruction_id: str, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        build(instruction_id, kwargs)


@pytest.mark.usefixtures("without_langdetect")
def test_a_language_instruction_without_langdetect_says_how_to_install_it() -> None:
    check = build("language:response_language", {"language": "en"})  # building needs nothing
    with pytest.raises(LanguageDetectionUnavailableError, match=r"uv sync --extra ifeval"):
        check("Hello there.")
    with pytest.raises(ImportError, match="change_case:english_capital"):
        instructions.require_language_detection()
    # the others do not need it
    assert follows(build("punctuation:no_comma"), "Hello there.")


def test_linear_rewrites_match_the_reference_regexes() -> None:
    """Placeholders, titles, bullets and postscripts are counted without the reference's
    regexes (quadratic on degenerate text) but find what they find: random texts, seeded."""
    rng = random.Random(0)
    alphabet = "[]<>*-\n \t.!?pPsSab\"'"
    markers = {"P.S.": r"\s*p\.\s?s\..*$", "P.P.S": r"\s*p\.\s?p\.\s?s.*$", "ps": r"\s*ps.*$"}
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        assert instructions._placeholders(text) == len(re.findall(r"\[.*?\]", text)), text
        assert instructions._titles(text) == re.findall(r"<<[^\n]+>>", text), text
        bullets = len(re.findall(r"^\s*\*[^\*].*$", text, flags=re.MULTILINE)) + len(
            re.findall(r"^\s*-.*$", text, flags=re.MULTILINE)
        )
        check = build("detectable_format:number_bullet_lists", {"num_bullets": bullets})
        assert check(text), text
        for marker, pattern in markers.items():
            check = build("detectable_content:postscript", {"postscript_marker": marker})
            expected = re.search(pattern, text.lower(), flags=re.MULTILINE) is not None
            assert check(text) is expected, (marker, text)


def test_degenerate_responses_are_graded_quickly() -> None:
    """A policy early in RL repeats characters; no check may take quadratic time on that (a
    100 kB response would take minutes), nor crash (the reference's JSON check overflows the
    stack on deep nesting)."""
    texts = ["[" * 100_000, "<<" * 50_000, "\n" * 100_000, "." * 100_000 + "x", "!" * 100_000]
    texts += ["a" * 100_000 + " b.", " " * 100_000 + "x", "\n*" * 50_000, "{" * 100_000]
    checks = [
        build(i, next(k for j, k, _, _ in CASES if j == i)) for i in IDS if i not in LANGUAGE_IDS
    ]
    start = time.perf_counter()
    for text in texts:
        evaluate(checks, text)
    assert time.perf_counter() - start < 10.0
    assert not follows(build("detectable_format:json_format"), "[" * 100_000)
