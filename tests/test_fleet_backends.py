"""A fleet of vLLM or SGLang servers (`generation.servers`, or a `gpu.server_gpus` list), without
the packages or a GPU: one GPU per server and the trainer's after them, the config refused in one
line where the GPUs do not add up, and the fleet's control plane against stand-ins that take the
real command lines and answer with the packages' recorded shapes (tests/helpers/fake_gpu_server.py):
every server reloads the one directory the first sync wrote, a dead one restarts in the background
and rejoins at the next sync."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from helpers.fake_gpu_server import (
    RELOAD_ROUTES,
    FakeSGLangServer,
    FakeVLLMServer,
    calls,
    info,
    plan,
)

from grail.core.config import Config, DataConfig, GenerationConfig, TrainConfig
from grail.core.errors import ConfigError
from grail.core.placement import GpuConfig, fleet_size, gpu_layout, gpu_placement
from grail.core.validate import validate
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.inference.weights.syncer import WeightSyncer
from grail.rollouts.fleet import Fleet, FleetClient
from grail.train.components import server_manager_from_config, weight_route_from_config


def _config(backend: str, gpu: GpuConfig, servers: int = 1, processes: int | None = None) -> Config:
    cfg = Config(
        gpu=gpu,
        generation=GenerationConfig(backend=backend, servers=servers),
        train=TrainConfig(processes=processes),
        data=DataConfig(environment="copy_digits"),
    )
    validate(cfg)
    return cfg


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_each_server_of_a_fleet_gets_a_gpu_of_its_own(backend: str, tmp_path: Path) -> None:
    cfg = _config(backend, GpuConfig(strategy="multi"), servers=2, processes=2)
    # multi: the servers take the lowest GPUs, the trainer's ranks the next ones
    assert gpu_layout(cfg.gpu, 2, 2).server == (0, 1)
    assert gpu_layout(cfg.gpu, 2, 2).trainer == (2, 3)
    assert gpu_placement(cfg.gpu, 2) == (0, 2)
    servers = [
        server_manager_from_config(cfg, tmp_path, tmp_path, cuda_available=True, member=i)
        for i in range(2)
    ]
    assert [s.device for s in servers] == ["cuda:0", "cuda:1"]
    assert [s.child_env()["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1"]
    assert [s.log_dir for s in servers] == [tmp_path / "logs" / f"server-{i}" for i in range(2)]
    # apart from the trainer: each server its own NCCL group (auto), sent to in turn
    assert [weight_route_from_config(cfg, True, member=i).name for i in range(2)] == ["nccl"] * 2

    # A list of server GPUs is a fleet of that many servers.
    listed = _config(backend, GpuConfig(server_gpus=[0, 1, 2, 3], training_gpus=[4]))
    assert fleet_size(listed.gpu, listed.generation.servers) == 4
    devices = [
        server_manager_from_config(listed, tmp_path, tmp_path, cuda_available=True, member=i).device
        for i in range(4)
    ]
    assert devices == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]


@pytest.mark.parametrize(
    ("gpu", "servers", "processes", "message"),
    [
        (
            GpuConfig(strategy="single"),
            2,
            None,
            r"generation.servers=2 with generation.backend=vllm: each vllm server needs a GPU of "
            r"its own, and gpu.strategy=single gives the servers GPUs \[0\]",
        ),
        (
            GpuConfig(server_gpus=[0, 1, 2], training_gpus=[3]),
            2,
            None,
            r"generation.servers=2 .* the server GPUs are \[0, 1, 2\]; name one GPU per server",
        ),
    ],
)
def test_a_fleet_whose_gpus_do_not_add_up_is_refused(
    gpu: GpuConfig, servers: int, processes: int | None, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _config("vllm", gpu, servers=servers, processes=processes)


def test_built_in_servers_may_share_a_gpu() -> None:
    cfg = _config("builtin", GpuConfig(strategy="single"), servers=3)
    assert gpu_layout(cfg.gpu, None, 3).server == (0,)  # all three on the trainer's GPU


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "weights"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    return path


def _client(server: FakeVLLMServer | FakeSGLangServer) -> CompletionClient:
    return CompletionClient(
        server.base_url,
        server.model_name,
        api_key=server.api_key,
        timeout=10.0,
        max_retries=0,
        liveness_check=server.check_alive,
        backend=server.kind,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_a_fleet_reloads_every_server_and_restarts_a_dead_one_in_the_background(
    kind: str, model_dir: Path, tmp_path: Path
) -> None:
    cls = FakeVLLMServer if kind == "vllm" else FakeSGLangServer
    servers = [
        cls(
            model_dir,
            "policy",
            log_dir=tmp_path / "logs" / f"server-{i}",
            device=f"cuda:{i}",
            start_timeout=20.0,
            stop_timeout=5.0,
        )
        for i in range(2)
    ]
    fleet = Fleet([(s, WeightSyncer.for_server(s, "disk")) for s in servers])
    written: list[Path] = []
    loop = asyncio.new_event_loop()  # the clients' one loop, as the run's generation thread
    try:
        fleet.launch()
        client = fleet.connect(
            FleetClient([_client(s) for s in servers], window=2, on_set_aside=fleet.set_aside)
        )
        assert [info(s)["env"]["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1"]

        async def ask(count: int) -> None:
            sampling = SamplingParams(max_tokens=3, temperature=0.7)
            groups = await client.complete_many([[1, 2]] * count, 2, sampling, list(range(count)))
            assert len(groups) == count and all(len(g) == 2 for g in groups)

        loop.run_until_complete(ask(8))
        assert all(r["requests"] > 0 for r in client.server_records())

        # The first server's sync writes the directory once; every server reloads it.
        fleet.sync(lambda d: written.append(Path(d)), "iter_001")
        assert written == [model_dir]
        for server in servers:
            reloads = [c for c in calls(server) if c["path"] in RELOAD_ROUTES]
            assert len(reloads) == 1 and str(model_dir) in str(reloads[0])
            assert server.weight_version == "iter_001"

        # Server 1 dies in the middle of a request: the batch completes on server 0, and
        # server 1 restarts at once, in the background, before any sync.
        dead_pid = servers[1].pid
        plan(servers[1], v1__completions=[{"die": True}])
        loop.run_until_complete(ask(8))
        assert client.aside() == [1] and client.server_records()[1]["failures"] >= 1
        deadline = time.monotonic() + 20
        while not (servers[1].is_alive() and servers[1].pid != dead_pid):
            assert time.monotonic() < deadline, "server 1 was not restarted in the background"
            time.sleep(0.05)

        # The next sync waits for it, gives it the new weights, and it serves again.
        fleet.sync(lambda d: written.append(Path(d)), "iter_002")
        assert client.aside() == [] and servers[1].weight_version == "iter_002"
        before = client.server_records()[1]["requests"]
        loop.run_until_complete(ask(8))
        assert client.server_records()[1]["requests"] > before
        loop.run_until_complete(client.aclose())
    finally:
        loop.close()
        fleet.stop()
    assert not any(s.is_alive() for s in servers)
