"""What can go wrong with an inference server: failing to start, dying, refusing new weights."""

from __future__ import annotations

from grail.core.errors import UserError


class ServerError(RuntimeError):
    """Base class of every server lifecycle error."""


class ServerStartError(ServerError):
    """The server exited during start-up, or did not become ready in time."""


class ServerDiedError(ServerError):
    """The server process exited while it was supposed to be serving."""


class WeightSyncError(ServerError):
    """New weights could not be loaded into the server."""


class ServerTimeoutError(WeightSyncError):
    """A call to a server (a weight sync's request, an NCCL join or broadcast) got no answer in
    time: the server is hung (stopped, deadlocked) or far slower than it should be. A fleet
    server that misses its deadline (`ServerManager.call_deadline_s`) is set aside at once, no
    fallback trying it again (grail/rollouts/fleet.py)."""


class ExternalServerError(ServerStartError, UserError):
    """A server the user runs (`generation.urls`) failed a start-up check: unreachable, another
    model, no log-probabilities, or the run's weights cannot reach it. One line naming the URL
    (`grail-train` exits 1 without a traceback): the user fixes the server, not grail."""


class FleetGone(ServerDiedError, UserError):
    """Every server of a fleet failed (at start, in a weight sync, or in generation after the
    fleet's restarts) and none is left to serve: the run ends with this one line, each server's
    reason in it (their logs under `logs/server-<i>/` say more)."""


class ExternalServerGone(ServerDiedError, UserError):
    """A server the user runs stopped answering mid-run, and grail cannot restart a server it
    did not start. A fleet sets it aside and tries it again at each sync; a run with that
    server alone ends with this one line."""
