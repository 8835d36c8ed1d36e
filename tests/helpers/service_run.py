"""`grail-train mode=service` as a subprocess: what the end-to-end tests of the service share
(tests/test_service.py, test_service_environment.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from helpers.forked import popen
from helpers.run_dirs import REPO


class ServiceRun:
    """`grail-train mode=service ARGS` in the background, killed (with its process group) if a
    test leaves it running."""

    def __init__(self, run_dir: Path, *args: str) -> None:
        self.run_dir = run_dir
        self.endpoint = run_dir / "service" / "endpoint.json"
        self.endpoint.unlink(missing_ok=True)
        self.log = (run_dir.parent / f"{run_dir.name}.log").open("a")
        command = [sys.executable, "-m", "grail.train.cli", "mode=service", "service.port=0"]
        self.process = popen(
            [*command, *args, f"hydra.run.dir={run_dir}"],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def connect(self, timeout_s: float = 120) -> httpx.Client:
        """A client of the service, once it listens."""
        deadline = time.monotonic() + timeout_s
        while not self.endpoint.exists():
            assert self.process.poll() is None, self.output()
            assert time.monotonic() < deadline, "the service did not start"
            time.sleep(0.1)
        endpoint = json.loads(self.endpoint.read_text())
        headers = {"Authorization": f"Bearer {endpoint['api_key']}"}
        return httpx.Client(base_url=endpoint["url"], headers=headers, timeout=60)

    def output(self) -> str:
        self.log.flush()
        return (self.run_dir.parent / f"{self.run_dir.name}.log").read_text()[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.log.close()
