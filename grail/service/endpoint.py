"""Where clients find the service: `RUN_DIR/service/endpoint.json`, `{"url", "api_key"}`,
written (owner-only) once the service listens, and read by clients (examples/service_*.py)."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from grail.core.records import SECRET_FILE_MODE, atomic_write_text

ENDPOINT = "endpoint.json"  # the service's URL and key, readable by the run's owner only


def write_endpoint(directory: Path, url: str, api_key: str) -> Path:
    """Write `directory`/endpoint.json, the service's URL and key, owner-only (0600) whatever
    the umask; return its path."""
    path = directory / ENDPOINT
    text = json.dumps({"url": url, "api_key": api_key}) + "\n"
    atomic_write_text(path, text, mode=SECRET_FILE_MODE)
    return path


def read_endpoint(path: Path, timeout_s: float) -> tuple[str, str]:
    """(url, key) from a service's endpoint file, waiting up to `timeout_s` for the service to
    write it (TimeoutError after)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            data = json.loads(path.read_text())
            return str(data["url"]), str(data["api_key"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no service endpoint at {path} after {timeout_s:g} s") from None
            time.sleep(0.2)


def add_endpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """A client's flags for finding the service: --endpoint, or --url and --api-key (or
    GRAIL_SERVICE_URL and GRAIL_SERVICE_API_KEY), and --wait."""
    parser.add_argument("--endpoint", type=Path, help="the service's endpoint.json")
    parser.add_argument("--url", default=os.environ.get("GRAIL_SERVICE_URL"))
    parser.add_argument("--api-key", default=os.environ.get("GRAIL_SERVICE_API_KEY"))
    parser.add_argument("--wait", type=float, default=300, help="seconds to wait for the service")


def endpoint_from_arguments(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[str, str]:
    """(url, key) from the flags `add_endpoint_arguments` added; the parser's error (exit 2)
    when neither way is given, one line (exit 1) when the file never comes."""
    if args.endpoint is not None:
        try:
            return read_endpoint(args.endpoint, args.wait)
        except TimeoutError as exc:
            raise SystemExit(str(exc)) from None
    if args.url and args.api_key:
        return str(args.url), str(args.api_key)
    parser.error("give --endpoint, or --url and --api-key")
