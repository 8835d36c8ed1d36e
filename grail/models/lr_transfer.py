"""The learning rate a run trains with under `train.lr_rule` (grail/models/lr_rules.py): the two
models' shapes read from their configs, the rule applied.

A model is named as `model.train_id` names it and resolved by the same code (`resolve_model`:
a preset is built once and cached, a local directory is read, a hub id is looked up in the hub
cache or fetched), but only its config.json is read: the hidden size and model_type from it,
the parameter count (the params rule only) from a local directory's safetensors headers or,
without them, from a model built on torch's meta device (shapes, no memory, no weights).
Importing this module is cheap; torch and transformers load when a rule is set.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from grail.core.choices import LrRule
from grail.core.config import ModelConfig, TrainConfig
from grail.core.errors import ConfigError
from grail.models.lr_rules import HIDDEN_EXPONENTS, LORA_OVER_FULL, ModelShape, lr_factor

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class LrTransfer:
    """train.lr (`stated_lr`, for `reference` fine-tuned in full) carried over to `model`."""

    rule: LrRule
    reference: str
    model: str
    reference_shape: ModelShape
    model_shape: ModelShape
    lora: bool
    stated_lr: float
    factor: float

    @property
    def lr(self) -> float:
        """What the optimizer is given (the warmup scales it, as it scales train.lr)."""
        return self.stated_lr * self.factor

    def record(self) -> dict[str, Any]:
        """As summary.json keeps it (`lr_rule`; grail/schemas/summary.schema.json)."""
        return {
            "rule": str(self.rule),
            "reference": self.reference,
            "stated_lr": self.stated_lr,
            "factor": self.factor,
            "lora": self.lora,
            "lr": self.lr,
        }

    def describe(self) -> str:
        """The one line a run logs at its start."""
        lora = f", x{LORA_OVER_FULL:g} for LoRA included" if self.lora else ""
        return (
            f"train.lr_rule={self.rule}: train.lr={self.stated_lr:g} is stated for "
            f"{self.reference} ({self.reference_shape.describe()}); on {self.model} "
            f"({self.model_shape.describe()}) x {self.factor:.6g}{lora}: effective lr "
            f"{self.lr:.6g}"
        )


def lr_transfer(train: TrainConfig, model: ModelConfig) -> LrTransfer | None:
    """The rule applied to train.lr; None for `none` (then nothing is read, and train.lr is used
    as given, bit for bit). ConfigError, naming the key, for a missing reference, a model that
    cannot be read, or a family the hidden rule has no exponent for."""
    rule = LrRule(train.lr_rule)
    if rule == LrRule.none:
        return None
    if train.lr_reference is None:
        raise ConfigError(
            f"train.lr_rule={rule} needs train.lr_reference: the model train.lr is stated for, "
            "fine-tuned in full (a preset such as tiny, a local directory or a hub id)"
        )
    count = rule == LrRule.params
    ref = model_shape(train.lr_reference, "train.lr_reference", count_parameters=count)
    own = model_shape(model.train_id, "model.train_id", count_parameters=count)
    if rule == LrRule.hidden:
        for key, name, shape in (
            ("train.lr_reference", train.lr_reference, ref),
            ("model.train_id", model.train_id, own),
        ):
            if shape.model_type not in HIDDEN_EXPONENTS:
                raise ConfigError(
                    f"train.lr_rule=hidden: {key}={name} is a {shape.model_type!r} model, a "
                    f"family the rule has no exponent for (known: {', '.join(HIDDEN_EXPONENTS)}); "
                    "use train.lr_rule=params"
                )
    return LrTransfer(
        rule=rule,
        reference=train.lr_reference,
        model=model.train_id,
        reference_shape=ref,
        model_shape=own,
        lora=model.lora.enabled,
        stated_lr=train.lr,
        factor=lr_factor(rule, own, ref, model.lora.enabled),
    )


def model_shape(model_id: str, key: str, *, count_parameters: bool) -> ModelShape:
    """model_type and hidden size (and, if asked, the parameter count) of the model `model_id`
    names, as `key` names it; ConfigError naming `key` when it cannot be read."""
    source = _source(model_id, key)
    config = _config(source, model_id, key)
    model_type = str(getattr(config, "model_type", "") or "unknown")
    hidden = getattr(config, "hidden_size", None)
    if hidden is None:  # multimodal configs keep the language model's under text_config
        hidden = getattr(getattr(config, "text_config", None), "hidden_size", None)
    if not isinstance(hidden, int) or hidden <= 0:
        raise ConfigError(f"{key}={model_id}: its config ({model_type}) has no hidden_size")
    parameters = _parameter_count(source, config, model_id, key) if count_parameters else None
    return ModelShape(model_type=model_type, hidden_size=hidden, parameters=parameters)


def _source(model_id: str, key: str) -> str:
    """A local directory or a hub id the hub (or its cache) can give, as the run's model is."""
    from grail.models.loading import check_hub_source, resolve_source
    from grail.models.tiny import resolve_model

    try:
        source = resolve_source(resolve_model(model_id))
        check_hub_source(source)
    except (OSError, ValueError) as exc:  # missing path, a file, an unreachable hub
        raise ConfigError(f"{key}: {exc}") from exc
    return source


def _config(source: str, model_id: str, key: str) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:  # no config.json, an unknown model_type
        raise ConfigError(f"{key}={model_id}: cannot read its config: {exc}") from exc


def _parameter_count(source: str, config: PretrainedConfig, model_id: str, key: str) -> int:
    """As tinker-cookbook counts (`get_full_finetune_param_count`): the shapes in the safetensors
    headers, each tensor once. A hub id's weights are not fetched for it, and a directory may
    hold none in safetensors: the model is then built from its config on the meta device."""
    shards = _safetensors_files(Path(source))
    if shards:
        shapes: dict[str, list[int]] = {}
        try:
            for shard in shards:
                shapes.update(_safetensors_shapes(shard))
        except (OSError, SafetensorError) as exc:
            raise ConfigError(f"{key}={model_id}: unreadable safetensors header: {exc}") from exc
        return sum(math.prod(shape) for shape in shapes.values())
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, ImportError) as exc:  # an architecture transformers lacks
        raise ConfigError(
            f"{key}={model_id}: cannot count its parameters from its config: {exc}"
        ) from exc
    return int(model.num_parameters())


def _safetensors_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files: the shards its index names, or model.safetensors."""
    if not directory.is_dir():
        return []
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    return [single] if single.is_file() else []


def _safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape from a safetensors file's header (safetensors reads the header and
    maps the file; no tensor's bytes are read)."""
    with safe_open(str(path), framework="numpy") as f:
        return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118


def check_lr_transfer(train: TrainConfig, model: ModelConfig) -> None:
    """The learning rate a transfer rule makes of train.lr (`lr_transfer`), held to train.lr's
    bound (grail.core.validate checks train.lr itself). Only with a rule set, as it
    reads both models' configs and loads transformers (a preset is built if not cached): the run
    needs them next anyway. Here, not in grail.core.validate, which sits below the models."""
    t = train
    if t.lr_rule == LrRule.none:
        return
    transfer = lr_transfer(t, model)
    assert transfer is not None  # a rule is set
    if not transfer.lr <= 1:  # AdamW steps each weight by ~lr: past 1 the weights are noise
        raise ConfigError(
            f"train.lr={t.lr} under train.lr_rule={t.lr_rule} (train.lr_reference="
            f"{t.lr_reference}) is an effective lr of {transfer.lr:.6g} on {model.train_id} "
            f"(x {transfer.factor:.6g}); it must be <= 1"
        )
