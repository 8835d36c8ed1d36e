"""A stand-in for vLLM and SGLang servers, for tests that must not need either package or a GPU.

It accepts the command line `VLLMServer` / `SGLangServer` build (`serve MODEL --port P ...` or
`--model-path MODEL --port P ...`; flags it does not know are ignored) and answers the routes the
harness uses, with the shapes recorded in tests/fixtures/:

    GET  /health                         200 (or --health-status)
    POST /v1/completions                 the recorded vLLM or SGLang answer for n = 2, whatever
                                         was asked, so parsing is tested against the real shape
    POST /pause /collective_rpc /reset_prefix_cache /resume          (vLLM dev-mode routes)
    POST /update_weights_from_disk                                    (SGLang)
    POST the NCCL weight-transfer routes of each (fixtures/weight_transfer/; no NCCL behind them)
    GET  /debug/calls                    every request so far: method, path, query, JSON body
    GET  /debug/info                     pid, argv, model and selected environment variables
    POST /debug/plan                     {"ROUTE": [ACTION, ...]}: the next requests to ROUTE get
                                         these actions in order, then the normal answer

An ACTION is {"status": N, "body": ...} (answer that), {"sleep": S} (wait S seconds, then answer
normally), {"fixture": "NAME"} (answer fixtures/control_routes.json's entry NAME) or
{"die": true} (exit at once with code 9, without answering: a crash mid-request).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

FAKE_GPU_SERVER = Path(__file__).resolve()
FIXTURES = FAKE_GPU_SERVER.parents[1] / "fixtures"
# The reload route of each backend (docs/protocols.md): vLLM's collective_rpc reload_weights,
# SGLang's update_weights_from_disk.
RELOAD_ROUTES = frozenset({"/collective_rpc", "/update_weights_from_disk"})
ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "VLLM_SERVER_DEV_MODE",
    "SGLANG_RETURN_ORIGINAL_LOGPROB",
    "OMP_NUM_THREADS",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--flavour", choices=["vllm", "sglang"], required=True)
    parser.add_argument("--model-path")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--health-status", type=int, default=200)
    args, rest = parser.parse_known_args()
    model = args.model_path
    if args.flavour == "vllm":
        if rest[:1] != ["serve"] or len(rest) < 2:
            sys.exit(f"fake vllm: expected 'serve MODEL ...', got {rest[:2]}")
        model = rest[1]
    if model is None or not Path(model).is_dir():
        print(f"fatal: model directory {model} does not exist", flush=True)
        sys.exit(3)
    print(f"fake {args.flavour}: model={model} pid={os.getpid()}", flush=True)

    controls = json.loads((FIXTURES / "control_routes.json").read_text())[args.flavour]
    # The NCCL weight-transfer routes, as recorded from the real packages (their failure cases
    # are plan fixtures too: "ROUTE failed").
    nccl = json.loads((FIXTURES / "weight_transfer" / f"{args.flavour}_nccl.json").read_text())
    controls.update({k: v for k, v in nccl.items() if not k.startswith("_")})
    completion = json.loads((FIXTURES / f"{args.flavour}_completion_n2.json").read_text())
    calls: list[dict] = []
    plan: dict[str, list[dict]] = {}
    state = {"model": model}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: object) -> None:
            data = b"" if body is None else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = urlsplit(self.path).path
            if path == "/health":
                self._send(args.health_status, {})
            elif path == "/debug/calls":
                with lock:
                    self._send(200, list(calls))
            elif path == "/debug/info":
                env = {k: os.environ.get(k) for k in ENV_KEYS}
                self._send(200, {"pid": os.getpid(), "argv": sys.argv[1:], "env": env, **state})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            parts = urlsplit(self.path)
            length = int(self.headers.get("Content-Length", 0))
            raw = self.rfile.read(length)
            body = json.loads(raw) if raw else None
            if parts.path == "/debug/plan":
                with lock:
                    for route, actions in body.items():
                        plan.setdefault(route, []).extend(actions)
                self._send(200, {})
                return
            with lock:
                calls.append(
                    {"path": parts.path, "query": dict(parse_qsl(parts.query)), "body": body}
                )
                action = plan[parts.path].pop(0) if plan.get(parts.path) else None
            if action is not None:
                if action.get("die"):
                    print(f"fatal: simulated crash during {parts.path}", flush=True)
                    os._exit(9)
                if "sleep" in action:
                    time.sleep(action["sleep"])
                elif "fixture" in action:
                    answer = controls[action["fixture"]]
                    self._send(answer["status"], answer["body"])
                    return
                else:
                    self._send(action["status"], action.get("body"))
                    return
            if parts.path == "/v1/completions":
                self._send(200, completion)
            elif parts.path in controls:
                if parts.path == "/update_weights_from_disk":
                    state["model"] = body["model_path"]
                elif parts.path == "/collective_rpc":
                    state["model"] = body["kwargs"]["weights_path"]
                answer = controls[parts.path]
                self._send(answer["status"], answer["body"])
            else:
                self._send(404, {"detail": "Not Found"})

        def log_message(self, format: str, *log_args: object) -> None:
            print(format % log_args, flush=True)

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"fake {args.flavour}: listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
else:
    import httpx

    from grail.inference.backends.sglang import SGLangServer
    from grail.inference.backends.vllm import VLLMServer

    # What a test reads and sets through the stand-in's /debug routes.

    def calls(server) -> list[dict]:
        return httpx.get(f"{server.root_url}/debug/calls", timeout=5).json()

    def info(server) -> dict:
        return httpx.get(f"{server.root_url}/debug/info", timeout=5).json()

    def plan(server, **routes: list[dict]) -> None:
        body = {"/" + route.replace("__", "/"): actions for route, actions in routes.items()}
        httpx.post(f"{server.root_url}/debug/plan", json=body, timeout=5).raise_for_status()

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    class FakeVLLMServer(VLLMServer):
        """`VLLMServer` running this script (its real argv after the script's own flags)."""

        def check_installed(self) -> None:
            pass

        def build_command(self) -> list[str]:
            real = super().build_command()
            assert real[1:3] == ["-m", self.server_module], real
            return [sys.executable, str(FAKE_GPU_SERVER), "--flavour", "vllm", *real[3:]]

    class FakeSGLangServer(SGLangServer):
        """`SGLangServer` running this script (its real argv after the script's own flags)."""

        def check_installed(self) -> None:
            pass

        def build_command(self) -> list[str]:
            real = super().build_command()
            assert real[1:3] == ["-m", self.server_module], real
            return [sys.executable, str(FAKE_GPU_SERVER), "--flavour", "sglang", *real[3:]]
