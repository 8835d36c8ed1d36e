"""The data plane of a fleet of inference servers (`generation.servers=N`; grail/rollouts/fleet.py
has its control plane): `FleetClient`, the completion client of the fleet. A batch's prompts go in
requests of whole groups (a problem's n samples never part, so its prompt is prefilled once); each
request goes to the server the `Balancer` (grail/rollouts/balance.py) picks: the one whose queue
would finish first, at most a window of requests in flight per server, so a slow server, answering
later, gets fewer. A request has one request timeout (`generation.request_timeout_s`, one of the
client's attempts) to come back. One whose server died (`ServerDiedError`, or no answer after the
client's retries) or that missed that deadline (the server is hung: stopped, deadlocked; its retries
would hold the batch for several timeouts while the others idle) is counted as that server's
failure, the server is set aside, and the requests it holds, this one and the others, go to the
servers that answer at once; the batch ends with no group lost or sent twice. A request may name its
server instead (`complete_on`: an episode's later turns, on the server that holds its prefix in
cache); it waits for a slot in that server's window, and goes where the balancer picks only when
that server fails or is set aside. With every server set aside the request fails with
`ServerDiedError`, which the run's recovery handles as for one server.

Determinism: every prompt carries its own seed and the built-in server's batches are
batch-invariant on CPU, so a sample does not depend on which server drew it or what else was in
its batch: `generation.servers=2` gives the metrics of `servers=1`, bitwise, when each server has
the same thread count (tests/test_fleet.py); a request moved off a hung server is drawn again, with
the same seeds, by another.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from grail.core.errors import first_line
from grail.inference.client import CompletionClient, in_requests
from grail.inference.completions import (
    Completion,
    GenerationError,
    SamplingParams,
    check_seed_count,
)
from grail.inference.errors import ServerDiedError
from grail.rollouts.balance import Balancer
from grail.rollouts.sizing import group_cost, request_size

logger = logging.getLogger(__name__)


def is_server_fault(exc: BaseException) -> bool:
    """Whether a failed request says more about its server than about the request: the server
    died, or it gave no answer (connection refused, timeouts, 5xx) after the client's retries. A
    request refused with a 4xx, or an answer that does not parse, would fail on any server."""
    if isinstance(exc, ServerDiedError):
        return True
    if type(exc) is GenerationError:  # not MalformedResponseError, its subclass
        return exc.status_code is None or exc.status_code >= 500
    return False


class _Moved(Exception):
    """A request called back from a server set aside while it waited: it goes to another."""


def _seen(call: asyncio.Future[Any]) -> None:
    """Take the outcome of a request nobody waits for any more (a timeout called it back), so
    that asyncio does not log it as never retrieved."""
    if not call.cancelled():
        call.exception()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class FleetClient:
    """`CompletionClient`'s `complete_many` / `complete` / `aclose` over the clients of a fleet.

    `clients[i]` is server i's client, whose `timeout` is the deadline of each request to that
    server; `window` is how many requests one server may have in flight (`Balancer`).
    `on_set_aside(i)` is called once when server i is set aside. Use it from one event loop, as
    its clients (`set_aside` and `restore` from any thread)."""

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
        self._loop: asyncio.AbstractEventLoop | None = None
        # The requests each server holds now, so that setting it aside calls them back at once.
        self._calls: list[set[asyncio.Future[list[list[Completion]]]]] = [
            set() for _ in self.clients
        ]

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
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> list[list[Completion]]:
        """As `CompletionClient.complete_many`: n completions of each prompt, in input order,
        sample i of prompt j seeded `seeds[j] + i`; the requests spread over the fleet."""
        check_seed_count(prompts, seeds)
        self.new_batch(len(prompts), n, sampling)
        groups, _ = await self.complete_on(prompts, n, sampling, seeds, None, on_done, spans)
        return groups

    def new_batch(self, prompts: int, n: int, sampling: SamplingParams) -> None:
        """A batch of `prompts` prompts of n samples starts (`Balancer.new_batch`, in the
        requests `complete_many` would send them in). `complete_on` does not begin one: an
        episode batch sends its turns over many calls, and a batch per call would probe a slow
        server at each of them."""
        if prompts:
            per_request = self.prompts_per_request(n, prompts)
            requests = -(-prompts // per_request)
            self.balancer.new_batch(requests, group_cost(n, sampling) * per_request)

    async def complete_on(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        server: int | None,
        on_done: Callable[[int], None] | None = None,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> tuple[list[list[Completion]], list[int]]:
        """`complete_many`'s groups, within the current batch (`new_batch`), and the server that
        answered each prompt. With `server`, every request goes to that server (it holds the
        prompts' prefixes in its cache: an episode's earlier turns), waiting for a slot in its
        window, unless it is set aside or fails: then, as any request, to the server the
        balancer picks. Without, the requests spread over the fleet as `complete_many`'s.
        `spans`: as `CompletionClient.complete_many`'s."""
        check_seed_count(prompts, seeds)
        if server is not None and not 0 <= server < len(self.clients):
            raise ValueError(f"server {server} is not in this fleet of {len(self.clients)}")
        if not prompts:
            return [], []
        if self._loop is None:  # where `set_aside` from another thread calls requests back
            self._loop = asyncio.get_running_loop()
        per_prompt = group_cost(n, sampling)
        per_request = (
            self.prompts_per_request(n, len(prompts))
            if server is None
            else self.clients[server].prompts_per_request(n)  # one request, one answer's wait
        )
        answered = [0] * len(prompts)

        async def send(start: int, stop: int) -> list[list[Completion]]:
            groups, where = await self._send(
                prompts[start:stop],
                n,
                sampling,
                seeds[start:stop],
                per_prompt,
                server,
                None if spans is None else spans[start:stop],
            )
            answered[start:stop] = [where] * (stop - start)
            return groups

        return await in_requests(len(prompts), per_request, send, on_done), answered

    async def _send(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        per_prompt: float,
        pinned: int | None = None,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> tuple[list[list[Completion]], int]:
        """One request on `pinned` or the server the balancer picks; on another (the balancer's)
        when that server fails, misses the request's deadline, or is set aside meanwhile. The
        groups, and the server that answered them."""
        cost = per_prompt * len(prompts)
        while True:
            server = await self._acquire(cost, pinned)
            t0 = time.perf_counter()
            try:
                groups = await self._call(server, prompts, n, sampling, seeds, spans)
            except _Moved:
                self.balancer.failed(server, cost)
                await self._notify()
                pinned = None
                continue
            except Exception as exc:
                if not is_server_fault(exc):  # any server would refuse it: the batch fails
                    self.balancer.withdrawn(server, cost)
                    await self._notify()
                    raise
                self.balancer.failed(server, cost)
                self._set_aside(server, exc)
                await self._notify()
                pinned = None
                continue
            except BaseException:  # cancelled: its work is no longer in flight
                self.balancer.withdrawn(server, cost)
                raise
            tokens = sum(len(c.token_ids) for group in groups for c in group)
            self.balancer.finished(server, cost, tokens=tokens, seconds=time.perf_counter() - t0)
            await self._notify()
            return groups, server

    async def _call(
        self,
        server: int,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,
    ) -> list[list[Completion]]:
        """`clients[server].complete_many`, given one request timeout (the client's `timeout`,
        one of its attempts) to answer: a server that has not by then is hung or far too slow,
        and waiting through the client's retries held a batch for 4 x 120 s while the other
        server idled. A `GenerationError` (a server fault) when it misses it; `_Moved` when the
        server is set aside meanwhile (`set_aside`)."""
        client = self.clients[server]
        call = asyncio.ensure_future(client.complete_many(prompts, n, sampling, seeds, spans=spans))
        call.add_done_callback(_seen)
        self._calls[server].add(call)
        try:
            done, _ = await asyncio.wait({call}, timeout=client.timeout)
        finally:
            self._calls[server].discard(call)
            call.cancel()  # a no-op once it ended; else (its deadline, our cancellation) it ends
        if not done:
            raise GenerationError(
                f"a request to server {server} of the fleet got no answer within "
                f"{client.timeout:g} s (generation.request_timeout_s): the server is hung or far "
                "too slow",
                attempts=1,
            )
        if call.cancelled():
            raise _Moved
        return call.result()

    async def _acquire(self, cost: float, pinned: int | None = None) -> int:
        changed = self._condition()
        balancer = self.balancer
        async with changed:
            while True:
                usable = balancer.usable()
                if not usable:
                    raise ServerDiedError(
                        f"every server of the fleet ({len(self.clients)}) is set aside: "
                        "none answers"
                    )
                if pinned is not None and pinned in usable:
                    # It waits for a slot there: on another server it would miss the cache.
                    server = pinned if balancer.has_room(pinned) else None
                else:
                    server = balancer.choose(cost)
                if server is not None:
                    balancer.started(server, cost)
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
        logger.warning(
            "server %d of the fleet set aside (%s); its requests go to the others",
            server,
            first_line(exc),
        )
        self.set_aside(server)
        self._on_set_aside(server)

    def aside(self) -> list[int]:
        """The servers set aside, in index order."""
        usable = set(self.balancer.usable())
        return [i for i in range(len(self.clients)) if i not in usable]

    def set_aside(self, server: int) -> None:
        """Server `server` takes no requests until `restore`d, and those it holds go to the
        others at once (the fleet says so, from any thread)."""
        self.balancer.set_aside(server)
        loop = self._loop
        if loop is None:  # no request made yet: none to call back
            return
        if _running_loop() is loop:
            self._call_back(server)
        else:
            with contextlib.suppress(RuntimeError):  # its loop closed: nothing runs there
                loop.call_soon_threadsafe(self._call_back, server)

    def _call_back(self, server: int) -> None:
        for call in list(self._calls[server]):
            call.cancel()  # its `_send` sends it to another server (`_Moved`)

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
