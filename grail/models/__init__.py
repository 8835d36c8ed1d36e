"""Load HF causal LMs and tokenizers (loading.py); build the tiny offline Qwen2 model and its
tokenizer (tiny.py); LoRA (lora.py); packed attention (packed_attention.py).

Nothing is imported here: the submodules import torch and transformers (~4.5 s on a 2-core CPU),
which a command that only checks its configuration must not pay (a misspelt key answered in ~7 s
before, measured with `time uv run grail-train train.lr=inf`).
"""

#: The model name `grail-train` (`model.train_id`) and `grail-serve --model` give the tiny model.
TINY_MODEL_NAME = "tiny"
#: Every offline model of the tiny family by name (grail/models/tiny.py TINY_PRESETS): the same
#: tokenizer, depth and head size at other widths, for studies whose cheap fidelity is a
#: narrower model of the family (docs/transfer.md).
TINY_MODEL_NAMES = (TINY_MODEL_NAME, "tiny-wide")
