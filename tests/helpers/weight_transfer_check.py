"""Replay the NCCL weight-transfer requests against vLLM's or SGLang's own routes and models.

    python tests/helpers/weight_transfer_check.py {vllm|sglang} < job.json

job.json: {"argv": the server's arguments after `python -m MODULE`, "init": the init body,
"update": the update body, "finish"/"begin"/"end": the other bodies}. Prints one line
"RESULT <json>": what the package's parser made of the command line, how its request models
parsed each body, and the answer of each route (status, body), served by the package's own
FastAPI routes in-process with a stand-in only for the engine (it records what it was handed, and
for the failure cases raises or answers as the engine does). Run with the package's interpreter
(tests/test_weight_transfer_backends.py does; it skips when neither is there).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from types import SimpleNamespace


def check_vllm(job: dict) -> dict:
    import vllm
    from vllm import platforms

    if platforms.current_platform.is_unspecified():
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
    args = parser.parse_args(job["argv"])
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    ServeSubcommand().validate(args)
    engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
    result: dict = {
        "version": vllm.__version__,
        "weight_transfer_backend": engine_args.weight_transfer_config.backend,
    }

    class Engine:  # what the routes call on the engine client (vllm/engine/protocol.py)
        def __init__(self) -> None:
            self.calls: list = []
            self.fail: str | None = None

        async def pause_generation(self, mode: str, clear_cache: bool) -> None:
            self.calls.append(["pause", mode, clear_cache])

        async def resume_generation(self) -> None:
            self.calls.append(["resume"])

        async def init_weight_transfer_engine(self, request) -> None:
            # what NCCLWeightTransferEngine.parse_init_info does with it
            info = NCCLWeightTransferInitInfo(**request.init_info)
            self.calls.append(["init", asdict(info)])

        async def start_weight_update(self) -> None:
            self.calls.append(["start"])

        async def update_weights(self, request) -> None:
            if self.fail:
                raise RuntimeError(self.fail)
            info = NCCLWeightTransferUpdateInfo(**request.update_info)
            self.calls.append(["update", asdict(info)])

        async def finish_weight_update(self, weight_version) -> None:
            self.calls.append(["finish", weight_version])

    engine = Engine()
    app = FastAPI()
    app.state.engine_client = engine
    register_rl_api_routers(app)
    client = TestClient(app, raise_server_exceptions=False)

    def post(route: str, body=None, params=None) -> dict:
        response = client.post(route, json=body, params=params)
        try:
            decoded = response.json()
        except ValueError:
            decoded = response.text
        return {"status": response.status_code, "body": decoded}

    answers = {
        "/pause": post("/pause", params={"mode": "wait"}),
        "/init_weight_transfer_engine": post("/init_weight_transfer_engine", job["init"]),
        "/start_weight_update": post("/start_weight_update"),
        "/update_weights": post("/update_weights", job["update"]),
        "/finish_weight_update": post("/finish_weight_update", job["finish"]),
        "/resume": post("/resume"),
    }
    engine.fail = "NCCL error: unhandled system error"
    answers["/update_weights failed"] = post("/update_weights", job["update"])
    answers["/init_weight_transfer_engine bad"] = post(
        "/init_weight_transfer_engine", {"init_info": {**job["init"]["init_info"], "extra": 1}}
    )
    result["answers"] = answers
    result["calls"] = engine.calls
    return result


def check_sglang(job: dict) -> dict:
    import sglang.srt.entrypoints.http_server as http_server
    from fastapi.testclient import TestClient
    from sglang.srt.server_args import ServerArgs
    from sglang.version import __version__

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    ServerArgs.from_cli_args(parser.parse_args(job["argv"]))
    result: dict = {"version": __version__}

    def fields(obj) -> dict:
        import msgspec

        return {k: v for k, v in msgspec.structs.asdict(obj).items() if k != "rid"}

    class Manager:  # the tokenizer manager's side; messages as SGLang 0.5.23's weight updaters
        def __init__(self) -> None:
            self.calls: list = []
            self.refuse: str | None = None

        def auto_create_handle_loop(self) -> None:
            pass

        async def init_weights_update_group(self, obj, request):
            self.calls.append(["init", type(obj).__name__, fields(obj)])
            return True, "Succeeded to initialize custom process group."

        async def begin_weight_update(self, obj, request):
            self.calls.append(["begin", type(obj).__name__, fields(obj)])
            return True, "Success"

        async def update_weights_from_distributed(self, obj, request):
            self.calls.append(["update", type(obj).__name__, fields(obj)])
            if self.refuse:
                return False, self.refuse
            return True, "Succeeded to update parameter online."

        async def end_weight_update(self, obj, request):
            self.calls.append(["end", type(obj).__name__, fields(obj)])
            return True, "Success"

    manager = Manager()
    http_server._global_state = SimpleNamespace(tokenizer_manager=manager)
    client = TestClient(http_server.app, raise_server_exceptions=False)

    def post(route: str, body) -> dict:
        response = client.post(route, json=body)
        try:
            decoded = response.json()
        except ValueError:
            decoded = response.text
        return {"status": response.status_code, "body": decoded}

    answers = {
        "/init_weights_update_group": post("/init_weights_update_group", job["init"]),
        "/begin_weight_update": post("/begin_weight_update", job["begin"]),
        "/update_weights_from_distributed": post("/update_weights_from_distributed", job["update"]),
        "/end_weight_update": post("/end_weight_update", job["end"]),
    }
    manager.refuse = (  # sglang/srt/managers/scheduler_components/weight_updater.py
        "update_weights_from_distributed must run between begin_weight_update() and "
        "end_weight_update()"
    )
    answers["/update_weights_from_distributed failed"] = post(
        "/update_weights_from_distributed", job["update"]
    )
    result["answers"] = answers
    result["calls"] = manager.calls
    return result


def main() -> None:
    job = json.loads(sys.stdin.read())
    result = check_vllm(job) if sys.argv[1] == "vllm" else check_sglang(job)
    print("RESULT " + json.dumps(result, default=str))


if __name__ == "__main__":
    asyncio.set_event_loop(asyncio.new_event_loop())
    main()
