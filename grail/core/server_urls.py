"""The URLs of servers the user runs (`generation.urls`): what one may look like, and the root
of the server it names, which the config validation and the external server share."""

from __future__ import annotations

from urllib.parse import urlsplit


def server_root(url: str) -> str:
    """The server root of `url`, an http(s) URL of a server's root or of its `/v1`
    ("http://host:8000/v1/" -> "http://host:8000"; scheme and host lowercased). Raises
    `ValueError` saying what is wrong with anything else."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("is empty")
    try:
        parts = urlsplit(url.strip())
        parts.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError as exc:
        raise ValueError(f"is not a URL ({exc})") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise ValueError("is not an http:// or https:// URL")
    if not parts.hostname:
        raise ValueError("names no host")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError("has a query, fragment or credentials; give only scheme, host, port")
    path = parts.path.rstrip("/")
    if path not in ("", "/v1"):
        raise ValueError(f"has the path {parts.path!r}: give the server's root or its /v1")
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"
