"""A stand-in for the built-in inference server, for lifecycle tests that must not load a model.

It takes the built-in server's command line, answers its control routes, and can be told to
misbehave the ways real servers do. Standard library only, so it starts in a fraction of a second.

    python tests/helpers/fake_server.py --model DIR --served-model-name NAME --host H --port P \
        --device D
        [--start-delay S]      sleep before binding the port (connection refused meanwhile)
        [--health-status N]    answer GET /health with HTTP N (e.g. 503: never ready)
        [--die-after S]        exit with code 7 S seconds after binding, printing why
        [--ignore-sigterm]     ignore SIGTERM (stop() must escalate to SIGKILL)
        [--spawn-worker]       start a SIGTERM-ignoring worker process in the same group

Markers in the model directory: FAIL_START makes start-up fail (exit 3, after printing an error);
FAIL_UPDATE in a checkpoint directory makes /update_weights_from_disk refuse it with HTTP 400.
GET /debug/info returns pid, worker pid, argv, model, weight version, the thread/device env and
the key the server got in GRAIL_API_KEY.

`FakeBuiltinServer` is `BuiltinServer` with this script in place of the real module.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

FAKE_SERVER = Path(__file__).resolve()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", required=True, choices=["cpu", "cuda:0"])
    parser.add_argument("--dtype")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--api-key")
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--health-status", type=int, default=200)
    parser.add_argument("--die-after", type=float)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--spawn-worker", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"fake server: model={args.model} pid={os.getpid()}", flush=True)
    if (Path(args.model) / "FAIL_START").exists():
        print("fatal: cannot load weights: FAIL_START marker present", file=sys.stderr, flush=True)
        sys.exit(3)
    time.sleep(args.start_delay)

    state = {"model": args.model, "weight_version": None, "worker_pid": None}
    if args.spawn_worker:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "time.sleep(600)",
            ]
        )
        state["worker_pid"] = worker.pid

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
                self._send(args.health_status, {"status": args.health_status})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": args.served_model_name}]})
            elif self.path == "/debug/info":
                env = {
                    k: os.environ.get(k)
                    for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
                }
                key = os.environ.get("GRAIL_API_KEY")  # how the harness passes grail-serve's key
                body = {"pid": os.getpid(), "argv": sys.argv[1:], "env": env, "key": key}
                self._send(200, {**body, **state})
            else:
                self._send(404, {"detail": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"{}")
            if self.path != "/update_weights_from_disk":
                self._send(404, {"detail": "not found"})
                return
            path = Path(body["model_path"])
            if not path.is_absolute():
                self._send(400, {"success": False, "message": f"not absolute: {path}"})
            elif (path / "FAIL_UPDATE").exists():
                self._send(400, {"success": False, "message": "shape mismatch in layer 0"})
            else:
                state["model"] = str(path)
                state["weight_version"] = body["weight_version"]
                self._send(200, {"success": True, "message": "ok"})

        def log_message(self, format: str, *log_args: object) -> None:
            print(format % log_args, flush=True)

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake server: listening on {args.host}:{args.port}", flush=True)
    if args.die_after is not None:

        def die() -> None:
            time.sleep(args.die_after)
            print("fatal: simulated crash (CUDA error: illegal memory access)", flush=True)
            os._exit(7)

        threading.Thread(target=die, daemon=True).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
else:
    from grail.inference.backends.builtin import BuiltinServer

    class FakeBuiltinServer(BuiltinServer):
        """`BuiltinServer` running this script; every other behaviour is the real class's."""

        def build_command(self) -> list[str]:
            return [sys.executable, str(FAKE_SERVER), *self.server_args()]
