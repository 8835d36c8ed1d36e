"""Load HF causal LMs and tokenizers; build the tiny offline Qwen2 model and its tokenizer."""

from grail.models.loading import load_model, load_tokenizer, parse_dtype, resolve_source
from grail.models.tiny import (
    BUILDER_VERSION,
    TINY_PRESET,
    build_random_qwen2,
    build_tiny_model,
    build_tokenizer,
    ensure_tiny_model,
)

__all__ = [
    "BUILDER_VERSION",
    "TINY_PRESET",
    "build_random_qwen2",
    "build_tiny_model",
    "build_tokenizer",
    "ensure_tiny_model",
    "load_model",
    "load_tokenizer",
    "parse_dtype",
    "resolve_source",
]
