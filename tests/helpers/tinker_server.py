"""`grail-tinker` as a subprocess, and the official `tinker` SDK pointed at it, offline: what
tests/test_tinker*.py and examples/tinker_rl_copy_digits.py share."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grail.inference.os_process import free_port
from helpers.builtin_server import ServerProcess

API_KEY = "tml-grail-test"
STOP_TIMEOUT = 15.0

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
