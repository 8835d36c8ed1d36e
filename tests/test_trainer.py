"""The trainer process (`grail.train.trainer`): what it prints, and what it does with batches that
carry no learning signal."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import huggingface_hub.utils
import pytest
import transformers
from helpers.batches import scored_batch

from grail.core.config import Config, DataConfig, GenerationConfig, TrainConfig
from grail.core.records import validate_metrics
from grail.inference.process import SyncResult
from grail.rollouts.batch import GeneratedBatch, Resampling, WeightSync
from grail.train import trainer as trainer_module
from grail.train.checkpoint import CheckpointRef
from grail.train.loop import iteration_record
from grail.train.trainer import Trainer, setup_torch


def _config() -> Config:
    return Config(
        data=DataConfig(
            environment="copy_digits", problems_per_iteration=3, rollouts_per_problem=4
        ),
        generation=GenerationConfig(max_new_tokens=4),
        train=TrainConfig(batch_size=4, lr=1e-2),
    )


TIMINGS = ("generation_s", "train_s", "weight_sync_s", "eval_s", "checkpoint_s", "iteration_s")
NO_SIGNAL = [[0.0] * 4] * 3  # nobody solves anything: every group has zero variance
SIGNAL = [[0.0, 1.0, 0.0, 0.0], [0.0] * 4, [1.0] * 4]


@pytest.fixture
def library_progress_bars_on() -> Iterator[None]:
    """Progress bars on, as in a fresh process (another test may have turned them off), and
    back to how they were afterwards."""
    transformers_on = transformers.utils.logging.is_progress_bar_enabled()
    hub_on = not huggingface_hub.utils.are_progress_bars_disabled()
    transformers.utils.logging.enable_progress_bar()  # huggingface_hub's too
    yield
    if not transformers_on:
        transformers.utils.logging.disable_progress_bar()
    if hub_on:
        huggingface_hub.utils.enable_progress_bars()
    else:
        huggingface_hub.utils.disable_progress_bars()


def test_saving_weights_prints_nothing(
    tmp_path: Path, library_progress_bars_on: None, capfd: pytest.CaptureFixture[str]
) -> None:
    """Every weight sync saves the weights; transformers drew a "Writing model shards" bar for
    each (181 lines of a piped default run). The trainer process draws none: not on loading
    the model, not on saving it."""
    cfg = _config()
    accelerator = setup_torch(cfg)
    capfd.readouterr()
    trainer = Trainer(cfg, accelerator, None)
    trainer.save_weights(tmp_path / "a")
    trainer.save_weights(tmp_path / "b")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_a_batch_without_signal_is_skipped_and_recorded_as_such() -> None:
    """All rewards equal in every group, no KL or entropy term: the update runs no forward pass,
    still steps the optimizer and the schedule, and the iteration's record says so and
    validates against the schema."""
    cfg = _config()
    trainer = Trainer(cfg, setup_torch(cfg), None)
    forwards: list[int] = []
    trainer.model.register_forward_hook(lambda *_: forwards.append(1))
    progress: list[int] = []

    metrics = trainer.update(scored_batch(NO_SIGNAL), progress.append)
    assert forwards == [] and metrics["update_skipped"] is True
    assert sum(progress) == 3  # the display's bar still completes: 12 samples, micro-batch 4
    # one optimizer step per micro-batch (grad_accum_steps 1), as a full update takes
    assert trainer.scheduler.last_epoch == 3 and metrics["optimizer_steps"] == 3
    record = iteration_record(
        0,
        GeneratedBatch(scored_batch(NO_SIGNAL), 0, 0.5),
        metrics,
        WeightSync(SyncResult(0.01, "in_place", fell_back=False), 0.02, 0.0),
        trainer.lr,
        dict(zip(TIMINGS, (0.5, 0.1, 0.02, 0.0, 0.0, 0.7), strict=True)),
        pipelined=False,
    )
    validate_metrics(record, "train_iteration")
    assert record["update_skipped"] is True and record["entropy"] is None
    assert record["loss_total"] == 0.0 and record["grad_norm"] == 0.0

    metrics = trainer.update(scored_batch(SIGNAL), progress.append)
    assert forwards and metrics["update_skipped"] is False
    assert trainer.scheduler.last_epoch == 6
    # A batch that dynamic sampling filled says what it took (data.dynamic_sampling).
    resampled = GeneratedBatch(scored_batch(SIGNAL), 1, 0.5, resampling=Resampling(2, 9, 6, 3))
    record = iteration_record(
        1, resampled, metrics, WeightSync(SyncResult(0.01, "in_place", fell_back=False), 0.02, 0.0),
        trainer.lr, dict.fromkeys(TIMINGS, 0.1), pipelined=False,
    )  # fmt: skip
    validate_metrics(record, "train_iteration")
    assert record["dynamic_sampling"] == {
        "extra_rounds": 2, "generated_groups": 9, "dropped_groups": 6, "kept_groups": 3
    }  # fmt: skip


def test_the_trainer_warns_once_after_many_iterations_without_signal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = _config()
    trainer = Trainer(cfg, setup_torch(cfg), None)
    n = trainer_module.NO_SIGNAL_WARN_ITERATIONS
    assert n == 10

    def warnings() -> list[str]:
        # The trainer's own records only: caplog holds every logger's, and a thread another
        # test left behind (the Tinker SDK's heartbeats) may warn in the meantime.
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and r.name == trainer_module.log.name
        ]

    with caplog.at_level(logging.WARNING, logger="grail.train"):
        for _ in range(n - 1):
            trainer.update(scored_batch(NO_SIGNAL))
        trainer.update(scored_batch(SIGNAL))  # one batch with signal starts the count again
        for _ in range(n - 1):
            trainer.update(scored_batch(NO_SIGNAL))
        assert warnings() == [] and trainer.no_signal_streak == n - 1
        trainer.update(scored_batch(NO_SIGNAL))
        assert len(warnings()) == 1
        message = warnings()[0]
        assert f"{n} iterations in a row had zero reward variance" in message
        assert "the model never solves the task" in message
        assert "model=qwen2.5-0.5b" in message
        for _ in range(n + 1):  # once per run, not once per streak
            trainer.update(scored_batch(NO_SIGNAL))
        assert len(warnings()) == 1


@pytest.mark.parametrize(
    ("rewards", "cause"),
    [
        ([[1.0] * 4] * 3, "the model solves every problem"),
        ([[1.0] * 4, [0.0] * 4], "each problem's completions all get the same reward"),
    ],
)
def test_the_warning_names_the_likely_cause(rewards: list[list[float]], cause: str) -> None:
    message = trainer_module.no_signal_message(scored_batch(rewards), 10)
    assert cause in message and "never solves" not in message


def test_adaptive_kl_adapts_after_each_step_is_recorded_and_resumes(tmp_path: Path) -> None:
    """grail's controller: the reference is the initial policy, so the first steps measure a KL
    far below the target and the coefficient falls by the rate per optimizer step (3 steps of 4
    samples here); the record carries it, and a checkpoint restores it."""
    cfg = _config()
    cfg.train.kl_coef = 0.05
    cfg.train.kl_target = 10.0
    cfg.train.kl_adapt_rate = 2.0
    cfg.train.kl_coef_min = 0.01
    trainer = Trainer(cfg, setup_torch(cfg), resume_from=None)
    metrics = trainer.update(scored_batch(SIGNAL))
    assert metrics["optimizer_steps"] == 3.0
    assert metrics["kl_coef"] == pytest.approx(max(0.05 / 2**3, 0.01))
    assert trainer.kl_control is not None and trainer.kl_control.value == metrics["kl_coef"]

    staged = trainer.stage_checkpoint(tmp_path, 0, None)
    resumed = Trainer(cfg, setup_torch(cfg), resume_from=CheckpointRef(0, staged))
    assert resumed.kl_control is not None and resumed.kl_control.value == metrics["kl_coef"]

    fixed = _config()
    fixed.train.kl_coef = 0.05
    assert Trainer(fixed, setup_torch(fixed), None).update(scored_batch(SIGNAL))["kl_coef"] == 0.05


@pytest.mark.parametrize(
    ("tokens", "compile_body", "want"),
    [(0, False, "sdpa"), (64, False, "grail_packed_sdpa"), (64, True, "grail_packed_sdpa")],
)
def test_packed_pieces_attend_per_sample_compiled_or_not(
    tokens: int, compile_body: bool, want: str
) -> None:
    """train.micro_batch_tokens > 0 switches policy and reference from sdpa's dense
    block-diagonal mask to sdpa per sample (grail/models/packed_attention.py), also with a
    compiled body (the samples' lengths reach it as data, tests/test_packing.py)."""
    cfg = _config()
    cfg.train.micro_batch_tokens = tokens
    cfg.train.compile = compile_body
    cfg.train.kl_coef = 0.05
    trainer = Trainer(cfg, setup_torch(cfg), None)
    assert trainer.model.config._attn_implementation == want
    assert trainer.ref_model is not None
    assert trainer.ref_model.config._attn_implementation == want
