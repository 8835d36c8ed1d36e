"""Surviving a server that dies mid-run: restart it from its newest weights and repeat the call."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from grail.core.errors import first_line
from grail.inference.errors import ServerDiedError
from grail.inference.process import ServerManager

logger = logging.getLogger(__name__)

T = TypeVar("T")


def call_with_recovery(
    server: ServerManager,
    call: Callable[[], T],
    *,
    max_restarts: int,
    what: str = "generation",
    recover: Callable[[], object] | None = None,
) -> T:
    """Run `call` (e.g. one generation batch); if it fails because the server died, restart the
    server from its newest weights (`recover`: `ServerManager.recover` unless given, e.g.
    `WeightSyncer.recover`, which writes the weights a fast route served first) and run `call`
    again, at most `max_restarts` times.

    "Because the server died" means the failure is a `ServerDiedError` (the completion client's
    liveness check raises it) or the server process is gone when the failure arrives. Any other
    failure (a bad request, a bug in scoring) is re-raised at once: restarting would not help.
    The retried call starts over, so `call` must be safe to repeat (a generation batch is: its
    seeds are fixed). Raises `ServerDiedError` naming the attempts once restarts are used up, and
    `ServerStartError` if a restart itself fails.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    restarts = 0
    while True:
        try:
            return call()
        except Exception as exc:
            died = isinstance(exc, ServerDiedError) or (
                server.pid is not None and not server.is_alive() and not server._stopped_by_us
            )
            if not died:
                raise
            if restarts >= max_restarts:
                raise ServerDiedError(
                    f"{what} failed: the {server.kind} server died {restarts + 1} time(s) and "
                    f"was restarted {restarts} time(s) (max_restarts={max_restarts}); giving "
                    f"up. Last failure: {exc}"
                ) from exc
            restarts += 1
            logger.warning(
                "%s failed because the %s server died (%s); restart %d/%d and retry",
                what,
                server.kind,
                first_line(exc),
                restarts,
                max_restarts,
            )
            (recover or server.recover)()
