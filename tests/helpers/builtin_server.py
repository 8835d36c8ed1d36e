"""The built-in server (`grail-serve`) as a subprocess over real HTTP: what the tests of the server
share (tests/test_builtin_server.py, test_server_hardening.py)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest

from grail.inference.os_process import free_port
from helpers.forked import popen

API_KEY = "test-key"
NAME = "tiny"
STARTUP_TIMEOUT = 120.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class ServerProcess:
    """`python -m grail.inference.builtin.server` as a subprocess on a free port, logging to a
    file; the other servers the tests run as processes (grail-tinker: helpers/tinker_server.py)
    subclass it with their own command and health route. A context manager: entered once ready,
    stopped on exit."""

    name = "server"
    health_path = "/health"
    stop_timeout = 15.0

    def __init__(
        self, model_dir: Path | str, log_path: Path, *extra: str, new_interpreter: bool = False
    ) -> None:
        self.api_key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        self.port = free_port()
        self._spawn(log_path, [
            sys.executable, "-m", "grail.inference.builtin.server",
            "--model", str(model_dir), "--served-model-name", NAME,
            "--port", str(self.port), "--threads", "1", "--max-batch-size", "16", *extra,
        ], new_interpreter)  # fmt: skip

    def _spawn(self, log_path: Path, command: list[str], new_interpreter: bool = False) -> None:
        """Start `command`. grail-serve is forked from the test runner (helpers/forked.py), as
        grail-train forks its servers from its zygote: ready without a new interpreter's ~5 s
        of imports. `new_interpreter` for a test of how the process itself ends (a forked one
        leaves by os._exit, without the interpreter's wait for its threads)."""
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        start = subprocess.Popen if new_interpreter else popen
        self.proc = start(command, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def side_by_side(
    logs: Path,
    new_interpreters: Collection[str] = (),
    **specs: tuple[Path | str, tuple[str, ...]],
) -> Iterator[dict[str, ServerProcess]]:
    """Servers started side by side, name=(model, extra args), each logging to `logs`/name.log
    (those named in `new_interpreters` as new interpreters: `ServerProcess`); yielded once all
    are ready, all stopped on exit."""
    started: dict[str, ServerProcess] = {}
    try:
        for name, (model, extra) in specs.items():
            started[name] = ServerProcess(
                model, logs / f"{name}.log", *extra, new_interpreter=name in new_interpreters
            )
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


def require_batch_invariance(server: ServerProcess) -> None:
    """Skip what follows where this CPU's BLAS offers no batch-invariant linear layers."""
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    if not card["batch_invariant"]:
        pytest.skip("the server reports no batch invariance on this BLAS (see engine docstring)")
