"""LoRA through peft: the trainer's adapter, the reference policy it gives for free, and the
merged model a user serves anywhere.

With `model.lora.enabled` only the adapter's matrices train; the base stays frozen. The KL
reference is the same model with the adapter switched off (`AdapterOff`), so no second copy of
the model is held. What the trainer sends the inference server, and what a checkpoint holds, is
the adapter alone (`adapter_config.json` + `adapter_model.safetensors`, peft's format); the
built-in server adds it to its base in place (grail/inference/builtin/lora.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model

from grail.config import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(lora: LoraConfig) -> PeftLoraConfig:
    return PeftLoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        # peft's "all-linear": every nn.Linear of the blocks, never the output layer
        target_modules=list(lora.target_modules) if lora.target_modules else "all-linear",
        modules_to_save=list(lora.modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def with_new_adapter(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """`model` frozen under a fresh adapter (B = 0: the policy starts as the base)."""
    return get_peft_model(model, peft_config(lora))  # type: ignore[arg-type]


def with_saved_adapter(model: torch.nn.Module, adapter_dir: Path) -> PeftModel:
    """`model` frozen under the trainable adapter saved in `adapter_dir` (a resumed run)."""
    return PeftModel.from_pretrained(model, adapter_dir, is_trainable=True)  # type: ignore[arg-type]


def is_adapter_dir(path: Path) -> bool:
    return (path / ADAPTER_CONFIG).is_file()


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
    state = model.get_base_model().state_dict()
    return {
        name.replace(".base_layer.", ".").replace(".original_module.", "."): tensor
        for name, tensor in state.items()
        if "lora_" not in name and ".modules_to_save." not in name
    }


def export_merged(checkpoint: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Write the model of a LoRA checkpoint (`RUN_DIR/checkpoints/iter_XXX`) as one plain
    `save_pretrained` directory, base and adapter merged, with the tokenizer: what transformers,
    vLLM or SGLang load as any model. The base is the one the run's config names."""
    import yaml

    from grail.models.loading import load_model, load_tokenizer
    from grail.models.tiny import resolve_model
    from grail.train.checkpoint import load_trainer_state

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not is_adapter_dir(checkpoint):
        raise FileNotFoundError(
            f"{checkpoint} holds no LoRA adapter ({ADAPTER_CONFIG}): a full fine-tuning "
            "checkpoint is already a plain model directory"
        )
    config = yaml.safe_load(load_trainer_state(checkpoint)["config"])
    base = load_model(resolve_model(config["model"]["train_id"]), dtype=dtype)
    model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()  # type: ignore[arg-type]
    model.save_pretrained(out_dir, safe_serialization=True)
    load_tokenizer(checkpoint).save_pretrained(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> None:
    """`grail-export-merged CHECKPOINT OUT_DIR`: see `export_merged`."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="grail-export-merged",
        description="Merge a LoRA checkpoint of grail-train into its base model and save the "
        "result as a plain save_pretrained directory (with the tokenizer).",
    )
    parser.add_argument("checkpoint", type=Path, help="RUN_DIR/checkpoints/iter_XXX")
    parser.add_argument("out_dir", type=Path, help="where to write the merged model")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        out = export_merged(args.checkpoint, args.out_dir, args.dtype)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"grail-export-merged: {exc}") from None
    print(f"merged model written to {out}")
