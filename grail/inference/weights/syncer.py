"""`WeightSyncer`: the one object that sends a server the trainer's weights at each sync, through
the run's route with disk as the fallback, and that keeps the server's directory able to
restart it.

Disk is the fallback of every fast route: any failure (a refusal, a timeout, a server that
died) is logged with its reason and counted (`SyncResult.transfer_fallbacks`, the iteration
record's `weight_sync`), and the sync goes on from disk. After `MAX_FAILURES_IN_A_ROW` failures in
a row the run stops trying the fast route. The exception: a fleet's server that missed the
fleet's deadline (`ServerManager.missed_deadline`) is hung, and the disk route would wait for it
again; the failure is raised, and the fleet sets the server aside (grail/rollouts/fleet.py).

A fast route leaves the server's directory older than what it serves, so a restart (recovery
from a crash, or the disk route's own restart fallback) would bring back old weights: before a
restart (`before_restart`, which `recover` and the rollout source's recovery call) the syncer
has the route write the weights last sent into that directory.

One syncer per server: its failures in a row and whether its directory is behind are that
server's alone (one server's broken NCCL group says nothing of another's). A fleet would hold
one syncer (with routes built for that server) per server and fan `sync` out to them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from grail.core.choices import WeightSyncMode
from grail.inference.errors import ServerStartError
from grail.inference.process import ServerManager, SyncResult
from grail.inference.weights.disk import DiskRoute
from grail.inference.weights.policy import PolicyWeights, Weights
from grail.inference.weights.route import FastRoute, RouteChoice, make_fast_route

logger = logging.getLogger(__name__)

#: failures of a fast route in a row after which a run syncs from disk only
MAX_FAILURES_IN_A_ROW = 3


class WeightSyncer:
    """Syncs one server through `fast` (None: disk only), falling back to `disk` (module
    docstring). Drive it from one thread (the trainer's)."""

    def __init__(self, disk: DiskRoute, fast: FastRoute | None = None, why: str = "") -> None:
        self.server: ServerManager = disk.server
        self.disk = disk
        self.fast = fast
        self.fallbacks = 0  # fast-route failures so far (each fell back to disk)
        self._in_a_row = 0
        # The fast route that last carried the weights while the directory still holds older
        # ones: it writes them there before a restart.
        self._unwritten: FastRoute | None = None
        if fast is not None:
            why = why or fast.name
            logger.info("weight transfer: %s (%s), disk as the fallback", fast.name, why)

    @classmethod
    def for_server(
        cls,
        server: ServerManager,
        route: RouteChoice | str,
        mode: WeightSyncMode = WeightSyncMode.in_place,
    ) -> WeightSyncer:
        """The syncer of `server` for `route` (its name, or the run's `RouteChoice`), the disk
        route reloading in `mode` (generation.weight_sync)."""
        choice = route if isinstance(route, RouteChoice) else RouteChoice(route, "")
        fast = None if choice.name == "disk" else make_fast_route(choice.name, server)
        return cls(DiskRoute(server, mode), fast, choice.why)

    @property
    def route(self) -> str:
        """The run's route: the fast one, or disk."""
        return "disk" if self.fast is None else self.fast.name

    @property
    def active_route(self) -> str:
        """The route the next full-model sync tries first."""
        return "disk" if self._in_a_row >= MAX_FAILURES_IN_A_ROW else self.route

    def sync(self, weights: Weights, weight_version: str) -> SyncResult:
        """Give the server `weights`: through the fast route when there is one and it can carry
        them (the trainer's `PolicyWeights`, the whole model, an in-place sync), else (or when it
        fails) through the disk route."""
        t0 = time.perf_counter()
        reason = None
        fast = self.fast if self.active_route != "disk" else None
        if (
            fast is not None
            and isinstance(weights, PolicyWeights)
            and not self.disk.adapter
            and self.disk.mode == "in_place"
        ):
            try:
                result = fast.send(weights, weight_version)
            except Exception as exc:  # any failure: the disk route still works
                if self.server.missed_deadline(exc):
                    raise  # a hung fleet server: its fleet sets it aside, not the disk route
                reason = f"{type(exc).__name__}: {exc}"
                self._failed(fast.name, reason)
            else:
                self._in_a_row = 0
                self._unwritten = fast  # the directory is now older than the served weights
                return replace(
                    result,
                    seconds=time.perf_counter() - t0,
                    transfer_fallbacks=self.fallbacks,
                )
        if not self.disk.adapter:
            # The disk route writes the newest weights into the directory first (a write that
            # fails raises out of the sync, and the run stops).
            self._unwritten = None
        result = self.disk.send(weights, weight_version)
        return replace(
            result,
            seconds=time.perf_counter() - t0,
            transfer_fallback_reason=reason,
            transfer_fallbacks=self.fallbacks,
        )

    def _failed(self, route: str, reason: str) -> None:
        self.fallbacks += 1
        self._in_a_row += 1
        logger.warning(
            "%s weight transfer failed, syncing from disk instead (%d in a row): %s",
            route,
            self._in_a_row,
            reason,
        )
        if self._in_a_row == MAX_FAILURES_IN_A_ROW:
            logger.warning(
                "%s weight transfer failed %d times in a row: this run syncs from disk from now on",
                route,
                MAX_FAILURES_IN_A_ROW,
            )

    def before_restart(self) -> None:
        """Write the weights the server serves into its directory if a fast route left it
        older, once: a restart loads from there. Raises `ServerStartError` when that fails (the
        restart would bring back old weights)."""
        route, self._unwritten = self._unwritten, None
        if route is None:
            return
        directory = self.server.model_path
        logger.info("writing the served weights to %s before the server restarts", directory)
        try:
            route.write_served(directory)
        except Exception as exc:
            raise ServerStartError(
                f"cannot restart the {self.server.kind} server: writing the weights it served to "
                f"{directory} failed: {exc}"
            ) from exc

    def recover(self) -> float:
        """`ServerManager.recover` (a dead server restarted from its directory) after
        `before_restart`; the seconds taken."""
        self.before_restart()
        return self.server.recover()

    def close(self) -> None:
        """Let go of the routes' buffers and the server's NCCL group (if any)."""
        if self.fast is not None:
            self.fast.close()
        self.disk.close()
