"""LoRA adapters in the built-in engine: peft's LoRA layers added to the served model once, at
start (`--lora-dir`), and each adapter sync copying the new A and B matrices into them in place.

The served computation is the trainer's, layer for layer: base(x) + s·B(A(x)) through the same
peft LoRA layers, so the behaviour log-probabilities match the trainer's (the base is never
merged and unmerged, which would drift with every sync in bfloat16). Like a full-weight reload,
the adapter is read and checked whole (names, shapes, rank, scaling, target modules) before a
single value is copied, so a refused sync leaves the old adapter serving.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from grail.inference.builtin.weights import WeightUpdateError, read_checked
from grail.models.adapter_files import ADAPTER_CONFIG, ADAPTER_WEIGHTS, is_adapter_dir

__all__ = ["is_adapter_dir", "read_adapter", "add_lora_layers", "copy_adapter"]

ADAPTER_NAME = "default"  # peft's name for the one adapter
_SAVED_PREFIX = "base_model.model."  # peft's saved names: base_model.model.<module>.lora_A.weight
# What must agree between the adapter the layers were made for and a later one.
_SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "bias", "modules_to_save")


def adapter_settings(path: Path) -> dict[str, Any]:
    """The adapter's `adapter_config.json`, checked to be a LoRA adapter this engine serves."""
    try:
        settings = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise WeightUpdateError(f"cannot read {path / ADAPTER_CONFIG}: {exc}") from exc
    if settings.get("peft_type") != "LORA":
        raise WeightUpdateError(
            f"{path / ADAPTER_CONFIG}: peft_type {settings.get('peft_type')!r}, expected 'LORA'"
        )
    if settings.get("bias", "none") != "none":
        raise WeightUpdateError(f"{path / ADAPTER_CONFIG}: bias must be 'none' (trained biases)")
    return settings


def add_lora_layers(model: torch.nn.Module, settings: dict[str, Any]) -> None:
    """Give `model` peft LoRA layers shaped as `settings` (an adapter_config.json) says."""
    # Here, not at the top: a server with no adapter never imports peft (models/adapter_files.py).
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=settings["r"],
        lora_alpha=settings["lora_alpha"],
        lora_dropout=0.0,  # serving: dropout never applies
        target_modules=settings["target_modules"],
        use_rslora=settings.get("use_rslora", False),
        bias="none",
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    model.eval().requires_grad_(False)
    # modules_to_save get no wrapper here: their trained weights overwrite the base's own.
    model.lora_settings = {k: settings.get(k) for k in _SHAPE_KEYS}  # type: ignore[assignment]


def read_adapter(path: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapter in `path` as {parameter name in `model`: tensor}, checked against the LoRA
    layers `model` has: same settings, every A and B present, with their shapes."""
    if not path.is_dir():
        raise WeightUpdateError(f"adapter directory {path} does not exist")
    settings = adapter_settings(path)
    served = getattr(model, "lora_settings", None)
    if served is None:
        raise WeightUpdateError(
            f"{path} is a LoRA adapter, but this server has no LoRA layers: start it with "
            "--lora-dir (grail-train does with model.lora.enabled)"
        )
    given = {k: settings.get(k) for k in _SHAPE_KEYS}
    for key in _SHAPE_KEYS:
        if _normalised(given[key]) != _normalised(served[key]):
            raise WeightUpdateError(
                f"{path}: adapter {key}={given[key]!r}, but the server's LoRA layers were made "
                f"for {key}={served[key]!r}; restart the server to change the adapter's shape"
            )
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        raise WeightUpdateError(f"{path} has no {ADAPTER_WEIGHTS}")
    params = dict(model.named_parameters())
    saved_modules = settings.get("modules_to_save") or []

    def lora_name(saved: str) -> str | None:
        # A LoRA matrix, or a weight of a module trained in full (modules_to_save), which
        # replaces the base's own.
        name = served_name(saved)
        return name if ".lora_" in name or _in_saved_module(name, saved_modules) else None

    tensors: dict[str, torch.Tensor] = {}
    read_checked(file, params, tensors, "a LoRA weight of the served model", lora_name)
    missing = [n for n in params if ".lora_" in n and n not in tensors]
    if missing:
        shown = ", ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise WeightUpdateError(f"{path} lacks {len(missing)} LoRA weights: {shown}")
    return tensors


def served_name(saved: str) -> str:
    """peft's saved name of a LoRA weight -> its parameter name in the served model:
    base_model.model.X.lora_A.weight -> X.lora_A.default.weight."""
    name = saved.removeprefix(_SAVED_PREFIX)
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
    return name


def copy_adapter(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor)


def _in_saved_module(name: str, modules: list[str]) -> bool:
    """Whether parameter `name` belongs to a module of `modules_to_save`, matched as peft
    matches them: by the end of the module's name, "norm" taking "input_layernorm" too."""
    module = name.rpartition(".")[0]
    return any(module.endswith(m) for m in modules)


def _normalised(value: Any) -> Any:
    # target_modules is a list in one file and a set serialised as a list in another
    return sorted(value) if isinstance(value, list | set | tuple) else value
