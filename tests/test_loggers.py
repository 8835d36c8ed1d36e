"""Metric loggers: the records of metrics/*.json as TensorBoard scalars and W&B history.

TensorBoard files are read back with TensorBoard's own Python reader (EventAccumulator, what
`tensorboard --load_fast=false` serves);
W&B runs for real in offline mode (no network) and through a fake module that records the calls.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from helpers.loggers import read_scalars

from grail.core.config import LoggingConfig
from grail.core.errors import ConfigError
from grail.train.loggers import WANDB_ID_FILE, MetricLoggers, flatten_scalars, tensorboard_tag


def train_record(iteration: int, reward: float) -> dict[str, Any]:
    """Shaped like the loop's metrics/train_iter_XXX.json record (grail/train/loop.py)."""
    return {
        "schema_version": 1,
        "iteration": iteration,
        "reward_mean": reward,
        "success_rate": 0.5,
        "loss_total": -0.125,
        "kl": None,  # no reference model
        "grad_norm": 2.5,
        "completion_length": {"mean": 7.5, "min": 3, "max": 12},
        "tokens": {"prompt": 640, "completion": 480},
        "weight_sync": {"mode": "in_place", "fell_back": False},
        "timings": {"generation_s": 1.5, "train_s": 3.25, "eval_s": 0.0},
    }


def eval_record(iteration: int, success: float) -> dict[str, Any]:
    """Shaped like the loop's metrics/eval_*.json record."""
    return {
        "schema_version": 1,
        "iteration": iteration,
        "environment": "copy_digits",
        "num_tasks": 8,
        "replicates": 4,
        "success_rate": success,
        "reward_mean": 0.75,
        "pass@k": {"1": success, "4": 0.875},
        "mean@k": {"1": success, "4": success},
        "best@k": {"1": 0.5, "4": 1.0},
        "eval_s": 2.0,
    }


def test_flatten_makes_slash_tags_and_skips_what_is_not_a_number() -> None:
    assert flatten_scalars(train_record(3, 0.25), "train") == {
        "train/reward_mean": 0.25,
        "train/success_rate": 0.5,
        "train/loss_total": -0.125,
        "train/grad_norm": 2.5,
        "train/completion_length/mean": 7.5,
        "train/completion_length/min": 3.0,
        "train/completion_length/max": 12.0,
        "train/tokens/prompt": 640.0,
        "train/tokens/completion": 480.0,
        "train/weight_sync/fell_back": 0.0,
        "train/timings/generation_s": 1.5,
        "train/timings/train_s": 3.25,
        "train/timings/eval_s": 0.0,
    }  # kl (None), weight_sync.mode (a string), schema_version and iteration are left out
    tags = flatten_scalars(eval_record(-1, 0.5), "eval")
    assert tags["eval/pass@k/4"] == 0.875 and tags["eval/best@k/1"] == 0.5
    assert "eval/environment" not in tags and "eval/iteration" not in tags
    # Only top-level bookkeeping is skipped: a nested "iteration" is a metric like any other.
    assert flatten_scalars({"a": {"iteration": 2, "b": [1, 2]}}, "x") == {"x/a/iteration": 2.0}


def test_nothing_enabled_imports_nothing_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # None in sys.modules makes an import fail: disabled backends must never be imported.
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with MetricLoggers.from_config(LoggingConfig(), tmp_path, {}) as loggers:
        assert not loggers.enabled
        loggers.log("train", train_record(0, 0.25), step=1)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "key,module,extra",
    [("tensorboard", "tensorboardX", "tensorboard"), ("wandb", "wandb", "wandb")],
)
def test_missing_package_fails_at_startup_naming_key_and_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, key: str, module: str, extra: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError) as info:
        MetricLoggers.from_config(LoggingConfig(**{key: True}), tmp_path, {})
    message = str(info.value)
    assert f"logging.{key}=true" in message and module in message
    assert f"uv sync --extra {extra}" in message
    assert list(tmp_path.iterdir()) == []


def test_log_rejects_unknown_kind_and_bad_steps(tmp_path: Path) -> None:
    loggers = MetricLoggers.from_config(LoggingConfig(), tmp_path, {})
    with pytest.raises(ValueError, match="'rollout'"):
        loggers.log("rollout", {}, step=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step"):
        loggers.log("train", {}, step=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step must be >= 0"):
        loggers.log("eval", eval_record(-1, 0.5), step=-1)  # the baseline goes at step 0


# --- TensorBoard ----------------------------------------------------------------------------------


def test_tensorboard_scalars_read_back_with_tags_steps_values(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    cfg = LoggingConfig(tensorboard=True)
    with MetricLoggers.from_config(cfg, tmp_path, {"train": {"lr": 1e-5}}) as loggers:
        assert not (tmp_path / "tensorboard").exists()  # opened at the first log call
        loggers.log("eval", eval_record(-1, 0.25), step=0)  # the baseline
        loggers.log("train", train_record(0, 0.25), step=1)
        loggers.log("eval", eval_record(0, 0.5), step=1)
        loggers.log("train", train_record(1, 0.75), step=2)
        # Flushed on every log call: readable while the run is still going.
        assert read_scalars(tmp_path / "tensorboard")["train/reward_mean"] == [(1, 0.25), (2, 0.75)]

    scalars = read_scalars(tmp_path / "tensorboard")
    tags = [
        *flatten_scalars(train_record(0, 0.0), "train"),
        *flatten_scalars(eval_record(0, 0.0), "eval"),
    ]
    assert set(scalars) == {tensorboard_tag(tag) for tag in tags}
    assert scalars["train/timings/train_s"] == [(1, 3.25), (2, 3.25)]
    assert scalars["train/tokens/completion"] == [(1, 480.0), (2, 480.0)]
    assert scalars["eval/success_rate"] == [(0, 0.25), (1, 0.5)]
    assert scalars["eval/pass_at_k/4"] == [(0, 0.875), (1, 0.875)]
    assert "train/kl" not in scalars and "eval/environment" not in scalars


def test_tensorboard_resume_replaces_the_steps_it_recomputes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboardX")
    cfg = LoggingConfig(tensorboard=True)
    # First process: logs steps 0..4, then is "killed" (events already flushed).
    with MetricLoggers.from_config(cfg, tmp_path, {}) as first:
        for step in range(5):
            first.log("train", {"reward_mean": float(step)}, step=step)
            if step % 2 == 0:
                first.log("eval", {"success_rate": step / 10}, step=step)
    # Resumed from a checkpoint after step 2, within the same second (file names must not clash):
    # steps 3.. are recomputed with other values, and this time without the eval at step 4.
    with MetricLoggers.from_config(cfg, tmp_path, {}) as resumed:
        for step in range(3, 6):
            resumed.log("train", {"reward_mean": 10.0 + step}, step=step)

    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["eval/success_rate"] == [(0, 0.0), (2, pytest.approx(0.2))]  # purge_step
    assert scalars["train/reward_mean"] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 13.0),
        (4, 14.0),
        (5, 15.0),
    ]


# --- W&B: a fake module recording the calls ------------------------------------------------------


class FakeRun:
    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def define_metric(self, name: str, step_metric: str | None = None) -> None:
        self.calls.append(("define_metric", (name, step_metric)))

    def log(self, data: dict[str, Any]) -> None:
        self.calls.append(("log", data))

    def finish(self, exit_code: int | None = None) -> None:
        self.calls.append(("finish", exit_code))


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    module = ModuleType("wandb")

    def init(**kwargs: Any) -> FakeRun:
        calls.append(("init", kwargs))
        return FakeRun(calls)

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_wandb_run_in_run_dir_with_config_and_step_axis(
    tmp_path: Path, fake_wandb: list[tuple[str, Any]]
) -> None:
    run_dir = tmp_path / "12-30-00"
    config = {"seed": 3, "train": {"lr": 1e-5}}
    cfg = LoggingConfig(wandb=True, wandb_project="grail-tests")
    with MetricLoggers.from_config(cfg, run_dir, config) as loggers:
        loggers.log("eval", eval_record(-1, 0.25), step=0)
        loggers.log("train", train_record(0, 0.5), step=1)

    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    assert run_id.isalnum() and run_id == run_id.lower()
    (_, init), *rest = fake_wandb
    assert init == {
        "project": "grail-tests",
        "name": "12-30-00",
        "dir": str(run_dir),
        "id": run_id,
        "resume": "allow",
        "config": config,
        "allow_val_change": True,
    }
    defined = [args for call, args in rest if call == "define_metric"]
    assert defined == [("step", None), ("train/*", "step"), ("eval/*", "step")]
    logged = [data for call, data in rest if call == "log"]
    assert logged == [
        {"step": 0, **flatten_scalars(eval_record(-1, 0.25), "eval")},
        {"step": 1, **flatten_scalars(train_record(0, 0.5), "train")},
    ]
    assert rest[-1] == ("finish", 0)


def test_wandb_resume_continues_the_same_run_and_failure_marks_it(
    tmp_path: Path, fake_wandb: list[tuple[str, Any]]
) -> None:
    cfg = LoggingConfig(wandb=True)
    with pytest.raises(RuntimeError), MetricLoggers.from_config(cfg, tmp_path, {}):
        raise RuntimeError("training died")
    MetricLoggers.from_config(cfg, tmp_path, {"resume": True}).close()
    inits = [args for call, args in fake_wandb if call == "init"]
    assert inits[0]["id"] == inits[1]["id"] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    assert [args for call, args in fake_wandb if call == "finish"] == [1, 0]


def test_wandb_empty_project_is_rejected(tmp_path: Path, fake_wandb: list) -> None:
    with pytest.raises(ConfigError, match="logging.wandb_project"):
        MetricLoggers.from_config(LoggingConfig(wandb=True, wandb_project=" "), tmp_path, {})
    assert fake_wandb == []


def test_one_failing_close_still_closes_the_others() -> None:
    closed: list[str] = []

    def backend(name: str, fail: bool) -> SimpleNamespace:
        def close(failed: bool) -> None:
            closed.append(name)
            if fail:
                raise OSError(f"{name} cannot flush")

        return SimpleNamespace(close=close)

    loggers = MetricLoggers([backend("a", True), backend("b", False)])  # type: ignore[list-item]
    with pytest.raises(OSError, match="a cannot flush"):
        loggers.close()
    assert closed == ["a", "b"]
    loggers.close()  # already closed: nothing left to do
    assert closed == ["a", "b"]


# --- W&B: the real package, offline --------------------------------------------------------------


@pytest.mark.timeout(120)
def test_wandb_offline_for_real(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network, whatever the user's setup
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # leave pytest's stdout capture alone
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    run_dir = tmp_path / "run"
    cfg = LoggingConfig(wandb=True)
    try:
        with MetricLoggers.from_config(cfg, run_dir, {"seed": 0}) as loggers:
            loggers.log("train", train_record(0, 0.625), step=1)
        # W&B names offline run directories by the second: a resume within the same second
        # would reuse (and overwrite) the first one's directory, which no real resume does.
        time.sleep(1.1)
        with MetricLoggers.from_config(cfg, run_dir, {"seed": 0, "resume": True}) as loggers:
            loggers.log("eval", eval_record(1, 0.375), step=2)
    finally:
        wandb.teardown()  # stops the wandb-core service process this test started

    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    # Both processes wrote to the same run id, under the run directory.
    history = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(history) == 2
    first, second = (path.read_bytes() for path in history)
    assert b"train/timings/train_s" in first and b"0.625" in first
    assert b"eval/pass@k/4" in second and b"0.375" in second
