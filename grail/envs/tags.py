"""Finding the last <tag>…</tag> block of a completion in linear time.

Why not `re.findall(r"<tag>(.*?)</tag>")`: with many unclosed opening tags (a degenerate policy
repeating "<answer>" is common early in RL) every opening scans to the end of the text, which is
quadratic: a 200 kB completion took over 30 s to grade. Here the last closing tag is found first,
then the nearest opening tag before it, so the cost is two linear scans.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterator
from functools import lru_cache


@lru_cache(maxsize=32)
def _patterns(tag: str, ignore_case: bool) -> tuple[re.Pattern[str], re.Pattern[str]]:
    flags = re.IGNORECASE if ignore_case else 0
    return re.compile(re.escape(f"<{tag}>"), flags), re.compile(re.escape(f"</{tag}>"), flags)


def last_block(text: str, tag: str, *, ignore_case: bool = False) -> str | None:
    """Content between the last `</tag>` and the nearest `<tag>` before it, or None.

    "<a>1<a>2</a>" gives "2" (the innermost opening counts), and an unclosed trailing "<a>"
    is ignored, as a model that starts a block and never closes it has given no block.
    """
    opening, closing = _patterns(tag, ignore_case)
    close = _last(closing.finditer(text))
    if close is None:
        return None
    start = _last(opening.finditer(text, 0, close.start()))
    if start is None:
        return None
    return text[start.end() : close.start()]


def _last(matches: Iterator[re.Match[str]]) -> re.Match[str] | None:
    tail = deque(matches, maxlen=1)
    return tail[0] if tail else None
