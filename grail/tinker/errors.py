"""What a Tinker request can fail with, and how the client sees it.

Refused when it arrives (the route answers the HTTP status, which the SDK raises as
``tinker.BadRequestError``/``NotFoundError``/...) or, found while the job runs, answered through
its future as ``{"error": message, "category": "user"}`` (the SDK raises ``RequestFailedError``).
Never a 5xx for the client's mistakes: the SDK retries those for minutes.
"""

from __future__ import annotations


class UserFault(ValueError):
    """A request this server cannot serve as sent (HTTP 400 / category "user")."""

    status = 400


class NotFound(UserFault):
    """An unknown model_id, checkpoint, sampling session or future (HTTP 404)."""

    status = 404


class Busy(UserFault):
    """The request queue is full (HTTP 429: the SDK backs off and sends it again)."""

    status = 429
