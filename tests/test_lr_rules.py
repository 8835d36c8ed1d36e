"""Transfer rules (train.lr_rule, train.lr_reference; grail/models/lr_rules.py and
lr_transfer.py): the formulas against their sources, the errors that name the key, and one real
run on tiny-wide whose records, summary and log carry the lr the rule makes of train.lr."""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import pytest
from helpers.short_runs import one_iteration, short_config
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoConfig, GPT2Config

from grail.core.choices import LrRule
from grail.core.config import Config, ModelConfig, TrainConfig
from grail.core.errors import ConfigError
from grail.core.validate import validate
from grail.models.lr_rules import (
    LORA_OVER_FULL,
    ModelShape,
    UnknownFamily,
    hidden_multiplier,
    lr_factor,
    params_multiplier,
)
from grail.models.lr_transfer import (
    _parameter_count,
    check_lr_transfer,
    lr_transfer,
    model_shape,
)
from grail.models.tiny import ensure_tiny_model
from grail.train.cli import CONF_DIR
from grail.train.trainer import lr_multiplier

QWEN_64 = ModelShape("qwen2", 64, 156_224)
QWEN_128 = ModelShape("qwen2", 128, 558_208)


def test_the_hidden_rule_is_tinkers_former_formula() -> None:
    # Twice the width: (2000/H)^p falls by 2^p, p = 0.0775 for Qwen.
    assert hidden_multiplier(64, "qwen2") / hidden_multiplier(128, "qwen2") == pytest.approx(
        2**0.0775, rel=1e-12
    )
    assert lr_factor(LrRule.hidden, QWEN_128, QWEN_64, lora=False) == pytest.approx(
        2**-0.0775, rel=1e-12
    )
    for family in ("qwen3", "qwen2_moe", "qwen3_moe"):
        assert hidden_multiplier(128, family) == hidden_multiplier(128, "qwen2")
    # Llama's exponent, 0.781: Llama-3.2-1B (hidden 2048) to Llama-3.1-8B (4096)
    small, large = ModelShape("llama", 2048), ModelShape("llama", 4096)
    assert lr_factor(LrRule.hidden, large, small, lora=False) == pytest.approx(2**-0.781)
    with pytest.raises(UnknownFamily, match="'gpt2'.*known families: qwen2, .*llama"):
        hidden_multiplier(768, "gpt2")


def test_the_params_rule_and_the_lora_factor() -> None:
    assert params_multiplier(10_000) == 0.01
    factor = lr_factor(LrRule.params, QWEN_128, QWEN_64, lora=False)
    assert factor == pytest.approx(math.sqrt(156_224 / 558_208), rel=1e-12)
    assert lr_factor(LrRule.params, QWEN_128, QWEN_64, lora=True) == pytest.approx(10 * factor)
    assert LORA_OVER_FULL == 10.0
    # The reference itself: exactly 1 (x 10 under LoRA); no rule: 1 whatever the run
    for rule in (LrRule.hidden, LrRule.params):
        assert lr_factor(rule, QWEN_64, QWEN_64, lora=False) == 1.0
        assert lr_factor(rule, QWEN_64, QWEN_64, lora=True) == 10.0
    assert lr_factor(LrRule.none, QWEN_128, QWEN_64, lora=True) == 1.0


def test_the_tiny_presets_shapes_are_read_from_their_configs(tmp_path: Path) -> None:
    shape = model_shape("tiny-wide", "model.train_id", count_parameters=True)
    assert shape == QWEN_128
    assert model_shape("tiny", "train.lr_reference", count_parameters=False).parameters is None
    # The count from a model built on the meta device from config.json alone (a hub id's way)
    # is the safetensors headers' (a local directory's, as tinker-cookbook counts).
    bare = tmp_path / "config-only"
    bare.mkdir()
    shutil.copy(ensure_tiny_model(name="tiny-wide") / "config.json", bare)
    config = AutoConfig.from_pretrained(bare)
    assert _parameter_count(str(bare), config, "bare", "model.train_id") == QWEN_128.parameters


def test_no_rule_reads_nothing_and_keeps_train_lr() -> None:
    # lr_reference is ignored without a rule (a sweep over train.lr_rule=none,hidden keeps it set)
    train = TrainConfig(lr=5e-3, lr_reference="/no/such/model")
    assert lr_transfer(train, ModelConfig(train_id="/no/such/model/either")) is None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.lr_rule=hidden"], r"train\.lr_rule=hidden needs train\.lr_reference"),
        (["train.lr_rule=params"], r"train\.lr_rule=params needs train\.lr_reference"),
        (
            ["train.lr_rule=hidden", "train.lr_reference=/no/such/model"],
            r"train\.lr_reference: model path '/no/such/model' does not exist",
        ),
        (  # 0.5 stated for full fine-tuning is 5 under LoRA
            [
                "train.lr=0.5",
                "train.lr_rule=hidden",
                "train.lr_reference=tiny",
                "model.lora.enabled=true",
            ],
            r"train\.lr=0\.5 under train\.lr_rule=hidden .* effective lr of 5 on tiny .*<= 1",
        ),
    ],
)
def test_a_rule_that_cannot_apply_is_refused_naming_the_key(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _checked(_composed(*overrides))


def test_a_family_the_hidden_rule_does_not_know_is_named(tmp_path: Path) -> None:
    GPT2Config(n_embd=64, n_layer=1, n_head=2).save_pretrained(tmp_path)
    bad = _composed("train.lr_rule=hidden", f"train.lr_reference={tmp_path}")
    with pytest.raises(ConfigError, match=r"train\.lr_reference=.* 'gpt2' model.*known: qwen2"):
        _checked(bad)


def _checked(cfg: Config) -> None:
    """What grail-train checks before anything loads (grail/train/launch.py)."""
    validate(cfg)
    check_lr_transfer(cfg.train, cfg.model)


def _composed(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_a_run_on_tiny_wide_trains_with_the_lr_stated_for_tiny(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    overrides = ("model=tiny-wide", "train.lr_rule=hidden", "train.lr_reference=tiny")
    stated = short_config(*overrides).train
    expected = stated.lr * (2000 / 128) ** 0.0775 / (2000 / 64) ** 0.0775
    with caplog.at_level(logging.INFO, logger="grail.train"):
        records = one_iteration(tmp_path, *overrides)
    warmup = lr_multiplier(0, stated.warmup_steps)
    assert records[0]["lr"] == pytest.approx(expected * warmup, rel=1e-12)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["config"]["train"]["lr"] == stated.lr  # what the user stated, kept
    assert summary["lr_rule"] == {
        "rule": "hidden",
        "reference": "tiny",
        "stated_lr": stated.lr,
        "factor": pytest.approx(2**-0.0775, rel=1e-12),
        "lora": False,
        "lr": pytest.approx(expected, rel=1e-12),
    }
    lines = [r.getMessage() for r in caplog.records if "train.lr_rule=" in r.getMessage()]
    assert lines == [
        f"train.lr_rule=hidden: train.lr={stated.lr:g} is stated for tiny (qwen2, hidden 64); "
        f"on tiny-wide (qwen2, hidden 128) x {2**-0.0775:.6g}: effective lr {expected:.6g}"
    ]
