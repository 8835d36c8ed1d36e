"""An ASGI app served by uvicorn in this process, with bounded start and stop: on a daemon thread
of its own (`ServerThread`), or as a task of the running event loop (`LoopServer`).

What the trainer serves beside its own work runs here: the trainer as a service and an OpenEnv
environment class on threads (a daemon, so a server that fails to stop never keeps the process
alive after Ctrl-C), verifiers' gateway on the rollouts' own loop (its routes await that loop's
completion client).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import uvicorn

log = logging.getLogger(__name__)


def _config(app: Any, host: str, port: int) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5
    )


def _listening_url(server: uvicorn.Server) -> str:
    """The `http://host:port` a started server listens on (port 0 asked: the one it got)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://{host}:{port}"


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
        self._server = uvicorn.Server(_config(app, host, port))
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
        return _listening_url(self._server)

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


class LoopServer:
    """`app` on `host:port` (port 0: a free one) as a task of the running event loop: `await
    start()` returns its URL once it listens, `await stop()` ends it."""

    def __init__(
        self, app: Any, host: str, port: int, *, name: str, start_timeout_s: float = 30.0
    ) -> None:
        self.host, self.port, self.name, self.start_timeout_s = host, port, name, start_timeout_s
        self._server = uvicorn.Server(_config(app, host, port))
        self._task: asyncio.Future[None] | None = None

    async def start(self) -> str:
        """Serve; the `http://host:port` it listens on. TimeoutError when it does not listen
        within start_timeout_s (a port taken)."""
        self._task = asyncio.ensure_future(self._server.serve())
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if self._task.done() or time.monotonic() > deadline:
                await self.stop()
                raise TimeoutError(
                    f"{self.name} did not start listening on {self.host}:{self.port}"
                )
            await asyncio.sleep(0.005)
        return _listening_url(self._server)

    async def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
