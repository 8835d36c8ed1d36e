"""Sweeps: runs that share a machine get disjoint GPUs and a share of the cores, concurrent runs
never share a port or a directory, a failed run does not stop the sweep (and is listed at its end),
and a `resume=true` rerun finishes only what is missing.

The end-to-end tests drive the real `grail-train` entry logic (`grail.train.cli.train_job`) through
Hydra's multirun and the submitit local launcher, with the training loop replaced by a stand-in
that starts a (fake) inference server and writes schema-valid metrics in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import httpx
import pytest
from helpers.fake_server import FakeBuiltinServer
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core.placement import GpuConfig
from grail.core.validate import validate
from grail.inference import os_process
from grail.study.runs import append_attempt, run_record
from grail.study.sweep import (
    SUBMITIT_LOCAL,
    SUBMITIT_SLURM,
    Action,
    RunRecord,
    RunShape,
    SweepError,
    assign_resources,
    decide,
    default_parallel_runs,
    explicit_keys,
    resource_overrides,
    run_shape,
)
from grail.train import launch, sweep_job
from grail.train.cli import CONF_DIR

TESTS_DIR = Path(__file__).resolve().parent
BASIC = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"

# ---- resource assignment ------------------------------------------------------------------------


@pytest.mark.parametrize("strategy,per_run", [("single", 1), ("multi", 2)])
def test_runs_alive_together_get_disjoint_gpus(strategy: str, per_run: int) -> None:
    gpus = 8
    parallel = gpus // per_run
    for batch in range(3):  # Hydra launches job numbers [b*P, b*P + P) together
        used: list[int] = []
        for job in range(batch * parallel, (batch + 1) * parallel):
            r = assign_resources(job, parallel, gpus=gpus, cpus=32, strategy=strategy)
            ids = sorted({r.server_gpu, r.training_gpu})
            assert len(ids) == per_run  # multi: server and trainer on different GPUs
            used += ids
        assert sorted(used) == list(range(gpus))  # every GPU used once


def test_cpu_runs_split_the_cores_instead_of_oversubscribing() -> None:
    r = assign_resources(5, 4, gpus=0, cpus=16, strategy="single")
    assert (r.slot, r.cores, r.server_gpu, r.training_gpu) == (1, 4, None, None)
    assert assign_resources(0, 4, gpus=0, cpus=2, strategy="single").cores == 1  # never 0
    assert assign_resources(0, 1, gpus=0, cpus=2, strategy="single").cores == 2


def test_more_parallel_runs_than_gpus_is_refused_naming_the_knob() -> None:
    with pytest.raises(SweepError, match=r"need 6 GPUs.*has 4.*max_batch_size=2"):
        assign_resources(0, 3, gpus=4, cpus=8, strategy="multi")
    with pytest.raises(SweepError, match="needs 2 GPUs per run, this machine has 1"):
        assign_resources(0, 1, gpus=1, cpus=8, strategy="multi")
    with pytest.raises(SweepError, match="gpu.strategy='both'"):
        assign_resources(0, 1, gpus=4, cpus=8, strategy="both")


def test_default_parallelism_per_launcher() -> None:
    assert default_parallel_runs(SUBMITIT_LOCAL, gpus=8, cpus=64, strategy="multi") == 4
    assert default_parallel_runs(SUBMITIT_LOCAL, gpus=1, cpus=64, strategy="multi") == 1
    assert default_parallel_runs(SUBMITIT_LOCAL, gpus=0, cpus=2, strategy="single") == 2
    assert default_parallel_runs(SUBMITIT_LOCAL, gpus=0, cpus=64, strategy="single") == 4
    # launchers that do not share this machine must not be batched (a batch waits for its slowest)
    assert default_parallel_runs(BASIC, gpus=8, cpus=64, strategy="single") is None
    assert default_parallel_runs(SUBMITIT_SLURM, gpus=8, cpus=64, strategy="single") is None


def test_explicit_settings_win_over_the_assignment() -> None:
    r = assign_resources(1, 2, gpus=2, cpus=8, strategy="single")
    # the run's 4 cores split as a lone run splits the machine: the trainer all in sync mode
    assert resource_overrides(r, set(), pipelined=False) == {
        "train.threads": 4,
        "generation.server_threads": 2,
        "gpu.server_gpu": 1,
        "gpu.training_gpu": 1,
    }
    assert resource_overrides(r, {"train.threads", "gpu.server_gpu"}, pipelined=True) == {
        "generation.server_threads": 2,
        "gpu.training_gpu": 1,
    }
    assert resource_overrides(r, set(), pipelined=True)["train.threads"] == 2
    # a run of a fleet of 2 servers gives each half the servers' share (generation.servers)
    assert (
        resource_overrides(r, set(), pipelined=False, servers=2)["generation.server_threads"] == 1
    )
    keys = ["train.threads", "gpu.server_gpu"]
    assert explicit_keys(["train.lr=1", "++train.threads=2", "gpu.server_gpu=0"], keys) == {
        "train.threads",
        "gpu.server_gpu",
    }


# Shapes on an 8-GPU machine: (shape, runs packed at once by default, {slot: (server, trainer)})
EIGHT_GPU_SHAPES = [
    (RunShape(1, 1, shared=True), 8, {0: ((0,), (0,)), 1: ((1,), (1,)), 7: ((7,), (7,))}),
    (RunShape(1, 1, shared=False), 4, {0: ((0,), (1,)), 1: ((2,), (3,)), 3: ((6,), (7,))}),
    (RunShape(1, 3, shared=False), 2, {0: ((0,), (1, 2, 3)), 1: ((4,), (5, 6, 7))}),
    (RunShape(2, 6, shared=False), 1, {0: ((0, 1), (2, 3, 4, 5, 6, 7))}),
    (RunShape(1, 2, shared=True), 4, {0: ((0,), (0, 1)), 3: ((6,), (6, 7))}),
    (RunShape(1, 2, shared=False), 2, {0: ((0,), (1, 2)), 1: ((4,), (5, 6))}),  # windows of 4
]


@pytest.mark.parametrize("shape,parallel,layouts", EIGHT_GPU_SHAPES)
def test_eight_gpus_pack_as_many_runs_as_fit_each_on_its_own_gpus(
    shape: RunShape, parallel: int, layouts: dict
) -> None:
    assert default_parallel_runs(SUBMITIT_LOCAL, gpus=8, cpus=64, shape=shape) == parallel
    for batch in range(2):  # Hydra launches job numbers [b*P, b*P + P) together
        runs = [
            assign_resources(job, parallel, gpus=8, cpus=64, shape=shape)
            for job in range(batch * parallel, (batch + 1) * parallel)
        ]
        used = [g for r in runs for g in {*r.server_gpus, *r.training_gpus}]
        assert len(used) == len(set(used)) == parallel * shape.gpus  # disjoint, none idle inside
        assert all(len(r.training_gpus) == shape.trainer for r in runs)
        assert all(len(r.server_gpus) == shape.server for r in runs)
        for slot, expected in layouts.items():
            assert (runs[slot].server_gpus, runs[slot].training_gpus) == expected


def test_runs_of_different_shapes_in_one_sweep_stay_apart() -> None:
    # train.processes=1,3 with gpu.strategy=multi swept together: each run owns a window of 4
    small = assign_resources(0, 2, gpus=8, cpus=64, shape=RunShape(1, 1, shared=False))
    big = assign_resources(1, 2, gpus=8, cpus=64, shape=RunShape(1, 3, shared=False))
    assert (small.server_gpus, small.training_gpus) == ((0,), (1,))
    assert (big.server_gpus, big.training_gpus) == ((4,), (5, 6, 7))


def test_a_run_larger_than_the_machine_is_refused() -> None:
    with pytest.raises(
        SweepError,
        match=r"1 server \+ 8 training GPU\(s\) needs 9 GPUs per run, "
        r"this machine has 8: use fewer train.processes",
    ):
        assign_resources(0, 1, gpus=8, cpus=64, shape=RunShape(1, 8, shared=False))
    # the default batch size is then 1, and that one run is what is refused
    assert (
        default_parallel_runs(SUBMITIT_LOCAL, gpus=8, cpus=64, shape=RunShape(1, 8, shared=False))
        == 1
    )
    with pytest.raises(
        SweepError,
        match=r"3 runs at once, each with 1 server \+ 3 training GPU"
        r"\(s\), need 12 GPUs, this machine has 8: set "
        r"hydra.sweeper.max_batch_size=2",
    ):
        assign_resources(0, 3, gpus=8, cpus=64, shape=RunShape(1, 3, shared=False))
    with pytest.raises(SweepError, match="shared server needs no more GPUs"):
        RunShape(2, 1, shared=True)


@pytest.mark.parametrize(
    "gpu,processes,shape",
    [
        (GpuConfig(), None, RunShape(1, 1, shared=True)),
        (GpuConfig(strategy="multi"), 3, RunShape(1, 3, shared=False)),  # type: ignore[arg-type]
        (GpuConfig(), 4, RunShape(1, 4, shared=True)),
        (
            GpuConfig(server_gpus=[0, 1], training_gpus=[2, 3, 4, 5, 6, 7]),
            None,
            RunShape(2, 6, shared=False),
        ),
    ],
)
def test_a_runs_shape_follows_its_gpu_config(
    gpu: GpuConfig, processes: int | None, shape: RunShape
) -> None:
    assert run_shape(gpu, processes) == shape


def test_sides_of_several_gpus_are_set_as_lists_and_explicit_sides_left_whole() -> None:
    r = assign_resources(1, 2, gpus=8, cpus=8, shape=RunShape(2, 2, shared=False))
    assert resource_overrides(r, set(), pipelined=False) == {
        "train.threads": 4,
        "generation.server_threads": 2,
        "gpu.server_gpus": [4, 5],
        "gpu.training_gpus": [6, 7],
    }
    # a side the user named, by either of its keys, is left alone
    assert resource_overrides(r, {"gpu.training_gpu", "gpu.server_gpus"}, pipelined=False) == {
        "train.threads": 4,
        "generation.server_threads": 2,
    }
    cfg = _compose("gpu.strategy=multi", "train.iterations=1")
    for key, value in resource_overrides(r, set(), pipelined=False).items():
        OmegaConf.update(cfg, key, value, merge=False)
    validate(OmegaConf.to_object(cfg))  # lists set by the sweep make a valid config


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose(config_name="offline_grpo", overrides=list(overrides))


def _hydra_cfg(target: str, batch: int | None, job: int, task: list[str]):
    return OmegaConf.create(
        {
            "launcher": {"_target_": target},
            "sweeper": {"max_batch_size": batch},
            "job": {"num": job},
            "overrides": {"task": task},
        }
    )


def test_cli_applies_the_share_to_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "visible_gpus", lambda: 4)
    monkeypatch.setattr(sweep_job, "available_cores", lambda: 16)
    # reproducible=false (the default): the threads follow the cores (reproducible=true: below)
    cfg = _compose("train.threads=3", "gpu.strategy=multi", "reproducible=false")
    cfg.generation.server_threads = 5  # set in a YAML file: also the user's choice
    values = sweep_job.sweep_resources(
        cfg, _hydra_cfg(SUBMITIT_LOCAL, 2, job=3, task=["train.threads=3", "gpu.strategy=multi"])
    )
    assert values == {"gpu.server_gpu": 2, "gpu.training_gpu": 3}

    cfg = _compose("gpu.strategy=multi", "reproducible=false")
    values = sweep_job.sweep_resources(cfg, _hydra_cfg(SUBMITIT_LOCAL, 2, job=3, task=[]))
    assert values == {
        "train.threads": 8,
        "generation.server_threads": 4,
        "gpu.server_gpu": 2,
        "gpu.training_gpu": 3,
    }
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=False)
    validate(OmegaConf.to_object(cfg))  # the result is a valid config

    # one run at a time (basic launcher) or one allocation per job (SLURM): the whole machine
    for target in (BASIC, SUBMITIT_SLURM):
        values = sweep_job.sweep_resources(
            _compose("reproducible=false"), _hydra_cfg(target, None, job=5, task=[])
        )
        assert values["train.threads"] == 16 and values["gpu.server_gpu"] == 0

    # reproducible=true: fixed threads in a sweep as alone, so a seed gives the same numbers
    # either way; only the GPUs are shared out
    values = sweep_job.sweep_resources(
        _compose("gpu.strategy=multi", "reproducible=true"),
        _hydra_cfg(SUBMITIT_LOCAL, 2, job=3, task=[]),
    )
    assert values == {"gpu.server_gpu": 2, "gpu.training_gpu": 3}


def test_local_launcher_preset_composes_with_automatic_batch_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sweep_job, "available_cores", lambda: 2)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        local = compose(
            config_name="offline_grpo",
            overrides=["hydra/launcher=local"],
            return_hydra_config=True,
        )
        slurm = compose(
            config_name="offline_grpo",
            overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
            return_hydra_config=True,
        )
    assert local.hydra.launcher._target_ == SUBMITIT_LOCAL
    gpus = launch.visible_gpus()
    expected = gpus if gpus else 2
    assert local.hydra.sweeper.max_batch_size == expected
    assert local.hydra.launcher.gpus_per_node == gpus  # jobs see every GPU, grail splits them
    assert slurm.hydra.launcher._target_ == SUBMITIT_SLURM
    assert slurm.hydra.sweeper.max_batch_size is None and slurm.hydra.launcher.partition == "gpu"


# ---- rerun decisions ----------------------------------------------------------------------------


def _record(status=None, progress=False, overrides=None) -> RunRecord:
    return RunRecord(status=status, has_progress=progress, overrides=overrides)


@pytest.mark.parametrize(
    "record,action",
    [
        (_record("completed", True), Action.SKIP),
        (_record("failed", True), Action.RETRY),
        (_record("failed", False), Action.RETRY),  # failed before any progress: run it again
        (_record(None, True), Action.RESUME),  # killed mid-way
        (_record(None, False), Action.START),  # never got going
    ],
)
def test_resume_finishes_only_what_is_missing(record: RunRecord, action: Action) -> None:
    assert decide(record, resume=True, overrides=["train.lr=1"]).action is action


def test_without_resume_every_job_starts_over() -> None:
    assert decide(_record("completed", True), resume=False, overrides=[]).action is Action.START


def test_a_directory_holding_another_sweep_point_is_not_continued() -> None:
    earlier = _record("completed", True, ("train.lr=1e-5", "train.kl_coef=0"))
    # the user reordered or changed the sweep values: job 0 is now a different point
    with pytest.raises(SweepError, match=r"train.lr=1e-5 before, train.lr=1e-4 now"):
        decide(earlier, resume=True, overrides=["train.lr=1e-4", "train.kl_coef=0"])
    # resume=true itself, or a setting added for the rerun, is not a different point
    same = decide(
        earlier,
        resume=True,
        overrides=["train.lr=1e-5", "train.kl_coef=0", "resume=true", "x.timeout=300"],
    )
    assert same.action is Action.SKIP


def test_run_record_reads_the_directory(tmp_path: Path) -> None:
    from helpers.run_dirs import make_run

    assert run_record(tmp_path / "none") == RunRecord(None, False, None)
    run = make_run(tmp_path / "r", ["train.lr=1"], iterations=4, done=2)
    append_attempt(run, "start", ["train.lr=1"], 0)
    assert run_record(run) == RunRecord(None, True, ("train.lr=1",))
    make_run(run, ["train.lr=1"], iterations=4, done=4, completed=True)
    assert run_record(run).status == "completed"


# ---- concurrent runs: ports and directories -----------------------------------------------------


def test_concurrent_servers_never_share_a_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two sweep runs starting their servers at the same moment, both handed the same "free"
    port (the race between probing a port and binding it, forced): one binds it, the other sees
    "address already in use" and retries on a new port. Each ends up talking to its own server,
    and each writes its log into its own run directory."""
    shared = os_process.free_port("127.0.0.1")
    real = os_process.free_port
    handed: list[int] = []
    lock = threading.Lock()

    def racy_free_port(host: str) -> int:
        with lock:
            port = shared if len(handed) < 2 else real(host)
            handed.append(port)
            return port

    monkeypatch.setattr(os_process, "free_port", racy_free_port)
    model = tmp_path / "model"
    model.mkdir()
    made = [
        FakeBuiltinServer(
            model, "policy", log_dir=tmp_path / f"run{i}" / "logs", start_timeout=20, stop_timeout=5
        )
        for i in range(2)
    ]
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def launch(server: FakeBuiltinServer) -> None:
        try:
            barrier.wait()
            server.launch()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch, args=(s,)) for s in made]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert handed[:2] == [shared, shared]  # both really were given the same port
        ports = {s.port for s in made}
        assert len(ports) == 2 and shared in ports
        for s in made:
            info = httpx.get(f"{s.root_url}/debug/info", timeout=5).json()
            assert info["pid"] == s.pid  # our own server, not the other run's
        logs = {s.log_path.parent.parent.name for s in made}
        assert logs == {"run0", "run1"}
    finally:
        for s in made:
            s.stop(timeout=1.0)


# ---- end to end through Hydra -------------------------------------------------------------------

DRIVER = textwrap.dedent(
    """
    # grail-train with the training loop replaced by a quick stand-in (see tests/test_sweep.py).
    import sys

    import hydra

    from grail.train.cli import CONF_DIR

    TESTS_DIR = {tests_dir!r}


    def fake_run(cfg, run_dir, resume=None):
        import json, os, sys, time
        sys.path.insert(0, TESTS_DIR)
        from helpers.fake_server import FakeBuiltinServer
        from helpers.run_dirs import eval_record, summary_record, train_record
        from grail.core.records import write_metrics

        start = time.time()
        fail_lr = os.environ.get("FAKE_FAIL_LR")
        metrics = run_dir / "metrics"
        done = sorted(metrics.glob("train_iter_*.json")) if cfg.resume else []
        model = run_dir / "weights"
        model.mkdir(parents=True, exist_ok=True)
        with FakeBuiltinServer(model, "policy", log_dir=run_dir / "logs", start_timeout=30) as s:
            port = s.port
            write_metrics(metrics / "eval_baseline.json", eval_record(-1, 0.0, 0.1), "eval")
            for i in range(len(done), cfg.train.iterations):
                if fail_lr is not None and cfg.train.lr == float(fail_lr) and i == 1:
                    raise FloatingPointError(f"loss is NaN at iteration {{i}}")
                record = train_record(i, 0.1 + cfg.train.lr * i)
                write_metrics(metrics / f"train_iter_{{i:03d}}.json", record, "train_iteration")
            # FAKE_BARRIER=n: wait (server up) until n runs of the sweep are here at once.
            barrier, waited = int(os.environ.get("FAKE_BARRIER", "0")), 0.0
            if barrier:
                here = run_dir.parent / ".barrier"
                here.mkdir(exist_ok=True)
                (here / run_dir.name).touch()
                while len(list(here.iterdir())) < barrier and waited < 60:
                    time.sleep(0.1)
                    waited += 0.1
        write_metrics(
            metrics / f"eval_iter_{{cfg.train.iterations - 1:03d}}.json",
            eval_record(cfg.train.iterations - 1, cfg.train.lr, 0.5),
            "eval",
        )
        seen = {{
            "port": port, "pid": os.getpid(), "start": start, "end": time.time(),
            "resumed_after": len(done), "threads": cfg.train.threads, "waited": waited,
            "server_threads": cfg.generation.server_threads,
        }}
        with open(run_dir / "fake_run.jsonl", "a") as f:
            f.write(json.dumps(seen) + "\\n")
        summary = summary_record(cfg.train.iterations, 1.0)
        write_metrics(run_dir / "summary.json", summary, "summary")


    @hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="offline_grpo")
    def task(cfg):
        import types
        import grail.train.cli as cli
        import grail.train.launch as launch

        loop = types.ModuleType("grail.train.loop")
        loop.run = fake_run
        sys.modules["grail.train.loop"] = loop
        launch.visible_gpus = lambda: 0  # a CPU machine, whatever this one has
        cli.train_job(cfg)


    if __name__ == "__main__":
        task()
    """
)


@pytest.fixture
def driver(tmp_path: Path) -> Path:
    path = tmp_path / "driver.py"
    path.write_text(DRIVER.format(tests_dir=str(TESTS_DIR)))
    return path


def _grail_train(driver: Path, *args: str, env: dict[str, str] | None = None, timeout=180):
    result = subprocess.run(
        [sys.executable, str(driver), *args],
        cwd=driver.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    return result.returncode, result.stdout + result.stderr


def _seen(run_dir: Path) -> list[dict]:
    path = run_dir / "fake_run.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _actions(run_dir: Path) -> list[str]:
    lines = (run_dir / "attempts.jsonl").read_text().splitlines()
    return [json.loads(line)["action"] for line in lines]


def test_sweep_survives_a_failed_run_and_a_rerun_finishes_only_what_is_missing(
    driver: Path,
) -> None:
    sweep_dir = driver.parent / "sweep"
    grid = ["-m", "train.lr=0.1,0.2", "train.kl_coef=0,0.05", "train.iterations=3"]
    code, out = _grail_train(
        driver, *grid, f"hydra.sweep.dir={sweep_dir}", env={"FAKE_FAIL_LR": "0.2"}
    )
    assert code == 1, out  # the sweep ran to its end, then reported the failures
    runs = [sweep_dir / str(i) for i in range(4)]
    status = {r.name: json.loads((r / "summary.json").read_text())["status"] for r in runs}
    assert status == {"0": "completed", "1": "completed", "2": "failed", "3": "failed"}
    assert "2 of 4 runs did not complete" in out
    assert "train.lr=0.2 train.kl_coef=0): failed - FloatingPointError: loss is NaN at" in out
    failed = json.loads((runs[2] / "summary.json").read_text())
    assert failed["iterations"] == 1 and "loss is NaN" in failed["error"]["message"]

    # Each run: its own directory, server (port, log) and metrics.
    seen = [_seen(r)[0] for r in runs[:2]]
    assert seen[0]["port"] != seen[1]["port"]
    for r in runs:
        assert (r / "logs" / "builtin-policy.log").is_file()
        assert (r / ".hydra" / "overrides.yaml").is_file()
    assert len(list((runs[0] / "metrics").glob("train_iter_*.json"))) == 3

    # Run 1 is interrupted after its first iteration (no summary, a later iteration missing).
    (runs[1] / "summary.json").unlink()
    (runs[1] / "metrics" / "train_iter_002.json").unlink()
    (runs[1] / "metrics" / "train_iter_001.json").unlink()

    # Rerun the same command with resume=true (the cause of the failures fixed meanwhile).
    code, out = _grail_train(driver, *grid, f"hydra.sweep.dir={sweep_dir}", "resume=true")
    assert code == 0, out
    assert "all 4 runs completed" in out
    assert _actions(runs[0]) == ["start", "skip"] and len(_seen(runs[0])) == 1  # not run again
    assert _actions(runs[1]) == ["start", "resume"]
    assert _seen(runs[1])[-1]["resumed_after"] == 1  # continued, not restarted
    assert _actions(runs[2]) == ["start", "retry"]
    assert (runs[2] / "summary.failed.json").is_file()  # the first failure is kept
    for r in runs:
        assert json.loads((r / "summary.json").read_text())["status"] == "completed"


def test_single_run_failure_still_exits_non_zero(driver: Path) -> None:
    code, out = _grail_train(driver, "train.lr=-1", f"hydra.run.dir={driver.parent / 'bad'}")
    assert code == 2 and "train.lr must be > 0" in out
    code, out = _grail_train(
        driver,
        "train.lr=0.2",
        "train.iterations=3",
        f"hydra.run.dir={driver.parent / 'nan'}",
        env={"FAKE_FAIL_LR": "0.2"},
    )
    assert code == 1 and "loss is NaN" in out


def test_submitit_local_launcher_runs_jobs_in_parallel_with_their_own_share(
    driver: Path,
) -> None:
    sweep_dir = driver.parent / "parallel"
    code, out = _grail_train(
        driver,
        "-m",
        "hydra/launcher=local",
        "hydra.launcher.gpus_per_node=0",
        "hydra.sweeper.max_batch_size=2",
        "train.lr=0.1,0.2",
        "train.iterations=2",
        "reproducible=false",  # threads from the share (reproducible runs have fixed ones)
        f"hydra.sweep.dir={sweep_dir}",
        env={"FAKE_BARRIER": "2"},
        timeout=240,
    )
    assert code == 0, out
    seen = [_seen(sweep_dir / str(i))[0] for i in range(2)]
    assert seen[0]["pid"] != seen[1]["pid"]  # separate processes...
    assert all(s["waited"] < 60 for s in seen)  # ...alive at the same time (they met)
    assert seen[0]["port"] != seen[1]["port"]
    share = max(1, sweep_job.available_cores() // 2)
    for s in seen:
        assert (s["threads"], s["server_threads"]) == (share, max(1, share // 2))
    assert (sweep_dir / ".submitit").is_dir()
