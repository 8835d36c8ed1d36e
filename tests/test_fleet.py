"""A fleet of inference servers (`generation.servers`, grail/rollouts/fleet.py): the same metrics
as one server, failures that cost nothing, slow servers that get less, and clear errors."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.short_runs import results, short_config, train_records
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core.errors import ConfigError
from grail.core.validate import validate
from grail.inference.completions import Completion, GenerationError, SamplingParams
from grail.inference.errors import ServerDiedError
from grail.rollouts import fleet_client, sizing
from grail.rollouts.balance import Balancer
from grail.rollouts.fleet import Fleet
from grail.rollouts.fleet_client import FleetClient
from grail.train.cli import CONF_DIR
from grail.train.loop import fleet_text, run


def test_two_servers_give_one_servers_metrics_bitwise_even_when_one_dies(
    one_server_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The default job on two servers. In iteration 1, as the first request comes back, server 1
    # is killed: its unfinished requests fail and go to server 0, server 1 restarts in the
    # background (its new process is there before the next sync) and serves iteration 2. Every
    # iteration's metrics are the lone server's, bitwise: no group lost or counted twice,
    # whichever server drew it.
    syncs: list[Fleet] = []
    killed: list[int] = []
    restarted_before_sync: list[bool] = []
    sync, finished = Fleet.sync, Balancer.finished

    def sync_and_watch(self: Fleet, weights: Any, weight_version: str) -> Any:
        if killed and not restarted_before_sync:
            process = self.servers[1]._proc
            restarted_before_sync.append(process is not None and process.pid != killed[0])
        syncs.append(self)
        return sync(self, weights, weight_version)

    def kill_mid_iteration(self: Balancer, *args: Any, **kwargs: Any) -> None:
        finished(self, *args, **kwargs)
        if len(syncs) == 1 and not killed:
            process = syncs[0].servers[1]._proc
            assert process is not None
            process.kill()
            process.wait(timeout=10)
            killed.append(process.pid)

    monkeypatch.setattr(Fleet, "sync", sync_and_watch)
    monkeypatch.setattr(Balancer, "finished", kill_mid_iteration)
    run(short_config("generation.servers=2"), tmp_path)
    records = train_records(tmp_path)
    assert results(tmp_path) == results(one_server_run)
    assert all("fleet" not in r for r in train_records(one_server_run))
    for record in records:
        assert sum(s["tokens"] for s in record["fleet"]) == record["tokens"]["completion"]
    healthy = records[0]["fleet"]  # before the kill: both served, nothing failed
    assert [s["requests"] > 0 and s["failures"] == 0 for s in healthy] == [True, True]
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["server-0", "server-1"]
    dead, rejoined = records[1]["fleet"][1], records[2]["fleet"][1]
    assert dead["failures"] >= 1 and not dead["usable"]
    assert restarted_before_sync == [True]
    assert rejoined["requests"] > 0 and rejoined["failures"] == 0 and rejoined["usable"]
    assert records[1]["fleet"][0]["failures"] == 0


# Slows process argv[1] to about a third of its speed: stopped 20 ms of every 30. A process of
# its own, not a thread of the test's: a thread waits for the GIL the in-process trainer holds,
# and under load then let the server run most of the time (it got as many groups as the other).
_A_THIRD_OF_THE_TIME = """
import os, signal, sys, time
pid = int(sys.argv[1])
try:
    while True:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.02)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)
except ProcessLookupError:
    pass
"""


def _run_a_third_of_the_time(pid: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", _A_THIRD_OF_THE_TIME, str(pid)])


def _stop_slowing(slower: subprocess.Popen[bytes], pid: int) -> None:
    slower.kill()
    slower.wait()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def test_a_slowed_server_gets_fewer_groups_and_a_pipelined_fleet_matches_one_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two built-in servers, server 1 slowed to a third of its speed from the start (its process
    # stopped 2/3 of the time), in pipelined mode: once the balancer has measured it, server 1
    # gets fewer groups, and the metrics are still the lone pipelined server's, bitwise.
    run(short_config("train.pipeline=true"), tmp_path / "one")
    slowed: list[tuple[subprocess.Popen[bytes], int]] = []
    launch = Fleet.launch

    def launch_then_slow(self: Fleet) -> None:
        launch(self)
        pid = self.servers[1].pid
        assert pid is not None
        slowed.append((_run_a_third_of_the_time(pid), pid))

    monkeypatch.setattr(Fleet, "launch", launch_then_slow)
    try:
        run(short_config("train.pipeline=true", "generation.servers=2"), tmp_path / "fleet")
    finally:
        for slower, pid in slowed:
            _stop_slowing(slower, pid)
    assert results(tmp_path / "fleet") == results(tmp_path / "one")
    measured = train_records(tmp_path / "fleet")[1:]  # after the first batch's measurements
    fast, slow = (sum(r["fleet"][i]["requests"] for r in measured) for i in (0, 1))
    assert slow < fast, (fast, slow)
    assert all(r["fleet"][1]["failures"] == 0 for r in measured)  # slow, not dead


def test_a_fleet_whose_servers_are_all_gone_fails_naming_the_fleet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sync = Fleet.sync

    def sync_then_kill_all(self: Fleet, weights: Any, weight_version: str) -> Any:
        result = sync(self, weights, weight_version)
        for server in self.servers:
            assert server._proc is not None
            server._proc.kill()
            server._proc.wait(timeout=10)
        return result

    monkeypatch.setattr(Fleet, "sync", sync_then_kill_all)
    with pytest.raises(ServerDiedError, match=r"every server of the fleet \(2\) died"):
        small = ["data.problems_per_iteration=4", "data.rollouts_per_problem=4"]
        run(short_config("generation.servers=2", "generation.max_restarts=0", *small), tmp_path)


# --- the client's routing, with servers simulated ---------------------------------------------


class _FakeServer:
    """A `CompletionClient` stand-in: answers after `seconds_per_token` x tokens; records what
    it drew; `dead` makes it fail as a dead server does, `hung` never answer. `timeout` is the
    deadline of one request, as the client's."""

    def __init__(self, seconds_per_token: float, timeout: float = 60.0) -> None:
        self.seconds_per_token = seconds_per_token
        self.timeout = timeout
        self.prompts: list[int] = []
        self.dead = self.hung = False
        self.called_back = 0  # requests it held when the fleet took them away

    def prompts_per_request(self, n: int) -> int:
        return max(1, 256 // n)

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Any = None,
        spans: Any = None,
    ) -> list[list[Completion]]:
        try:
            await asyncio.sleep(self.seconds_per_token * len(prompts) * n * sampling.max_tokens)
            if self.hung:  # a stopped process: the connection stays open, nothing comes back
                await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.called_back += 1
            raise
        if self.dead:
            raise ServerDiedError("the server died")
        self.prompts += [p[0] for p in prompts]
        # The answer depends on the prompt and seed only, as the built-in server's does.
        return [
            [Completion([p[0], s + i], [-0.5, -0.5], "length", "") for i in range(n)]
            for p, s in zip(prompts, seeds, strict=True)
        ]

    async def aclose(self) -> None:
        pass


async def _ask_async(client: FleetClient, count: int) -> list[list[Completion]]:
    prompts = [[j, 7] for j in range(count)]
    sampling = SamplingParams(max_tokens=4, temperature=1.0)
    return await client.complete_many(prompts, 2, sampling, [1000 + j for j in range(count)])


def _ask(client: FleetClient, count: int) -> list[list[Completion]]:
    return asyncio.run(_ask_async(client, count))


def _expected(count: int) -> list[list[Completion]]:
    return [
        [Completion([j, 1000 + j + i], [-0.5, -0.5], "length", "") for i in range(2)]
        for j in range(count)
    ]


def test_a_slow_server_gets_fewer_groups_and_every_group_comes_back_once() -> None:
    fast, slow = _FakeServer(0.0005), _FakeServer(0.0015)  # a third of the speed
    client = FleetClient([fast, slow], window=2)  # type: ignore[list-item]
    assert _ask(client, 96) == _expected(96)
    assert sorted(fast.prompts + slow.prompts) == list(range(96))
    assert len(fast.prompts) > 1.4 * len(slow.prompts)
    records = client.server_records()
    assert [r["requests"] for r in records] == [
        len(s.prompts) // client.prompts_per_request(2, 96) for s in (fast, slow)
    ]


def test_a_dead_servers_requests_go_to_the_others() -> None:
    alive, dead = _FakeServer(0.0002), _FakeServer(0.0002)
    dead.dead = True
    aside: list[int] = []
    client = FleetClient([alive, dead], window=2, on_set_aside=aside.append)  # type: ignore[list-item]

    async def scenario() -> None:  # one event loop, as the run's generation thread has
        assert await _ask_async(client, 32) == _expected(32)
        assert sorted(alive.prompts) == list(range(32)) and aside == [1]
        assert client.server_records()[1]["failures"] == 2  # its window: two requests in flight
        dead.dead = alive.dead = True
        client.restore(1)
        with pytest.raises(ServerDiedError, match=r"every server of the fleet \(2\) is set aside"):
            await _ask_async(client, 8)

    asyncio.run(scenario())


def test_a_hung_servers_requests_go_to_the_others_after_one_request_timeout() -> None:
    # Server 1 takes its requests and never answers (SIGSTOP): at the first request's deadline
    # (its client's timeout, one attempt) it is set aside, and every request it holds goes to
    # server 0, which draws each with the same seeds: the answers are those of a healthy fleet.
    alive, hung = _FakeServer(0.0002, timeout=0.5), _FakeServer(0.0002, timeout=0.5)
    hung.hung = True
    aside: list[int] = []
    client = FleetClient([alive, hung], window=2, on_set_aside=aside.append)  # type: ignore[list-item]

    async def scenario() -> float:
        t0 = time.perf_counter()
        assert await asyncio.wait_for(_ask_async(client, 32), 10) == _expected(32)
        return time.perf_counter() - t0

    seconds = asyncio.run(scenario())
    assert seconds < 3.0, seconds  # one deadline (0.5 s); without it, never
    assert aside == [1] and sorted(alive.prompts) == list(range(32)) and hung.prompts == []
    assert hung.called_back == 2  # its window: both requests it held were taken back
    assert client.server_records()[1]["failures"] == 2


def test_a_server_set_aside_from_another_thread_hands_its_requests_over_at_once() -> None:
    # The fleet sets a server aside from the trainer's thread (its weight sync failed) while a
    # batch runs on the generation thread: the requests it holds go to the other server now,
    # not when it would have answered (30 s here).
    fast, slow = _FakeServer(0.0002), _FakeServer(1.0)  # 30 s for one request
    client = FleetClient([fast, slow], window=2)  # type: ignore[list-item]

    async def scenario() -> float:
        t0 = time.perf_counter()
        timer = threading.Timer(0.2, client.set_aside, [1])
        timer.start()
        try:
            assert await asyncio.wait_for(_ask_async(client, 16), 10) == _expected(16)
        finally:
            timer.cancel()
        return time.perf_counter() - t0

    assert asyncio.run(scenario()) < 5.0  # not the 30 s server 1 takes
    assert slow.called_back == 2 and slow.prompts == [] and client.aside() == [1]


def test_a_pinned_request_waits_for_its_server_and_moves_once_that_is_set_aside() -> None:
    # An episode's later turns name the server holding their prefix: they go there, in requests
    # of its size (here 4 prompts of n=64), even when its window (1) is full and the other server
    # is faster and idle; once it dies, to the balancer's pick, which the answer names.
    fast, slow = _FakeServer(0.00001), _FakeServer(0.00003)
    client = FleetClient([fast, slow], window=1)  # type: ignore[list-item]
    sampling = SamplingParams(max_tokens=1, temperature=1.0)
    prompts, seeds = [[j, 7] for j in range(8)], [1000 + j for j in range(8)]
    expected = [
        [Completion([j, 1000 + j + i], [-0.5] * 2, "length", "") for i in range(64)]
        for j in range(8)
    ]

    async def scenario() -> None:
        client.new_batch(8, 64, sampling)
        assert await client.complete_on(prompts, 64, sampling, seeds, 1) == (expected, [1] * 8)
        assert slow.prompts == list(range(8)) and fast.prompts == []
        slow.dead = True
        assert await client.complete_on(prompts, 64, sampling, seeds, 1) == (expected, [0] * 8)
        assert client.aside() == [1] and fast.prompts == list(range(8))

    asyncio.run(asyncio.wait_for(scenario(), 10))
    records = client.server_records()
    assert [r["requests"] for r in records] == [2, 2] and records[1]["failures"] >= 1


def test_a_request_any_server_would_refuse_is_not_retried_elsewhere() -> None:
    class Refusing(_FakeServer):
        async def complete_many(self, *args: Any, **kwargs: Any) -> list[list[Completion]]:
            raise GenerationError("rejected with HTTP 400", attempts=1, status_code=400)

    other = _FakeServer(0.0001)
    client = FleetClient([Refusing(0.0), other], window=8)  # type: ignore[list-item]
    with pytest.raises(GenerationError, match="HTTP 400"):
        _ask(client, 64)
    assert fleet_client.is_server_fault(GenerationError("x", attempts=4, status_code=None))
    assert not fleet_client.is_server_fault(GenerationError("x", attempts=1, status_code=400))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["generation.servers=0"], "generation.servers must be > 0"),
        (
            ["generation.servers=2", "generation=vllm"],
            "each vllm server needs a GPU of its own",
        ),
    ],
)
def test_a_fleet_it_cannot_run_is_refused_naming_the_key(
    overrides: list[str], message: str
) -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="offline_grpo", overrides=overrides)
    with pytest.raises(ConfigError, match=message):
        validate(OmegaConf.to_object(cfg))  # type: ignore[arg-type]


def test_a_servers_window_is_two_of_its_batches_and_at_most_its_share() -> None:
    # The default job's shape on 2 servers: 64 prompts of 16 in requests of 8 prompts, 8 requests.
    assert sizing.window_for(256, 16, 8, requests=8, servers=2) == 4
    # Large batches: two server batches of requests in flight (here 2 x 256 / (16 x 4) = 8).
    assert sizing.window_for(256, 16, 4, requests=128, servers=2) == 8
    # A small batch (4 problems x 4 samples): its even share, not 128 requests, so that a
    # server measured a little faster by noise does not take the whole batch.
    assert sizing.window_for(256, 4, 1, requests=4, servers=2) == 2


def test_the_iteration_line_shows_the_fleet() -> None:
    up = {"requests": 5, "tokens": 40, "busy_s": 0.2, "failures": 0, "usable": True}
    down = {"requests": 1, "tokens": 8, "busy_s": 0.1, "failures": 2, "usable": False}
    assert fleet_text(None) == ""
    assert fleet_text([up, {**up, "requests": 3}]) == " servers 5/3 requests"
    assert fleet_text([up, down]) == " servers 5/1 requests, failures on 1, 1 set aside"
