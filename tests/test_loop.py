"""The training loop in-process: the real trainer on the tiny model, rollouts from a scripted
source (no server), so the order of the loop's steps and what it records can be checked directly.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from grail.core.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    GenerationConfig,
    TrainConfig,
)
from grail.core.records import read_metrics, train_metrics_path, validate_metrics
from grail.envs import make_env
from grail.inference.process import SyncResult
from grail.rollouts.batch import GeneratedBatch, Group, RolloutBatch, Sample, WeightSync
from grail.rollouts.generation import render_prompt_ids
from grail.train.checkpoint import list_checkpoints, load_source_state, load_trainer_state
from grail.train.display import Display
from grail.train.loggers import MetricLoggers
from grail.train.loop import Recorder, iteration_record, resume_point, run_iterations
from grail.train.trainer import Trainer, setup_torch


def _config(**train: Any) -> Config:
    return Config(
        data=DataConfig(
            environment="copy_digits", problems_per_iteration=3, rollouts_per_problem=4
        ),
        generation=GenerationConfig(max_new_tokens=4),
        train=TrainConfig(**{"iterations": 4, "batch_size": 8, "lr": 1e-2, **train}),
        eval=EvalConfig(interval=3, num_ids=4, replicates=2, report_ks=[1, 2]),
        checkpoint=CheckpointConfig(save_interval=2, keep_last_k=1),
    )


class ScriptedSource:
    """A RolloutSource that makes up scored groups (deterministic in the iteration; rewards only,
    as every source delivers them) and records what the loop asked of it, in order."""

    def __init__(
        self, cfg: Config, tokenizer: Any, weights_root: Path, fail_at: int | None = None
    ) -> None:
        self.cfg, self.tokenizer, self.fail_at = cfg, tokenizer, fail_at
        self.weights_root = weights_root
        self.env = make_env("copy_digits")
        self.calls: list[tuple[str, int]] = []

    def _batch(self, iteration: int, replicas: int, policy_version: int) -> GeneratedBatch:
        rng = random.Random(iteration)
        groups = []
        for seed in range(iteration * 10, iteration * 10 + self.cfg.data.problems_per_iteration):
            problem = self.env.problem(seed)
            samples = []
            for _ in range(replicas):
                length = rng.randint(1, 4)
                reward = float(rng.random() < 0.5)
                samples.append(
                    Sample(
                        completion_ids=[rng.randrange(3, 60) for _ in range(length)],
                        behaviour_logprobs=[-2.0] * length,
                        finish_reason="stop",
                        text="7",
                        reward=reward,
                        components={"correct": reward},
                        success=reward > 0,
                    )
                )
            groups.append(Group(problem, render_prompt_ids(self.tokenizer, problem), samples))
        return GeneratedBatch(RolloutBatch(groups), policy_version, 0.5, 0.0, 0.5)

    def next_batch(self, iteration: int, policy_version: int) -> GeneratedBatch:
        self.calls.append(("next_batch", iteration))
        if iteration == self.fail_at:
            raise RuntimeError("the source broke")
        return self._batch(iteration, self.cfg.data.rollouts_per_problem, policy_version)

    def sync_weights(self, save: Callable[[Path], None], policy_version: int) -> WeightSync:
        self.calls.append(("sync_weights", policy_version))
        self.saved = self.weights_root / f"weights_v{policy_version}"
        save(self.saved)
        return WeightSync(SyncResult(0.01, "in_place", fell_back=False), 0.02, 0.0, None)

    def evaluate(self, on_progress: Callable[[int], None] | None = None) -> RolloutBatch:
        self.calls.append(("evaluate", -1))
        return self._batch(999, self.cfg.eval.replicates, 0).batch

    def state(self) -> dict[str, Any]:
        return {}  # nothing generated ahead

    def checkpointed(self, iteration: int) -> None:
        self.calls.append(("checkpointed", iteration))

    def close(self) -> None:
        self.calls.append(("close", -1))


def _run(cfg: Config, run_dir: Path, fail_at: int | None = None) -> ScriptedSource:
    trainer = Trainer(cfg, setup_torch(cfg), None)
    source = ScriptedSource(cfg, trainer.tokenizer, run_dir, fail_at)
    with MetricLoggers.from_config(cfg.logging, run_dir, {}) as loggers:
        recorder = Recorder(run_dir, cfg, loggers, Display())
        run_iterations(cfg, run_dir, trainer, source, recorder)
    return source


def test_the_loop_runs_its_steps_in_order_and_records_each(tmp_path: Path) -> None:
    cfg = _config()
    source = _run(cfg, tmp_path)
    # Baseline eval, then per iteration: rollouts, update, sync with the new version, an
    # evaluation every eval.interval iterations and after the last, and the source told of each
    # committed checkpoint (save_interval 2, and the last).
    assert source.calls == [
        ("evaluate", -1),
        ("next_batch", 0),
        ("sync_weights", 1),
        ("next_batch", 1),
        ("sync_weights", 2),
        ("checkpointed", 1),
        ("next_batch", 2),
        ("sync_weights", 3),
        ("evaluate", -1),
        ("next_batch", 3),
        ("sync_weights", 4),
        ("evaluate", -1),
        ("checkpointed", 3),
    ]
    names = sorted(p.name for p in (tmp_path / "metrics").iterdir())
    assert names == [
        "eval_baseline.json",
        "eval_iter_002.json",
        "eval_iter_003.json",
        *(f"train_iter_{i:03d}.json" for i in range(4)),
    ]
    for path in (tmp_path / "metrics").iterdir():
        validate_metrics(
            read_metrics(path), "eval" if path.name.startswith("eval") else "train_iteration"
        )
    # The weights the source was asked to load are the trainer's, as save_pretrained wrote them.
    assert (source.saved / "model.safetensors").exists()
    # Checkpoints after iterations 1 and 3 (save_interval 2, and the last), newest 1 kept.
    assert [c.iteration for c in list_checkpoints(tmp_path / "checkpoints")] == [3]
    assert not list((tmp_path / "checkpoints").glob(".*"))
    state = load_trainer_state(tmp_path / "checkpoints" / "iter_003")
    assert state["iteration"] == 3 and "pending_rollouts" not in state
    assert load_source_state(tmp_path / "checkpoints" / "iter_003") == {}


def test_each_record_names_the_policy_that_generated_its_batch(tmp_path: Path) -> None:
    _run(_config(), tmp_path)
    records = [read_metrics(train_metrics_path(tmp_path, i)) for i in range(4)]
    assert [r["policy"] for r in records] == [
        {"version": i, "staleness": 0, "pipelined": False} for i in range(4)
    ]
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in records)
    first = ScriptedSource(_config(), _tokenizer(), tmp_path)._batch(0, 4, 0).batch
    assert records[0]["tokens"]["completion"] == sum(len(s.completion_ids) for s in first.samples)


def _tokenizer() -> Any:
    from grail.models.loading import load_tokenizer
    from grail.models.tiny import ensure_tiny_model

    return load_tokenizer(str(ensure_tiny_model()))


def test_a_failure_mid_run_leaves_committed_checkpoints_only(tmp_path: Path) -> None:
    cfg = _config(iterations=4)
    with pytest.raises(RuntimeError, match="the source broke"):
        _run(cfg, tmp_path, fail_at=3)
    # Iterations 0-2 recorded; the checkpoint after iteration 1 committed, nothing half-written.
    assert sorted(p.name for p in (tmp_path / "metrics").glob("train_*")) == [
        f"train_iter_{i:03d}.json" for i in range(3)
    ]
    assert [c.iteration for c in list_checkpoints(tmp_path / "checkpoints")] == [1]
    assert not list((tmp_path / "checkpoints").glob(".*"))


def test_iteration_record_is_pure_and_reports_staleness_and_bad_norms() -> None:
    batch = ScriptedSource(_config(), _tokenizer(), Path())._batch(5, 4, policy_version=4)
    batch.generation_s = 2.0
    sync = WeightSync(SyncResult(0.1, "restart", fell_back=True, fallback_reason="x"), 0.1, 0.0)
    train = {"loss_total": 0.5, "grad_norm": math.inf, "kl": 0.01, "zero_variance_group_frac": 0.5}
    timings = {"train_s": 1.0}
    record = iteration_record(5, batch, train, sync, 1e-3, timings, pipelined=True)
    assert record == iteration_record(5, batch, train, sync, 1e-3, timings, pipelined=True)
    assert record["policy"] == {"version": 4, "staleness": 1, "pipelined": True}
    assert record["grad_norm"] is None  # a skipped (non-finite) step, not a number
    assert record["weight_sync"] == {
        "mode": "restart",
        "fell_back": True,
        "transfer": "disk",
        "transfer_fallbacks": 0,
    }
    completion = sum(len(s.completion_ids) for s in batch.batch.samples)
    assert record["tokens"]["completion"] == completion
    assert record["tokens_per_s"] == completion / 2.0
    assert record["lr"] == 1e-3 and record["loss_total"] == 0.5 and record["kl"] == 0.01


@pytest.mark.parametrize("damaged", ["model.safetensors", "trainer_state.pt"])
def test_resume_falls_back_past_a_truncated_checkpoint_to_the_same_metrics(
    tmp_path: Path, damaged: str, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = _config(iterations=4)
    cfg.checkpoint = CheckpointConfig(save_interval=1, keep_last_k=2)
    _run(cfg, tmp_path / "whole")
    run_dir = tmp_path / "damaged"
    _run(cfg, run_dir)
    truncated = run_dir / "checkpoints" / "iter_003" / damaged
    truncated.write_bytes(truncated.read_bytes()[:1000])

    resumed = replace(cfg, resume=True)
    resume_from = resume_point(resumed, run_dir)
    assert resume_from is not None and resume_from.iteration == 2
    assert str(truncated) in caplog.text  # the warning names the damaged file
    trainer = Trainer(resumed, setup_torch(resumed), resume_from)
    with MetricLoggers.from_config(cfg.logging, run_dir, {}) as loggers:
        source = ScriptedSource(resumed, trainer.tokenizer, run_dir)
        run_iterations(
            resumed, run_dir, trainer, source, Recorder(run_dir, cfg, loggers, Display())
        )
    assert [call for call in source.calls if call[0] == "next_batch"] == [("next_batch", 3)]
    for it in range(4):
        again, whole = (
            read_metrics(train_metrics_path(root, it)) for root in (run_dir, tmp_path / "whole")
        )
        assert {**again, "timings": None} == {**whole, "timings": None}, it
    assert [c.iteration for c in list_checkpoints(run_dir / "checkpoints")] == [2, 3]
