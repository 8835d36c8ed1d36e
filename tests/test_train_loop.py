"""End to end: `grail-train` on the tiny model through the built-in server, on CPU.

Covers what a user relies on: the files a run writes (all valid against their schemas), resume
after SIGKILL giving the same metrics as an uninterrupted run, and no server process surviving a
run that fails or is interrupted.
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
from helpers.grail_process import alive, finish, servers_of, train_process, wait_for
from helpers.loggers import read_scalars

from grail.core.records import read_metrics, validate_metrics

# Things that legitimately differ between two runs of the same config.
VOLATILE = {"timings", "tokens_per_s", "eval_s"}


def _stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in VOLATILE}


def _flat(record: dict, prefix: str = "") -> dict:
    """Nested metrics as one level (`tokens.prompt`), for pytest.approx."""
    out: dict = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _kill_after_checkpoint(run_dir: Path, *overrides: str) -> None:
    """Start a run, SIGKILL it (no cleanup code runs in the trainer) once checkpoint iter_001 is
    committed, and wait for its orphaned server to die."""
    proc = train_process(run_dir, *overrides)
    wait_for(
        lambda: (run_dir / "checkpoints" / "iter_001").exists() or proc.poll() is not None,
        240,
        "checkpoint iter_001",
    )
    server_pids = servers_of(run_dir)
    assert server_pids, "the run should have a server process"
    proc.kill()
    proc.communicate()
    wait_for(lambda: not any(alive(p) for p in server_pids), 15, "the orphaned server to die")


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 4-iteration run SIGKILLed once its checkpoint iter_001 was committed, left as the kill
    left it. The resume tests each resume a copy (run directories hold no absolute paths that
    resume reads), so the kill, a whole run's start, happens once."""
    run_dir = tmp_path_factory.mktemp("killed")
    _kill_after_checkpoint(run_dir, "train.iterations=4")
    return run_dir


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 4-iteration run, shared by the tests below."""
    run_dir = tmp_path_factory.mktemp("full")
    out = finish(train_process(run_dir, "train.iterations=4"))
    assert (run_dir / "summary.json").exists(), out[-3000:]
    return run_dir


def test_run_writes_every_file_valid_against_its_schema(full_run: Path) -> None:
    metrics = full_run / "metrics"
    names = sorted(p.name for p in metrics.iterdir())
    assert names == [
        "eval_baseline.json",
        "eval_iter_001.json",
        "eval_iter_003.json",
        *[f"train_iter_{i:03d}.json" for i in range(4)],
    ]
    for path in metrics.iterdir():
        schema = "eval" if path.name.startswith("eval") else "train_iteration"
        validate_metrics(read_metrics(path), schema)
    validate_metrics(read_metrics(full_run / "summary.json"), "summary")
    record = read_metrics(metrics / "train_iter_002.json")
    assert record["iteration"] == 2 and record["tokens"]["completion"] > 0
    assert set(record["timings"]) >= {"generation_s", "train_s", "weight_sync_s", "iteration_s"}
    # the default job on CPU: the built-in server reads the trainer's shared-memory weights
    assert record["weight_sync"] == {
        "mode": "in_place",
        "fell_back": False,
        "transfer": "shared",
        "transfer_fallbacks": 0,
    }
    # newest keep_last_k checkpoints, each a directory transformers can load
    assert sorted(p.name for p in (full_run / "checkpoints").iterdir()) == ["iter_002", "iter_003"]
    assert (full_run / "checkpoints" / "iter_003" / "model.safetensors").exists()
    assert any((full_run / "logs").glob("*.log"))
    assert not list(full_run.rglob("*.tmp"))


def test_same_seed_gives_same_metrics(full_run: Path, tmp_path: Path) -> None:
    out = finish(train_process(tmp_path, "train.iterations=2", "eval.enabled=false"))
    for it in range(2):
        name = f"train_iter_{it:03d}.json"
        assert tmp_path.joinpath("metrics", name).exists(), out[-3000:]
        assert _stable(read_metrics(tmp_path / "metrics" / name)) == _stable(
            read_metrics(full_run / "metrics" / name)
        )


def test_sigkill_then_resume_matches_uninterrupted_run(
    full_run: Path, killed_run: Path, tmp_path: Path
) -> None:
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    killed_at = max(
        int(p.name.removeprefix("iter_")) for p in (tmp_path / "checkpoints").glob("iter_*")
    )

    out = finish(train_process(tmp_path, "train.iterations=4", "resume=true"))
    assert "resuming after iteration" in out, out[-3000:]
    for it in (2, 3):
        name = f"train_iter_{it:03d}.json"
        resumed = read_metrics(tmp_path / "metrics" / name)
        assert _stable(resumed) == _stable(read_metrics(full_run / "metrics" / name)), name
    final = read_metrics(tmp_path / "metrics" / "eval_iter_003.json")
    assert _stable(final) == _stable(read_metrics(full_run / "metrics" / "eval_iter_003.json"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["iterations"] == 4
    # The wall time covers both parts: the killed start (up to its last iteration) and the resume.
    first, resume = summary["parts"]
    assert first["iterations"] >= 2 and resume["iterations"] == 4 - (killed_at + 1)
    assert first["wall_time_s"] > 0 and resume["wall_time_s"] > 0
    assert summary["wall_time_s"] == pytest.approx(first["wall_time_s"] + resume["wall_time_s"])


def test_resume_falls_back_past_a_truncated_checkpoint(
    full_run: Path, killed_run: Path, tmp_path: Path
) -> None:
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    newest = max((tmp_path / "checkpoints").glob("iter_*"))
    state = newest / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:1000])  # a disk that filled, a copy cut short

    out = finish(train_process(tmp_path, "train.iterations=4", "resume=true"))
    assert f"checkpoint {newest} is damaged, falling back" in out, out[-3000:]
    assert str(state) in out
    older = int(newest.name.removeprefix("iter_")) - 1
    assert f"resuming after iteration {older} from" in out
    for it in range(4):
        name = f"train_iter_{it:03d}.json"
        resumed = read_metrics(tmp_path / "metrics" / name)
        assert _stable(resumed) == _stable(read_metrics(full_run / "metrics" / name)), name
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["iter_002", "iter_003"]


def test_resume_of_a_finished_run_says_so_without_starting_a_server(full_run: Path) -> None:
    before = json.loads((full_run / "summary.json").read_text())
    (full_run / "summary.json").unlink()
    proc = train_process(full_run, "train.iterations=4", "resume=true")
    out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert f"run {full_run} is complete" in out
    assert "started builtin server" not in out and "loaded weights" not in out
    summary = json.loads((full_run / "summary.json").read_text())  # written again
    assert summary["parts"] == before["parts"] and len(summary["parts"]) == 1
    assert summary["wall_time_s"] == before["wall_time_s"]
    assert summary["status"] == "completed" and summary["iterations"] == 4
    # The end of the summary says where the run's files are.
    assert f"run directory: {full_run}" in out
    for name in ("summary.json", "metrics/", "checkpoints/", "logs/"):
        assert f"\n  {name} " in out, name


def test_failing_run_leaves_no_server_and_names_the_plugin(tmp_path: Path) -> None:
    proc = train_process(
        tmp_path,
        "train.iterations=2",
        "eval.enabled=false",
        "data.rewards=[{fn: 'tests.reward_plugins:raises', weight: 1.0}]",
        cwd=Path(__file__).resolve().parents[1],
    )
    out = finish(proc)
    assert proc.returncode != 0
    assert "tests.reward_plugins:raises" in out, out[-3000:]
    assert (tmp_path / "logs").is_dir(), "the server should have started before the failure"
    assert not servers_of(tmp_path)


@pytest.mark.parametrize("pipeline", [False, True], ids=["sync", "pipelined"])
def test_ctrl_c_stops_the_run_and_its_server(tmp_path: Path, pipeline: bool) -> None:
    proc = train_process(
        tmp_path, "train.iterations=50", f"train.pipeline={pipeline}", "eval.enabled=false"
    )
    # Once iteration 0 is written, a pipelined run trains iteration 1 while iteration 2 generates.
    wait_for(
        lambda: any((tmp_path / "metrics").glob("train_iter_*.json")) or proc.poll() is not None,
        240,
        "the first iteration",
    )
    server_pids = servers_of(tmp_path)
    assert server_pids, "the run should have a server process"
    proc.send_signal(signal.SIGINT)
    out = finish(proc, timeout=60)
    assert proc.returncode != 0
    # What the harness logs when it restarts a server (a traceback may quote the source line that
    # names `max_restarts`, which is no restart).
    restarts = [m for m in ("restarting the", "and retry", "falling back to a restart") if m in out]
    assert not restarts, f"a cancelled generation must not restart the server: {restarts}"
    assert out.count("started builtin server") == 1, out[-3000:]
    wait_for(lambda: not any(alive(p) for p in server_pids), 15, "the server to stop")
    assert not list(tmp_path.rglob("*.tmp"))


def test_fresh_run_refuses_a_directory_that_holds_a_run(full_run: Path) -> None:
    """Refused before anything is written: the metrics, and `.hydra/`, which says how the run was
    configured (a resume and grail-report read it; the refused start once wrote its own config
    there, so a later resume=true would have continued with train.iterations=7)."""
    before = sorted(p.name for p in (full_run / "metrics").iterdir())
    hydra = {p.name: p.read_bytes() for p in (full_run / ".hydra").iterdir()}
    proc = train_process(full_run, "train.iterations=7")
    out = finish(proc)
    assert proc.returncode == 1
    assert "already holds the metrics of a run" in out and "resume=true" in out, out[-3000:]
    assert sorted(p.name for p in (full_run / "metrics").iterdir()) == before  # nothing lost
    assert {p.name: p.read_bytes() for p in (full_run / ".hydra").iterdir()} == hydra
    assert "started builtin server" not in out


# --- pipelined mode (train.pipeline=true): one step off-policy ------------------------------------


@pytest.fixture(scope="module")
def pipelined_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("pipelined")
    out = finish(
        train_process(
            run_dir, "train.iterations=4", "train.pipeline=true", "logging.tensorboard=true"
        )
    )
    assert (run_dir / "summary.json").exists(), out[-3000:]
    return run_dir


def test_tensorboard_gets_the_same_numbers_as_the_json_files(pipelined_run: Path) -> None:
    scalars = read_scalars(pipelined_run / "tensorboard")
    rewards = [
        read_metrics(pipelined_run / "metrics" / f"train_iter_{i:03d}.json") for i in range(4)
    ]
    assert [step for step, _ in scalars["train/reward_mean"]] == [1, 2, 3, 4]
    for (_, value), record in zip(scalars["train/reward_mean"], rewards, strict=True):
        assert value == pytest.approx(record["reward_mean"], rel=1e-6)
    baseline = read_metrics(pipelined_run / "metrics" / "eval_baseline.json")
    assert scalars["eval/success_rate"][0] == (0, pytest.approx(baseline["success_rate"]))


def test_pipelined_batches_are_at_most_one_update_stale(
    pipelined_run: Path, full_run: Path
) -> None:
    records = [
        read_metrics(pipelined_run / "metrics" / f"train_iter_{i:03d}.json") for i in range(4)
    ]
    for record in records:
        validate_metrics(record, "train_iteration")
    # Batch 0 comes before any training; batch i+1 is generated with the weights that train batch
    # i, i.e. one update behind the trainer.
    assert [r["policy"]["version"] for r in records] == [0, 0, 1, 2]
    assert [r["policy"]["staleness"] for r in records] == [0, 1, 1, 1]
    assert all(r["policy"]["pipelined"] for r in records)
    # Generation of the next batch ran while this one trained; the last has nothing to prefetch.
    assert all(r["timings"]["overlap_s"] > 0 for r in records[:3])
    assert records[3]["timings"]["overlap_s"] == 0
    # Batch 0 is the synchronous run's batch 0, trained from the same weights: the same samples
    # and rewards exactly; the trainer's numbers within float rounding, since a pipelined trainer
    # has half the cores, and torch's CPU reductions depend on the thread count.
    sync0 = read_metrics(full_run / "metrics" / "train_iter_000.json")
    pipelined0 = _flat(_stable(records[0]))
    expected = _flat({**_stable(sync0), "policy": records[0]["policy"]})
    assert pipelined0.keys() == expected.keys()
    for key in ("reward_mean", "reward_std", "success_rate", "completion_length.mean"):
        assert pipelined0[key] == expected[key], key
    numbers = {k for k, v in expected.items() if isinstance(v, float)}
    assert {k: pipelined0[k] for k in numbers} == pytest.approx(
        {k: expected[k] for k in numbers}, rel=1e-5, abs=1e-7
    )
    assert {k: v for k, v in pipelined0.items() if k not in numbers} == {
        k: v for k, v in expected.items() if k not in numbers
    }
    assert sync0["policy"] == {"version": 0, "staleness": 0, "pipelined": False}


def test_pipelined_run_is_deterministic_and_resumes_exactly(
    pipelined_run: Path, tmp_path: Path
) -> None:
    _kill_after_checkpoint(tmp_path, "train.iterations=4", "train.pipeline=true")

    out = finish(
        train_process(tmp_path, "train.iterations=4", "train.pipeline=true", "resume=true")
    )
    assert "resuming after iteration" in out, out[-3000:]
    # 0-1 ran before the kill (same seed, same metrics); 2-3 after the resume, which trains on the
    # prefetched batch saved in the checkpoint, exactly as the uninterrupted run did.
    for it in range(4):
        name = f"train_iter_{it:03d}.json"
        assert _stable(read_metrics(tmp_path / "metrics" / name)) == _stable(
            read_metrics(pipelined_run / "metrics" / name)
        ), name
