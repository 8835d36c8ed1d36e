"""GPU integration tests: everything under tests/gpu/ gets the `gpu` marker and is skipped, with
the reason, on a machine where torch sees no CUDA device. Run only these with `pytest -m gpu`.

Tests that also need vLLM or SGLang call `gpu_helpers.require_package`, which skips with the
install command.
Models are built offline: the tiny preset (grail.models.tiny) and a ~0.5B random Qwen2
(`grail.models.tiny.MID_PRESET`), so no test downloads anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from grail.models.tiny import MID_PRESET

GPU_DIR = Path(__file__).resolve().parent


def _cuda_skip_reason() -> str | None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return "torch is not importable"
    if not torch.cuda.is_available():
        return (
            "needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Hooks in a conftest see the whole session's items; touch only the ones in this directory.
    reason = _cuda_skip_reason()
    for item in items:
        if GPU_DIR in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from grail.models.tiny import ensure_tiny_model

    return ensure_tiny_model()


@pytest.fixture(scope="session")
def mid_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ~0.5B random Qwen2, float32 on disk (what the trainer's master copy saves)."""
    from grail.models.tiny import build_random_qwen2

    return build_random_qwen2(tmp_path_factory.mktemp("mid") / "model", seed=0, **MID_PRESET)
