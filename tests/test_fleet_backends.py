"""A fleet of vLLM or SGLang servers (`generation.servers`, or a `gpu.server_gpus` list), without
the packages or a GPU: one GPU per server and the trainer's after them, the config refused in one
line where the GPUs do not add up, and the fleet's control plane against stand-ins that take the
real command lines and answer with the packages' recorded shapes (tests/helpers/fake_gpu_server.py):
every server reloads the one directory the first sync wrote, a dead one restarts in the background
and rejoins at the next sync, and a server that hangs (SIGSTOP) or fails at any moment (start,
sync, restart) is set aside after at most one deadline while the others go on."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers.fake_gpu_server import (
    RELOAD_ROUTES,
    FakeSGLangServer,
    FakeVLLMServer,
    calls,
    info,
    plan,
)

from grail.core.config import Config, DataConfig, GenerationConfig, TrainConfig
from grail.core.errors import ConfigError, UserError
from grail.core.placement import GpuConfig, fleet_size, gpu_layout, gpu_placement
from grail.core.validate import validate
from grail.inference.backends import nccl as nccl_module
from grail.inference.backends import vllm as vllm_module
from grail.inference.backends.nccl import VLLMSender
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.inference.errors import FleetGone, ServerDiedError, ServerTimeoutError
from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.syncer import WeightSyncer
from grail.rollouts.fleet import Fleet
from grail.rollouts.fleet_client import FleetClient
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


def _client(
    server: FakeVLLMServer | FakeSGLangServer, timeout: float = 10.0, max_retries: int = 0
) -> CompletionClient:
    return CompletionClient(
        server.base_url,
        server.model_name,
        api_key=server.api_key,
        timeout=timeout,
        max_retries=max_retries,
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
    fleet = Fleet([(s, WeightSyncer.for_server(s, "disk")) for s in servers], deadline_s=10.0)
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
        # As unmeasured: the stand-ins answer in a millisecond or two, and a speed measured that
        # noisily could keep server 1 from this batch (balance.py's WAIT_MARGIN).
        client.restore(1)
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


# --- servers that hang or fail at any moment ---------------------------------------------------


def _vllm(model_dir: Path, tmp_path: Path, i: int, **kwargs: object) -> FakeVLLMServer:
    """Server i of a fleet of vLLM stand-ins."""
    kwargs.setdefault("start_timeout", 20.0)
    kwargs.setdefault("stop_timeout", 5.0)
    return FakeVLLMServer(
        model_dir,
        "policy",
        log_dir=tmp_path / "logs" / f"server-{i}",
        device=f"cuda:{i}",
        **kwargs,  # type: ignore[arg-type]
    )


def _fleet(servers: list[FakeVLLMServer], deadline_s: float) -> Fleet:
    return Fleet([(s, WeightSyncer.for_server(s, "disk")) for s in servers], deadline_s=deadline_s)


def _ask(client: FleetClient, count: int) -> Callable[[], object]:
    async def ask() -> None:
        sampling = SamplingParams(max_tokens=3, temperature=0.7)
        groups = await client.complete_many([[1, 2]] * count, 2, sampling, list(range(count)))
        assert len(groups) == count and all(len(g) == 2 for g in groups)

    return ask


@contextlib.contextmanager
def _one_stopped(
    servers: list[FakeVLLMServer],
    stopped: int,
    client_of: Callable[[FakeVLLMServer], CompletionClient] = _client,
) -> Iterator[tuple[Fleet, FleetClient, asyncio.AbstractEventLoop, int]]:
    """A fleet of `servers` (deadline 1 s) launched and connected to a client over their
    `client_of`s (made once they listen),
    then server `stopped` SIGSTOPped (its requests reach the kernel's queue and nothing comes
    back): the fleet, the client, an event loop for it, and the stopped pid. On exit the stopped
    process is continued, unless it was replaced meanwhile, and everything stops."""
    fleet = _fleet(servers, deadline_s=1.0)
    loop = asyncio.new_event_loop()
    pid = None
    try:
        fleet.launch()
        clients = [client_of(s) for s in servers]
        client = fleet.connect(FleetClient(clients, window=2, on_set_aside=fleet.set_aside))
        pid = servers[stopped].pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        yield fleet, client, loop, pid
        loop.run_until_complete(client.aclose())
    finally:
        if pid is not None and servers[stopped].pid == pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        loop.close()
        fleet.stop()


def test_a_stopped_server_costs_one_request_timeout_then_restarts_and_rejoins(
    model_dir: Path, tmp_path: Path
) -> None:
    # Server 1 is SIGSTOPped: its requests reach the kernel's queue and nothing comes back. At
    # the first request's deadline (1 s, the client's timeout) it is set aside and its requests
    # go to server 0 (not 4 attempts with backoff, as the client's retries would take); it
    # restarts in the background (its stop continues it, so that it acts on SIGTERM at once,
    # rather than waiting 30 s of grace for SIGKILL) and rejoins at the next sync.
    servers = [_vllm(model_dir, tmp_path, i, stop_timeout=30.0) for i in range(2)]
    client_of = functools.partial(_client, timeout=1.0, max_retries=3)
    with _one_stopped(servers, 1, client_of) as (fleet, client, loop, stopped):
        t0 = time.monotonic()
        loop.run_until_complete(_ask(client, 8)())
        assert time.monotonic() - t0 < 4.5  # one deadline, not ~7 s of retries and backoff
        records = client.server_records()
        assert client.aside() == [1] and records[1]["failures"] >= 1
        assert records[0]["requests"] == 8 // client.prompts_per_request(2, 8)

        t0 = time.monotonic()
        fleet.sync(lambda _d: None, "iter_001")  # waits for its restart
        assert time.monotonic() - t0 < 15.0  # not the 30 s of grace
        assert servers[1].pid != stopped and client.aside() == []
        assert servers[1].weight_version == "iter_001"
        loop.run_until_complete(_ask(client, 8)())
        assert client.server_records()[1]["requests"] > records[1]["requests"]


def test_a_server_that_hangs_in_a_weight_sync_is_set_aside_after_one_deadline(
    model_dir: Path, tmp_path: Path
) -> None:
    # Server 0, the one a disk sync goes to first, is SIGSTOPped before the sync: its reload
    # gets no answer within the fleet's deadline (1 s; 8 s is each call's own timeout), so it is
    # set aside without a restart fallback, server 1 takes the weights, and the sync returns.
    # Server 0 restarts in the background and takes the next sync's weights.
    servers = [
        _vllm(model_dir, tmp_path, i, weight_sync_timeout=8.0, stop_timeout=1.0) for i in range(2)
    ]
    with _one_stopped(servers, 0) as (fleet, client, loop, stopped):
        t0 = time.monotonic()
        fleet.sync(lambda _d: None, "iter_001")
        assert time.monotonic() - t0 < 5.0  # one deadline, not 8 s and a restart
        assert fleet.aside() == [0] and client.aside() == [0]
        assert servers[1].weight_version == "iter_001"
        loop.run_until_complete(_ask(client, 8)())  # all on server 1
        assert client.server_records()[0]["requests"] == 0

        fleet.sync(lambda _d: None, "iter_002")
        assert fleet.aside() == [] and servers[0].pid != stopped
        assert [s.weight_version for s in servers] == ["iter_002", "iter_002"]


class _Sender:
    """The trainer's side of an NCCL group without NCCL: the server's requests, at once."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.master_address, self.master_port = "127.0.0.1", 29511
        self.broken: str | None = None

    init_info = VLLMSender.init_info

    def join(self, server_join: Callable[[], None]) -> None:
        server_join()

    def send(self, tensors: list[torch.Tensor], server_receive: Callable[[], None]) -> float:
        server_receive()
        return 0.0

    def close(self) -> None:
        pass


def test_an_nccl_sync_that_misses_the_fleets_deadline_calls_the_server_no_more(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The fleet's deadline (1 s) bounds the NCCL route too: vLLM's receive request does not
    # answer (4 s), so the sync raises ServerTimeoutError after one deadline, with neither the
    # resume after it nor the disk route's fallback, each of which would wait for it again.
    monkeypatch.setattr(vllm_module, "VLLMSender", _Sender)
    server = _vllm(model_dir, tmp_path, 0, weight_transfer="nccl")
    fleet = Fleet([(server, WeightSyncer.for_server(server, "nccl"))], deadline_s=1.0)
    assert server.nccl_timeout_s == 1.0
    try:
        fleet.launch()
        plan(server, update_weights=[{"sleep": 4}])
        t0 = time.monotonic()
        with pytest.raises(ServerTimeoutError, match="POST /update_weights got no answer"):
            fleet.syncers[0].sync(PolicyWeights(torch.nn.Linear(2, 2)), "iter_001")
        assert time.monotonic() - t0 < 3.5  # the stand-in answers after 4 s
        routes = [c["path"] for c in calls(server)]
        assert routes[-2:] == ["/start_weight_update", "/update_weights"], routes
        assert "/collective_rpc" not in routes
    finally:
        fleet.stop()
    # The real sender's waits time out the same way (a lone server then syncs from disk).
    with pytest.raises(ServerTimeoutError, match="did not finish within 0.05 s"):
        nccl_module._wait(concurrent.futures.Future(), 0.05, "the server's receive")


def test_a_server_killed_in_a_sync_whose_replacement_dies_starting_is_set_aside(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Server 1 dies during its reload; its restart fallback's new process is killed while it
    # starts (the ServerStartError that used to fail the run). It is set aside, server 0 has the
    # weights, the sync returns; server 1 restarts in the background and rejoins at the next.
    servers = [_vllm(model_dir, tmp_path, i) for i in range(2)]
    fleet = _fleet(servers, deadline_s=5.0)
    wait_ready = servers[1].wait_ready
    killed: list[int] = []

    def killed_while_starting(timeout: float | None = None) -> float:
        process = servers[1]._proc
        if not killed and process is not None:
            process.kill()
            process.wait(timeout=5)
            killed.append(process.pid)
        return wait_ready(timeout)

    try:
        fleet.launch()
        fleet.connect(
            FleetClient([_client(s) for s in servers], window=2, on_set_aside=fleet.set_aside)
        )
        monkeypatch.setattr(servers[1], "wait_ready", killed_while_starting)
        plan(servers[1], collective_rpc=[{"die": True}])
        fleet.sync(lambda _d: None, "iter_001")
        assert killed and fleet.aside() == [1]
        assert servers[0].weight_version == "iter_001"
        fleet.sync(lambda _d: None, "iter_002")
        assert fleet.aside() == [] and servers[1].weight_version == "iter_002"
    finally:
        fleet.stop()


def test_a_server_that_does_not_start_is_set_aside_and_none_left_fails_in_one_line(
    model_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "missing"  # the stand-in exits at once: no model there
    fleet = _fleet([_vllm(model_dir, tmp_path, 0), _vllm(missing, tmp_path, 1)], 5.0)
    try:
        fleet.launch()
        assert fleet.aside() == [1] and fleet.servers[0].is_alive()
    finally:
        fleet.stop()

    # None starts: one line, each server's reason and its log.
    fleet = _fleet([_vllm(missing, tmp_path, i) for i in range(2)], 5.0)
    with pytest.raises(FleetGone) as gone:
        fleet.launch()
    message = str(gone.value)
    assert isinstance(gone.value, UserError) and "\n" not in message
    assert message.startswith("no server of the fleet (2) started: server 0: vllm server")
    assert "; server 1: " in message and str(tmp_path / "logs" / "server-1") in message

    # Both take the weights from a directory that is gone, and neither restarts from it, in
    # this sync's round or in the second one it gives those that failed.
    own = tmp_path / "own"
    shutil.copytree(model_dir, own)
    fleet = _fleet([_vllm(own, tmp_path, i) for i in range(2)], 5.0)
    try:
        fleet.launch()
        fleet.connect(FleetClient([_client(s) for s in fleet.servers], window=2))
        shutil.rmtree(own)
        with pytest.raises(FleetGone) as gone:
            fleet.sync(lambda _d: None, "iter_001")
        message = str(gone.value)
        assert "\n" not in message and "none took weights iter_001" in message
        assert "server 0: " in message and "server 1: " in message

        def died() -> None:
            raise ServerDiedError("every server of the fleet (2) is set aside: none answers")

        with pytest.raises(FleetGone, match=r"giving up. Last failure: every server") as gone:
            fleet.call_with_recovery(died, max_restarts=0)
        assert "\n" not in str(gone.value)
    finally:
        fleet.stop()
