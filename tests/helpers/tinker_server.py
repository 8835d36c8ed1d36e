"""`grail-tinker` as a subprocess, and the official `tinker` SDK pointed at it, offline: what
tests/test_tinker*.py and examples/tinker_rl_copy_digits.py share."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "tml-grail-test"
STARTUP_TIMEOUT = 120.0
STOP_TIMEOUT = 15.0

# The SDK sends telemetry to its base_url unless this is off (the server would accept and drop
# it; off keeps the client's background work small).
os.environ.setdefault("TINKER_TELEMETRY", "0")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TinkerServer:
    """`python -m grail.tinker.cli --model tiny` on a free port, logging to `log_path`."""

    def __init__(self, run_dir: Path, log_path: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir, self.log_path = run_dir, log_path
        self._log = log_path.open("wb")
        command = [
            sys.executable, "-m", "grail.tinker.cli", "--model", "tiny",
            "--port", str(self.port), "--api-key", API_KEY, "--run-dir", str(run_dir),
            "--threads", "1", *extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"grail-tinker exited with {self.proc.returncode}:\n{self.log()}"
                )
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"grail-tinker not ready after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()

    def __enter__(self) -> TinkerServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
