"""Configuration: composed by Hydra against the typed schema; bad values fail naming the key."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core import placement as placement_module
from grail.core.config import Config
from grail.core.errors import ConfigError
from grail.core.placement import body_parameters, cpu_threads, gpu_placement, split_cores
from grail.core.validate import validate
from grail.models.tiny import ensure_tiny_model
from grail.train.cli import CONF_DIR


def _compose(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=list(overrides))
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def test_default_config_composes_and_validates() -> None:
    cfg = _compose()
    assert isinstance(cfg, Config)
    assert cfg.data.environment == "copy_digits" and cfg.generation.backend == "builtin"
    validate(cfg)


def test_cpu_threads_trainer_takes_all_cores_only_when_the_server_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert split_cores(8, pipelined=False) == (8, 4)  # sync: generation and training take turns
    assert split_cores(8, pipelined=True) == (4, 4)  # pipelined: both compute at once
    assert split_cores(1, pipelined=True) == split_cores(1, pipelined=False) == (1, 1)
    monkeypatch.setattr(placement_module, "available_cores", lambda: 6)
    off = "reproducible=false"
    assert _threads(off) == (6, 3)
    assert _threads(off, "train.pipeline=true") == (3, 3)
    # an explicit choice wins, each side on its own
    assert _threads(off, "train.threads=2") == (2, 3)
    assert _threads(off, "generation.server_threads=5", "train.pipeline=true") == (3, 5)
    # reproducible (the default): one thread each whatever the cores, explicit values still win
    on = "reproducible=true"
    assert _threads() == _threads(on)
    assert _threads(on) == _threads(on, "train.pipeline=true") == (1, 1)
    monkeypatch.setattr(placement_module, "available_cores", lambda: 64)
    assert _threads(on) == (1, 1)
    assert _threads(on, "train.threads=4") == (4, 1)


def test_in_sync_mode_the_server_takes_every_core_for_a_model_large_enough_to_gain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The server's decode gains from threads only past ~1M body parameters (docs/benchmarks.md).
    assert split_cores(8, pipelined=False, server_scales=True) == (8, 8)
    assert split_cores(8, pipelined=True, server_scales=True) == (4, 4)  # both compute at once
    monkeypatch.setattr(placement_module, "available_cores", lambda: 6)
    large = tmp_path / "large"
    large.mkdir()
    shape = {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6}
    (large / "config.json").write_text(json.dumps({**shape, "num_key_value_heads": 2}))
    assert body_parameters(large) == 6 * (2 * 384 * 384 + 2 * 384 * 128 + 3 * 384 * 1536)

    def threads(model_dir: Path | None, pipelined: bool = False) -> tuple[int, int]:
        return cpu_threads(None, None, pipelined=pipelined, model_dir=model_dir)

    assert threads(large) == (6, 6)
    assert threads(large, pipelined=True) == (3, 3)
    assert threads(ensure_tiny_model()) == (6, 3)  # 0.1M parameters: more threads lose
    assert threads(None) == (6, 3)
    assert body_parameters(tmp_path / "missing") is None
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"d_model": 512}')  # another architecture's keys
    assert threads(tmp_path / "odd") == (6, 3)
    assert cpu_threads(None, 2, pipelined=False, model_dir=large) == (6, 2)  # explicit wins


def _threads(*overrides: str) -> tuple[int, int]:
    cfg = _compose(*overrides)
    return cpu_threads(
        cfg.train.threads,
        cfg.generation.server_threads,
        pipelined=cfg.train.pipeline,
        reproducible=cfg.reproducible,
    )


@pytest.mark.parametrize(
    "group",
    [
        "env=sat",
        "env=gsm8k",
        "model=qwen2.5-1.5b",
        "model=qwen2.5-7b",
        "generation=vllm",
        "generation=sglang",
    ],
)
def test_config_groups_compose(group: str) -> None:
    validate(_compose(group))


REPO = Path(CONF_DIR).parent
# GROUP=OPTION as a command line writes it: not a key's tail (data.env=, train_id=), nor a
# placeholder (`env=<multi-turn env>`, `+prune=...`); a sweep lists options with commas.
GROUP_OPTION = re.compile(
    r"(?<![\w.$/-])(\+?prune|model|env|generation|hydra/launcher|hydra/sweeper)=([\w.,-]+)"
)
# Named on purpose although they do not exist: an error's example, an option that was removed.
NOT_PRESETS = {"env=doesnotexist", "+prune=median", "model=ctx.model"}  # the last: a keyword


def test_every_config_group_option_the_docs_name_exists() -> None:
    """`model=qwen2.5-7b` in the README's multi-GPU example named no preset; a user copying it got
    Hydra's "Could not find 'model/qwen2.5-7b'". Every GROUP=OPTION in README.md, docs/*.md and
    conf/ (its comments, --help's text) names a file of conf/GROUP/ (hydra/launcher and
    hydra/sweeper: conf/hydra/launcher/ and conf/hydra/sweeper/)."""
    conf = Path(CONF_DIR)
    files = [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted(conf.rglob("*.yaml")),
    ]
    missing, seen = [], set()
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for match in GROUP_OPTION.finditer(line):
                group = match[1].removeprefix("+")
                for option in match[2].rstrip(".,").split(","):
                    named = f"{match[1]}={option}"
                    seen.add(named)
                    if (
                        option
                        and named not in NOT_PRESETS
                        and not (conf / group / f"{option}.yaml").is_file()
                    ):
                        missing.append(f"{path.relative_to(REPO)}:{number}: {named}")
    assert not missing, "options with no conf/ file:\n" + "\n".join(missing)
    # the scan finds what the docs do name (a regex that matched nothing would pass as well)
    assert {"model=qwen2.5-7b", "env=sat", "generation=vllm", "hydra/sweeper=grail_race"} <= seen


def test_unknown_key_names_the_key() -> None:
    with pytest.raises(Exception, match="lerning_rate"):
        _compose("train.lerning_rate=1e-4")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("+train.lrr=1e-3", r"unknown config key train\.lrr \(did you mean train\.lr\?\)"),
        ("++train.lrr=1e-3", r"unknown config key train\.lrr \(did you mean train\.lr\?\)"),
        ("+seeed=1", r"unknown config key seeed \(did you mean seed\?\)"),
        ("+eval.zzz=1", r"unknown config key eval\.zzz \(eval has: enabled, interval"),
    ],
)
def test_a_key_added_with_plus_is_refused(override: str, message: str) -> None:
    # Hydra's + and ++ add a key even to a structured node, and OmegaConf.to_object keeps it as a
    # plain attribute that nothing reads: validate must refuse it.
    cfg = _compose(override)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        (["env=gsm8k", "data.env_kwargs.path=/data/gsm8k.jsonl"], "path", "/data/gsm8k.jsonl"),
        (["env=sat", "data.env_kwargs.difficulty=0.9"], "difficulty", 0.9),
        (["data.env_kwargs.num_digits=2"], "num_digits", 2),
    ],
)
def test_env_kwargs_are_set_without_plus(overrides: list[str], key: str, value: object) -> None:
    cfg = _compose(*overrides)
    validate(cfg)
    assert cfg.data.env_kwargs[key] == value


def test_wrong_type_names_the_key() -> None:
    with pytest.raises(Exception, match="iterations"):
        _compose("train.iterations=many")


@pytest.mark.parametrize(
    "override,key",
    [
        ("data.rollouts_per_problem=1", "data.rollouts_per_problem"),
        ("eval.id_seed_start=10", "eval.id_seed_start"),
        ("gpu.strategy=multi gpu.server_gpu=1 gpu.training_gpu=1", "gpu.server_gpu"),
        ("eval.report_ks=[1,64]", "eval.report_ks"),
        ("generation.temperature=0", "generation.temperature"),
        ("generation.start_timeout_s=0", "generation.start_timeout_s"),
        ("train.epsilon_high=0.1", "train.epsilon_high"),
        ("train.micro_batch_tokens=-1", "train.micro_batch_tokens"),
        ("train.is_clip_min=3 train.is_clip_max=2", "train.is_clip_min"),
        ("train.kl_target=0.04", "train.kl_coef"),  # adaptive KL starts from kl_coef > 0
        ("train.kl_target=0.04 train.kl_coef=0.1 train.kl_adapt_rate=1", "train.kl_adapt_rate"),
    ],
)
def test_impossible_combinations_name_the_key(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(_compose(*override.split()))


@pytest.mark.parametrize(
    "override",
    [
        "train.lr=inf",
        "train.weight_decay=inf",
        "train.kl_coef=nan",
        "train.kl_coef=inf",
        "train.entropy_coef=inf",
        "train.epsilon=inf",
        "generation.temperature=inf",
        "train.grad_clip=-inf",
        "train.is_clip_max=nan",
        "generation.request_timeout_s=inf",
    ],
)
def test_a_non_finite_float_is_refused_naming_the_key(override: str) -> None:
    """inf passes `> 0`: these trained an iteration and crashed writing its metrics, or failed
    in the sampler, before validation checked every float for finiteness."""
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')} must be a finite number"):
        validate(_compose(override))


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=1e308", r"train\.lr must be <= 1"),
        ("train.weight_decay=-0.1", r"train\.weight_decay must be >= 0"),
        ("train.grad_clip=0", r"train\.grad_clip must be > 0"),
        ("generation.request_timeout_s=0", r"generation\.request_timeout_s must be > 0"),
    ],
)
def test_a_float_out_of_its_range_is_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate(_compose(override))


CHOICES_OUTSIDE_THEIR_ENUM = [
    ("train.loss_type", "ppo"),
    ("generation.backend", "tgi"),
    ("train.is_correction", "token"),
]


@pytest.mark.parametrize("key,value", CHOICES_OUTSIDE_THEIR_ENUM)
def test_a_choice_outside_its_enum_fails_composition_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(Exception) as err:
        _compose(f"{key}={value}")
    message = f"{err.value} {err.value.__cause__}"
    assert key in message and "expected one of" in message


@pytest.mark.parametrize("key,value", CHOICES_OUTSIDE_THEIR_ENUM)
def test_a_choice_set_in_code_is_checked_by_validate(key: str, value: str) -> None:
    cfg = _compose()
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_the_removed_tis_cap_names_the_keys_that_replace_it() -> None:
    with pytest.raises(ConfigError) as err:
        validate(_compose("train.tis_cap=1.5"))
    assert "train.is_correction=token_truncate train.is_clip_max=1.5" in str(err.value)


@pytest.mark.parametrize(
    "overrides,placement",
    [
        ([], (0, 0)),
        (["gpu.server_gpu=2"], (2, 2)),  # single: the trainer follows the server's GPU
        (["gpu.training_gpu=3"], (3, 3)),
        (["gpu.strategy=multi"], (0, 1)),
        (["gpu.strategy=multi", "gpu.server_gpu=1"], (1, 0)),
        (["gpu.strategy=multi", "gpu.training_gpu=0"], (1, 0)),
        (["gpu.strategy=multi", "gpu.server_gpu=2", "gpu.training_gpu=5"], (2, 5)),
    ],
)
def test_unset_gpus_are_placed_by_the_strategy(
    overrides: list[str], placement: tuple[int, int]
) -> None:
    cfg = _compose(*overrides)
    validate(cfg)
    assert gpu_placement(cfg.gpu) == placement


def test_logging_backends_are_accepted() -> None:
    # A missing backend package fails later, in MetricLoggers.from_config (tests/test_loggers.py).
    cfg = _compose("logging.tensorboard=true", "logging.wandb=true", "logging.wandb_project=p")
    validate(cfg)
    assert cfg.logging.tensorboard and cfg.logging.wandb and cfg.logging.wandb_project == "p"


@pytest.mark.parametrize(
    "override,key", [("data.rollouts_per_problem=1", "data.rollouts_per_problem"),
                     ("train.lr=inf", "train.lr")],
)  # fmt: skip
def test_cli_rejects_bad_config_before_loading_anything(
    tmp_path: Path, override: str, key: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "grail.train.cli", override, f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert key in result.stdout + result.stderr
    assert not (tmp_path / "weights").exists()


def test_a_hub_model_the_hub_cannot_give_fails_at_once_in_one_line(tmp_path: Path) -> None:
    """Without the hub (here: an endpoint whose name never resolves, RFC 2606), a hub id that
    is not cached stopped the run only after about a minute of transformers' retries, after
    start-up."""
    import os
    import time

    env = {**os.environ, "HF_ENDPOINT": "http://hub.invalid", "HF_HOME": str(tmp_path / "hf")}
    t0 = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "grail.train.cli", "model.train_id=someorg/not-cached",
         f"hydra.run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    elapsed = time.perf_counter() - t0
    assert result.returncode == 2, result.stderr[-2000:]
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "model.train_id" in errors[0] and "unreachable" in errors[0]
    assert "Traceback" not in output
    assert elapsed < 45, elapsed  # imports + a 5 s probe; the retries took ~60 s
