"""Iteration 0's rollouts shared by the runs of a study (grail/rollouts/shared.py): what the key
covers, the store's round trip and its recovery from a bad file, and, end to end, a run that
loads the stored batch recording the same metrics, bit for bit, as one that generated it."""

from __future__ import annotations

import json
import logging
import random
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers.grail_process import finish, train_process
from helpers.samples import awkward_sample

from grail.core.config import Config, DataConfig, GenerationConfig, TrainConfig
from grail.core.records import read_metrics, validate_metrics
from grail.envs import make_env
from grail.rollouts.batch import GeneratedBatch, Group, Resampling, RolloutBatch
from grail.rollouts.server import iteration_seeds
from grail.rollouts.shared import SharedRollouts, identity, rollout_key, weights_digest
from grail.train.components import rollout_settings

# ---- the key --------------------------------------------------------------------------------


def _config(**sections: Any) -> Config:
    base = Config(
        data=DataConfig(environment="copy_digits", problems_per_iteration=3, rollouts_per_problem=4)
    )
    return replace(base, **sections)


def _server(**changes: Any) -> Any:
    """What `identity` reads of a ServerManager."""
    fields = {"kind": "builtin", "device": "cpu", "dtype": None, "threads": 1, "extra_args": []}
    return SimpleNamespace(**{**fields, **changes})


def _weights(directory: Path, content: bytes = b"weights") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.safetensors").write_bytes(content)
    (directory / "tokenizer.json").write_text('{"vocab": {}}')
    return directory


def _key(cfg: Config, weights: Path, server: Any = None) -> str:
    return rollout_key(
        identity(rollout_settings(cfg), weights_digest(weights), server or _server())
    )


def test_key_changes_with_what_determines_the_batch(tmp_path: Path) -> None:
    weights = _weights(tmp_path / "w")
    cfg = _config()
    base = _key(cfg, weights)
    assert base == _key(_config(), _weights(tmp_path / "same"))  # the same files elsewhere
    changed = {
        "seed": _key(replace(cfg, seed=1), weights),
        "temperature": _key(replace(cfg, generation=GenerationConfig(temperature=0.7)), weights),
        "env_kwargs": _key(
            replace(cfg, data=replace(cfg.data, env_kwargs={"num_digits": 2})), weights
        ),
        "rollouts_per_problem": _key(
            replace(cfg, data=replace(cfg.data, rollouts_per_problem=8)), weights
        ),
        "rewards": _key(
            replace(cfg, data=replace(cfg.data, rewards=[{"fn": "strict_format"}])), weights
        ),
        "initial weights": _key(cfg, _weights(tmp_path / "other", b"weights2")),
        "server threads": _key(cfg, weights, _server(threads=2)),
        "server dtype": _key(cfg, weights, _server(dtype="bfloat16")),
    }
    tokenizer_changed = _weights(tmp_path / "tok")
    (tokenizer_changed / "chat_template.jinja").write_text("{{ messages }}")
    changed["tokenizer"] = _key(cfg, tokenizer_changed)
    for what, key in changed.items():
        assert key != base, f"the key should change with {what}"
    assert len(set(changed.values())) == len(changed)


def test_key_ignores_what_leaves_the_batch_alone(tmp_path: Path) -> None:
    weights = _weights(tmp_path / "w")
    cfg = _config()
    base = _key(cfg, weights)
    same = [
        replace(cfg, train=TrainConfig(lr=3e-4)),
        replace(cfg, train=TrainConfig(kl_coef=0.05)),
        replace(cfg, train=TrainConfig(scale_rewards="batch", pipeline=True, iterations=3)),
        replace(cfg, study_dir=str(tmp_path), resume=True),
        replace(cfg, generation=GenerationConfig(request_timeout_s=5.0, max_restarts=0)),
        replace(cfg, data=replace(cfg.data, reuse_initial_rollouts=False)),
    ]
    for other in same:
        assert _key(other, weights) == base, other
    # which GPU a sweep job's server got does not count, which kind of device does
    assert _key(cfg, weights, _server(device="cuda:0")) == _key(
        cfg, weights, _server(device="cuda:1")
    )
    assert _key(cfg, weights, _server(device="cuda:0")) != base


# ---- the store ------------------------------------------------------------------------------


class CharTokenizer:
    """Just what `render_prompt_ids` asks of a tokenizer."""

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        return [ord(c) for m in messages for c in m["content"]]


def _generated(cfg: Config, env: Any, tokenizer: Any) -> GeneratedBatch:
    """Iteration 0's seeds with made-up samples: floats with every bit set, a -inf log-probability,
    text that JSON must escape."""
    rng = random.Random(0)
    groups = []
    for seed in iteration_seeds(cfg.data, 0):
        problem = env.problem(seed)
        samples = [awkward_sample(rng) for _ in range(cfg.data.rollouts_per_problem)]
        prompt_ids = CharTokenizer().apply_chat_template(problem.prompt_messages)
        groups.append(Group(problem, prompt_ids, samples))
    return GeneratedBatch(RolloutBatch(groups), 0, 1.5, 0.0, 1.5)


def _store(cfg: Config, study: Path) -> SharedRollouts:
    return SharedRollouts(cfg.data, study, {"format": 1, "test": True})


def _stored_file(study: Path) -> Path:
    (path,) = (study / "rollouts").glob("*.json")
    return path


def _never() -> GeneratedBatch:
    raise AssertionError("the stored batch should have been loaded, not generated")


def test_a_stored_batch_loads_exactly_whatever_this_run_scales_rewards_by(tmp_path: Path) -> None:
    cfg, env, tok = _config(), make_env("copy_digits"), CharTokenizer()
    seeds = iteration_seeds(cfg.data, 0)
    original = _generated(cfg, env, tok)
    first = _store(cfg, tmp_path).get(lambda: original, env, tok, seeds)
    assert first is original and first.reused is None
    assert json.loads(_stored_file(tmp_path).read_text())["generation_s"] == 1.5

    loaded = _store(cfg, tmp_path).get(_never, env, tok, seeds)
    assert loaded.batch.groups == original.batch.groups  # every float to the bit
    assert loaded.reused is not None and loaded.reused.generation_s == 1.5
    assert loaded.policy_version == 0 and loaded.generation_s < 1.5

    # Rewards only: the loading run's trainer computes advantages with its own
    # train.scale_rewards (grail/train/trainer.py), so a run that scales otherwise shares it.
    other = replace(cfg, train=TrainConfig(scale_rewards="none"))
    again = _store(other, tmp_path).get(_never, env, tok, seeds)
    assert again.batch.groups == _generated(cfg, env, tok).batch.groups
    assert all(s.advantage == 0.0 for s in again.batch.samples)


def test_a_dynamic_sampling_batch_keeps_what_resampling_did(tmp_path: Path) -> None:
    base, env, tok = _config(), make_env("copy_digits"), CharTokenizer()
    cfg = replace(base, data=replace(base.data, dynamic_sampling=True))
    original = _generated(cfg, env, tok)
    original.resampling = Resampling(
        extra_rounds=2, generated_groups=7, dropped_groups=4, kept_groups=3
    )
    _store(cfg, tmp_path).get(lambda: original, env, tok, iteration_seeds(cfg.data, 0))
    loaded = _store(cfg, tmp_path).get(_never, env, tok, iteration_seeds(cfg.data, 0))
    assert loaded.resampling == original.resampling
    assert loaded.batch.groups == original.batch.groups


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],  # cut short
        lambda text: "[]",
        lambda text: text.replace('"prompt_ids":[', '"prompt_ids":[1,', 1),  # not the prompt
        lambda text: text.replace('"success":', '"success":0,"x":', 1),  # wrong type
        lambda text: text.replace('"key":"', '"key":"0', 1),
    ],
    ids=["truncated", "not-an-object", "other-prompt", "bad-field", "other-key"],
)
def test_a_bad_store_file_is_ignored_and_generated_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: Any
) -> None:
    cfg, env, tok = _config(), make_env("copy_digits"), CharTokenizer()
    seeds = iteration_seeds(cfg.data, 0)
    original = _generated(cfg, env, tok)
    _store(cfg, tmp_path).get(lambda: original, env, tok, seeds)
    path = _stored_file(tmp_path)
    good = path.read_text()
    path.write_text(damage(good))

    calls = []

    def generate() -> GeneratedBatch:
        calls.append(1)
        return original

    with caplog.at_level(logging.WARNING, logger="grail.rollouts.shared"):
        batch = _store(cfg, tmp_path).get(generate, env, tok, seeds)
    assert calls == [1] and batch is original
    assert "ignoring stored rollouts" in caplog.text
    assert path.read_text() == good  # stored anew
    assert not list(path.parent.glob("*.tmp"))


# ---- end to end -----------------------------------------------------------------------------

# Differ between runs of one config, or say how a run got its rollouts: not metrics.
VOLATILE = {
    "timings",
    "tokens_per_s",
    "eval_s",
    "wall_time_s",
    "train_time_s",
    "config",
    "parts",
    "rollouts_reused",
}


def _metrics(run_dir: Path) -> dict[str, dict[str, Any]]:
    files = [*sorted((run_dir / "metrics").glob("*.json")), run_dir / "summary.json"]
    return {p.name: {k: v for k, v in read_metrics(p).items() if k not in VOLATILE} for p in files}


def test_a_run_reusing_iteration_0_records_what_generating_it_would(tmp_path: Path) -> None:
    """A study's first run stores iteration 0's batch; a run of it with another learning rate,
    reward scaling and pipelining loads it and records the same metrics, bit for bit, as the
    same run with reuse off."""
    study = tmp_path / "study"
    common = ["train.iterations=2", f"study_dir={study}"]
    other = ["train.lr=1e-2", "train.scale_rewards=batch", "train.pipeline=true"]
    first = train_process(tmp_path / "first", *common)
    reference = train_process(
        tmp_path / "reference", *common, *other, "data.reuse_initial_rollouts=false"
    )
    out = finish(first)
    assert (tmp_path / "first" / "summary.json").exists(), out[-3000:]
    out = finish(reference)
    assert (tmp_path / "reference" / "summary.json").exists(), out[-3000:]
    (stored,) = (study / "rollouts").glob("*.json")
    out = finish(train_process(tmp_path / "reusing", *common, *other))
    assert (tmp_path / "reusing" / "summary.json").exists(), out[-3000:]

    first_record = read_metrics(tmp_path / "first" / "metrics" / "train_iter_000.json")
    assert "rollouts_reused" not in first_record and first_record["tokens_per_s"] > 0
    record = read_metrics(tmp_path / "reusing" / "metrics" / "train_iter_000.json")
    validate_metrics(record, "train_iteration")
    assert record["rollouts_reused"]["key"] == stored.stem
    assert record["tokens_per_s"] is None
    assert record["timings"]["generation_s"] < first_record["timings"]["generation_s"]
    later = read_metrics(tmp_path / "reusing" / "metrics" / "train_iter_001.json")
    assert "rollouts_reused" not in later and later["tokens_per_s"] > 0
    ref_record = read_metrics(tmp_path / "reference" / "metrics" / "train_iter_000.json")
    assert "rollouts_reused" not in ref_record

    assert _metrics(tmp_path / "reusing") == _metrics(tmp_path / "reference")
