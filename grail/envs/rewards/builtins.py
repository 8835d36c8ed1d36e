"""The built-in reward functions (TRL signature: fn(prompts, completions, **kwargs) ->
list[float])."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from grail.envs.tags import last_block

_STRICT_RE = re.compile(r"<reasoning>\n(.*)\n</reasoning>\n<answer>\n(.*)\n</answer>\n?", re.DOTALL)


_TAG_RE = re.compile(r"</?(?:reasoning|answer)>")


def _per_sample(kwargs: Mapping[str, Any], key: str, n: int) -> list[Any]:
    if key not in kwargs:
        raise ValueError(f"needs per-sample `{key}`; the batch has {sorted(kwargs)}")
    values = kwargs[key]
    if isinstance(values, str | bytes) or not isinstance(values, Sequence):
        raise ValueError(f"`{key}` must be a list with one entry per sample, got {values!r:.80}")
    if len(values) != n:
        raise ValueError(f"`{key}` has {len(values)} entries for {n} completions")
    return list(values)


def extract_answer_text(completion: str) -> str:
    """The stripped content of the last <answer>…</answer> block, else the stripped completion."""
    block = last_block(completion, "answer")
    return (completion if block is None else block).strip()


def correctness(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """1.0 where `extract_answer_text(completion)` equals the stripped reference in `answers`.

    Exact string comparison: "1,000" and "1000" differ. Environments with numeric answers grade
    numbers themselves (gsm8k's `correct` component); this is for exact-match tasks.
    """
    answers = _per_sample(kwargs, "answers", len(completions))
    return [
        1.0 if extract_answer_text(c) == str(a).strip() else 0.0
        for c, a in zip(completions, answers, strict=True)
    ]


def keyword_match(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """Fraction of the sample's `keywords` found in the completion (case-insensitive substrings).

    A sample's keywords may be one string or a list of strings; an empty list is an error
    (the fraction 0/0 has no meaning, and a silent 0 or 1 would bias the group).
    """
    keywords = _per_sample(kwargs, "keywords", len(completions))
    out = []
    for i, (c, kws) in enumerate(zip(completions, keywords, strict=True)):
        words = [kws] if isinstance(kws, str) else kws
        if not isinstance(words, Sequence) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"sample {i}: keywords must be a string or a list of strings")
        if not words:
            raise ValueError(f"sample {i}: empty keyword list")
        text = c.casefold()
        out.append(sum(w.casefold() in text for w in words) / len(words))
    return out


def strict_format(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """1.0 iff the completion is exactly the GRPO-recipe layout, else 0.0:

        <reasoning>\\n…\\n</reasoning>\\n<answer>\\n…\\n</answer>   (one optional trailing \\n)

    with non-blank block contents that contain no <reasoning>/<answer> tags themselves.
    """
    # Block contents are checked in Python rather than in the pattern: a pattern that excludes
    # tags and requires a non-space character backtracks quadratically on long completions.
    out = []
    for c in completions:
        m = _STRICT_RE.fullmatch(c)
        ok = m is not None and all(g.strip() and not _TAG_RE.search(g) for g in m.groups())
        out.append(1.0 if ok else 0.0)
    return out
