"""The examples of the documentation pages, run as written: a page's first Python block under a
heading, installed as an importable module (docs/environments.md's environment classes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"


def python_block(page: str, heading: str) -> str:
    """The first ```python block after `heading` in docs/`page`."""
    text = (DOCS / page).read_text()
    section = text[text.index(heading) :]
    start = section.index("```python\n") + len("```python\n")
    return section[start : section.index("```\n", start)]


def install_example(
    page: str, heading: str, module: str, directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """That block as module `module` (a file in `directory`, put on sys.path for the test); a
    module of that name another page's example left in sys.modules is dropped, for the test."""
    (directory / f"{module}.py").write_text(python_block(page, heading))
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.delitem(sys.modules, module, raising=False)
