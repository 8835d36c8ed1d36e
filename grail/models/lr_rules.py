"""Transfer rules: a learning rate stated for one model (the reference, fine-tuned in full) carried
over to another, so that a study's answer on a cheap model is stated in units that hold on an
expensive one (docs/transfer.md "Transfer rules"). Pure arithmetic; reading a model's shape from
its config is grail/models/lr_transfer.py's.

    effective lr = train.lr x m(model) / m(reference) x (LORA_OVER_FULL if LoRA)

Only ratios of m are used, so each rule's constant factors (Tinker's base rate 5e-5, say) cancel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grail.core.choices import LrRule

# `hidden`: m = (2000 / hidden_size) ** p, p per model family. Tinker's former formula,
# LR = 5e-5 x M_LoRA x (2000 / H) ** P with P = 0.781 for Llama and 0.0775 for Qwen
# (tinker-cookbook tinker_cookbook/hyperparam_utils.py `get_lr`, before it became a table of
# swept rates; Tinker docs, supervised-learning/sl-hyperparams). Tinker chose P by "llama" or
# "qwen" in the model's name; here by its config's model_type, which a local directory has too.
HIDDEN_BASE = 2000
QWEN_EXPONENT = 0.0775
LLAMA_EXPONENT = 0.781
HIDDEN_EXPONENTS: dict[str, float] = {
    "qwen2": QWEN_EXPONENT,
    "qwen2_moe": QWEN_EXPONENT,
    "qwen3": QWEN_EXPONENT,
    "qwen3_moe": QWEN_EXPONENT,
    "llama": LLAMA_EXPONENT,
}

# LoRA's learning rate over full fine-tuning's: tinker-cookbook's
# `get_lora_lr_over_full_finetune_lr` returns 10 for every model, found "more accurate
# empirically" than its earlier formula ("LoRA Without Regret", Thinking Machines blog,
# https://thinkingmachines.ai/blog/lora/).
LORA_OVER_FULL = 10.0


class UnknownFamily(ValueError):
    """The hidden rule has no exponent for this model_type."""

    def __init__(self, model_type: str) -> None:
        self.model_type = model_type
        super().__init__(
            f"no hidden-size exponent for model_type {model_type!r}; known families: "
            f"{', '.join(HIDDEN_EXPONENTS)}"
        )


@dataclass(frozen=True)
class ModelShape:
    """What the rules read of a model. `parameters` is None when not counted: only the params
    rule needs it, and counting can fail where reading hidden_size does not."""

    model_type: str
    hidden_size: int
    parameters: int | None = None

    def describe(self) -> str:
        counted = "" if self.parameters is None else f", {self.parameters:,} parameters"
        return f"{self.model_type}, hidden {self.hidden_size}{counted}"


def hidden_multiplier(hidden_size: int, model_type: str) -> float:
    """Tinker's former (2000 / H) ** P (see HIDDEN_EXPONENTS)."""
    if model_type not in HIDDEN_EXPONENTS:
        raise UnknownFamily(model_type)
    if hidden_size <= 0:
        raise ValueError(f"hidden_size must be > 0, got {hidden_size}")
    return (HIDDEN_BASE / hidden_size) ** HIDDEN_EXPONENTS[model_type]


def params_multiplier(parameters: int) -> float:
    """1 / sqrt(parameter count): tinker-cookbook's `get_full_finetune_lr_multiplier` (its count
    sums the shapes in the checkpoint's safetensors headers, tied weights once)."""
    if parameters <= 0:
        raise ValueError(f"parameter count must be > 0, got {parameters}")
    return 1.0 / math.sqrt(parameters)


def multiplier(rule: LrRule, shape: ModelShape) -> float:
    """m(model) under `rule` (not `none`, which has no m)."""
    if rule == LrRule.hidden:
        return hidden_multiplier(shape.hidden_size, shape.model_type)
    if rule == LrRule.params:
        if shape.parameters is None:
            raise ValueError("the params rule needs the parameter count")
        return params_multiplier(shape.parameters)
    raise ValueError(f"lr rule {rule!r} has no multiplier")


def lr_factor(rule: LrRule, model: ModelShape, reference: ModelShape, lora: bool) -> float:
    """What train.lr is multiplied by: m(model) / m(reference), x LORA_OVER_FULL under LoRA (the
    reference's rate is full fine-tuning's). 1 for `none`, LoRA or not: the rate as given."""
    if rule == LrRule.none:
        return 1.0
    factor = multiplier(rule, model) / multiplier(rule, reference)
    return factor * LORA_OVER_FULL if lora else factor
