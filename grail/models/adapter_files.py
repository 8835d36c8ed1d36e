"""A LoRA adapter's files, as peft saves and loads them: what the trainer and grail-tinker write,
checkpoints hold and the built-in server reads. Apart from grail/models/lora.py so that a server
that serves no adapter never imports peft (~0.45 s of every server start, measured beside
transformers' Qwen2 on the 2-core CI machine)."""

from __future__ import annotations

from pathlib import Path

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()
