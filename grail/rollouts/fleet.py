"""A fleet of inference servers for one run (`generation.servers=N`): one data plane, control to
all of them.

Data plane. `FleetClient` is the completion client of the fleet. A batch's prompts go in requests
of whole groups (a problem's n samples never part, so its prompt is prefilled once); each request
goes to the server the `Balancer` (grail/rollouts/balance.py) picks: the one whose queue would
finish first, at most a window of requests in flight per server, so a slow server, answering
later, gets fewer. A request whose server died (`ServerDiedError`, or no answer after the
client's retries) is counted as that server's failure, the server is set aside, and the request
goes to another; the batch ends with no group lost or sent twice. With every server set aside the
request fails with `ServerDiedError`, which the run's recovery handles as for one server.

Control plane. `Fleet.sync` gives every server the same weights, in parallel, and returns only
when all have them: no request of the next batch reaches an older version. Under the disk route
the weights are written once into the directory the servers share and every server reloads it;
fast routes (shared tensors, NCCL) send to each server on its own. A server set aside restarts
at once, in the background, from the newest weights its directory holds, while the others serve;
the next sync waits for it, gives it the new weights, and it rejoins. A server the user runs
(`generation.urls`, grail/inference/external.py) cannot be restarted: at each sync it is asked
whether it answers again (then it gets the newest weights and rejoins); until then it stays
aside with a warning, and the others serve.

Determinism: every prompt carries its own seed and the built-in server's batches are
batch-invariant on CPU, so a sample does not depend on which server drew it or what else was in
its batch: `generation.servers=2` gives the metrics of `servers=1`, bitwise, when each server has
the same thread count (tests/test_fleet.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from grail.inference.client import CompletionClient, in_requests
from grail.inference.completions import Completion, GenerationError, SamplingParams
from grail.inference.errors import ExternalServerGone, ServerDiedError, ServerError
from grail.inference.external import ExternalServer
from grail.inference.process import ServerManager, SyncResult
from grail.inference.weights.policy import Weights
from grail.inference.weights.syncer import WeightSyncer
from grail.rollouts.balance import Balancer

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A batch goes in at least this many requests per server, so that the balancer has requests to
# move: with one request per server a slow server would hold its whole share to the end.
REQUESTS_PER_SERVER = 4


def request_size(most: int, prompts: int, servers: int) -> int:
    """Prompts in one request of a batch of `prompts`: at most `most` (what one server takes in
    one request), but few enough that each of `servers` gets `REQUESTS_PER_SERVER` requests."""
    spread = math.ceil(prompts / (REQUESTS_PER_SERVER * servers))
    return max(1, min(most, spread))


def window_for(batch_sequences: int, n: int, per_request: int, requests: int, servers: int) -> int:
    """Requests one server may have in flight: about twice its batch (`batch_sequences`
    sequences), in requests of `per_request` prompts of n samples, but no more than its even
    share of a batch of `requests`. A request holds its slot until its longest sample ends, so a
    window of one batch kept the simulated engine half full (docs/benchmarks.md, "A fleet of
    servers, simulated"). The cap: with a window larger than the batch, measured speeds that
    differ by noise alone sent a small batch to one server (4 x 4 samples all went to the first)."""
    batches = math.ceil(2 * batch_sequences / (n * per_request))
    return max(1, min(batches, math.ceil(requests / servers)))


def is_server_fault(exc: BaseException) -> bool:
    """Whether a failed request says more about its server than about the request: the server
    died, or it gave no answer (connection refused, timeouts, 5xx) after the client's retries. A
    request refused with a 4xx, or an answer that does not parse, would fail on any server."""
    if isinstance(exc, ServerDiedError):
        return True
    if type(exc) is GenerationError:  # not MalformedResponseError, its subclass
        return exc.status_code is None or exc.status_code >= 500
    return False


class FleetClient:
    """`CompletionClient`'s `complete_many` / `complete` / `aclose` over the clients of a fleet.

    `clients[i]` is server i's client; `window` is how many requests one server may have in
    flight (`Balancer`). `on_set_aside(i)` is called once when server i is set aside. Use it from
    one event loop, as its clients."""

    def __init__(
        self,
        clients: Sequence[CompletionClient],
        *,
        window: int,
        on_set_aside: Callable[[int], None] = lambda _i: None,
    ) -> None:
        if not clients:
            raise ValueError("a fleet needs at least one client")
        self.clients = list(clients)
        self.balancer = Balancer(len(self.clients), window)
        self._on_set_aside = on_set_aside
        self._changed: asyncio.Condition | None = None

    def prompts_per_request(self, n: int, prompts: int) -> int:
        """Prompts of n samples in one request of a batch of `prompts` (`request_size`)."""
        return request_size(self.clients[0].prompts_per_request(n), prompts, len(self.clients))

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        (completions,) = await self.complete_many([prompt_ids], n, sampling, [seed])
        return completions

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Callable[[int], None] | None = None,
    ) -> list[list[Completion]]:
        """As `CompletionClient.complete_many`: n completions of each prompt, in input order,
        sample i of prompt j seeded `seeds[j] + i`; the requests spread over the fleet."""
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds (one per prompt)")
        if not prompts:
            return []
        # Expected tokens of one prompt's group: what the balancer weighs requests by.
        group_cost = n * (sampling.max_tokens or 1)
        per_request = self.prompts_per_request(n, len(prompts))
        requests = -(-len(prompts) // per_request)
        self.balancer.new_batch(requests, group_cost * per_request)
        return await in_requests(
            len(prompts),
            per_request,
            lambda start, stop: self._send(
                prompts[start:stop], n, sampling, seeds[start:stop], group_cost
            ),
            on_done,
        )

    async def _send(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        group_cost: float,
    ) -> list[list[Completion]]:
        """One request on the server the balancer picks; on a server fault, on another."""
        cost = group_cost * len(prompts)
        while True:
            server = await self._acquire(cost)
            t0 = time.perf_counter()
            try:
                groups = await self.clients[server].complete_many(prompts, n, sampling, seeds)
            except Exception as exc:
                if not is_server_fault(exc):  # any server would refuse it: the batch fails
                    self.balancer.withdrawn(server, cost)
                    await self._notify()
                    raise
                self.balancer.failed(server, cost)
                self._set_aside(server, exc)
                await self._notify()
                continue
            except BaseException:  # cancelled: its work is no longer in flight
                self.balancer.withdrawn(server, cost)
                raise
            tokens = sum(len(c.token_ids) for group in groups for c in group)
            self.balancer.finished(server, cost, tokens=tokens, seconds=time.perf_counter() - t0)
            await self._notify()
            return groups

    async def _acquire(self, cost: float) -> int:
        changed = self._condition()
        async with changed:
            while True:
                if not self.balancer.usable():
                    raise ServerDiedError(
                        f"every server of the fleet ({len(self.clients)}) is set aside: "
                        "none answers"
                    )
                server = self.balancer.choose(cost)
                if server is not None:
                    self.balancer.started(server, cost)
                    return server
                await changed.wait()

    async def _notify(self) -> None:
        changed = self._condition()
        async with changed:
            changed.notify_all()

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:  # made on the loop that runs the requests
            self._changed = asyncio.Condition()
        return self._changed

    def _set_aside(self, server: int, exc: BaseException) -> None:
        if server not in self.balancer.usable():
            return
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.warning(
            "server %d of the fleet set aside (%s); its requests go to the others", server, first
        )
        self.balancer.set_aside(server)
        self._on_set_aside(server)

    def aside(self) -> list[int]:
        """The servers set aside, in index order."""
        usable = set(self.balancer.usable())
        return [i for i in range(len(self.clients)) if i not in usable]

    def set_aside(self, server: int) -> None:
        """Server `server` takes no requests until `restore`d (the fleet says so)."""
        self.balancer.set_aside(server)

    def restore(self, server: int) -> None:
        """Server `server` is back (restarted, synced): it takes requests again."""
        self.balancer.restore(server)

    def server_records(self) -> list[dict[str, Any]]:
        """Per server: requests, completion tokens, seconds in requests and failures so far, and
        whether it takes requests now (for the train records)."""
        usable = set(self.balancer.usable())
        return [
            {
                "requests": load.requests,
                "tokens": load.tokens,
                "busy_s": load.busy_s,
                "failures": load.failures,
                "usable": i in usable,
            }
            for i, load in enumerate(self.balancer.loads)
        ]

    async def aclose(self) -> None:
        for client in self.clients:
            await client.aclose()


class Fleet:
    """The servers of a run and their weight syncers: started, synced and stopped together.

    `members[i]` is server i and the `WeightSyncer` that gives it the trainer's weights; all
    serve from one directory (`model_path`, or `lora_dir`), which the first server synced writes.
    `clients` are the `FleetClient`s that route to these servers (`connect`: the run's, and the
    service's on its own event loop); a server one of them sets aside is set aside in all."""

    def __init__(self, members: Sequence[tuple[ServerManager, WeightSyncer]]) -> None:
        if not members:
            raise ValueError("a fleet needs at least one server")
        self.servers = [server for server, _ in members]
        self.syncers = [syncer for _, syncer in members]
        self.clients: list[FleetClient] = []
        # Servers on their way back: a managed one restarts as soon as it is set aside, while
        # the others serve; the next sync waits for it (it must not read a directory being
        # rewritten) and then gives it the new weights. Each result: None, or why it failed.
        self._returning: dict[int, concurrent.futures.Future[str | None]] = {}
        self._restarts = concurrent.futures.ThreadPoolExecutor(
            len(self.servers), thread_name_prefix="grail-fleet-restart"
        )

    def __len__(self) -> int:
        return len(self.servers)

    def launch(self) -> None:
        """Start every server at once and wait until all answer; stop them all if one fails (or
        on Ctrl-C: the others' waits then end as their processes do)."""
        _all_at_once([server.launch for server in self.servers], on_failure=self.stop)

    def call_with_recovery(self, call: Callable[[], T], max_restarts: int) -> T:
        """Run `call` (a generation batch: safe to repeat, its seeds fixed); when it fails because
        every server is gone, restart the fleet and run it again, at most `max_restarts` times.
        A fleet with one server left serves on: only losing them all stops a batch."""
        restarts = 0
        while True:
            try:
                return call()
            except ServerDiedError as exc:
                if restarts >= max_restarts:
                    raise ServerDiedError(
                        f"generation failed: every server of the fleet ({len(self)}) died, and the "
                        f"fleet was restarted {restarts} time(s) (max_restarts={max_restarts}); "
                        f"giving up. Last failure: {exc}"
                    ) from exc
                restarts += 1
                logger.warning(
                    "every server of the fleet is gone (%s); restart %d/%d and retry",
                    str(exc).splitlines()[0],
                    restarts,
                    max_restarts,
                )
                self._bring_back()

    def connect(self, client: FleetClient) -> FleetClient:
        """Have `client` (built over these servers, with `on_set_aside=self.set_aside`) route by
        which servers this fleet has set aside, from now on."""
        for server in self.aside():
            client.set_aside(server)
        self.clients.append(client)
        return client

    def aside(self) -> list[int]:
        """The servers set aside, in index order."""
        return sorted({i for client in self.clients for i in client.aside()})

    def set_aside(self, server: int) -> None:
        """Server `server` stopped answering: every client sets it aside. A managed one
        restarts now, in the background, from the newest weights its directory holds; it
        rejoins at the next sync. A server the user runs is asked again at the next sync."""
        for client in self.clients:
            client.set_aside(server)
        if self._external(server) or server in self._returning:
            return
        logger.warning(
            "%s restarts in the background; it rejoins at the next sync", self._name(server)
        )
        self._returning[server] = self._restarts.submit(self._try_recover, server)

    def sync(self, weights: Weights, weight_version: str) -> SyncResult:
        """Give every server `weights`; returns when all have them. Servers set aside are
        brought back first (restarted from the newest weights the directory holds; a server the
        user runs, asked whether it answers) and then synced too. One that does not come back,
        or stops answering during the sync, stays aside (with a warning) while the others serve;
        raises `ServerDiedError` when no server is left. The result is the first synced
        server's, with the whole fan-out's seconds."""
        t0 = time.perf_counter()
        self._bring_back()
        if not self.clients:
            raise RuntimeError("the fleet has no client yet: connect one first")
        members = [i for i in range(len(self)) if i not in self.aside()]
        first: SyncResult | None = None
        while first is None and members:
            first = self._try_sync(members.pop(0), weights, weight_version)
        if first is None:
            raise ServerDiedError(
                f"every server of the fleet ({len(self)}) is set aside: none answers to take "
                "the new weights"
            )
        if first.transfer == "disk":
            # The directory now holds the new weights: the others reload it, all at once.
            results = _all_at_once(
                [
                    functools.partial(self._try_sync, i, _already_written, weight_version)
                    for i in members
                ]
            )
        else:
            # A fast route sends from the trainer's GPU, to one server at a time: NCCL
            # broadcasts (or CUDA IPC exports) from threads of one process at once were never
            # measured safe. One broadcast to a group of every server is the step after.
            results = [self._try_sync(i, weights, weight_version) for i in members]
        synced = [r for r in (first, *results) if r is not None]
        fallbacks = sum(r.transfer_fallbacks for r in synced)
        return replace(first, seconds=time.perf_counter() - t0, transfer_fallbacks=fallbacks)

    def _try_sync(self, server: int, weights: Weights, weight_version: str) -> SyncResult | None:
        """`syncers[server].sync`; None when that server is one the user runs and it stopped
        answering (it is then set aside). Any other failure is raised."""
        try:
            return self.syncers[server].sync(weights, weight_version)
        except ServerError as exc:
            if not self._external(server) or self.servers[server].is_alive():
                raise
            logger.warning(
                "%s stopped answering (%s); set aside, tried again at the next sync",
                self._name(server),
                str(exc).splitlines()[0],
            )
            self.set_aside(server)
            return None

    def _bring_back(self) -> None:
        """Wait for the servers set aside to come back (restarts begun in the background, and
        the others begun now, all in parallel); they take requests again. One that does not
        come back stays aside, with a warning, and is tried again at the next sync."""
        aside = self.aside()
        for i in aside:
            if i not in self._returning:
                self._returning[i] = self._restarts.submit(self._try_recover, i)
        try:
            problems = [self._returning[i].result() for i in aside]
        finally:
            for i in aside:
                if self._returning[i].done():
                    del self._returning[i]
        for i, problem in zip(aside, problems, strict=True):
            if problem is None:
                for client in self.clients:
                    client.restore(i)
            else:
                logger.warning(
                    "%s is still set aside (%s); tried again at the next sync",
                    self._name(i),
                    problem,
                )

    def _try_recover(self, server: int) -> str | None:
        """`syncers[server].recover`: None when the server is back, else why not (a managed
        server that did not restart, one the user runs that still does not answer)."""
        try:
            self.syncers[server].recover()
        except (ExternalServerGone, ServerError) as exc:
            return str(exc).splitlines()[0]
        return None

    def _external(self, server: int) -> bool:
        return isinstance(self.servers[server], ExternalServer)

    def _name(self, server: int) -> str:
        where = self.servers[server]
        return f"server {server} of the fleet" + (
            f" ({where.url})" if isinstance(where, ExternalServer) else ""
        )

    def stop(self) -> None:
        """Stop every server, also those restarting in the background (stopping a server ends
        its restart's wait; one started after that is stopped once the restarts have ended)."""
        self._restarts.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.stop()
        self._restarts.shutdown(wait=True)
        for syncer in self.syncers:
            syncer.close()
        for server in self.servers:
            server.stop()


def _already_written(_directory: object) -> None:
    """The `Weights` of a server whose directory the fleet's first sync already wrote."""


def _all_at_once(
    calls: Sequence[Callable[[], T]], on_failure: Callable[[], object] = lambda: None
) -> list[T]:
    """Run `calls` in threads at once and return their results in order; the first failure (or
    Ctrl-C here) runs `on_failure` and is raised once every call has ended."""
    if not calls:
        return []
    pool = concurrent.futures.ThreadPoolExecutor(len(calls), thread_name_prefix="grail-fleet")
    futures = [pool.submit(call) for call in calls]
    try:
        concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        failed = next((f.exception() for f in futures if f.done() and f.exception()), None)
        if failed is not None:
            raise failed
        return [f.result() for f in futures]
    except BaseException:
        on_failure()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
