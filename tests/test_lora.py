"""LoRA (model.lora): the trainer trains the adapter only over a frozen base, the reference is the
base with the adapter off, the built-in server hot-swaps the adapter and computes what the
trainer computes, a run resumes exactly, and a checkpoint exports as one plain merged model. End to
end: pipelined LoRA runs sync the adapter alone and resume exactly, a sweep mixes LoRA and full
runs and grail-report labels each, and a restarted server serves the base with the newest
adapter."""

from __future__ import annotations

import csv
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import torch
from helpers.batches import scored_batch
from helpers.run_dirs import TINY_RUN, grail_train
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from grail.core.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    GenerationConfig,
    LoraConfig,
    ModelConfig,
    TrainConfig,
)
from grail.core.errors import ConfigError
from grail.core.records import read_metrics, train_metrics_path
from grail.core.validate import validate
from grail.inference.builtin.engine import Engine
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.builtin.weights import WeightUpdateError
from grail.models.loading import load_model
from grail.models.lora import AdapterOff, with_new_adapter
from grail.report.cli import main as report_main
from grail.train.export_merged import export_merged
from grail.train.export_merged import main as export_main
from grail.train.trainer import Trainer, setup_torch

PROMPT = [3, 17, 42, 9, 11]
LORA_RUN = [*TINY_RUN, "model.lora.enabled=true", "model.lora.r=4", "train.kl_coef=0.02"]


def lora_config(**lora: object) -> Config:
    return Config(
        model=ModelConfig(lora=LoraConfig(enabled=True, r=4, **lora)),  # type: ignore[arg-type]
        data=DataConfig(
            environment="copy_digits", problems_per_iteration=3, rollouts_per_problem=4
        ),
        generation=GenerationConfig(max_new_tokens=4),
        train=TrainConfig(batch_size=4, lr=5e-2, kl_coef=0.05),
        checkpoint=CheckpointConfig(save_interval=1),
    )


def logits(model: torch.nn.Module, ids: list[int] = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_only_the_adapter_trains_and_the_reference_is_the_base(tiny_model_dir: Path) -> None:
    cfg = lora_config()
    trainer = Trainer(cfg, setup_torch(cfg), None)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    optimized = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    assert optimized and all("lora_" in names[id(p)] for p in optimized)
    assert isinstance(trainer.ref_model, AdapterOff)  # no second model in memory

    metrics = trainer.update(scored_batch([[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]]))
    assert metrics["kl"] is not None and not metrics["update_skipped"]
    # The adapter moved the policy; the base (and so the reference) did not move.
    assert not torch.allclose(logits(trainer.model), logits(base))
    torch.testing.assert_close(logits(trainer.ref_model), logits(base), rtol=0, atol=0)


def test_the_server_gets_the_base_and_the_adapter_apart(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = lora_config()
    trainer = Trainer(cfg, setup_torch(cfg), None)
    trainer.update(scored_batch([[1.0, 0.0, 0.0, 1.0]]))
    trainer.save_server_model(tmp_path / "base")
    trainer.save_weights(tmp_path / "adapter")
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for (name, a), (_, b) in zip(
        served.state_dict().items(), base.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    adapter_files = sorted(p.name for p in (tmp_path / "adapter").iterdir())
    assert "adapter_model.safetensors" in adapter_files and "model.safetensors" not in adapter_files
    full = (tmp_path / "base" / "model.safetensors").stat().st_size
    assert (tmp_path / "adapter" / "adapter_model.safetensors").stat().st_size < full / 4


@pytest.fixture
def base_and_adapters(tiny_model_dir: Path, tmp_path: Path) -> tuple[Path, Path, Path, Path]:
    """The tiny base; a fresh (B = 0) adapter; a trained-looking one (random B); one of another
    rank. Each a peft directory."""
    dirs = []
    for name, r, scale in (("zero", 4, 0.0), ("moved", 4, 0.5), ("rank8", 8, 0.5)):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = with_new_adapter(base, LoraConfig(enabled=True, r=r))
        generator = torch.Generator().manual_seed(r)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.copy_(scale * torch.randn(param.shape, generator=generator))
        model.save_pretrained(tmp_path / name)
        dirs.append(tmp_path / name)
    return tiny_model_dir, dirs[0], dirs[1], dirs[2]


def peft_logits(base_dir: Path, adapter: Path) -> torch.Tensor:
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return logits(PeftModel.from_pretrained(base, adapter))


def greedy(engine: Engine) -> list[int]:
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=1, ignore_eos=True)
    (future,) = engine.submit(PROMPT, params, n=1, seed=0)
    return future.result(30).token_ids


def test_adapter_sync_changes_generations_and_serves_what_the_trainer_computes(
    base_and_adapters: tuple[Path, Path, Path, Path],
) -> None:
    base_dir, zero, moved, rank8 = base_and_adapters
    engine = Engine(base_dir, lora_dir=zero)
    engine.start()
    try:
        before = greedy(engine)
        torch.testing.assert_close(logits(engine.model), peft_logits(base_dir, zero))
        engine.update_weights(moved, "v1")
        torch.testing.assert_close(logits(engine.model), peft_logits(base_dir, moved))
        assert greedy(engine) != before  # generations follow the adapter
        # An adapter of another rank is refused whole; the last one keeps serving.
        with pytest.raises(WeightUpdateError, match="r=8.*made for r=4"):
            engine.update_weights(rank8, "v2")
        torch.testing.assert_close(logits(engine.model), peft_logits(base_dir, moved))
        assert engine.weight_version == "v1"
    finally:
        engine.stop()


def test_an_adapter_needs_a_server_started_with_lora_layers(
    base_and_adapters: tuple[Path, Path, Path, Path],
) -> None:
    base_dir, _, moved, _ = base_and_adapters
    engine = Engine(base_dir)
    engine.start()
    try:
        with pytest.raises(WeightUpdateError, match="start it with --lora-dir"):
            engine.update_weights(moved)
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real 4-iteration LoRA run of grail-train with the built-in server."""
    run_dir = tmp_path_factory.mktemp("lora") / "whole"
    args = [*LORA_RUN, "train.iterations=4", "eval.interval=2", "checkpoint.save_interval=2"]
    result = grail_train(*args, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stdout + result.stderr
    return run_dir


def test_a_lora_run_resumes_to_the_same_metrics(lora_run: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "resumed"
    args = [*LORA_RUN, "eval.interval=2", "checkpoint.save_interval=2", f"hydra.run.dir={run_dir}"]
    first = grail_train(*args, "train.iterations=2")
    assert first.returncode == 0, first.stdout + first.stderr
    second = grail_train(*args, "train.iterations=4", "resume=true")
    assert second.returncode == 0, second.stdout + second.stderr
    for iteration in range(4):
        again, whole = (read_metrics(train_metrics_path(d, iteration)) for d in (run_dir, lora_run))
        timing = {"timings": None, "tokens_per_s": None}
        assert {**again, **timing} == {**whole, **timing}, iteration
        # The server sampled with the trainer's policy: the adapter it served was the trainer's.
        assert whole["logprob_mismatch"] < 1e-5 and whole["kl"] is not None
    assert whole["kl"] > 0  # the adapter moved the policy away from the base (the reference)


def test_a_checkpoint_exports_as_a_merged_model(lora_run: Path, tmp_path: Path) -> None:
    checkpoint = lora_run / "checkpoints" / "iter_003"
    out = export_merged(checkpoint, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    base_dir = Path(
        json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"]
    )
    expected = peft_logits(base_dir, checkpoint)
    torch.testing.assert_close(logits(merged), expected, rtol=1e-5, atol=1e-5)
    assert (out / "tokenizer.json").exists()
    with pytest.raises(FileNotFoundError, match="no LoRA adapter"):
        export_merged(tmp_path / "merged", tmp_path / "again")


def test_export_refuses_a_missing_checkpoint_a_used_out_dir_and_the_checkpoint_itself(
    lora_run: Path, tmp_path: Path
) -> None:
    checkpoint = lora_run / "checkpoints" / "iter_003"
    with pytest.raises(FileNotFoundError, match="nowhere does not exist"):
        export_merged(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(ValueError, match="is the checkpoint itself"):
        export_merged(checkpoint, checkpoint, force=True)
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty"):
        export_merged(checkpoint, used)
    # The command line says so in one line, and --force writes anyway.
    with pytest.raises(SystemExit, match="grail-export-merged: .*is not empty"):
        export_main([str(checkpoint), str(used)])
    export_main([str(checkpoint), str(used), "--force"])
    assert (used / "notes.txt").read_text() == "mine" and (used / "config.json").exists()


def test_a_full_disk_while_exporting_says_so_in_one_line_and_leaves_no_model(
    lora_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers.modeling_utils

    def full(*_args: object, **_kwargs: object) -> None:
        # What safetensors raises when the disk fills (its own Exception type).
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    checkpoint, out = lora_run / "checkpoints" / "iter_003", tmp_path / "merged"
    with pytest.raises(SystemExit) as info:
        export_main([str(checkpoint), str(out)])
    assert (
        str(info.value.code) == f"grail-export-merged: no space left on device while writing {out}"
    )
    assert not out.exists()  # no half-written model that something could load


@pytest.mark.parametrize(
    ("lora", "match"),
    [
        ({"target_modules": ["bogus_proj"]}, r"target_modules: 'bogus_proj' names no layer"),
        ({"target_modules": ["q_proj", "bogus_proj"]}, "'bogus_proj'"),  # peft took it silently
        ({"target_modules": ["mlp"]}, "'mlp' names no layer LoRA can wrap"),  # not a linear layer
        ({"modules_to_save": ["bogus"]}, r"modules_to_save: 'bogus' matches no module"),
    ],
)
def test_lora_module_names_are_checked_against_the_model(
    tiny_model_dir: Path, lora: dict[str, list[str]], match: str
) -> None:
    model = load_model(tiny_model_dir)
    with pytest.raises(ConfigError, match=match) as error:
        with_new_adapter(model, LoraConfig(enabled=True, **lora))  # type: ignore[arg-type]
    assert "q_proj" in str(error.value) or "input_layernorm" in str(error.value)  # the names
    with_new_adapter(
        load_model(tiny_model_dir), LoraConfig(enabled=True, target_modules=["q_proj"])
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"r": 0}, "model.lora.r"),
        ({"dropout": 1.0}, "model.lora.dropout"),
        ({"alpha": 0.0}, "model.lora.alpha"),
    ],
)
def test_bad_lora_settings_are_named(change: dict[str, object], match: str) -> None:
    cfg = lora_config()
    for key, value in change.items():
        setattr(cfg.model.lora, key, value)
    with pytest.raises(ConfigError, match=match):
        validate(cfg)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_gpu_servers_take_adapters_but_not_modules_trained_in_full(backend: str) -> None:
    cfg = lora_config()
    cfg.generation.backend = backend
    validate(cfg)  # adapter sync: tests/test_lora_backends.py
    cfg.model.lora.modules_to_save = ["norm"]
    with pytest.raises(ConfigError, match=f"generation.backend={backend}"):
        validate(cfg)


def test_modules_trained_in_full_sync_with_the_adapter(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """model.lora.modules_to_save: those modules' trained weights travel with the adapter and
    replace the served base's own; the trainer's base (its reference) keeps the originals."""
    lora = LoraConfig(enabled=True, r=4, modules_to_save=["norm"])
    dirs = {}
    for name, scale in (("start", 0.0), ("trained", 0.5)):
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        model = with_new_adapter(base, lora)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param.requires_grad and "lora_A" not in param_name:  # B and the norms
                    param.add_(scale * torch.randn(param.shape, generator=torch.manual_seed(1)))
        model.save_pretrained(tmp_path / name)
        dirs[name] = tmp_path / name
    engine = Engine(tiny_model_dir, lora_dir=dirs["start"])
    engine.start()
    try:
        torch.testing.assert_close(logits(engine.model), peft_logits(tiny_model_dir, dirs["start"]))
        engine.update_weights(dirs["trained"], "v1")
        torch.testing.assert_close(
            logits(engine.model), peft_logits(tiny_model_dir, dirs["trained"])
        )
    finally:
        engine.stop()
    # The trainer's base for the server: the original norms, not the trained copies.
    trainer_model = with_new_adapter(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), lora
    )
    from grail.models.lora import base_state_dict

    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert base_state_dict(trainer_model).keys() == original.state_dict().keys()


@pytest.mark.learning
def test_a_lora_run_learns_the_default_task_from_a_base_that_knows_its_tokens(
    tmp_path: Path, warm_base: Path
) -> None:
    """The default job's tiny model is random: its frozen embeddings and norms cap its logits
    near uniform, so LoRA alone cannot move it (docs/lora.md). From a base that knows its tokens
    and has begun to stop after them (`warm_base`: the default job's first checkpoint at held-out
    success 0.3), a LoRA run of the same task learns (deterministic on CPU)."""
    run_dir = tmp_path / "lora"
    result = grail_train(
        f"model.train_id={warm_base}",
        "model.lora.enabled=true",
        "train.lr=5e-3",
        "train.iterations=20",
        "eval.interval=20",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    baseline, final = summary["baseline_eval"], summary["final_eval"]
    assert final["success_rate"] >= baseline["success_rate"] + 0.1, (baseline, final)
    assert (run_dir / "checkpoints" / "iter_019" / "adapter_model.safetensors").exists()


# --- pipelined mode, sweeps, restarts: the rest of a full fine-tuning run's features, under LoRA --

# A sweep of one pipelined LoRA run (job 0) and one pipelined full fine-tuning run (job 1), as
# `grail-train -m` runs it with the basic launcher, each keeping every checkpoint.
SWEEP = [
    *TINY_RUN,
    "model.lora.enabled=true,false",
    "model.lora.r=4",
    "train.kl_coef=0.02",
    "train.pipeline=true",
    "train.iterations=4",
    "eval.interval=2",
    "checkpoint.save_interval=1",
    "checkpoint.keep_last_k=4",
]
# What differs between two runs of the same policies: wall-clock times, and how a sync was made.
VOLATILE = {"timings": None, "tokens_per_s": None, "weight_sync": None}


def same_metrics(run_dir: Path, other: Path, iterations: range) -> None:
    """The train records of `iterations` in both runs, equal but for times and the sync mode."""
    for iteration in iterations:
        this, that = (read_metrics(train_metrics_path(d, iteration)) for d in (run_dir, other))
        assert {**this, **VOLATILE} == {**that, **VOLATILE}, iteration


def sync_mode(record: dict) -> tuple[str, bool]:
    return record["weight_sync"]["mode"], record["weight_sync"]["fell_back"]


def server_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "builtin-policy.log").read_text()


def synced(run_dir: Path) -> list[str]:
    """What the server logged loading at each in-place sync: 'N [adapter ]tensors from DIR'."""
    return re.findall(r"weights updated: loaded (.+?) in [\d.]+ s;", server_log(run_dir))


def adapter_tensors(adapter_dir: Path) -> list[str]:
    with safe_open(adapter_dir / "adapter_model.safetensors", framework="pt") as f:
        return list(f.keys())


@pytest.fixture(scope="module")
def sweep(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real sweep: `grail-train -m model.lora.enabled=true,false train.pipeline=true ...`, 4
    iterations a run, with the built-in server."""
    sweep_dir = tmp_path_factory.mktemp("lora") / "sweep"
    result = grail_train("-m", f"hydra.sweep.dir={sweep_dir}", *SWEEP)
    assert result.returncode == 0, result.stdout + result.stderr
    return sweep_dir


def test_a_pipelined_lora_run_syncs_the_adapter_alone(sweep: Path, tiny_model_dir: Path) -> None:
    run_dir, full_run = sweep / "0", sweep / "1"
    assert read_metrics(run_dir / "summary.json")["status"] == "completed"
    records = [read_metrics(train_metrics_path(run_dir, i)) for i in range(4)]
    # Pipelined: batch i+1 generated by the policy that trains on batch i, one update behind.
    assert [r["policy"] for r in records] == [
        {"version": v, "staleness": s, "pipelined": True}
        for v, s in ((0, 0), (0, 1), (1, 1), (2, 1))
    ]
    assert [sync_mode(r) for r in records] == [("in_place", False)] * 4
    assert records[0]["logprob_mismatch"] < 1e-5  # batch 0: the server's adapter is the trainer's
    assert records[-1]["kl"] > 0  # the adapter moved the policy off the base

    # The server started on the base (weights/) with the adapter (weights/adapter/); every sync,
    # one per iteration, loaded the adapter's tensors alone from weights/adapter/ (the full run
    # beside it in the sweep never mentions an adapter).
    weights, adapter = run_dir / "weights", run_dir / "weights" / "adapter"
    loads = synced(run_dir)
    assert len(loads) == 4 and all(s.endswith(f" adapter tensors from {adapter}") for s in loads)
    names = adapter_tensors(adapter)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
    assert loads == [f"{len(names)} adapter tensors from {adapter}"] * 4
    assert not (adapter / "model.safetensors").exists()
    assert "adapter" not in server_log(full_run)
    # The base was written once, before the server started, and never again; it is the tiny
    # model unchanged (the frozen base), several times the adapter's size.
    base = weights / "model.safetensors"
    assert base.stat().st_mtime_ns < (run_dir / "metrics" / "eval_baseline.json").stat().st_mtime_ns
    with (
        safe_open(base, framework="pt") as served,
        safe_open(tiny_model_dir / "model.safetensors", framework="pt") as original,
    ):
        keys = sorted(original.keys())
        assert sorted(served.keys()) == keys
        for key in keys:
            assert torch.equal(served.get_tensor(key), original.get_tensor(key)), key
    assert (adapter / "adapter_model.safetensors").stat().st_size < base.stat().st_size / 4
    # Checkpoints hold the adapter (with the prefetched batch), not a model.
    for checkpoint in sorted((run_dir / "checkpoints").iterdir()):
        assert (checkpoint / "adapter_model.safetensors").exists(), checkpoint
        assert not (checkpoint / "model.safetensors").exists(), checkpoint


def test_a_pipelined_lora_run_resumes_to_the_same_metrics(sweep: Path, tmp_path: Path) -> None:
    """The LoRA run as a kill after its checkpoint of iteration 1 leaves it (the later
    checkpoints, records and summary gone; weights/adapter/ holding a newer adapter than the
    checkpoint's), resumed by rerunning the sweep's command with resume=true: the full run, which
    completed, is skipped; the LoRA run trains iteration 2 on the batch prefetched before the
    kill (saved in the checkpoint), and iteration 3 on a batch from its new server, which must
    serve the checkpoint's adapter."""
    again = tmp_path / "sweep"
    shutil.copytree(sweep, again)
    run_dir = again / "0"
    for name in ("iter_002", "iter_003"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    for name in ("train_iter_002.json", "train_iter_003.json", "eval_iter_003.json"):
        (run_dir / "metrics" / name).unlink()
    (run_dir / "summary.json").unlink()
    (run_dir / "logs" / "builtin-policy.log").unlink()

    result = grail_train("-m", f"hydra.sweep.dir={again}", *SWEEP, "resume=true")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "resuming after iteration 1" in out and out.count("started builtin server") == 1, out
    assert read_metrics(run_dir / "summary.json")["status"] == "completed"
    same_metrics(run_dir, sweep / "0", range(4))
    resumed, whole = (
        read_metrics(d / "metrics" / "eval_iter_003.json") for d in (run_dir, sweep / "0")
    )
    assert {**resumed, "eval_s": None} == {**whole, "eval_s": None}
    # The resumed run's syncs sent the adapter alone too.
    adapter = run_dir / "weights" / "adapter"
    assert (
        synced(run_dir) == [f"{len(adapter_tensors(adapter))} adapter tensors from {adapter}"] * 2
    )


def test_a_sweep_mixes_lora_and_full_runs_and_the_report_tells_them_apart(
    sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lora, full = sweep / "0", sweep / "1"
    for run in (lora, full):
        assert read_metrics(run / "summary.json")["status"] == "completed", run
        assert len(list((run / "metrics").glob("train_iter_*.json"))) == 4, run
    # Each run is what its label below says: the LoRA one checkpointed and synced an adapter, the
    # full one the whole model.
    checkpoint = "checkpoints/iter_003"
    assert (lora / checkpoint / "adapter_model.safetensors").exists()
    assert not (lora / checkpoint / "model.safetensors").exists()
    assert (full / checkpoint / "model.safetensors").exists()
    assert not (full / checkpoint / "adapter_config.json").exists()
    assert all("adapter tensors" in load for load in synced(lora))
    assert "adapter" not in server_log(full)

    assert report_main([str(sweep), "--out", str(tmp_path)]) == 0
    table = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): line for line in table.splitlines() if line.count("│") > 2}
    assert "model.lora.enabled=True" in rows["0"] and "done" in rows["0"], table
    assert "model.lora.enabled=False" in rows["1"] and "done" in rows["1"], table
    with (tmp_path / "summary.csv").open() as f:
        labels = {row["run"]: row["label"] for row in csv.DictReader(f)}
    assert labels == {"0": "model.lora.enabled=True", "1": "model.lora.enabled=False"}


def test_a_restart_serves_the_base_with_the_newest_adapter(lora_run: Path, tmp_path: Path) -> None:
    """generation.weight_sync=restart: each sync restarts the server on the base, which loads
    the adapter the trainer just wrote. Iteration 1's batch is the restarted server's: its
    behaviour log-probabilities are the trained policy's (the base's differ, kl > 0), and the run
    is the in-place run (lora_run) exactly."""
    run_dir = tmp_path / "restart"
    args = [*LORA_RUN, "eval.interval=2", "checkpoint.save_interval=2", "train.iterations=2"]
    result = grail_train(*args, "generation.weight_sync=restart", f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stdout + result.stderr
    records = [read_metrics(train_metrics_path(run_dir, i)) for i in range(2)]
    assert [sync_mode(r) for r in records] == [("restart", False)] * 2
    assert records[1]["policy"]["version"] == 1  # trained once, then generated after a restart
    assert records[1]["logprob_mismatch"] < 1e-5 and records[1]["kl"] > 1e-3
    same_metrics(run_dir, lora_run, range(2))
    again, whole = (read_metrics(d / "metrics" / "eval_iter_001.json") for d in (run_dir, lora_run))
    assert {**again, "eval_s": None} == {**whole, "eval_s": None}
    # Three starts (the run's, then one per sync), each on the base with the adapter directory,
    # and no in-place load.
    log = server_log(run_dir)
    commands = re.findall(r"^# command: (.*)$", log, flags=re.MULTILINE)
    assert len(commands) == 3, log
    weights = run_dir / "weights"
    for command in map(shlex.split, commands):
        model, adapter = (command[command.index(flag) + 1] for flag in ("--model", "--lora-dir"))
        assert (model, adapter) == (str(weights), str(weights / "adapter")), command
    assert "weights updated" not in log
