"""Checks against the real vLLM and SGLang packages, which CI does not install: each runs in an
interpreter that has the package (this one, or GRAIL_<PACKAGE>_PYTHON), in a process of its
own since importing either takes seconds and pulls in much, and prints one line "RESULT <json>"."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent
BACKEND_ARGV_CHECK = HELPERS / "backend_argv_check.py"
WEIGHT_TRANSFER_CHECK = HELPERS / "weight_transfer_check.py"


def python_with(package: str) -> str:
    """An interpreter that can import `package`: this one, or GRAIL_<PACKAGE>_PYTHON; the test
    is skipped, saying how to get one, when there is neither."""
    if importlib.util.find_spec(package) is not None:
        return sys.executable
    python = os.environ.get(f"GRAIL_{package.upper()}_PYTHON")
    if not python:
        pytest.skip(
            f"{package} is not installed (uv sync --extra {package}, or set "
            f"GRAIL_{package.upper()}_PYTHON to an interpreter that has it)"
        )
    return python


def run_check(python: str, program: list[str], job: object, *, timeout: float) -> dict:
    """`python PROGRAM...` with `job` as JSON on its standard input, no GPU visible; its RESULT."""
    result = subprocess.run(
        [python, *program],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    lines = [x for x in result.stdout.splitlines() if x.startswith("RESULT ")]
    assert result.returncode == 0 and lines, (result.stdout + result.stderr)[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
