"""vLLM and SGLang over NCCL (`weight_transfer=nccl`) without a GPU: the command line, the
requests in their order (init once per server process, an update per sync, vLLM's pause / prefix
cache reset / resume around it, SGLang's begin/end session), a failure's fallback to disk, and the
bodies against the packages' own routes and request models.

The trainer's side of the group (grail/inference/backends/nccl.py) needs CUDA: here a stand-in
sender joins and "broadcasts" by calling the server's side at once, so the HTTP side runs as it
does on a GPU, against tests/helpers/fake_gpu_server.py answering what vLLM 0.33.0 and SGLang 0.5.23
answered (tests/fixtures/weight_transfer/, recorded by tests/helpers/weight_transfer_check.py, which
`test_bodies_against_the_real_package` runs again whenever the package is importable).
tests/gpu/test_gpu_weight_transfer.py runs the real thing on GPUs.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers.fake_gpu_server import FakeSGLangServer, FakeVLLMServer, calls, plan
from helpers.real_packages import WEIGHT_TRANSFER_CHECK, python_with, run_check

from grail.inference.backends import nccl as nccl_module
from grail.inference.backends import sglang as sglang_module
from grail.inference.backends import vllm as vllm_module
from grail.inference.backends.nccl import SGLangSender, VLLMSender
from grail.inference.backends.sglang import SGLangServer
from grail.inference.backends.vllm import VLLMServer
from grail.inference.errors import WeightSyncError
from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.shared import FlatWeights
from grail.inference.weights.syncer import WeightSyncer
from grail.models.loading import load_model

TESTS_DIR = Path(__file__).resolve().parent
FIXTURES = TESTS_DIR / "fixtures" / "weight_transfer"
pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="process checks read /proc (Linux only)"
    ),
    pytest.mark.timeout(120),
]


class StandInSender:
    """The trainer's side of the group without NCCL: `join` and `send` call the server's side
    (as the real sender does from a thread) and record what would have been broadcast."""

    made: list[StandInSender] = []

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self.master_address, self.master_port = "127.0.0.1", 29511
        self.broken: str | None = None
        self.sent: list[list[torch.Tensor]] = []
        self.closed = False
        StandInSender.made.append(self)

    init_info = VLLMSender.init_info
    init_body = SGLangSender.init_body

    def join(self, server_join: Callable[[], None]) -> None:
        server_join()

    def send(self, tensors: list[torch.Tensor], server_receive: Callable[[], None]) -> float:
        self.sent.append(tensors)
        server_receive()
        return 0.0

    def close(self) -> None:
        self.closed = True


@pytest.fixture(autouse=True)
def _stand_in_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    StandInSender.made = []
    monkeypatch.setattr(vllm_module, "VLLMSender", StandInSender)
    monkeypatch.setattr(sglang_module, "SGLangSender", StandInSender)


@pytest.fixture
def model(tiny_model_dir: Path) -> torch.nn.Module:
    return load_model(str(tiny_model_dir), dtype="float32", device="cpu")


@pytest.fixture
def model_dir(tmp_path: Path, model: torch.nn.Module) -> Path:
    path = tmp_path / "weights"
    model.save_pretrained(path)
    return path


@pytest.fixture
def make(tmp_path: Path, model_dir: Path):
    made = []

    def build(kind: str, **kwargs):
        cls = FakeVLLMServer if kind == "vllm" else FakeSGLangServer
        kwargs.setdefault("log_dir", tmp_path / "logs")
        kwargs.setdefault("device", "cuda:0")
        kwargs.setdefault("start_timeout", 20.0)
        kwargs.setdefault("stop_timeout", 5.0)
        kwargs.setdefault("weight_transfer", "nccl")
        server = cls(model_dir, "policy", **kwargs)
        made.append(server)
        return server

    yield build
    for server in made:
        server.stop(timeout=1.0)


def _flat(model: torch.nn.Module) -> FlatWeights:
    flat = FlatWeights(torch.device("cpu"))
    flat.fill(PolicyWeights(model).named_tensors(), torch.bfloat16)
    return flat


def _routes(server) -> list[str]:
    return [call["path"] for call in calls(server)]


def test_vllm_is_started_with_the_nccl_engine_only_when_asked(tmp_path: Path) -> None:
    common = {"log_dir": tmp_path, "device": "cuda:0", "port": 8123}
    argv = VLLMServer(tmp_path, "p", **common, weight_transfer="nccl").build_command()
    i = argv.index("--weight-transfer-config")
    assert json.loads(argv[i + 1]) == {"backend": "nccl"}
    assert "--weight-transfer-config" not in VLLMServer(tmp_path, "p", **common).build_command()
    with pytest.raises(ValueError, match="must not set --weight-transfer-config"):
        VLLMServer(tmp_path, "p", **common, extra_args=["--weight-transfer-config", "{}"])
    with pytest.raises(ValueError, match="takes weight_transfer 'disk' or 'nccl', got 'shared'"):
        SGLangServer(tmp_path, "p", **common, weight_transfer="shared")


def test_vllm_joins_once_and_updates_between_pause_and_resume(make, model) -> None:
    server = make("vllm")
    with server:
        flat = _flat(model)
        server.update_weights_nccl(flat, "iter_000")
        server.update_weights_nccl(flat, "iter_001")
        sync = [
            "/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
            "/reset_prefix_cache", "/resume",
        ]  # fmt: skip
        assert _routes(server) == ["/init_weight_transfer_engine", *sync, *sync]
        got = calls(server)
        assert got[0]["body"] == {
            "init_info": {
                "master_address": "127.0.0.1",
                "master_port": 29511,
                "rank_offset": 1,
                "world_size": 2,  # the trainer and one worker (one GPU, no tensor parallel)
                "packed": False,
            }
        }
        assert got[1]["query"] == {"mode": "wait"}
        update = got[3]["body"]["update_info"]
        names = [name for name, _ in flat.named_views()]
        assert update["names"] == names and "lm_head.weight" not in names  # tied: embed only
        assert set(update["dtype_names"]) == {"bfloat16"}
        assert update["shapes"][0] == list(model.model.embed_tokens.weight.shape)
        assert got[4]["body"] == {"weight_version": "iter_000"}
        (sender,) = StandInSender.made
        assert len(sender.sent) == 2 and [t.shape for t in sender.sent[0]] == [
            torch.Size(s) for s in update["shapes"]
        ]
        assert server.weight_version == "iter_001"


def test_vllm_failed_update_resumes_and_the_sync_falls_back_to_disk(
    make, model, model_dir: Path
) -> None:
    server = make("vllm")
    with server:
        plan(server, update_weights=[{"fixture": "/update_weights failed"}])
        transfer = WeightSyncer.for_server(server, "nccl")
        result = transfer.sync(PolicyWeights(model), "iter_004")
        assert result.transfer == "disk" and result.transfer_fallbacks == 1
        assert "HTTP 500" in (result.transfer_fallback_reason or "")
        routes = _routes(server)
        # the failed round still resumed; then the disk route's own pause/reload/reset/resume
        assert routes[routes.index("/update_weights") :] == [
            "/update_weights", "/resume",
            "/pause", "/collective_rpc", "/reset_prefix_cache", "/resume",
        ]  # fmt: skip
        assert calls(server)[-3]["body"]["kwargs"] == {"weights_path": str(model_dir)}
        # in the server's dtype: bf16 files, as vLLM serves bf16 (dtype=None means bfloat16)
        from safetensors import safe_open

        with safe_open(model_dir / "model.safetensors", "pt") as handle:
            assert handle.get_tensor("model.norm.weight").dtype == torch.bfloat16
        # the next sync tries NCCL again, and it works
        result = transfer.sync(PolicyWeights(model), "iter_005")
        assert result.transfer == "nccl" and result.transfer_fallback_reason is None


def test_a_restarted_server_joins_a_new_group(make, model) -> None:
    server = make("vllm")
    with server:
        flat = _flat(model)
        server.update_weights_nccl(flat, "iter_000")
        server.restart(server.model_path)
        server.update_weights_nccl(flat, "iter_001")
        assert _routes(server)[0] == "/init_weight_transfer_engine"  # the new process's calls
        first, second = StandInSender.made
        assert first.closed and not second.closed


def test_a_server_started_without_nccl_is_not_sent_over_it(make, model) -> None:
    server = make("vllm", weight_transfer="disk")
    with server:
        with pytest.raises(WeightSyncError, match="without --weight-transfer-config"):
            server.update_weights_nccl(_flat(model), "iter_000")
        assert _routes(server) == []


def test_sglang_joins_once_and_updates_inside_a_session(make, model) -> None:
    server = make("sglang")
    with server:
        flat = _flat(model)
        server.update_weights_nccl(flat, "iter_000")
        server.update_weights_nccl(flat, "iter_001")
        sync = ["/begin_weight_update", "/update_weights_from_distributed", "/end_weight_update"]
        assert _routes(server) == ["/init_weights_update_group", *sync, *sync]
        got = calls(server)
        assert got[0]["body"] == {
            "master_address": "127.0.0.1",
            "master_port": 29511,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "grail_weight_sync",
            "backend": "nccl",
        }
        body = got[2]["body"]
        assert body["names"] == [name for name, _ in flat.named_views()]
        assert set(body["dtypes"]) == {"bfloat16"} and body["flush_cache"] is True
        assert (body["group_name"], body["weight_version"]) == ("grail_weight_sync", "iter_000")


def test_sglang_refused_update_ends_the_session_and_carries_its_message(make, model) -> None:
    server = make("sglang")
    with server:
        plan(
            server,
            update_weights_from_distributed=[
                {"fixture": "/update_weights_from_distributed failed"}
            ],
        )
        with pytest.raises(WeightSyncError, match="must run between begin_weight_update"):
            server.update_weights_nccl(_flat(model), "iter_000")
        assert _routes(server)[-1] == "/end_weight_update"


def test_the_stand_in_matches_the_real_senders_interface() -> None:
    """What the tests above replace: the same constructor, join/send/close and bodies."""
    for real in (VLLMSender, SGLangSender):
        for name in ("join", "send", "close", "broken"):
            assert hasattr(real(2), name)
    with pytest.raises(WeightSyncError, match="needs CUDA"):
        nccl_module.VLLMSender(2).join(lambda: None)


# ---- the packages' own routes and request models -------------------------------------------


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_bodies_against_the_real_package(kind: str, model, tmp_path: Path) -> None:
    python = python_with(kind)
    common = {"log_dir": tmp_path, "device": "cuda:0", "port": 8123, "weight_transfer": "nccl"}
    flat = FlatWeights(torch.device("cpu"))
    flat.fill(PolicyWeights(model).named_tensors()[:3], torch.bfloat16)
    if kind == "vllm":
        server = VLLMServer(tmp_path, "policy", **common)
        sender = VLLMSender(2)
        sender.master_port = 29511
        job = {
            "argv": server.build_command()[3:],
            "init": {"init_info": sender.init_info()},
            "update": {"update_info": server.update_info(flat)},
            "finish": {"weight_version": "iter_001"},
        }
    else:
        server = SGLangServer(tmp_path, "policy", **common)
        sender = SGLangSender(2)
        sender.master_port = 29511
        job = {
            "argv": server.build_command()[3:],
            "init": sender.init_body(),
            "begin": {"selector": "all"},
            "update": server.distributed_update_body(flat, "iter_001"),
            "end": {},
        }
    parsed = run_check(python, [str(WEIGHT_TRANSFER_CHECK), kind], job, timeout=540)
    recorded = json.loads((FIXTURES / f"{kind}_nccl.json").read_text())
    assert parsed["answers"] == {k: v for k, v in recorded.items() if not k.startswith("_")}
    names = [name for name, _ in flat.named_views()]
    if kind == "vllm":
        assert parsed["weight_transfer_backend"] == "nccl"
        calls_by_kind = {call[0]: call[1:] for call in parsed["calls"]}
        init = calls_by_kind["init"][0]
        assert (init["rank_offset"], init["world_size"], init["packed"]) == (1, 2, False)
        assert calls_by_kind["update"][0]["names"] == names
        assert calls_by_kind["finish"] == ["iter_001"]
        assert calls_by_kind["pause"] == ["wait", True]
    else:
        kinds = [(call[0], call[1]) for call in parsed["calls"]]
        assert kinds[:4] == [
            ("init", "InitWeightsUpdateGroupReqInput"),
            ("begin", "BeginWeightUpdateReqInput"),
            ("update", "UpdateWeightsFromDistributedReqInput"),
            ("end", "EndWeightUpdateReqInput"),
        ]
        update = parsed["calls"][2][2]
        assert update["names"] == names and update["group_name"] == "grail_weight_sync"
