"""What can go wrong with an inference server: failing to start, dying, refusing new weights."""

from __future__ import annotations


class ServerError(RuntimeError):
    """Base class of every server lifecycle error."""


class ServerStartError(ServerError):
    """The server exited during start-up, or did not become ready in time."""


class ServerDiedError(ServerError):
    """The server process exited while it was supposed to be serving."""


class WeightSyncError(ServerError):
    """New weights could not be loaded into the server."""
