"""The built-in server on CUDA, end to end: `grail-train` generates through it, trains in bf16
(accelerate's mixed precision on CUDA), syncs weights in place, evaluates and checkpoints, with
the tiny model and with a ~0.5B random Qwen2."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grail.records import read_metrics, validate_metrics

SMALL = [
    "data.problems_per_iteration=4",
    "data.rollouts_per_problem=4",
    "eval.num_ids=8",
    "eval.replicates=2",
    "eval.report_ks=[1,2]",
    "eval.interval=1",
    "checkpoint.save_interval=1",
]


def _train(run_dir: Path, *overrides: str, timeout: float) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "grail.train.cli", *SMALL, *overrides, f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out


def _check_run(run_dir: Path, iterations: int) -> list[dict]:
    records = []
    for i in range(iterations):
        record = read_metrics(run_dir / "metrics" / f"train_iter_{i:03d}.json")
        validate_metrics(record, "train_iteration")
        assert record["tokens"]["completion"] > 0
        assert math.isfinite(record["loss_total"])
        assert record["grad_norm"] is not None  # finite: bf16 training did not blow up
        assert record["weight_sync"] == {"mode": "in_place", "fell_back": False}
        records.append(record)
    validate_metrics(read_metrics(run_dir / "summary.json"), "summary")
    assert (run_dir / "metrics" / f"eval_iter_{iterations - 1:03d}.json").exists()
    (log,) = (run_dir / "logs").glob("builtin-*.log")
    ready = [line for line in log.read_text().splitlines() if "grail-serve ready" in line]
    assert ready and "cuda" in ready[-1], ready  # the server really ran on the GPU
    return records


def test_tiny_model_iterations_on_cuda(tmp_path: Path) -> None:
    _train(tmp_path, "train.iterations=2", "gpu.strategy=single", timeout=600)
    _check_run(tmp_path, 2)


def test_mid_size_model_iteration_on_cuda(tmp_path: Path, mid_model_dir: Path) -> None:
    _train(
        tmp_path / "run",
        f"model.train_id={mid_model_dir}",
        "train.iterations=1",
        "train.lr=1e-5",
        "train.batch_size=8",
        "generation.max_new_tokens=16",
        timeout=900,
    )
    (record,) = _check_run(tmp_path / "run", 1)
    print(
        f"0.5B on CUDA: generation {record['timings']['generation_s']:.2f} s, "
        f"train {record['timings']['train_s']:.2f} s, "
        f"weight sync {record['timings']['weight_sync_s']:.2f} s"
    )


@pytest.mark.parametrize("strategy", ["multi"])
def test_two_gpu_layout_when_there_are_two(tmp_path: Path, strategy: str) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for gpu.strategy={strategy}, found {torch.cuda.device_count()}")
    _train(
        tmp_path,
        "train.iterations=1",
        f"gpu.strategy={strategy}",
        "gpu.server_gpu=1",
        "gpu.training_gpu=0",
        timeout=600,
    )
    _check_run(tmp_path, 1)
