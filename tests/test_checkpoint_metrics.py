"""Checkpoints and metrics files: atomic, complete or absent, schema-checked."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
import torch

from grail.records import atomic_write_text, validate_metrics, write_metrics
from grail.train.checkpoint import (
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    set_rng_state,
    stage_checkpoint,
)


class _Saves:
    """Stands in for a model/tokenizer: anything with save_pretrained(dir)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, path: Path, **_: object) -> None:
        (Path(path) / f"{self.name}.json").write_text("{}")


def test_staged_checkpoint_is_invisible_until_committed(tmp_path: Path) -> None:
    staged = stage_checkpoint(tmp_path, 3, _Saves("model"), _Saves("tok"), {"optimizer": {}})
    assert latest_checkpoint(tmp_path) is None  # a run killed here resumes from nothing newer
    final = commit_checkpoint(staged)
    assert final.name == "iter_003" and (final / "model.json").exists()
    ref = latest_checkpoint(tmp_path)
    assert ref is not None and ref.iteration == 3 and ref.path == final


def test_prune_keeps_newest_and_removes_stale_temporaries(tmp_path: Path) -> None:
    for it in range(5):
        commit_checkpoint(stage_checkpoint(tmp_path, it, _Saves("m"), _Saves("t"), {}))
    stage_checkpoint(tmp_path, 9, _Saves("m"), _Saves("t"), {})  # a crash left this behind
    prune_checkpoints(tmp_path, keep_last_k=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_003", "iter_004"]


def test_rng_state_round_trips(tmp_path: Path) -> None:
    torch.manual_seed(1)
    random.seed(2)
    final = commit_checkpoint(stage_checkpoint(tmp_path, 0, _Saves("m"), _Saves("t"), {}))
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    set_rng_state(load_trainer_state(final)["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def _eval_record() -> dict[str, object]:
    return {
        "schema_version": 1,
        "iteration": -1,
        "num_tasks": 4,
        "replicates": 2,
        "success_rate": 0.5,
        "reward_mean": 0.25,
        "pass@k": {"1": 0.5, "2": 0.75},
        "mean@k": {"1": 0.25},
        "best@k": {"1": 0.25},
    }


def test_metrics_file_validates_and_names_the_bad_field(tmp_path: Path) -> None:
    path = tmp_path / "metrics" / "eval_baseline.json"
    write_metrics(path, _eval_record(), "eval")
    assert json.loads(path.read_text())["pass@k"]["2"] == 0.75
    bad = {**_eval_record(), "success_rate": 1.5}
    with pytest.raises(jsonschema.ValidationError, match="1.5"):
        validate_metrics(bad, "eval")
    with pytest.raises(jsonschema.ValidationError, match="success_rate"):
        validate_metrics({k: v for k, v in _eval_record().items() if k != "success_rate"}, "eval")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    atomic_write_text(path, "old")
    with pytest.raises(ValueError):
        write_metrics(path, {**_eval_record(), "reward_mean": float("nan")}, "eval")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
