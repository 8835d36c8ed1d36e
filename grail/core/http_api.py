"""What grail's two HTTP APIs share (the built-in inference server in
grail/inference/builtin/app.py, the trainer as a service in grail/service/app.py): errors in
the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` and the gate in front of
every route (Bearer key, loopback-only routes, body size)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import secrets
from collections.abc import Callable, Sequence
from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered in the OpenAI shape with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


def describe_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A request body that failed validation, in one line (the first five problems, each with
    where it is), and the first problem's place as the OpenAI error's ``param``."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None

    def where(error: Any) -> str:
        return ".".join(str(x) for x in error.get("loc", ()) if x != "body")

    message = "; ".join(f"{where(e) or 'body'}: {e.get('msg')}" for e in errors[:5])
    return message, where(first) or None


def is_loopback(host: str | None) -> bool:
    """Whether `host` is this machine's loopback: 'localhost' or a loopback address (127.0.0.0/8,
    ::1, ::ffff:127.x). Any other name, a wildcard (0.0.0.0, ::) and None are not: a name may
    resolve to anything, and a wildcard listens on every interface."""
    if host is None:
        return False
    if host.lower() == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


class Gate:
    """ASGI middleware in front of every route: the API key, then the body size.

    - With a key, every route but ``open_paths`` needs ``Authorization: Bearer <key>``: 401 before
      anything else happens (unknown routes included, so they reveal nothing).
    - Without a key, ``local_only_paths`` (the routes that change the server's state, e.g. its
      weights) answer 403 to any client not on this machine's loopback, whatever address the
      server listens on: without a key, nothing tells a caller from the network from the owner.
    - A body over ``max_body_bytes`` gets 413 without being kept: decided at once from its
      Content-Length, or, for a chunked body (no length), as soon as the bytes received pass the
      limit; the rest is read and dropped (up to ``DRAIN_MAX_BYTES``, ``DRAIN_TIMEOUT_S``) before
      the answer, so that a client still uploading gets it rather than a connection reset.

    Plain ASGI rather than ``@app.middleware("http")``, whose per-request task group and streams
    cost more than the rest of a small request's handling."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_body_bytes: int,
        open_paths: tuple[str, ...] = ("/health",),
        limit_name: str = "(--max-request-bytes)",
        key_header: str | None = None,
        local_only_paths: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        # A second header that may carry the bare key instead (the Tinker SDK's X-API-Key).
        self.key_header = None if key_header is None else key_header.lower().encode()
        self.bare_key = None if api_key is None else api_key.encode()
        self.max_body_bytes = max_body_bytes
        self.open_paths, self.limit_name = open_paths, limit_name
        self.local_only_paths = local_only_paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan (and websockets, which no route accepts)
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected is not None and scope["path"] not in self.open_paths:
            given = headers.get(b"authorization", b"")
            ok = secrets.compare_digest(given, self.expected)
            if self.key_header is not None and self.bare_key is not None:
                ok |= secrets.compare_digest(headers.get(self.key_header, b""), self.bare_key)
            if not ok:
                also = f" or '{self.key_header.decode()}: <key>'" if self.key_header else ""
                message = f"invalid or missing API key: send 'Authorization: Bearer <key>'{also}"
                await error_response(message, 401)(scope, receive, send)
                return
        if self.expected is None and scope["path"] in self.local_only_paths:
            client = scope.get("client")
            if not is_loopback(client[0] if client else None):
                message = (
                    f"{scope['path']} answers only this machine's loopback when the server has "
                    "no API key: start it with an API key to call it from elsewhere"
                )
                await error_response(message, 403)(scope, receive, send)
                return
        length = headers.get(b"content-length")
        if length is not None:  # h11 has checked that it is a number
            if int(length) > self.max_body_bytes:
                await self._too_large(f"of {int(length)} bytes is", scope, receive, send)
                return
        elif b"transfer-encoding" in headers:  # chunked: count while reading, then replay
            body = bytearray()
            more = True
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away
                    return
                body += message.get("body", b"")
                more = message.get("more_body", False)
                if len(body) > self.max_body_bytes:
                    await self._too_large("(chunked) is", scope, receive, send)
                    return
            receive = replay(bytes(body), receive)
        await self.app(scope, receive, send)

    async def _too_large(self, what: str, scope: Any, receive: Any, send: Any) -> None:
        message = (
            f"request body {what} over this server's limit of {self.max_body_bytes} bytes "
            f"{self.limit_name}"
        )
        # Clients that send the whole body before reading (urllib, most scripts) got a
        # connection reset instead of this answer when it came early and the connection closed
        # under their upload: read and drop the rest first, within bounds.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_drain(receive, DRAIN_MAX_BYTES), DRAIN_TIMEOUT_S)
        await error_response(message, 413)(scope, receive, send)


# An over-limit body is read and dropped up to this many bytes, for this long, before the 413:
# past either, the answer goes out and the connection closes under the upload.
DRAIN_MAX_BYTES = 256 * 2**20
DRAIN_TIMEOUT_S = 10.0


async def _drain(receive: Any, limit: int) -> None:
    """Read the request body to its end (or `limit` bytes, or the client leaving), keeping none
    of it."""
    seen = 0
    while seen <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def replay(body: bytes, receive: Any) -> Callable[[], Any]:
    """An ASGI ``receive`` that gives ``body`` first, then what ``receive`` gives (disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Any:
        return pending.pop() if pending else await receive()

    return replay
