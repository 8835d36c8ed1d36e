"""grail-export-merged: a LoRA checkpoint as one plain model directory (base + adapter merged)."""

from __future__ import annotations

from pathlib import Path

from peft import PeftModel

from grail.models.lora import ADAPTER_CONFIG, is_adapter_dir


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
    model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
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
