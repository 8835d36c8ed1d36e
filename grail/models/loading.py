"""Load causal LMs and tokenizers by local directory or Hugging Face Hub id.

Why a wrapper around the Auto classes: three failure modes deserve clear messages instead of a
long transformers traceback: a mistyped local path (FileNotFoundError naming it), a hub id on a
machine without hub access (an error that says so and suggests a local copy), and a tokenizer
without a pad token (batched generation and training need one; we fall back to eos, as most
causal LMs expect).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

# "org/name" with the characters the hub allows (a revision is not part of the id).
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# Fragments of the errors huggingface_hub/transformers raise when the hub cannot be reached or
# offline mode forbids it (as opposed to "no such repository" or "no such file").
_UNREACHABLE_HINTS = (
    "offline",
    "couldn't connect",
    "could not connect",
    "connection",
    "cannot find the requested files in the disk cache",
    "cannot find the requested files in the local cache",
    "outgoing traffic has been disabled",
    "name resolution",
    "timed out",
)


def is_hub_id(name: str) -> bool:
    """True when `name` has the shape of a hub repository id, `org/name`."""
    return bool(_HUB_ID_RE.match(name))


def resolve_source(name_or_path: str | Path) -> str:
    """A local directory (as a string) or a hub id; anything else is a FileNotFoundError.

    A path that exists wins over a hub id of the same spelling, as in transformers.
    """
    text = str(name_or_path)
    if not text.strip():
        raise ValueError("model name_or_path is empty")
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise NotADirectoryError(
                f"model path {text!r} is a file; expected a save_pretrained directory"
            )
        return str(path)
    if isinstance(name_or_path, str) and is_hub_id(text):
        return text
    raise FileNotFoundError(
        f"model path {text!r} does not exist (resolved to {path.resolve()}) and is not a "
        "Hugging Face Hub id of the form 'org/name'"
    )


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.dtype from a dtype or a name ("float32", "bf16", "torch.float16", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(set(_DTYPES))}")


def _hub_error(source: str, what: str, exc: Exception) -> Exception:
    """Re-word a failed hub load: say whether the hub was unreachable, suggest a local path."""
    message = str(exc)
    lowered = message.lower()
    advice = (
        f"download it where the hub is reachable (e.g. `hf download {source} --local-dir "
        f"DIR`) and pass the local directory DIR instead"
    )
    if any(hint in lowered for hint in _UNREACHABLE_HINTS):
        return OSError(
            f"could not load {what} {source!r}: the Hugging Face Hub is unreachable (or offline "
            f"mode is set, HF_HUB_OFFLINE=1) and it is not in the local hub cache; {advice}. "
            f"Original error: {message}"
        )
    return OSError(f"could not load {what} {source!r} from the Hugging Face Hub: {message}")


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """Load a tokenizer with `AutoTokenizer`; pad_token falls back to eos_token when unset.

    Padding side is left as loaded: left padding for generation and right padding for training
    are the caller's choice.
    """
    source = resolve_source(name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as exc:
        if Path(source).exists():
            raise
        raise _hub_error(source, "tokenizer", exc) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer {source!r} has neither a pad token nor an eos token to use as one"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str | Path,
    dtype: torch.dtype | str = "float32",
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Load a causal LM with `AutoModelForCausalLM` in `dtype`, moved to `device`."""
    torch_dtype = parse_dtype(dtype)
    source = resolve_source(name_or_path)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        if Path(source).exists():
            raise
        raise _hub_error(source, "model", exc) from exc
    return model.to(torch.device(device))
