"""A stand-in for a server the user runs, in a thread of the test process: it answers the routes
grail's start-up checks of an external server ask (grail/inference/external.py), each of which
can be told to answer the ways real servers do when they cannot serve a run. Standard library
only, so it starts at once."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class StubBehaviour:
    """How the stub answers. Defaults: a healthy server of one model, with log-probabilities,
    that loads any weights it is given."""

    models: list[str] = field(default_factory=lambda: ["policy"])
    models_status: int = 200  # 404: not an OpenAI server
    logprobs: bool = True
    # /update_weights_from_disk: HTTP status and message; 404 is a server without the route.
    # grail-serve answers 400 "model_path ... is not a directory" for a path it cannot see.
    update_status: int = 200
    update_message: str = "ok"
    loaded: list[str] = field(default_factory=list)  # the paths it was asked to load


def _completion(logprobs: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": "a", "finish_reason": "length"}
    choice["token_ids"] = [5]
    choice["logprobs"] = {"token_logprobs": [-1.5], "tokens": ["a"]} if logprobs else None
    return {"object": "text_completion", "choices": [choice]}


@contextlib.contextmanager
def stub_server(behaviour: StubBehaviour) -> Iterator[str]:
    """The stub, answering as `behaviour` says, at the URL yielded (its /v1); stopped on exit."""

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models" and behaviour.models_status == 200:
                self._send(200, {"object": "list", "data": [{"id": m} for m in behaviour.models]})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/v1/completions":
                self._send(200, _completion(behaviour.logprobs))
            elif self.path == "/update_weights_from_disk" and behaviour.update_status != 404:
                behaviour.loaded.append(body["model_path"])
                ok = behaviour.update_status == 200
                answer = {"success": ok, "message": behaviour.update_message}
                self._send(behaviour.update_status, answer)
            else:
                self._send(404, {"detail": "Not Found"})

        def log_message(self, format: str, *args: object) -> None:
            pass  # quiet: the tests read what grail says

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # A short poll: shutdown() waits for it (the default, 0.5 s, per stub)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
