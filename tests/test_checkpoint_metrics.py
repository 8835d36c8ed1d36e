"""Checkpoints and metrics files: atomic, complete or absent, schema-checked."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from grail.core.errors import UserError
from grail.core.records import atomic_write_text, validate_metrics, write_metrics
from grail.envs.base import Problem
from grail.rollouts.batch import GeneratedBatch, Group, RolloutBatch, Sample
from grail.train.checkpoint import (
    checkpoint_problems,
    commit_checkpoint,
    latest_checkpoint,
    load_source_state,
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


def _old_trainer_state(checkpoint: Path, pending: GeneratedBatch | None) -> Path:
    """trainer_state.pt as grail wrote it before rollout_source.json: numpy's RNG state as an
    array, and a pipelined run's pending batch pickled in it."""
    checkpoint.mkdir()
    path = checkpoint / "trainer_state.pt"
    state = {"iteration": 4, "config": "", "pending_rollouts": pending}
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    torch.save({**state, "rng": rng}, path)
    return path


def test_an_old_checkpoint_with_a_pickled_pending_batch_is_refused_saying_what_to_do(
    tmp_path: Path,
) -> None:
    sample = Sample([5], [-0.5], "stop", "7", 1.0, {"correct": 1.0}, True)
    pending = GeneratedBatch(RolloutBatch([Group(Problem(3, [], "7"), [1, 2], [sample])]), 4, 1.0)
    path = _old_trainer_state(tmp_path / "iter_004", pending)
    with pytest.raises(UserError) as err:
        load_trainer_state(path.parent)
    message = str(err.value)
    assert "\n" not in message and str(path) in message
    assert "older version of grail" in message
    assert "resume the run with the grail version that wrote it" in message
    assert "start it over in a new hydra.run.dir" in message


def test_an_old_checkpoint_without_a_pending_batch_still_loads(tmp_path: Path) -> None:
    """Only the pickled batch is refused: an older sync run's checkpoint (numpy's RNG state as an
    array) resumes as before."""
    np.random.seed(5)
    path = _old_trainer_state(tmp_path / "iter_004", None)
    expected = np.random.rand(3)
    np.random.seed(99)
    state = load_trainer_state(path.parent)
    assert state["iteration"] == 4 and state["pending_rollouts"] is None
    set_rng_state(state["rng"])
    assert (np.random.rand(3) == expected).all()
    assert load_source_state(path.parent) == {}


def test_the_rollout_source_state_is_kept_as_json(tmp_path: Path) -> None:
    """What the source keeps goes in its own JSON file beside trainer_state.pt (which loads with
    weights_only=True), -inf included; nothing when it keeps nothing."""
    state = {"pending": {"behaviour_logprobs": [-0.1, -math.inf]}}
    kept = commit_checkpoint(stage_checkpoint(tmp_path, 1, _Saves("m"), _Saves("t"), {}, state))
    assert load_source_state(kept) == state
    assert json.loads((kept / "manifest.json").read_text())["files"]["rollout_source.json"]
    empty = commit_checkpoint(stage_checkpoint(tmp_path, 2, _Saves("m"), _Saves("t"), {}, {}))
    assert not (empty / "rollout_source.json").exists() and load_source_state(empty) == {}


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


# --- manifests: resume trusts only intact checkpoints, pruning counts only those ---------------


def _commit(checkpoints: Path, iteration: int) -> Path:
    return commit_checkpoint(stage_checkpoint(checkpoints, iteration, _Saves("m"), _Saves("t"), {}))


def test_a_checkpoint_carries_a_manifest_of_its_files(tmp_path: Path) -> None:
    final = _commit(tmp_path, 0)
    files = json.loads((final / "manifest.json").read_text())["files"]
    assert sorted(files) == ["m.json", "t.json", "trainer_state.pt"]
    state = final / "trainer_state.pt"
    assert files["trainer_state.pt"]["size"] == state.stat().st_size
    assert checkpoint_problems(final) == []


@pytest.mark.parametrize(
    "damage",
    ["truncate", "same size, other bytes", "delete"],
)
def test_resume_skips_a_damaged_newest_checkpoint_naming_the_file(
    tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    _commit(tmp_path, 1)
    newest = _commit(tmp_path, 2)
    state = newest / "trainer_state.pt"
    if damage == "truncate":
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "delete":
        state.unlink()
    else:
        state.write_bytes(bytes(len(state.read_bytes())))
    ref = latest_checkpoint(tmp_path)
    assert ref is not None and ref.iteration == 1  # the newest intact one
    assert str(state) in caplog.text and "falling back" in caplog.text


def test_pruning_counts_intact_checkpoints_only_and_removes_broken_ones(tmp_path: Path) -> None:
    for it in (33, 34):
        _commit(tmp_path, it)
    (tmp_path / "iter_039").mkdir()  # empty: a copy cut short, a disk that filled
    cut = _commit(tmp_path, 40)  # complete but for its truncated weights
    (cut / "m.json").write_text("")
    prune_checkpoints(tmp_path, keep_last_k=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_033", "iter_034"]
    assert latest_checkpoint(tmp_path).iteration == 34  # type: ignore[union-attr]


def test_a_checkpoint_without_a_manifest_from_an_older_version_is_accepted(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Written before manifests: accepted (a warning says it is unverified) when the files a resume
    loads are there, so an upgrade does not restart a run from scratch; refused when they are
    not."""
    old = tmp_path / "iter_005"
    shutil.copytree(tiny_model_dir, old, ignore=shutil.ignore_patterns("grail_manifest.json"))
    torch.save({"iteration": 5}, old / "trainer_state.pt")
    ref = latest_checkpoint(tmp_path)
    assert ref is not None and ref.iteration == 5
    assert "no manifest.json" in caplog.text
    prune_checkpoints(tmp_path, keep_last_k=1)
    assert old.is_dir()

    weights = old / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    assert latest_checkpoint(tmp_path) is None
    assert f"{weights}: truncated" in caplog.text
