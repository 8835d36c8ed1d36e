"""grail-export-merged: a LoRA checkpoint as one plain model directory (base + adapter merged)."""

from __future__ import annotations

import shutil
from pathlib import Path

from peft import PeftModel

from grail.core.disk import writing
from grail.core.records import follow_umask
from grail.models.adapter_files import ADAPTER_CONFIG, is_adapter_dir


def export_merged(
    checkpoint: Path, out_dir: Path, dtype: str = "float32", *, force: bool = False
) -> Path:
    """Write the model of a LoRA checkpoint (`RUN_DIR/checkpoints/iter_XXX`) as one plain
    `save_pretrained` directory, base and adapter merged, with the tokenizer: what transformers,
    vLLM or SGLang load as any model. The base is the one the run's config names. `out_dir`
    must be new or empty (`force`: written into anyway), and never the checkpoint. A full disk
    raises a `DiskFullError` naming `out_dir`, and a new or empty `out_dir` is left empty."""
    import yaml

    from grail.models.loading import load_model, load_tokenizer
    from grail.models.tiny import resolve_model
    from grail.train.checkpoint import load_trainer_state

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not checkpoint.exists():
        raise FileNotFoundError(f"{checkpoint} does not exist")
    if out_dir.exists() and out_dir.resolve() == checkpoint.resolve():
        raise ValueError(f"{out_dir} is the checkpoint itself: write the merged model elsewhere")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(
            f"{out_dir} is not empty: its files would mix with the merged model's; choose a new "
            "directory, or pass --force to write into it"
        )
    if not is_adapter_dir(checkpoint):
        raise FileNotFoundError(
            f"{checkpoint} holds no LoRA adapter ({ADAPTER_CONFIG}): a full fine-tuning "
            "checkpoint is already a plain model directory"
        )
    config = yaml.safe_load(load_trainer_state(checkpoint)["config"])
    base = load_model(resolve_model(config["model"]["train_id"]), dtype=dtype)
    model = PeftModel.from_pretrained(base, checkpoint).merge_and_unload()
    existed = out_dir.exists()
    fresh = not existed or not any(out_dir.iterdir())  # nothing of the user's in it
    try:
        with writing(out_dir):  # a full disk: a DiskFullError naming OUT_DIR
            model.save_pretrained(out_dir, safe_serialization=True)
            load_tokenizer(checkpoint).save_pretrained(out_dir)
        follow_umask(out_dir)
    except BaseException:
        if fresh:  # leave no half-written model that something could load
            shutil.rmtree(out_dir, ignore_errors=True)
            if existed:
                out_dir.mkdir()
        raise
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
    parser.add_argument(
        "--force", action="store_true", help="write into OUT_DIR even if it is not empty"
    )
    args = parser.parse_args(argv)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        out = export_merged(args.checkpoint, args.out_dir, args.dtype, force=args.force)
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(f"grail-export-merged: {exc}") from None
    print(f"merged model written to {out}")
