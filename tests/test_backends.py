"""vLLM and SGLang backends without the packages or a GPU: command lines, environment, request
bodies, parsing of recorded answers, the weight-sync call sequences and their failures, and
recovery from a server that dies mid-run.

The recorded answers in tests/fixtures/ were produced by the packages' own response models
(vLLM 0.32.0 `CompletionResponse` through Starlette's JSONResponse, SGLang 0.5.23
`CompletionResponse` through its `model_json_response`), so they carry the real field names and
the real encodings of -inf (vLLM: -9999.0; SGLang: null). Lifecycle tests run
tests/helpers/fake_gpu_server.py, which takes the real command lines and answers with those shapes.

When vLLM or SGLang is importable (here, or in the interpreter named by GRAIL_VLLM_PYTHON /
GRAIL_SGLANG_PYTHON), the generated command lines are also parsed by the package's own parser.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from helpers.fake_gpu_server import FakeSGLangServer, FakeVLLMServer, calls, flag, info, plan
from helpers.real_packages import BACKEND_ARGV_CHECK, python_with, run_check

from grail.core.config import Config, DataConfig, GenerationConfig
from grail.core.errors import ConfigError
from grail.core.placement import GpuConfig
from grail.core.validate import validate
from grail.inference.backends import gpu as gpu_backend
from grail.inference.backends import make_server_manager
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.backends.gpu import (
    DEFAULT_MEMORY_FRACTION_OWN_GPU,
    DEFAULT_MEMORY_FRACTION_SHARED,
    GpuServer,
)
from grail.inference.backends.sglang import SGLangServer
from grail.inference.backends.vllm import VLLMServer
from grail.inference.client import CompletionClient
from grail.inference.completions import MalformedResponseError, SamplingParams, parse_completions
from grail.inference.errors import ServerDiedError, ServerStartError, WeightSyncError
from grail.inference.os_process import visible_devices
from grail.inference.recovery import call_with_recovery
from grail.train.components import server_manager_from_config

TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = TESTS_DIR / "fixtures"
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process checks read /proc (Linux only)"
)
SAMPLING = SamplingParams(max_tokens=3, temperature=0.7, top_p=1.0, top_k=-1)


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.fixture(autouse=True)
def _no_inherited_gpu_selection(monkeypatch) -> None:
    # GPU indices are mapped through the parent's CUDA_VISIBLE_DEVICES; start from none.
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "weights_iter_001"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"")
    return path


@pytest.fixture
def make(tmp_path: Path, model_dir: Path):
    """Fake vLLM/SGLang servers that are stopped at the end of the test, pass or fail."""
    made = []

    def build(kind: str, **kwargs):
        cls = FakeVLLMServer if kind == "vllm" else FakeSGLangServer
        kwargs.setdefault("log_dir", tmp_path / "logs")
        kwargs.setdefault("device", "cuda:0")
        kwargs.setdefault("start_timeout", 20.0)
        kwargs.setdefault("stop_timeout", 5.0)
        server = cls(kwargs.pop("model_path", model_dir), "policy", **kwargs)
        made.append(server)
        return server

    yield build
    for server in made:
        server.stop(timeout=1.0)


# ---- command lines -----------------------------------------------------------------------------


def test_vllm_command_line_is_built_from_the_config(model_dir: Path, tmp_path: Path) -> None:
    server = VLLMServer(
        model_dir,
        "policy",
        log_dir=tmp_path,
        device="cuda:1",
        gpu_memory_fraction=0.3,
        max_model_len=2048,
        max_num_seqs=128,
        seed=7,
        port=8123,
        extra_args=["--enforce-eager"],
    )
    argv = server.build_command()
    # Same interpreter, the module `vllm serve` runs, the model directory as positional.
    assert argv[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "8123"
    assert flag(argv, "--served-model-name") == "policy"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--gpu-memory-utilization") == "0.3"
    assert flag(argv, "--max-model-len") == "2048"
    assert flag(argv, "--max-num-seqs") == "128"
    assert flag(argv, "--seed") == "7"
    # What makes the behaviour log-probabilities mean what the trainer computes:
    assert flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert flag(argv, "--generation-config") == "vllm"
    assert "--tensor-parallel-size" not in argv  # one GPU
    assert argv[-1] == "--enforce-eager"  # extra flags pass through, last


def test_sglang_command_line_is_built_from_the_config(model_dir: Path, tmp_path: Path) -> None:
    server = SGLangServer(
        model_dir,
        "policy",
        log_dir=tmp_path,
        device="cuda:0,1",
        gpu_memory_fraction=0.85,
        max_model_len=4096,
        max_num_seqs=64,
        seed=3,
        port=30011,
        api_key="sekret",
        extra_args=["--disable-radix-cache"],
    )
    argv = server.build_command()
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == str(model_dir)
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "30011"
    assert flag(argv, "--served-model-name") == "policy"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--mem-fraction-static") == "0.85"
    assert flag(argv, "--context-length") == "4096"
    assert flag(argv, "--max-running-requests") == "64"
    assert flag(argv, "--random-seed") == "3"
    assert flag(argv, "--tp-size") == "2"  # both GPUs of the device
    assert flag(argv, "--config") == str(server.key_file)  # the key, off the command line
    assert argv[-1] == "--disable-radix-cache"


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_the_key_never_goes_on_a_gpu_server_s_command_line(
    kind: str, model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command line is in `ps` for every user of the machine. vLLM reads its key from
    VLLM_API_KEY; SGLang reads no variable, but merges a --config YAML file into its arguments
    in its own process: the key goes there, in a file only this user can read."""
    monkeypatch.setenv("VLLM_API_KEY", "inherited")
    cls = VLLMServer if kind == "vllm" else SGLangServer
    server = cls(model_dir, "policy", log_dir=tmp_path, device="cuda:0", port=1, api_key="sekret")
    argv = server.build_command()
    assert "--api-key" not in argv and not any("sekret" in arg for arg in argv)
    if kind == "vllm":
        assert server.child_env()["VLLM_API_KEY"] == "sekret"
        keyless = VLLMServer(model_dir, "policy", log_dir=tmp_path, device="cuda:0", port=1)
        assert "VLLM_API_KEY" not in keyless.child_env()  # the server's key is the harness's
        return
    assert isinstance(server, SGLangServer)
    key_file = Path(flag(argv, "--config"))
    assert key_file == server.key_file and key_file.suffix == ".yaml"  # SGLang wants .yaml
    assert oct(key_file.stat().st_mode & 0o777) == "0o600"
    assert yaml.safe_load(key_file.read_text()) == {"api-key": "sekret"}
    server.stop()
    assert not key_file.exists()
    with pytest.raises(ValueError, match="must not set --config with an api_key"):
        SGLangServer(
            model_dir, "policy", log_dir=tmp_path, device="cuda:0", api_key="k",
            extra_args=["--config", "mine.yaml"],
        )  # fmt: skip


def test_unset_sizes_are_left_to_the_server(model_dir: Path, tmp_path: Path) -> None:
    vllm = VLLMServer(model_dir, "policy", log_dir=tmp_path, device="cuda:0", port=1)
    sglang = SGLangServer(model_dir, "policy", log_dir=tmp_path, device="cuda:0", port=1)
    for argv, absent in (
        (vllm.build_command(), ("--max-model-len", "--max-num-seqs", "--seed", "--api-key")),
        (sglang.build_command(), ("--context-length", "--max-running-requests", "--random-seed")),
    ):
        assert not set(absent) & set(argv)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
@pytest.mark.parametrize("shares_gpu", [True, False])
def test_factory_memory_fraction_depends_on_sharing_the_gpu(
    kind: str, shares_gpu: bool, model_dir: Path, tmp_path: Path
) -> None:
    server = make_server_manager(
        kind,
        model_dir,
        "policy",
        log_dir=tmp_path,
        device="cuda:0",
        shares_gpu_with_trainer=shares_gpu,
    )
    expected = DEFAULT_MEMORY_FRACTION_SHARED if shares_gpu else DEFAULT_MEMORY_FRACTION_OWN_GPU
    assert server.gpu_memory_fraction == expected
    assert server.start_timeout >= 600  # real models take minutes to load
    explicit = make_server_manager(
        kind, model_dir, "policy", log_dir=tmp_path, device="cuda:0", gpu_memory_fraction=0.5
    )
    assert explicit.gpu_memory_fraction == 0.5


def test_factory_builtin_is_the_builtin_server(model_dir: Path, tmp_path: Path) -> None:
    server = make_server_manager(
        "builtin", model_dir, "policy", log_dir=tmp_path, device="cpu", threads=2
    )
    assert type(server) is BuiltinServer and server.threads == 2
    env = server.child_env()
    assert (env["OMP_NUM_THREADS"], env["CUDA_VISIBLE_DEVICES"]) == ("2", "")
    # OpenMP threads that sleep when they wait: beside other busy processes, spinning threads
    # made the default iteration 4.6x slower instead of 2.3x (benchmarks/under_load.py).
    assert env["OMP_WAIT_POLICY"] == "PASSIVE"
    with pytest.raises(ValueError, match="backend must be one of builtin, vllm, sglang"):
        make_server_manager("tgi", model_dir, "policy", log_dir=tmp_path, device="cuda:0")


def _config(backend: str, **generation) -> Config:
    cfg = Config(
        seed=11,
        gpu=GpuConfig(strategy="multi", server_gpu=1, training_gpu=0),
        generation=GenerationConfig(backend=backend, **generation),
        data=DataConfig(environment="copy_digits"),
    )
    validate(cfg)
    return cfg


def test_server_from_config_places_and_sizes_the_server(model_dir: Path, tmp_path: Path) -> None:
    cfg = _config("vllm", max_model_len=1024, max_num_seqs=32, extra_args=["--enforce-eager"])
    server = server_manager_from_config(cfg, model_dir, tmp_path, cuda_available=True)
    assert isinstance(server, VLLMServer)
    assert server.device == "cuda:1" and server.log_dir == tmp_path / "logs"
    assert server.gpu_memory_fraction == DEFAULT_MEMORY_FRACTION_OWN_GPU  # multi: own GPU
    assert (server.max_model_len, server.max_num_seqs, server.seed) == (1024, 32, 11)
    assert server.child_env()["CUDA_VISIBLE_DEVICES"] == "1"
    assert server.build_command()[-1] == "--enforce-eager"
    assert server.start_timeout == GpuServer.default_start_timeout_s  # not the builtin's 120 s
    patient = _config("sglang", start_timeout_s=1800.0)
    assert (
        server_manager_from_config(patient, model_dir, tmp_path, cuda_available=True).start_timeout
        == 1800.0
    )

    cfg.gpu = GpuConfig(strategy="single", server_gpu=0, training_gpu=0)
    shared = server_manager_from_config(cfg, model_dir, tmp_path, cuda_available=True)
    assert shared.gpu_memory_fraction == DEFAULT_MEMORY_FRACTION_SHARED

    with pytest.raises(ServerStartError, match="generation.backend=vllm needs a CUDA GPU"):
        server_manager_from_config(cfg, model_dir, tmp_path, cuda_available=False)
    builtin = server_manager_from_config(
        _config("builtin"), model_dir, tmp_path, cuda_available=False
    )
    assert isinstance(builtin, BuiltinServer) and builtin.device == "cpu"
    # generation.start_timeout_s null: each backend's own default; a set value wins everywhere
    assert builtin.start_timeout == BuiltinServer.default_start_timeout_s == 120.0
    assert GpuServer.default_start_timeout_s == 900.0
    quick = _config("builtin", start_timeout_s=30.0)
    assert (
        server_manager_from_config(quick, model_dir, tmp_path, cuda_available=False).start_timeout
        == 30.0
    )


@pytest.mark.parametrize(
    "override,key",
    [
        ({"gpu_memory_fraction": 1.5}, "generation.gpu_memory_fraction"),
        ({"max_model_len": 0}, "generation.max_model_len"),
        ({"max_num_seqs": -1}, "generation.max_num_seqs"),
        ({"max_restarts": -1}, "generation.max_restarts"),
        ({"start_timeout_s": 0.0}, "generation.start_timeout_s"),
    ],
)
def test_bad_generation_sizes_name_the_key(override: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _config("vllm", **override)


@pytest.mark.parametrize(
    "cls,arg,match",
    [
        (VLLMServer, "--logprobs-mode=raw_logprobs", "--logprobs-mode: the harness sets it"),
        (VLLMServer, "--max_model_len", "generation.max_model_len"),
        (VLLMServer, "--gpu-memory-utilization", "generation.gpu_memory_fraction"),
        (VLLMServer, "--port", "--port: the harness sets it"),
        (SGLangServer, "--mem-fraction-static", "generation.gpu_memory_fraction"),
        (SGLangServer, "--enable-deterministic-inference", "every sample of a GRPO group"),
    ],
)
def test_extra_args_cannot_override_what_the_harness_sets(
    cls, arg: str, match: str, model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=match):
        cls(model_dir, "policy", log_dir=tmp_path, device="cuda:0", extra_args=[arg, "1"])


def test_bad_construction_arguments_are_named(model_dir: Path, tmp_path: Path) -> None:
    common = {"log_dir": tmp_path}
    with pytest.raises(ValueError, match="serves on CUDA GPUs.*generation.backend=builtin"):
        VLLMServer(model_dir, "policy", device="cpu", **common)
    with pytest.raises(ValueError, match="gpu_memory_fraction must be in"):
        SGLangServer(model_dir, "policy", device="cuda:0", gpu_memory_fraction=1.0, **common)
    with pytest.raises(ValueError, match="max_model_len must be"):
        VLLMServer(model_dir, "policy", device="cuda:0", max_model_len=0, **common)
    with pytest.raises(ValueError, match="dtype must be one of"):
        VLLMServer(model_dir, "policy", device="cuda:0", dtype="fp8", **common)
    with pytest.raises(ValueError, match="must not contain ':'"):
        SGLangServer(model_dir, "policy:v2", device="cuda:0", **common)


# ---- environment -----------------------------------------------------------------------------


def test_environment_selects_the_gpu_and_the_reload_routes(
    model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
    vllm = VLLMServer(model_dir, "policy", log_dir=tmp_path, device="cuda:2")
    env = vllm.child_env()
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    sglang = SGLangServer(model_dir, "policy", log_dir=tmp_path, device="cuda:0")
    # That variable would make SGLang's log-probabilities ignore the temperature.
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in sglang.child_env()


def test_gpu_indices_are_mapped_through_the_parents_visible_devices(
    model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    assert visible_devices((), "4,5") == ""
    assert visible_devices((1,), None) == "1"
    assert visible_devices((1,), "4,5") == "5"
    assert visible_devices((0, 1), "GPU-aa, GPU-bb") == "GPU-aa,GPU-bb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    server = VLLMServer(model_dir, "policy", log_dir=tmp_path, device="cuda:1")
    assert server.child_env()["CUDA_VISIBLE_DEVICES"] == "5"
    with pytest.raises(ValueError, match=r"GPU index 2 does not exist.*sees 2 GPU"):
        VLLMServer(model_dir, "policy", log_dir=tmp_path, device="cuda:2")


@pytest.mark.parametrize("cls,extra", [(VLLMServer, "vllm"), (SGLangServer, "sglang")])
def test_missing_package_is_reported_before_spawning(
    cls, extra: str, model_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(gpu_backend.importlib.util, "find_spec", lambda name: None)
    server = cls(model_dir, "policy", log_dir=tmp_path / "logs", device="cuda:0")
    with pytest.raises(ServerStartError, match=rf"uv sync --extra {extra}"):
        server.launch()
    assert server.pid is None  # nothing was spawned
    assert not (tmp_path / "logs").exists()


# ---- request bodies and recorded answers -------------------------------------------------------


def test_recorded_vllm_answer_is_parsed_exactly() -> None:
    data = fixture("vllm_completion_n2.json")
    first, second = parse_completions(data, 2, "vllm")
    # ids exactly as sent: the EOS (<|im_end|> = 2) a sample stopped on is kept
    assert first.token_ids == [49, 50, 2] and first.finish_reason == "stop"
    assert first.logprobs == pytest.approx([-0.6931, -1.25, -0.0412])
    assert first.text == "12"
    assert second.token_ids == [55, 120, 57] and second.finish_reason == "length"
    assert second.logprobs[1] == -math.inf  # -9999.0 is vLLM's -inf


def test_recorded_sglang_answer_is_parsed_exactly() -> None:
    data = fixture("sglang_completion_n2.json")
    assert data["choices"][1]["logprobs"]["token_logprobs"][1] is None  # how SGLang sends -inf
    first, second = parse_completions(data, 2, "sglang")
    assert first.token_ids == [49, 50, 2] and first.finish_reason == "stop"
    assert first.logprobs == pytest.approx([-0.6931, -1.25, -0.0412])
    assert second.token_ids == [55, 120, 57] and second.finish_reason == "length"
    assert second.logprobs[1] == -math.inf
    # null means -inf only where that is how the server writes it
    with pytest.raises(MalformedResponseError, match=r"token_logprobs\[1\] = None"):
        parse_completions(data, 2, "vllm")


def test_finish_reasons_are_mapped_or_refused() -> None:
    data = fixture("vllm_completion_n2.json")
    data["choices"][0]["finish_reason"] = "repetition"  # vLLM's repetition detector stopped it
    assert parse_completions(data, 2, "vllm")[0].finish_reason == "stop"
    data["choices"][0]["finish_reason"] = "abort"
    assert parse_completions(data, 2, "vllm")[0].finish_reason == "abort"
    data["choices"][0]["finish_reason"] = "tool_calls"
    with pytest.raises(MalformedResponseError, match="'tool_calls' is not one of"):
        parse_completions(data, 2, "vllm")
    sglang = fixture("sglang_completion_n2.json")
    sglang["choices"][1]["finish_reason"] = None
    with pytest.raises(MalformedResponseError, match=r"choices\[1\].finish_reason is None"):
        parse_completions(sglang, 2, "sglang")
    with pytest.raises(ValueError, match="backend must be one of"):
        parse_completions(data, 2, "tgi")  # type: ignore[arg-type]


class _Recorder(BaseHTTPRequestHandler):
    answer: dict = {}
    bodies: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        data = json.dumps(type(self).answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_client_sends_one_request_shape_and_reads_each_backends_answer(backend: str) -> None:
    handler = type("Handler", (_Recorder,), {"answer": fixture(f"{backend}_completion_n2.json")})
    handler.bodies = []
    http = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        client = CompletionClient(
            f"http://127.0.0.1:{http.server_address[1]}/v1", "policy", backend=backend
        )
        prompt = [1, 320, 198, 45, 2, 198, 1, 419, 198]
        completions = asyncio.run(client.complete(prompt, 2, SAMPLING, seed=1234))
    finally:
        http.shutdown()
        http.server_close()
    (body,) = handler.bodies
    assert body == {
        "model": "policy",
        "prompt": prompt,  # token ids, never text
        "n": 2,
        "max_tokens": 3,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "stop": [],
        "seed": 1234,
        "logprobs": 0,
        "return_token_ids": True,
    }
    assert [c.token_ids for c in completions] == [[49, 50, 2], [55, 120, 57]]
    assert completions[1].logprobs[1] == -math.inf


# ---- vLLM weight sync --------------------------------------------------------------------------


def test_vllm_sync_is_pause_reload_reset_resume(make, checkpoint: Path) -> None:
    server = make("vllm")
    server.launch()
    pid = server.pid
    seconds = server.update_weights(checkpoint, "iter_001")
    assert seconds > 0 and server.pid == pid
    assert [(c["path"], c["query"], c["body"]) for c in calls(server)] == [
        ("/pause", {"mode": "wait"}, None),
        (
            "/collective_rpc",
            {},
            {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}},
        ),
        ("/reset_prefix_cache", {}, None),
        ("/resume", {}, None),
    ]
    assert server.model_path == checkpoint and server.weight_version == "iter_001"
    assert set(server.last_sync_timings) == {"pause", "reload", "reset_prefix_cache", "resume"}
    assert info(server)["env"]["VLLM_SERVER_DEV_MODE"] == "1"


def test_vllm_busy_prefix_cache_is_retried(make, checkpoint: Path, monkeypatch) -> None:
    monkeypatch.setattr(VLLMServer, "reset_backoff_s", 0.01)
    server = make("vllm")
    server.launch()
    busy = {"fixture": "/reset_prefix_cache busy"}
    plan(server, reset_prefix_cache=[busy, busy])
    server.update_weights(checkpoint)
    paths = [c["path"] for c in calls(server)]
    assert paths == ["/pause", "/collective_rpc"] + ["/reset_prefix_cache"] * 3 + ["/resume"]


def test_vllm_prefix_cache_that_never_resets_fails_and_still_resumes(
    make, checkpoint: Path, monkeypatch
) -> None:
    monkeypatch.setattr(VLLMServer, "reset_backoff_s", 0.01)
    server = make("vllm")
    server.launch()
    plan(server, reset_prefix_cache=[{"fixture": "/reset_prefix_cache busy"}] * 5)
    with pytest.raises(WeightSyncError, match="could not reset its prefix cache after 5 attempts"):
        server.update_weights(checkpoint)
    paths = [c["path"] for c in calls(server)]
    assert paths.count("/reset_prefix_cache") == VLLMServer.reset_attempts
    assert paths[-1] == "/resume"  # never left paused


def test_vllm_failed_reload_reports_the_servers_message_and_resumes(make, checkpoint: Path) -> None:
    server = make("vllm")
    server.launch()
    old_path = server.model_path
    plan(server, collective_rpc=[{"fixture": "/collective_rpc failed"}])
    with pytest.raises(WeightSyncError, match=r"collective_rpc failed with HTTP 500: KeyError"):
        server.update_weights(checkpoint)
    assert [c["path"] for c in calls(server)] == ["/pause", "/collective_rpc", "/resume"]
    assert server.model_path == old_path  # a failed sync does not claim the new weights


def test_vllm_without_dev_mode_routes_says_so(make, checkpoint: Path) -> None:
    server = make("vllm")
    server.launch()
    plan(server, pause=[{"status": 404, "body": {"detail": "Not Found"}}])
    with pytest.raises(WeightSyncError, match="VLLM_SERVER_DEV_MODE=1"):
        server.update_weights(checkpoint)
    assert [c["path"] for c in calls(server)] == ["/pause"]  # nothing paused, nothing to resume


def test_vllm_failed_resume_is_an_error(make, checkpoint: Path) -> None:
    server = make("vllm")
    server.launch()
    plan(server, resume=[{"status": 500, "body": {"error": "Failed to resume generation: x"}}])
    with pytest.raises(WeightSyncError, match="resume failed with HTTP 500"):
        server.update_weights(checkpoint)


def test_vllm_reload_timeout_is_an_error_and_resumes(make, checkpoint: Path) -> None:
    server = make("vllm", weight_sync_timeout=0.3)
    server.launch()
    plan(server, collective_rpc=[{"sleep": 3}])
    with pytest.raises(WeightSyncError, match="collective_rpc failed: ReadTimeout"):
        server.update_weights(checkpoint)
    assert [c["path"] for c in calls(server)][-1] == "/resume"


def test_vllm_failed_sync_falls_back_to_a_restart_on_the_new_weights(
    make, checkpoint: Path, caplog
) -> None:
    server = make("vllm")
    server.launch()
    pid = server.pid
    plan(server, collective_rpc=[{"fixture": "/collective_rpc failed"}])
    with caplog.at_level(logging.WARNING, logger="grail.inference.process"):
        result = server.sync_weights(checkpoint, weight_version="iter_001")
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert "KeyError" in result.fallback_reason
    assert any("falling back to a restart" in r.getMessage() for r in caplog.records)
    assert server.pid != pid and server.is_alive()
    assert info(server)["model"] == str(checkpoint)  # restarted on the new weights


def test_vllm_server_dying_during_reload_is_reported_then_restarted(make, checkpoint: Path) -> None:
    server = make("vllm")
    server.launch()
    plan(server, collective_rpc=[{"die": True}])
    with pytest.raises(WeightSyncError, match=r"died with exit code 9"):
        server.update_weights(checkpoint)
    result = server.sync_weights(checkpoint)  # in place fails at once, restart brings it back
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert server.is_alive() and info(server)["model"] == str(checkpoint)


def test_update_refuses_a_directory_without_safetensors(make, tmp_path: Path) -> None:
    server = make("vllm")
    server.launch()
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightSyncError, match=r"holds no \*\.safetensors"):
        server.update_weights(empty)
    with pytest.raises(WeightSyncError, match="does not exist"):
        server.update_weights(tmp_path / "missing")
    assert calls(server) == []


# ---- SGLang weight sync ------------------------------------------------------------------------


def test_sglang_sync_is_one_update_from_disk_call(make, checkpoint: Path) -> None:
    server = make("sglang")
    server.launch()
    pid = server.pid
    server.update_weights(checkpoint, "iter_001")
    assert [(c["path"], c["body"]) for c in calls(server)] == [
        ("/update_weights_from_disk", {"model_path": str(checkpoint), "weight_version": "iter_001"})
    ]
    assert server.pid == pid and server.model_path == checkpoint
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" not in {
        k for k, v in info(server)["env"].items() if v is not None
    }


def test_sglang_refusal_carries_its_message_and_falls_back(make, checkpoint: Path) -> None:
    server = make("sglang")
    server.launch()
    failed = {"fixture": "/update_weights_from_disk failed"}
    plan(server, update_weights_from_disk=[failed, failed])
    with pytest.raises(WeightSyncError, match=r"HTTP 400\): Failed to get weights iterator"):
        server.update_weights(checkpoint)
    result = server.sync_weights(checkpoint)
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert "no safetensors found" in result.fallback_reason


def test_sglang_success_false_with_http_200_is_still_a_failure(make, checkpoint: Path) -> None:
    server = make("sglang")
    server.launch()
    plan(
        server,
        update_weights_from_disk=[{"status": 200, "body": {"success": False, "message": "busy"}}],
    )
    with pytest.raises(WeightSyncError, match="busy"):
        server.update_weights(checkpoint)


# ---- start-up ----------------------------------------------------------------------------------


def test_gpu_server_that_never_gets_ready_times_out_clearly(make, model_dir: Path) -> None:
    server = make("sglang", start_timeout=1.0, extra_args=["--health-status", "503"])
    with pytest.raises(ServerStartError, match=r"not ready after 1.0 s.*HTTP 503"):
        server.launch()
    assert not server.is_alive()


# ---- a server that dies mid-run ----------------------------------------------------------------


def test_dead_server_is_restarted_from_the_newest_weights_and_the_batch_retried(
    make, checkpoint: Path
) -> None:
    server = make("vllm")
    server.launch()
    server.sync_weights(checkpoint)  # the newest weights are now the checkpoint
    first_pid = server.pid
    plan(server, v1__completions=[{"die": True}])
    attempts = []

    def generate():
        attempts.append(server.pid)
        # The SDK's retries (~1.5 s with 2) outlast the crash; then the liveness check sees it.
        client = CompletionClient(
            server.base_url,
            server.model_name,
            backend="vllm",
            max_retries=2,
            liveness_check=server.check_alive,
        )

        async def run():
            try:
                return await client.complete([1, 2, 3], 2, SAMPLING, seed=0)
            finally:
                await client.aclose()

        return asyncio.run(run())

    completions = call_with_recovery(server, generate, max_restarts=2, what="iteration 3")
    assert [c.token_ids for c in completions] == [[49, 50, 2], [55, 120, 57]]
    assert attempts[0] == first_pid and attempts[1] != first_pid
    assert server.recoveries == 1
    argv = info(server)["argv"]
    assert argv[argv.index("serve") + 1] == str(checkpoint)  # restarted on the newest weights


def test_server_that_keeps_dying_gives_up_after_max_restarts(make) -> None:
    server = make("sglang")
    server.launch()
    pids = []

    def generate():
        pids.append(server.pid)
        os.kill(server.pid, signal.SIGKILL)
        server._proc.wait(timeout=5)
        server.check_alive()

    with pytest.raises(ServerDiedError, match=r"iteration 7 failed: .*died 2 time\(s\).*max_re"):
        call_with_recovery(server, generate, max_restarts=1, what="iteration 7")
    assert len(set(pids)) == 2 and server.recoveries == 1


def test_failures_of_a_live_server_are_not_retried(make) -> None:
    server = make("vllm")
    server.launch()
    pid = server.pid
    count = []

    def generate():
        count.append(1)
        raise ValueError("scoring bug")

    with pytest.raises(ValueError, match="scoring bug"):
        call_with_recovery(server, generate, max_restarts=3)
    assert len(count) == 1 and server.pid == pid and server.recoveries == 0
    with pytest.raises(ValueError, match="max_restarts"):
        call_with_recovery(server, generate, max_restarts=-1)


# ---- the packages' own argument parsers --------------------------------------------------------


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_command_line_is_accepted_by_the_packages_own_parser(
    kind: str, model_dir: Path, tmp_path: Path
) -> None:
    python = python_with(kind)
    cls = VLLMServer if kind == "vllm" else SGLangServer
    server = cls(
        model_dir,
        "policy",
        log_dir=tmp_path,
        device="cuda:0,1",
        port=8123,
        gpu_memory_fraction=0.3,
        max_model_len=2048,
        max_num_seqs=64,
        seed=5,
        api_key="sekret",
    )
    argv = server.build_command()[3:]  # after `python -m MODULE`
    parsed = run_check(python, [str(BACKEND_ARGV_CHECK), kind], argv, timeout=300)
    print(f"{kind} {parsed['version']} ({parsed['parser']}) accepted: {argv}")
    assert parsed["model"] == str(model_dir)
    assert (parsed["host"], parsed["port"]) == ("127.0.0.1", 8123)
    assert parsed["dtype"] == "bfloat16"
    # vLLM's key comes from VLLM_API_KEY (child_env), SGLang's from the --config file
    assert parsed["api_key"] in ((None, []) if kind == "vllm" else ("sekret",))
    if kind == "vllm":
        assert parsed["served_model_name"] == ["policy"]
        assert parsed["gpu_memory_utilization"] == 0.3
        assert (parsed["max_model_len"], parsed["max_num_seqs"], parsed["seed"]) == (2048, 64, 5)
        assert parsed["tensor_parallel_size"] == 2
        assert parsed["generation_config"] == "vllm"
        assert parsed["logprobs_mode"] == "processed_logprobs"
    else:
        assert parsed["served_model_name"] == "policy"
        assert parsed["mem_fraction_static"] == 0.3
        assert (parsed["context_length"], parsed["max_running_requests"]) == (2048, 64)
        assert (parsed["random_seed"], parsed["tp_size"]) == (5, 2)
