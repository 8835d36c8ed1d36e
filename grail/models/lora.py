"""LoRA through peft: the trainer's adapter, the reference policy it gives for free, and the
merged model a user serves anywhere.

With `model.lora.enabled` only the adapter's matrices train; the base stays frozen. The KL
reference is the same model with the adapter switched off (`AdapterOff`), so no second copy of
the model is held. What the trainer sends the inference server, and what a checkpoint holds, is
the adapter alone (`adapter_config.json` + `adapter_model.safetensors`, peft's format); the
built-in server adds it to its base in place (grail/inference/builtin/lora.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from grail.core.config import LoraConfig
from grail.core.errors import ConfigError


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,  # type: ignore[arg-type]  # peft says int; it scales by alpha / r
        lora_dropout=lora.dropout,
        # peft's "all-linear": every nn.Linear of the blocks, never the output layer
        target_modules=list(lora.target_modules) if lora.target_modules else "all-linear",
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


# The layers peft's LoRA can wrap (peft/tuners/lora/model.py dispatches on these).
_LORA_LAYERS = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.Conv2d)


def _lora_layer(module: torch.nn.Module) -> bool:
    return isinstance(module, _LORA_LAYERS) or type(module).__name__ == "Conv1D"  # GPT-2's


def module_suffixes(model: torch.nn.Module, keep: Callable[[torch.nn.Module], bool]) -> list[str]:
    """The last name part of `model`'s modules that pass `keep` (q_proj, input_layernorm, ...),
    sorted: how a user names them in model.lora.*."""
    last = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if name and keep(m)}
    return sorted(n for n in last if not n.isdigit())  # not the layers' indices


def check_lora_modules(model: torch.nn.Module, lora: LoraConfig) -> None:
    """Refuse, naming them and the model's names, entries of model.lora.target_modules that
    match no layer LoRA can wrap, and of model.lora.modules_to_save that match no module. peft
    raised a traceback for a list that matched nothing, and silently ignored unknown names in a
    list that matched something ([q_proj, bogus_proj]). Matching is peft's: a target matches a
    module whose name is it or ends in `.<target>`, a module to save one whose name ends in it."""
    names = [(name, m) for name, m in model.named_modules() if name]
    for target in lora.target_modules or []:
        if not any((n == target or n.endswith("." + target)) and _lora_layer(m) for n, m in names):
            raise ConfigError(
                f"model.lora.target_modules: {target!r} names no layer LoRA can wrap in this "
                f"model; its linear layers are: {', '.join(module_suffixes(model, _lora_layer))}"
            )
    for saved in lora.modules_to_save:
        if not any(n.endswith(saved) for n, _ in names):
            raise ConfigError(
                f"model.lora.modules_to_save: {saved!r} matches no module of this model; its "
                f"modules are named: {', '.join(module_suffixes(model, lambda m: True))}"
            )


def with_new_adapter(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """`model` frozen under a fresh adapter (B = 0: the policy starts as the base), after
    `check_lora_modules`."""
    check_lora_modules(model, lora)
    return get_peft_model(model, peft_config(lora))


def with_saved_adapter(model: torch.nn.Module, adapter_dir: Path) -> PeftModel:
    """`model` frozen under the trainable adapter saved in `adapter_dir` (a resumed run)."""
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


class AdapterOff(torch.nn.Module):
    """The base policy of a LoRA model, as the KL reference: the same module called with its
    adapter disabled (peft's `disable_adapter`), so the reference costs no memory."""

    def __init__(self, model: PeftModel) -> None:
        super().__init__()
        self.peft_model = [model]  # a list: not registered as a submodule (no second owner)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        model = self.peft_model[0]
        with model.disable_adapter():
            return model(*args, **kwargs)


def base_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The frozen base's weights under their own names (peft keeps them as
    `...q_proj.base_layer.weight`, and a module of `modules_to_save` as
    `...norm.original_module.weight` beside its trained copy): what the inference server starts
    from. No copy is made."""
    return base_weights(model.get_base_model().state_dict())


def base_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`base_state_dict` of a base model's state dict (`get_base_model().state_dict()`, or the
    same gathered from the shards of a multi-process run)."""
    return {
        name.replace(".base_layer.", ".").replace(".original_module.", "."): tensor
        for name, tensor in state.items()
        if "lora_" not in name and ".modules_to_save." not in name
    }
