"""`grail-tinker` as a subprocess, and the official `tinker` SDK pointed at it, offline: what
tests/test_tinker*.py and examples/tinker_rl_copy_digits.py share.

The SDK keeps each session alive with a heartbeat task on its one background loop; a session
left open outlives its test (and its server), and after two minutes of failed heartbeats warns
"Your connection may be unreliable or Tinker is down" into whatever test runs then. So every
ServiceClient a test makes is closed when the test ends (`sdk_service`, `close_service`), and
`no_session_left_open` fails a test that leaves a heartbeat behind.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import pytest
import tinker

from grail.inference.os_process import free_port
from helpers.builtin_server import ServerProcess

API_KEY = "tml-grail-test-0123456789abcdef"  # grail-tinker wants 16+ characters after tml-
STOP_TIMEOUT = 15.0
# How long closing a session may take: its finish request (the SDK retries one that cannot
# connect for five minutes), then the SDK's cleanup (heartbeats, connection pools).
CLOSE_TIMEOUT = 10.0

# The SDK sends telemetry to its base_url unless this is off (the server would accept and drop
# it; off keeps the client's background work small).
os.environ.setdefault("TINKER_TELEMETRY", "0")


class TinkerServer(ServerProcess):
    """`python -m grail.tinker.cli --model tiny` on a free port, logging to `log_path` (a later
    `--model` in `extra` wins)."""

    name = "grail-tinker"
    health_path = "/api/v1/healthz"
    stop_timeout = STOP_TIMEOUT

    def __init__(self, run_dir: Path, log_path: Path, *extra: str) -> None:
        self.run_dir = run_dir
        self.port = free_port()
        self._spawn(log_path, [
            sys.executable, "-m", "grail.tinker.cli", "--model", "tiny",
            "--port", str(self.port), "--api-key", API_KEY, "--run-dir", str(run_dir),
            "--threads", "1", *extra,
        ])  # fmt: skip


def close_service(
    service: tinker.ServiceClient,
    status: Literal["success", "errored", "interrupted"] = "success",
    timeout: float = CLOSE_TIMEOUT,
) -> None:
    """Finish `service`'s session and stop its heartbeats, within `timeout` even when its server
    is gone: the finish request, still retrying then, is cancelled, and the SDK's cleanup after it
    (the heartbeats, the connection pools) runs as the cancellation unwinds."""
    future = service.close(status).future()
    try:
        future.result(timeout)
    except concurrent.futures.TimeoutError:
        future.cancel()


@contextmanager
def sdk_service(url: str, api_key: str = API_KEY) -> Iterator[tinker.ServiceClient]:
    """A ServiceClient of the server at `url`, closed when the block ends, however it ends."""
    service = tinker.ServiceClient(base_url=url, api_key=api_key)
    try:
        yield service
    finally:
        close_service(service)


def heartbeats() -> set[asyncio.Task[None]]:
    """The SDK's session heartbeat tasks running in this process (on its one background loop)."""
    from tinker.lib.internal_client_holder import _internal_client_holder_thread_singleton

    loop = _internal_client_holder_thread_singleton.loop_if_started()
    if loop is None:
        return set()
    return {
        task
        for task in asyncio.all_tasks(loop)
        if task.get_coro().__qualname__.endswith("._session_heartbeat")  # type: ignore[union-attr]
    }


@pytest.fixture(autouse=True)
def no_session_left_open() -> Iterator[None]:
    """Fails the test that leaves an SDK session heartbeating after it (a module's own
    ServiceClient, made before the test, is not counted)."""
    before = heartbeats()
    yield
    deadline = time.monotonic() + CLOSE_TIMEOUT
    while (left := heartbeats() - before) and time.monotonic() < deadline:
        time.sleep(0.05)  # a close's cleanup runs on the SDK's loop, a moment after it returns
    assert not left, f"{len(left)} Tinker SDK session(s) left open: close every ServiceClient"
