"""An ASGI app served by uvicorn on a daemon thread of this process, with bounded start and stop.

What the trainer serves beside its own work (the trainer as a service, an OpenEnv environment
class served in-process) runs here: the thread is a daemon, so a server that fails to stop never
keeps the process alive after Ctrl-C.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


class ServerThread:
    """`app` on `host:port` (port 0: a free one), started by `start()`, which returns its URL
    once it listens; `close()` stops it, waiting at most `stop_timeout_s`."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        name: str,
        start_timeout_s: float = 30.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.host, self.port, self.name = host, port, name
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's, once it runs

    def start(self) -> str:
        """Start serving; the `http://host:port` it listens on. TimeoutError when it does not
        listen within start_timeout_s (a port taken, an app that fails at start-up)."""
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise TimeoutError(
                    f"{self.name} did not start listening on {self.host}:{self.port} within "
                    f"{self.start_timeout_s:g} s"
                )
            time.sleep(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def _serve(self) -> None:
        asyncio.run(self._serve_async())

    async def _serve_async(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self._server.serve()

    def close(self) -> None:
        """Stop serving (idempotent); a warning when it has not stopped within the timeout."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(self.stop_timeout_s)
            if self._thread.is_alive():
                log.warning("%s did not stop within %g s", self.name, self.stop_timeout_s)
