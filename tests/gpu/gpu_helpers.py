"""Shared by the GPU tests (a module, not conftest, so that test files can import it)."""

from __future__ import annotations

import importlib.util

import pytest

# A Qwen2 shape with ~0.47B parameters at the tiny tokenizer's 512-token vocabulary (Qwen2.5-0.5B
# has 0.36B outside its 151,936-token embedding): 24 layers of
# attention 2*d^2 + 2*d*(d/4) and SwiGLU MLP 3*d*5504, d = 1024.
MID_PRESET: dict[str, object] = {
    "hidden_size": 1024,
    "num_layers": 24,
    "num_heads": 16,
    "num_kv_heads": 4,
    "intermediate_size": 5504,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def require_package(name: str) -> None:
    """Skip the calling test unless `name` (vllm or sglang) is importable here."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed in this environment: uv sync --extra {name}")
