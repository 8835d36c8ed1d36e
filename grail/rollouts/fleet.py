"""A fleet of inference servers for one run (`generation.servers=N`): its control plane.

`Fleet.sync` gives every server the same weights, in parallel, and returns only
when each has them or is set aside: no request of the next batch reaches an older version. Under
the disk route the weights are written once into the directory the servers share and every server
reloads it; fast routes (shared tensors, NCCL) send to each server on its own. Every call to a
server has the same deadline as a request (`ServerManager.call_deadline_s`): one that misses it
raises `ServerTimeoutError`, and no fallback calls that server again. A server that fails at any
moment (it did not start, its sync failed or missed the deadline, its restart failed, a request
failed) is set aside, with a warning, and restarts at once, in the background, from the newest
weights its directory holds, while the others serve (one failed in a sync restarts once the sync
has written the directory); the next sync waits for it, gives it the new weights, and it rejoins.
A server the user runs (`generation.urls`, grail/inference/external.py) cannot be restarted: at
each sync it is asked whether it answers again (then it gets the newest weights and rejoins);
until then it stays aside with a warning, and the others serve. Only when no server is left does
the run fail, with `FleetGone`: one line, each server's reason in it.

Data plane: `FleetClient` (grail/rollouts/fleet_client.py) routes each request to one server;
a server it sets aside is set aside here, and in every client `connect`ed.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TypeVar

from grail.core.errors import UserError, first_line
from grail.inference.errors import FleetGone, ServerDiedError, ServerError
from grail.inference.external import ExternalServer
from grail.inference.process import ServerManager, SyncResult
from grail.inference.weights.policy import Weights
from grail.inference.weights.syncer import WeightSyncer
from grail.rollouts.fleet_client import FleetClient

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Fleet:
    """The servers of a run and their weight syncers: started, synced and stopped together.

    `members[i]` is server i and the `WeightSyncer` that gives it the trainer's weights; all
    serve from one directory (`model_path`, or `lora_dir`), which the first server synced writes.
    `deadline_s` (generation.request_timeout_s) bounds every call to a server: each request
    (the clients' own timeout) and each call of a weight sync (`call_deadline_s`, set here on
    every server). `clients` are the `FleetClient`s that route to these servers (`connect`: the
    run's, and the service's on its own event loop); a server one of them sets aside is set
    aside in all."""

    def __init__(
        self, members: Sequence[tuple[ServerManager, WeightSyncer]], *, deadline_s: float
    ) -> None:
        if not members:
            raise ValueError("a fleet needs at least one server")
        if not deadline_s > 0:
            raise ValueError(f"a fleet's deadline_s must be > 0 seconds, got {deadline_s!r}")
        self.servers = [server for server, _ in members]
        self.syncers = [syncer for _, syncer in members]
        self.clients: list[FleetClient] = []
        self.deadline_s = float(deadline_s)
        for server in self.servers:
            server.call_deadline_s = self.deadline_s
        # Servers set aside, and those on their way back: a managed one restarts as soon as it
        # is set aside, while the others serve; the next sync waits for it (it must not read a
        # directory being rewritten) and then gives it the new weights. Each result: None, or
        # why it failed. Both change from the generation thread (a request failed) and the
        # trainer's (a sync), under `_lock`.
        self._aside: set[int] = set()
        self._returning: dict[int, concurrent.futures.Future[str | None]] = {}
        self._lock = threading.Lock()
        # The servers read one directory, which a sync writes and a restart after a fast route
        # writes first (`WeightSyncer.before_restart`): one writer at a time.
        self._writing = threading.Lock()
        self._restarts = concurrent.futures.ThreadPoolExecutor(
            len(self.servers), thread_name_prefix="grail-fleet-restart"
        )

    def __len__(self) -> int:
        return len(self.servers)

    def launch(self) -> None:
        """Start every server at once and wait until each answers or fails. One that fails is
        set aside (it restarts in the background and rejoins at a sync) while the others serve;
        when none started, `FleetGone`. A failure the user fixes (a server of `generation.urls`
        that fails its checks) or Ctrl-C stops them all and is raised (the others' waits then
        end as their processes do)."""
        failures = _all_at_once(
            [functools.partial(_failure, server.launch) for server in self.servers],
            on_failure=self.stop,
        )
        failed = {i: exc for i, exc in enumerate(failures) if exc is not None}
        if len(failed) == len(self):
            self.stop()
            raise FleetGone(
                f"no server of the fleet ({len(self)}) started: {self._reasons(failed)}"
            ) from failed[0]
        for server, exc in failed.items():
            logger.warning("%s did not start (%s)", self._name(server), first_line(exc))
            self.set_aside(server)

    def call_with_recovery(self, call: Callable[[], T], max_restarts: int) -> T:
        """Run `call` (a generation batch: safe to repeat, its seeds fixed); when it fails because
        every server is gone, restart the fleet and run it again, at most `max_restarts` times,
        then `FleetGone`. A fleet with one server left serves on: only losing them all stops a
        batch."""
        restarts = 0
        while True:
            try:
                return call()
            except ServerDiedError as exc:
                if restarts >= max_restarts:
                    raise FleetGone(
                        f"generation failed: every server of the fleet ({len(self)}) died or "
                        f"hung, and the fleet was restarted {restarts} time(s) "
                        f"(max_restarts={max_restarts}); giving up. Last failure: "
                        f"{first_line(exc)}"
                    ) from exc
                restarts += 1
                logger.warning(
                    "every server of the fleet is gone (%s); restart %d/%d and retry",
                    first_line(exc),
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
        with self._lock:
            aside = set(self._aside)
        return sorted(aside.union(*(client.aside() for client in self.clients)))

    def set_aside(self, server: int) -> None:
        """Server `server` stopped answering: every client sets it aside (and sends the
        requests it holds elsewhere). A managed one restarts now, in the background, from the
        newest weights its directory holds; it rejoins at the next sync. A server the user runs
        is asked again at the next sync."""
        self._exclude(server)
        self._restart(server)

    def _exclude(self, server: int) -> None:
        with self._lock:
            self._aside.add(server)
        for client in self.clients:
            client.set_aside(server)

    def _restart(self, server: int) -> None:
        """Begin the background restart of managed server `server`, unless one is under way."""
        if self._external(server):
            return
        with self._lock:
            if server in self._returning:
                return
            try:
                self._returning[server] = self._restarts.submit(self._try_recover, server)
            except RuntimeError:  # the fleet is stopping: nothing restarts any more
                return
        logger.warning(
            "%s restarts in the background; it rejoins at the next sync", self._name(server)
        )

    def sync(self, weights: Weights, weight_version: str) -> SyncResult:
        """Give every server `weights`; returns when each has them or is set aside. Servers set
        aside are brought back first (restarted from the newest weights the directory holds; a
        server the user runs, asked whether it answers) and then synced too. One that fails now
        (it died and its restart failed, or it missed the fleet's deadline: hung) is set aside
        with a warning, and restarts once this sync has written the directory, while the others
        serve. When none took the weights, those that failed are restarted and synced once
        more, and if none takes them then, `FleetGone`. The result is the first synced
        server's, with the whole fan-out's seconds."""
        t0 = time.perf_counter()
        if not self.clients:
            raise RuntimeError("the fleet has no client yet: connect one first")
        failed: dict[int, BaseException] = {}
        for last in (False, True):
            still_aside = self._bring_back()
            failed = {}
            first, results = self._sync_all(weights, weight_version, failed)
            if first is not None or last or not failed:
                break
            logger.warning(
                "no server of the fleet took weights %s; those that failed restart and are "
                "given them once more",
                weight_version,
            )
            for server in failed:
                self._restart(server)
        if first is None:
            reasons: dict[int, BaseException | str] = {**still_aside, **failed}
            raise FleetGone(
                f"every server of the fleet ({len(self)}) is set aside: none took weights "
                f"{weight_version} ({self._reasons(reasons)})"
            )
        for server in failed:
            self._restart(server)
        synced = [r for r in (first, *results) if r is not None]
        fallbacks = sum(r.transfer_fallbacks for r in synced)
        return replace(first, seconds=time.perf_counter() - t0, transfer_fallbacks=fallbacks)

    def _sync_all(
        self, weights: Weights, weight_version: str, failed: dict[int, BaseException]
    ) -> tuple[SyncResult | None, list[SyncResult | None]]:
        """`_try_sync` of every server not set aside: the first's result (None when none
        took the weights) and the others'."""
        members = [i for i in range(len(self)) if i not in self.aside()]
        with self._writing:
            first: SyncResult | None = None
            while first is None and members:
                first = self._try_sync(members.pop(0), weights, weight_version, failed)
            if first is None:
                return None, []
            if first.transfer == "disk":
                # The directory now holds the new weights: the others reload it, all at once.
                return first, _all_at_once(
                    [
                        functools.partial(
                            self._try_sync, i, _already_written, weight_version, failed
                        )
                        for i in members
                    ]
                )
            # A fast route sends from the trainer's GPU, to one server at a time: NCCL
            # broadcasts (or CUDA IPC exports) from threads of one process at once were never
            # measured safe. One broadcast to a group of every server is the step after.
            return first, [self._try_sync(i, weights, weight_version, failed) for i in members]

    def _try_sync(
        self,
        server: int,
        weights: Weights,
        weight_version: str,
        failed: dict[int, BaseException],
    ) -> SyncResult | None:
        """`syncers[server].sync`; None when that server failed (it died and its restart
        fallback failed, it missed the fleet's deadline, or a server the user runs stopped
        answering): it is then set aside at once, and its failure goes in `failed`."""
        try:
            return self.syncers[server].sync(weights, weight_version)
        except ServerError as exc:
            failed[server] = exc
            self._exclude(server)
            logger.warning(
                "%s did not take weights %s (%s); set aside, %s",
                self._name(server),
                weight_version,
                first_line(exc),
                "tried again at the next sync"
                if self._external(server)
                else "it restarts after this sync and rejoins at the next one",
            )
            return None

    def _bring_back(self) -> dict[int, str]:
        """Wait for the servers set aside to come back (restarts begun in the background, and
        the others begun now, all in parallel); they take requests again. One that does not
        come back stays aside, with a warning, and is tried again at the next sync; returns why
        each such did not come back."""
        aside = self.aside()
        with self._lock:
            for i in aside:
                if i not in self._returning:
                    self._returning[i] = self._restarts.submit(self._try_recover, i)
            returning = {i: self._returning[i] for i in aside}
        try:
            problems = {i: future.result() for i, future in returning.items()}
        finally:
            with self._lock:
                for i, future in returning.items():
                    if future.done() and self._returning.get(i) is future:
                        del self._returning[i]
        still_aside: dict[int, str] = {}
        for i, problem in problems.items():
            if problem is None:
                with self._lock:
                    self._aside.discard(i)
                for client in self.clients:
                    client.restore(i)
            else:
                logger.warning(
                    "%s is still set aside (%s); tried again at the next sync",
                    self._name(i),
                    problem,
                )
                still_aside[i] = problem
        return still_aside

    def _try_recover(self, server: int) -> str | None:
        """`syncers[server].recover`: None when the server is back, else why not (a managed
        server that did not restart, one the user runs that still does not answer)."""
        syncer = self.syncers[server]
        try:
            with self._writing:
                syncer.before_restart()
            self.servers[server].recover()
        except ServerError as exc:
            return first_line(exc)
        return None

    def _external(self, server: int) -> bool:
        return isinstance(self.servers[server], ExternalServer)

    def _name(self, server: int) -> str:
        where = self.servers[server]
        return f"server {server} of the fleet" + (
            f" ({where.url})" if isinstance(where, ExternalServer) else ""
        )

    def _reasons(self, failures: Mapping[int, BaseException | str]) -> str:
        """Why each server failed, on one line: the first line of its error and, for a server
        grail started, its log (which holds the rest)."""
        parts = []
        for i in sorted(failures):
            why = failures[i]
            text = why if isinstance(why, str) else first_line(why)
            log = "" if self._external(i) else f" (log {self.servers[i].log_path})"
            parts.append(f"server {i}: {text.rstrip('.')}{log}")
        return "; ".join(parts)

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


def _failure(call: Callable[[], object]) -> ServerError | None:
    """Run `call`; the `ServerError` it raised, None when it worked. A failure the user fixes
    (`UserError`) and any other exception are raised."""
    try:
        call()
    except ServerError as exc:
        if isinstance(exc, UserError):
            raise
        return exc
    return None


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
