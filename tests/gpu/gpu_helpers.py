"""Shared by the GPU tests (a module, not conftest, so that test files can import it)."""

from __future__ import annotations

import importlib.util

import pytest


def require_package(name: str) -> None:
    """Skip the calling test unless `name` (vllm or sglang) is importable here."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed in this environment: uv sync --extra {name}")
