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


class ExternalServerError(ServerStartError, UserError):
    """A server the user runs (`generation.urls`) failed a start-up check: unreachable, another
    model, no log-probabilities, or the run's weights cannot reach it. One line naming the URL
    (`grail-train` exits 1 without a traceback): the user fixes the server, not grail."""


class ExternalServerGone(ServerDiedError, UserError):
    """A server the user runs stopped answering mid-run, and grail cannot restart a server it
    did not start. A fleet sets it aside and tries it again at each sync; a run with that
    server alone ends with this one line."""
