"""A reward plugin for tests/test_cli.py, loaded as "tests.cli_plugins:brevity": its name is that
of a component of copy_digits' score (the README's first plugin example)."""

from __future__ import annotations

from typing import Any


def brevity(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0 / (1 + len(c)) for c in completions]
