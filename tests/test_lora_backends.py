"""vLLM and SGLang serving a LoRA adapter (`lora_dir`): command lines, the name requests use,
the adapter sync's requests and the handling of each answer, and the restart fallback, without
the packages or a GPU.

The answers in tests/fixtures/lora/ were recorded from vLLM 0.33.0's and SGLang 0.5.23's own
HTTP routes (their FastAPI apps, served in-process, in front of a stand-in for the engine; see
each file's "_source"). Lifecycle tests run tests/helpers/fake_gpu_server.py with the real
command lines and plan those recorded answers.

When vLLM or SGLang is importable (here, or in the interpreter named by GRAIL_VLLM_PYTHON /
GRAIL_SGLANG_PYTHON), the command lines are also parsed by the package's own parser, and the
adapter-sync requests are replayed against the package's own routes (the answers must be the
recorded ones): see `test_lora_against_the_real_package`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from pathlib import Path

import httpx
import pytest
from helpers.fake_gpu_server import FakeSGLangServer, FakeVLLMServer, calls, flag, info
from helpers.real_packages import python_with, run_check

from grail.inference.backends import make_server_manager
from grail.inference.backends.sglang import SGLangServer
from grail.inference.backends.vllm import VLLM_LORA_RANKS, VLLMServer, vllm_max_lora_rank
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.inference.errors import ServerStartError, WeightSyncError

TESTS_DIR = Path(__file__).resolve().parent
LORA_FIXTURES = TESTS_DIR / "fixtures" / "lora"
#: the adapter directory in the recorded answers (the replays are normalised to it)
RECORDED_LORA_DIR = "/runs/r1/lora"
pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="process checks read /proc (Linux only)"
    ),
    pytest.mark.timeout(60),
]


def recorded(backend: str) -> dict:
    return json.loads((LORA_FIXTURES / f"{backend}_lora_adapter.json").read_text())


def answer(backend: str, case: str, lora_dir: Path | None = None) -> dict:
    """A recorded answer as a fake-server plan action, its adapter path made `lora_dir`."""
    text = json.dumps(recorded(backend)[case])
    if lora_dir is not None:
        text = text.replace(RECORDED_LORA_DIR, str(lora_dir))
    return json.loads(text)


@pytest.fixture(autouse=True)
def _no_inherited_gpu_selection(monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    return path


def write_adapter(path: Path, r: int = 16, **config) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = {"peft_type": "LORA", "r": r, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps({**base, **config}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def lora_dir(tmp_path: Path) -> Path:
    return write_adapter(tmp_path / "lora")


@pytest.fixture
def make(tmp_path: Path, model_dir: Path, lora_dir: Path):
    """Fake vLLM/SGLang servers serving the adapter, stopped at the end of the test."""
    made = []

    def build(kind: str, **kwargs):
        cls = FakeVLLMServer if kind == "vllm" else FakeSGLangServer
        kwargs.setdefault("log_dir", tmp_path / "logs")
        kwargs.setdefault("device", "cuda:0")
        kwargs.setdefault("start_timeout", 20.0)
        kwargs.setdefault("stop_timeout", 5.0)
        kwargs.setdefault("lora_dir", lora_dir)
        kwargs.setdefault("lora_rank", 16)
        server = cls(model_dir, "policy", **kwargs)
        made.append(server)
        return server

    yield build
    for server in made:
        server.stop(timeout=1.0)


def plan(server, routes: dict[str, list[dict]]) -> None:
    httpx.post(f"{server.root_url}/debug/plan", json=routes, timeout=5).raise_for_status()


def common(tmp_path: Path, **kwargs) -> dict:
    return {"log_dir": tmp_path / "logs", "device": "cuda:0", "port": 8123, **kwargs}


# ---- command lines -----------------------------------------------------------------------------


def test_without_an_adapter_command_lines_and_environment_are_unchanged(
    model_dir: Path, tmp_path: Path
) -> None:
    """The command lines of servers without LoRA, spelled out: what they were before LoRA."""
    options = {"gpu_memory_fraction": 0.3, "max_model_len": 2048, "seed": 7, "api_key": "k"}
    vllm = VLLMServer(model_dir, "policy", **common(tmp_path, **options), lora_dir=None)
    assert vllm.build_command() == [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir),
        "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "policy",
        "--gpu-memory-utilization", "0.3", "--generation-config", "vllm",
        "--logprobs-mode", "processed_logprobs", "--dtype", "bfloat16",
        "--max-model-len", "2048", "--seed", "7",
    ]  # fmt: skip
    assert vllm.extra_env() == {"VLLM_SERVER_DEV_MODE": "1"}
    sglang = SGLangServer(model_dir, "policy", **common(tmp_path, **options))
    assert sglang.build_command() == [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--host", "127.0.0.1", "--port", "8123", "--served-model-name", "policy",
        "--mem-fraction-static", "0.3", "--dtype", "bfloat16", "--context-length", "2048",
        "--random-seed", "7", "--config", str(sglang.key_file),
    ]  # fmt: skip
    for server in (vllm, sglang):
        assert server.model_name == "policy" and server.lora_name is None
        assert not server.is_adapter_sync(model_dir)


def test_vllm_serves_the_adapter_from_the_start(
    model_dir: Path, lora_dir: Path, tmp_path: Path
) -> None:
    server = VLLMServer(
        model_dir, "policy", **common(tmp_path, extra_args=["--enforce-eager"]), lora_dir=lora_dir,
        lora_rank=16,
    )  # fmt: skip
    argv = server.build_command()
    assert argv[4] == str(model_dir)  # the base is the model; the adapter is on top
    assert "--enable-lora" in argv
    assert flag(argv, "--max-lora-rank") == "16"
    assert flag(argv, "--max-loras") == "1"
    # registered at start, so a restart comes back serving lora_dir's (newest) adapter
    module = json.loads(flag(argv, "--lora-modules"))
    assert module == {"name": "policy-lora", "path": str(lora_dir), "base_model_name": "policy"}
    # vLLM's --lora-modules takes one or more values: what follows it must be a flag
    assert argv[argv.index("--lora-modules") + 2].startswith("--")
    assert argv[-1] == "--enforce-eager"
    env = server.child_env()
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"  # registers /v1/load_lora_adapter
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # pause, reset_prefix_cache, resume
    assert server.model_name == server.lora_name == "policy-lora"
    assert server.is_adapter_sync(lora_dir) and not server.is_adapter_sync(model_dir)


def test_sglang_serves_the_adapter_from_the_start(
    model_dir: Path, lora_dir: Path, tmp_path: Path
) -> None:
    server = SGLangServer(model_dir, "policy", **common(tmp_path), lora_dir=lora_dir, lora_rank=8)
    argv = server.build_command()
    assert flag(argv, "--model-path") == str(model_dir)
    assert "--enable-lora" in argv
    assert flag(argv, "--max-lora-rank") == "16"  # adapter_config.json says r = 16 > 8
    assert flag(argv, "--max-loras-per-batch") == "2"  # the adapter and the base
    adapter = json.loads(flag(argv, "--lora-paths"))
    assert adapter == {"lora_name": "policy-lora", "lora_path": str(lora_dir), "pinned": False}
    assert argv[argv.index("--lora-paths") + 2].startswith("--")
    assert "--lora-target-modules" not in argv  # inferred from the adapter loaded at start
    # SGLang's OpenAI routes read "base:adapter"; the adapter's name alone would be the base
    assert server.model_name == "policy:policy-lora"
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server.extra_env()


@pytest.mark.parametrize(
    "rank,expected", [(1, 1), (2, 8), (8, 8), (9, 16), (16, 16), (17, 32), (300, 320), (512, 512)]
)
def test_vllm_rank_is_rounded_up_to_one_it_accepts(rank: int, expected: int) -> None:
    assert vllm_max_lora_rank(rank) == expected
    assert expected in VLLM_LORA_RANKS


def test_vllm_rank_above_its_largest_is_refused(
    model_dir: Path, tmp_path: Path, lora_dir: Path
) -> None:
    with pytest.raises(ValueError, match=r"LoRA rank 513 is above the largest.*512"):
        VLLMServer(model_dir, "policy", **common(tmp_path), lora_dir=lora_dir, lora_rank=513)
    big = write_adapter(tmp_path / "big", r=16, rank_pattern={"q_proj": 1024})
    server = VLLMServer(model_dir, "policy", **common(tmp_path), lora_dir=big, lora_rank=16)
    with pytest.raises(ServerStartError, match="LoRA rank 1024 is above"):
        server.build_command()


def test_rank_comes_from_the_adapter_config_when_larger_or_unset(
    model_dir: Path, tmp_path: Path
) -> None:
    patterned = write_adapter(tmp_path / "a", r=8, rank_pattern={"v_proj": 24})
    server = VLLMServer(model_dir, "policy", **common(tmp_path), lora_dir=patterned)
    assert server.adapter_rank() == 24  # vLLM checks the largest of r and rank_pattern
    assert flag(server.build_command(), "--max-lora-rank") == "32"
    bigger = SGLangServer(model_dir, "p", **common(tmp_path), lora_dir=patterned, lora_rank=64)
    assert flag(bigger.build_command(), "--max-lora-rank") == "64"
    nothing = SGLangServer(model_dir, "p", **common(tmp_path), lora_dir=tmp_path / "missing")
    with pytest.raises(ServerStartError, match="LoRA rank is unknown"):
        nothing.build_command()


@pytest.mark.parametrize(
    "cls,arg",
    [
        (VLLMServer, "--max-lora-rank=64"),
        (VLLMServer, "--enable_lora"),
        (VLLMServer, "--lora-modules"),
        (VLLMServer, "--max-loras"),
        (SGLangServer, "--lora-paths"),
        (SGLangServer, "--max-loras-per-batch"),
    ],
)
def test_extra_args_cannot_set_the_lora_flags_when_serving_an_adapter(
    cls, arg: str, model_dir: Path, lora_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="when it serves the LoRA adapter"):
        cls(model_dir, "policy", **common(tmp_path), lora_dir=lora_dir, extra_args=[arg, "1"])
    cls(model_dir, "policy", **common(tmp_path), extra_args=[arg, "1"])  # no adapter: theirs


@pytest.mark.parametrize("rank", [0, -1, True, "16", 2.0])
def test_bad_lora_rank_is_named(rank, model_dir: Path, lora_dir: Path, tmp_path: Path) -> None:
    for cls in (VLLMServer, SGLangServer):
        with pytest.raises(ValueError, match="lora_rank must be an int >= 1"):
            cls(model_dir, "policy", **common(tmp_path), lora_dir=lora_dir, lora_rank=rank)


def test_factory_passes_the_adapter_on(model_dir: Path, lora_dir: Path, tmp_path: Path) -> None:
    server = make_server_manager(
        "vllm", model_dir, "policy", log_dir=tmp_path, device="cuda:0", lora_dir=lora_dir,
        lora_rank=4,
    )  # fmt: skip
    assert flag(server.build_command(), "--max-lora-rank") == "16"  # config r = 16
    assert server.model_name == "policy-lora"


# ---- vLLM adapter sync ---------------------------------------------------------------------------


def test_vllm_adapter_sync_loads_it_in_place_between_pause_and_resume(
    make, lora_dir: Path, model_dir: Path
) -> None:
    server = make("vllm")
    server.launch()
    pid = server.pid
    plan(server, {"/v1/load_lora_adapter": [answer("vllm", "ok", lora_dir)]})
    seconds = server.update_weights(lora_dir, "iter_007")
    assert seconds > 0 and server.pid == pid
    assert [(c["path"], c["query"], c["body"]) for c in calls(server)] == [
        ("/pause", {"mode": "wait"}, None),
        # the same name: vLLM refuses a loaded name unless load_inplace is true
        (
            "/v1/load_lora_adapter",
            {},
            {"lora_name": "policy-lora", "lora_path": str(lora_dir), "load_inplace": True},
        ),
        # blocks are hashed by adapter name and path, both unchanged: drop the old adapter's
        ("/reset_prefix_cache", {}, None),
        ("/resume", {}, None),
    ]
    assert server.model_path == model_dir  # the base stays what a (re)start serves
    assert server.weight_version == "iter_007"
    assert set(server.last_sync_timings) == {
        "pause",
        "load_adapter",
        "reset_prefix_cache",
        "resume",
    }


VLLM_REFUSALS = {
    "already loaded": r"HTTP 400: The lora adapter 'policy-lora' has already been loaded",
    "not found": r"HTTP 404: Loading lora policy-lora failed: No adapter found for <path>",
    "load failed": r"HTTP 500: Call to add_lora .*LoRA rank 64 is greater than max_lora_rank 16",
}


def test_vllm_refused_adapter_carries_its_message_and_resumes(
    make, lora_dir: Path, model_dir: Path
) -> None:
    server = make("vllm")
    server.launch()
    for case, message in VLLM_REFUSALS.items():
        done = len(calls(server))
        plan(server, {"/v1/load_lora_adapter": [answer("vllm", case, lora_dir)]})
        with pytest.raises(WeightSyncError, match=message):
            server.update_weights(lora_dir, "iter_002")
        paths = [c["path"] for c in calls(server)[done:]]
        assert paths == ["/pause", "/v1/load_lora_adapter", "/resume"], case
        assert server.model_path == model_dir and server.weight_version is None


def test_vllm_without_the_runtime_lora_route_says_which_variable(make, lora_dir: Path) -> None:
    server = make("vllm")
    server.launch()
    plan(server, {"/v1/load_lora_adapter": [answer("vllm", "route missing")]})
    with pytest.raises(WeightSyncError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
        server.update_weights(lora_dir)
    assert [c["path"] for c in calls(server)][-1] == "/resume"


def test_vllm_failed_adapter_sync_restarts_on_the_base_with_the_adapter(
    make, lora_dir: Path, model_dir: Path, caplog
) -> None:
    server = make("vllm")
    server.launch()
    pid = server.pid
    plan(server, {"/v1/load_lora_adapter": [answer("vllm", "load failed", lora_dir)]})
    with caplog.at_level(logging.WARNING, logger="grail.inference.process"):
        result = server.sync_weights(lora_dir, "in_place", weight_version="iter_007")
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert "greater than max_lora_rank" in result.fallback_reason
    assert server.pid != pid and server.is_alive()
    argv = info(server)["argv"]
    assert argv[argv.index("serve") + 1] == str(model_dir)  # the base, not the adapter dir
    assert json.loads(flag(argv, "--lora-modules"))["path"] == str(lora_dir)
    assert server.model_path == model_dir and server.model_name == "policy-lora"


def test_vllm_full_weight_sync_of_a_lora_server_is_the_usual_reload(make, tmp_path: Path) -> None:
    server = make("vllm")
    server.launch()
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "model.safetensors").write_bytes(b"")
    server.update_weights(merged)
    assert [c["path"] for c in calls(server)] == [
        "/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
    ]  # fmt: skip
    assert server.model_path == merged


def test_adapter_directory_without_its_config_is_refused(make, lora_dir: Path) -> None:
    server = make("vllm")
    server.launch()
    (lora_dir / "adapter_config.json").unlink()
    with pytest.raises(WeightSyncError, match="holds no adapter_config.json"):
        server.update_weights(lora_dir)
    assert calls(server) == []


# ---- SGLang adapter sync -------------------------------------------------------------------------


def test_sglang_adapter_sync_unloads_then_loads_the_same_name(
    make, lora_dir: Path, model_dir: Path
) -> None:
    server = make("sglang")
    server.launch()
    plan(
        server,
        {
            "/unload_lora_adapter": [answer("sglang", "unload ok", lora_dir)],
            "/load_lora_adapter": [answer("sglang", "load ok", lora_dir)],
        },
    )
    server.update_weights(lora_dir, "iter_007")
    assert [(c["path"], c["body"]) for c in calls(server)] == [
        ("/unload_lora_adapter", {"lora_name": "policy-lora"}),
        (
            "/load_lora_adapter",
            {"lora_name": "policy-lora", "lora_path": str(lora_dir), "pinned": False},
        ),
    ]
    assert server.model_path == model_dir and server.weight_version == "iter_007"
    assert set(server.last_sync_timings) == {"unload_adapter", "load_adapter"}


SGLANG_REFUSALS = [
    (
        "unload missing",
        None,
        r"unload_lora_adapter .* \(HTTP 400\): LoRA with name policy-lora does not exist",
    ),
    (
        "unload ok",
        "load already loaded",
        r"load_lora_adapter .* \(HTTP 400\): Failed to load LoRA adapter policy-lora because",
    ),
    (
        "unload ok",
        "load incompatible",
        r"\(HTTP 400\): LoRA adapter policy-lora with rank 64 is incompatible",
    ),
]


def test_sglang_refusal_carries_its_message(make, lora_dir: Path, model_dir: Path) -> None:
    server = make("sglang")
    server.launch()
    for unload, load, message in SGLANG_REFUSALS:
        done = len(calls(server))
        actions = {"/unload_lora_adapter": [answer("sglang", unload, lora_dir)]}
        if load:
            actions["/load_lora_adapter"] = [answer("sglang", load, lora_dir)]
        plan(server, actions)
        with pytest.raises(WeightSyncError, match=message):
            server.update_weights(lora_dir)
        routes = ["/unload_lora_adapter"] + (["/load_lora_adapter"] if load else [])
        assert [c["path"] for c in calls(server)[done:]] == routes
        assert server.model_path == model_dir and server.weight_version is None


def test_sglang_failed_adapter_sync_restarts_on_the_base_with_the_adapter(
    make, lora_dir: Path, model_dir: Path
) -> None:
    server = make("sglang")
    server.launch()
    pid = server.pid
    plan(
        server,
        {
            "/unload_lora_adapter": [answer("sglang", "unload ok", lora_dir)],
            "/load_lora_adapter": [answer("sglang", "load incompatible", lora_dir)],
        },
    )
    result = server.sync_weights(lora_dir, "in_place", weight_version="iter_003")
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert "incompatible" in result.fallback_reason
    assert server.pid != pid and server.is_alive()
    assert info(server)["model"] == str(model_dir)
    argv = info(server)["argv"]
    assert json.loads(flag(argv, "--lora-paths"))["lora_path"] == str(lora_dir)


@pytest.mark.parametrize("kind,model", [("vllm", "policy-lora"), ("sglang", "policy:policy-lora")])
def test_rollout_requests_name_the_adapter(make, kind: str, model: str) -> None:
    server = make(kind)
    server.launch()
    # the loop makes its client once, from model_name: it stays right across adapter syncs
    client = CompletionClient(server.base_url, server.model_name, backend=kind, max_retries=0)
    sampling = SamplingParams(max_tokens=3, temperature=1.0, top_p=1.0, top_k=-1)

    async def run():
        try:
            return await client.complete([1, 2, 3], 2, sampling, seed=0)
        finally:
            await client.aclose()

    asyncio.run(run())
    (request,) = [c["body"] for c in calls(server) if c["path"] == "/v1/completions"]
    assert request["model"] == model


# ---- the packages' own parsers and routes --------------------------------------------------------

# Run with the package's interpreter; reads {"argv", ...} on stdin, prints "RESULT <json>".
# Argument parsing as tests/helpers/backend_argv_check.py does it; the LoRA routes are the
# package's own FastAPI routes and request handling, served in-process, with a stand-in only for
# the engine (vLLM: the engine client's add_lora; SGLang: the scheduler's reply, whose "already
# loaded" and "incompatible" checks are LoRAManager.validate_new_adapter itself).
VLLM_CHECK = r"""
import asyncio, json, os, sys
from types import SimpleNamespace
import vllm
from vllm import platforms
if platforms.current_platform.is_unspecified():
    from vllm.platforms.cpu import CpuPlatform
    platforms.current_platform = CpuPlatform()
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.cli.serve import ServeSubcommand

job = json.loads(sys.stdin.read())
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(required=False, dest="subparser"))
args = parser.parse_args(job["argv"])
if getattr(args, "model_tag", None) is not None:
    args.model = args.model_tag
ServeSubcommand().validate(args)
engine_args = vllm.AsyncEngineArgs.from_cli_args(args)
from vllm.config.lora import LoRAConfig
LoRAConfig(max_lora_rank=engine_args.max_lora_rank, max_loras=engine_args.max_loras)
result = {
    "version": vllm.__version__,
    "model": engine_args.model,
    "enable_lora": engine_args.enable_lora,
    "max_lora_rank": engine_args.max_lora_rank,
    "max_loras": engine_args.max_loras,
    "lora_modules": [vars(m) for m in args.lora_modules],
}

from fastapi import FastAPI
from fastapi.testclient import TestClient
from vllm.entrypoints.openai.models.api_router import attach_router as attach_models
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.lora.api_router import attach_router as attach_lora
from vllm.exceptions import LoRAAdapterNotFoundError

class Engine:
    model_config = SimpleNamespace(model=engine_args.model, max_model_len=128)
    renderer = input_processor = None
    fail = None
    def __init__(self):
        self.added = []
    async def add_lora(self, request):
        self.added.append([request.lora_name, request.lora_int_id, request.load_inplace])
        if self.fail == "not found":  # what the worker raises for a missing directory
            self.fail = str(LoRAAdapterNotFoundError(request.lora_name, request.lora_path))
        if self.fail:  # how the engine core reports a failed utility call (v1/engine/core.py)
            raise Exception("Call to add_lora method failed: " + self.fail)
        return True

def app(runtime_updating):
    os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = runtime_updating
    engine = Engine()
    names = [BaseModelPath(name, engine_args.model) for name in engine_args.served_model_name]
    models = OpenAIServingModels(engine, names, lora_modules=args.lora_modules)
    asyncio.run(models.init_static_loras())  # what the server does at start
    fastapi_app = FastAPI()
    fastapi_app.state.openai_serving_models = models
    attach_models(fastapi_app)
    attach_lora(fastapi_app)
    return engine, TestClient(fastapi_app)

def post(client, body):
    response = client.post("/v1/load_lora_adapter", json=body)
    try:
        decoded = response.json()
    except ValueError:
        decoded = response.text
    return {"status": response.status_code, "body": decoded}

engine, client = app("True")
sync = job["sync_body"]
answers = {"ok": post(client, sync)}
answers["already loaded"] = post(client, {**sync, "load_inplace": False})
engine.fail = "not found"
answers["not found"] = post(client, sync)
engine.fail = "LoRA rank 64 is greater than max_lora_rank 16."
answers["load failed"] = post(client, sync)
result["add_lora"] = engine.added
result["models"] = [card["id"] for card in client.get("/v1/models").json()["data"]]
answers["route missing"] = post(app("0")[1], sync)
result["answers"] = answers
print("RESULT " + json.dumps(result, default=str))
"""

SGLANG_CHECK = r"""
import argparse, asyncio, json, sys
from types import SimpleNamespace
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.lora_hook import check_lora_server_args
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.version import __version__

job = json.loads(sys.stdin.read())
parser = argparse.ArgumentParser(prog="sglang serve")
ServerArgs.add_cli_args(parser)
server_args = ServerArgs.from_cli_args(parser.parse_args(job["argv"]))
check_lora_server_args(server_args)  # what resolution runs at start for LoRA
cfg = resolving_view(server_args)
result = {
    "version": __version__,
    "model": cfg.model_path,
    "enable_lora": cfg.enable_lora,
    "max_lora_rank": cfg.max_lora_rank,
    "max_loras_per_batch": cfg.max_loras_per_batch,
    "lora_target_modules": cfg.lora_target_modules,
    "lora_paths": [[r.lora_name, r.lora_path, r.pinned] for r in cfg.lora_paths],
}

from fastapi.testclient import TestClient
import sglang.srt.entrypoints.http_server as http_server
import sglang.srt.managers.tokenizer_control_mixin as control
from sglang.srt.entrypoints.openai.serving_base import OpenAIServingBase
from sglang.srt.lora.lora_manager import LoRAManager
from sglang.srt.lora.lora_registry import LoRARegistry
from sglang.srt.managers.io_struct import LoadLoRAAdapterReqInput, LoRAUpdateOutput

control.get_lora = lambda: SimpleNamespace(enable_lora=True, max_loaded_loras=None)
control.get_parallel = lambda: SimpleNamespace(dp_size=1)

class Scheduler:
    # the scheduler's side of a load/unload: LoRAManager's own checks, adapters kept by id
    def __init__(self, refs):
        self.manager = SimpleNamespace(
            attn_dp_enabled=False, lora_refs={r.lora_id: r for r in refs}, memory_pool=None,
            num_pinned_loras=0, max_loras_per_batch=cfg.max_loras_per_batch,
        )
        self.ids = []
    def reply(self, success, message=None):
        loaded = {r.lora_name: r.lora_path for r in self.manager.lora_refs.values()}
        return [LoRAUpdateOutput(success=success, error_message=message, loaded_adapters=loaded)]
    async def __call__(self, obj):
        if isinstance(obj, LoadLoRAAdapterReqInput):
            ref = obj.to_ref()
            adapter = SimpleNamespace(lora_added_tokens_size=0, use_dora=False, r=64)
            try:
                LoRAManager.validate_new_adapter(self.manager, adapter, ref)
            except ValueError as exc:
                return self.reply(False, str(exc))
            self.manager.lora_refs[ref.lora_id] = ref
            self.ids.append(ref.lora_id)
        else:
            self.manager.lora_refs.pop(obj.lora_id, None)
        return self.reply(True)

class TokenizerManager(control.TokenizerControlMixin):
    def __init__(self, refs):
        self.lora_update_lock = asyncio.Lock()
        self.pending_lora_unloads = {}
        self.lora_registry = LoRARegistry(refs)
        self.lora_ref_cache = {}
        self.update_lora_adapter_communicator = Scheduler(refs)
        self.served_model_name = cfg.served_model_name
    def auto_create_handle_loop(self):
        pass

manager = TokenizerManager(cfg.lora_paths)
http_server._global_state = SimpleNamespace(tokenizer_manager=manager)
client = TestClient(http_server.app)

def post(route, body):
    response = client.post(route, json=body)
    return {"status": response.status_code, "body": response.json()}

initial = manager.lora_registry.get_all_adapters()[job["lora_name"]].lora_id
answers = {
    "load already loaded": post("/load_lora_adapter", job["load_body"]),
    "unload ok": post("/unload_lora_adapter", job["unload_body"]),
    "load ok": post("/load_lora_adapter", job["load_body"]),
}
reloaded = manager.lora_registry.get_all_adapters()[job["lora_name"]].lora_id
post("/unload_lora_adapter", job["unload_body"])
answers["unload missing"] = post("/unload_lora_adapter", job["unload_body"])
manager.update_lora_adapter_communicator.manager.memory_pool = SimpleNamespace(
    can_support=lambda config: False
)
answers["load incompatible"] = post("/load_lora_adapter", job["load_body"])
result["answers"] = answers
result["new_id_after_reload"] = reloaded != initial
serving = SimpleNamespace(tokenizer_manager=manager)
result["model_parameter"] = OpenAIServingBase._parse_model_parameter(serving, job["model"])
result["adapter_name_alone"] = OpenAIServingBase._parse_model_parameter(serving, job["lora_name"])
print("RESULT " + json.dumps(result, default=str))
"""


def _normalised(value, lora_dir: Path):
    return json.loads(json.dumps(value).replace(str(lora_dir), RECORDED_LORA_DIR))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_lora_against_the_real_package(
    kind: str, model_dir: Path, lora_dir: Path, tmp_path: Path
) -> None:
    python = python_with(kind)
    cls = VLLMServer if kind == "vllm" else SGLangServer
    server = cls(model_dir, "policy", **common(tmp_path), lora_dir=lora_dir, lora_rank=16)
    argv = server.build_command()[3:]  # after `python -m MODULE`
    # the bodies the adapter sync sends (its tests above check they are what goes out)
    if kind == "vllm":
        job = {"argv": argv, "sync_body": server.lora_load_body(lora_dir)}
    else:
        job = {
            "argv": argv,
            "lora_name": server.lora_name,
            "model": server.model_name,
            "unload_body": server.lora_unload_body(),
            "load_body": server.lora_load_body(lora_dir),
        }
    check = VLLM_CHECK if kind == "vllm" else SGLANG_CHECK
    parsed = run_check(python, ["-c", check], job, timeout=540)
    print(f"{kind} {parsed['version']} accepted: {argv}")
    assert parsed["model"] == str(model_dir) and parsed["enable_lora"] is True
    assert parsed["max_lora_rank"] == 16
    answers = _normalised(parsed["answers"], lora_dir)
    expected = {k: v for k, v in recorded(kind).items() if not k.startswith("_")}
    if kind == "vllm":
        assert parsed["max_loras"] == 1
        assert parsed["lora_modules"] == [
            {
                "name": "policy-lora",
                "path": str(lora_dir),
                "base_model_name": "policy",
                "is_3d_lora_weight": False,
            }
        ]
        # the start registers it as adapter 1; the sync reloads adapter 1, in place
        assert parsed["add_lora"][:2] == [["policy-lora", 1, False], ["policy-lora", 1, True]]
        assert parsed["models"] == ["policy", "policy-lora"]
    else:
        assert parsed["max_loras_per_batch"] == 2
        assert parsed["lora_target_modules"] is None  # inferred from the adapter at start
        assert parsed["lora_paths"] == [["policy-lora", str(lora_dir), False]]
        assert parsed["new_id_after_reload"] is True  # a fresh prefix-cache namespace
        assert parsed["model_parameter"] == ["policy", "policy-lora"]
        assert parsed["adapter_name_alone"] == ["policy-lora", None]  # would be the base
    assert answers == expected
