"""Weight transfer (grail/inference/weights/): the route a run picks, the weights written in
the server's dtype, and the built-in server's shared-memory route against a real server on CPU
(the same code path as CUDA IPC but for the handle type): new weights served exactly, a refused
update leaving the old ones, the unpickler's allow-list, the key, the fallback to disk, and the
served weights written back before a restart."""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from helpers.fake_server import FakeBuiltinServer
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_file

from grail.core.config import Config
from grail.core.errors import ConfigError
from grail.core.records import load_schema
from grail.core.validate import validate
from grail.inference.backends import BACKEND_CLASSES
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.errors import WeightSyncError
from grail.inference.process import SyncResult
from grail.inference.weights.disk import DiskRoute
from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.route import make_fast_route, resolve_route
from grail.inference.weights.shared import FlatWeights, tensor_payload
from grail.inference.weights.shm_file import PREFIX, remove_stale, shm_dir
from grail.inference.weights.syncer import MAX_FAILURES_IN_A_ROW, WeightSyncer
from grail.models.loading import load_model
from grail.rollouts.batch import WeightSync
from grail.train.loop import weight_sync_record

pytestmark = pytest.mark.timeout(120)
PROMPT = [1, 5, 9, 13, 4]


def _config(**overrides: object) -> Config:
    from hydra import compose, initialize_config_dir

    from grail.train.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("offline_grpo", overrides=[f"{k}={v}" for k, v in overrides.items()])
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _served_top(server: BuiltinServer) -> dict[int, float]:
    body = {
        "model": server.model_name,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    answer = httpx.post(
        f"{server.base_url}/completions", json=body, headers=server._headers(), timeout=30
    )
    answer.raise_for_status()
    top = answer.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.removeprefix("token_id:")): v for k, v in top.items()}


def _local(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT])).logits[0, -1].float()
    return torch.log_softmax(logits, -1)


def _off(served: dict[int, float], local: torch.Tensor) -> float:
    return max(abs(lp - float(local[token])) for token, lp in served.items())


# ---- which route ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "strategy", "same", "lora", "sync", "route"),
    [
        ("builtin", "single", True, False, "in_place", "shared"),  # CPU default job, or one GPU
        ("builtin", "multi", False, False, "in_place", "disk"),
        ("builtin", "single", True, True, "in_place", "disk"),  # LoRA: the adapter from disk
        ("builtin", "single", True, False, "restart", "disk"),
        ("vllm", "multi", False, False, "in_place", "nccl"),
        ("sglang", "multi", False, False, "in_place", "nccl"),
        ("vllm", "single", True, False, "in_place", "disk"),  # NCCL cannot share a GPU
    ],
)
def test_auto_picks_the_fast_route_where_it_can(backend, strategy, same, lora, sync, route) -> None:
    got = resolve_route(
        "auto",
        BACKEND_CLASSES[backend].weight_routes,
        backend=backend,
        strategy=strategy,
        same_device=same,
        lora=lora,
        weight_sync=sync,
    )
    assert got.name == route and got.why.startswith("auto:")


def test_each_backend_lists_its_routes_and_gets_no_other(tmp_path: Path) -> None:
    assert BACKEND_CLASSES["builtin"].weight_routes == ("disk", "shared")
    assert BACKEND_CLASSES["vllm"].weight_routes == ("disk", "nccl")
    assert BACKEND_CLASSES["sglang"].weight_routes == ("disk", "nccl")
    server = BuiltinServer(tmp_path, "p", log_dir=tmp_path / "logs")
    assert make_fast_route("shared", server).name == "shared"
    with pytest.raises(ValueError, match="takes weight_transfer 'disk' or 'shared', got 'nccl'"):
        make_fast_route("nccl", server)
    with pytest.raises(ValueError, match="takes weight_transfer 'disk' or 'nccl', got 'shared'"):
        resolve_route(
            "shared",
            BACKEND_CLASSES["vllm"].weight_routes,
            backend="vllm",
            strategy="multi",
            same_device=False,
            lora=False,
            weight_sync="in_place",
        )


def test_config_names_a_bad_route_and_impossible_combinations() -> None:
    # (composed by Hydra, a value outside the Enum fails earlier: tests/test_config.py)
    in_code = _config()
    in_code.generation.weight_transfer = "ipc"  # type: ignore[assignment]
    with pytest.raises(ConfigError, match="generation.weight_transfer='ipc' is not one of"):
        validate(in_code)
    impossible = {
        "needs generation.backend=builtin": {"generation.weight_transfer": "shared",
                                             "generation.backend": "vllm"},
        "needs gpu.strategy=multi": {"generation.weight_transfer": "nccl",
                                     "generation.backend": "sglang"},
        "the built-in server takes": {"generation.weight_transfer": "nccl",
                                      "gpu.strategy": "multi"},
        "weight_sync=restart": {"generation.weight_transfer": "shared",
                                "generation.weight_sync": "restart"},
        "adapter": {"generation.weight_transfer": "shared", "model.lora.enabled": "true"},
    }  # fmt: skip
    for message, overrides in impossible.items():
        with pytest.raises(ConfigError, match=message):
            validate(_config(**overrides))
    validate(_config(**{"generation.weight_transfer": "disk"}))


# ---- the weights a sync writes -------------------------------------------------------------


def test_weights_are_written_in_the_servers_dtype(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    weights = PolicyWeights(model)
    weights.save(tmp_path / "bf16", torch.bfloat16)
    weights.save(tmp_path / "same", torch.float32)  # the server's dtype is the master's
    model.save_pretrained(tmp_path / "plain", safe_serialization=True)
    bf16 = load_file(tmp_path / "bf16" / "model.safetensors")
    plain = load_file(tmp_path / "plain" / "model.safetensors")
    assert sorted(bf16) == sorted(plain)  # the tied lm_head left out alike
    for name, tensor in bf16.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, plain[name].to(torch.bfloat16))
    same = tmp_path / "same" / "model.safetensors"
    assert same.read_bytes() == (tmp_path / "plain" / "model.safetensors").read_bytes()


def test_flat_weights_write_the_served_weights_in_place_of_shards(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    flat = FlatWeights(torch.device("cpu"))
    flat.fill(PolicyWeights(model).named_tensors(), torch.bfloat16)
    flat.write_dir(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
    written = load_file(tmp_path / "model.safetensors")
    state = model.state_dict()
    assert set(written) == {name for name, _ in PolicyWeights(model).named_tensors()}
    for name, tensor in written.items():
        assert torch.equal(tensor, state[name].to(torch.bfloat16))


# ---- the shared route against a real built-in server ---------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    weights = tmp_path_factory.mktemp("served")
    load_model(str(tiny_model_dir), dtype="float32", device="cpu").save_pretrained(weights)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights / name).write_bytes((tiny_model_dir / name).read_bytes())
    server = BuiltinServer(
        weights,
        "policy",
        log_dir=tmp_path_factory.mktemp("logs"),
        threads=1,
        api_key="sk-test",
        start_timeout=120,
        weight_sync_timeout=30,
    )
    with server:
        yield server


def test_shared_route_serves_exactly_the_new_weights(server: BuiltinServer) -> None:
    model = load_model(str(server.model_path), dtype="float32", device="cpu")
    before = _local(model)
    _perturb(model, seed=1)
    transfer = WeightSyncer.for_server(server, "shared")
    result = transfer.sync(PolicyWeights(model), "iter_007")
    assert (result.transfer, result.transfer_fallback_reason, result.mode_used) == (
        "shared",
        None,
        "in_place",
    )
    served = _served_top(server)
    assert _off(served, _local(model)) < 1e-5  # float32 in both: the same numbers
    assert _off(served, before) > 1e-3
    cards = httpx.get(f"{server.base_url}/models", headers=server._headers(), timeout=10).json()
    assert cards["data"][0]["weight_version"] == "iter_007"
    assert "loaded 26 shared tensors" in server.log_tail(400)

    # The directory is older than the served weights now: a restart first writes them there.
    before = (server.model_path / "model.safetensors").read_bytes()
    transfer.before_restart()
    on_disk = load_file(server.model_path / "model.safetensors")
    state = model.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in on_disk.items())
    assert (server.model_path / "model.safetensors").read_bytes() != before
    transfer.before_restart()  # once written, never again


def _children_named(name: str) -> list[int]:
    me = str(os.getpid())
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            comm, rest = stat.read_text().rsplit(")", 1)
        except OSError:
            continue
        if rest.split()[1] == me and comm.endswith(f"({name}"):
            found.append(int(stat.parent.name))
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_shared_route_leaves_no_process_and_no_file_behind(server: BuiltinServer) -> None:
    """torch's "file_system" strategy started torch_shm_manager, a child that outlived every
    in-process run (the smoke test failed on it); the buffers are now files in /dev/shm that
    the route unlinks when it closes."""
    model = load_model(str(server.model_path), dtype="float32", device="cpu")
    _perturb(model, seed=4)
    transfer = WeightSyncer.for_server(server, "shared")
    assert transfer.sync(PolicyWeights(model), "iter_008").transfer == "shared"
    files = list(shm_dir().glob(f"{PREFIX}{os.getpid()}-*"))
    assert files, "the buffers live in the shared-memory directory while the route is open"
    assert _children_named("torch_shm_manager") == []
    transfer.close()
    assert [f for f in files if f.exists()] == []


def test_buffer_files_of_dead_trainers_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PREFIX}{dead.pid}-0a1b"
    mine = tmp_path / f"{PREFIX}{os.getpid()}-0a1b"
    other = tmp_path / "unrelated-file"
    for path in (stale, mine, other):
        path.write_bytes(b"x")
    assert remove_stale(tmp_path) == [stale]
    assert not stale.exists() and mine.exists() and other.exists()


def test_tensor_route_maps_weight_buffer_files_only(server: BuiltinServer, tmp_path: Path) -> None:
    url = f"{server.root_url}/update_weights_from_tensor"
    for path in ("/etc/passwd", str(shm_dir() / "not-ours"), str(tmp_path / f"{PREFIX}1-x")):
        bucket = {"file": path, "dtype": "float32", "numel": 4, "entries": []}
        payload = base64.b64encode(pickle.dumps(bucket)).decode()
        answer = httpx.post(
            url, json={"serialized_named_tensors": [payload]}, headers=server._headers(), timeout=10
        )
        assert answer.status_code == 400
        assert "is not a weight buffer file" in answer.json()["message"], answer.json()


def test_refused_tensors_leave_the_old_weights_serving(server: BuiltinServer) -> None:
    before = _served_top(server)
    model = load_model(str(server.model_path), dtype="float32", device="cpu")
    _perturb(model, seed=2)
    named = PolicyWeights(model).named_tensors()
    flat = FlatWeights(torch.device("cpu"))
    wrong = [(n, t[:-1] if n.endswith("norm.weight") else t) for n, t in named]
    flat.fill(wrong, torch.float32)
    with pytest.raises(WeightSyncError, match=r"norm\.weight: shape \[63\] in the trainer's"):
        server.update_weights_from_tensor(tensor_payload(flat, "bad"))
    flat.fill(named[:-1], torch.float32)  # one weight short
    with pytest.raises(WeightSyncError, match="lacks 1 model weights"):
        server.update_weights_from_tensor(tensor_payload(flat, "bad"))
    assert _served_top(server) == before


def test_tensor_route_unpickles_tensor_handles_only(server: BuiltinServer, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    payload = base64.b64encode(pickle.dumps({"tensor": Evil(), "entries": []})).decode()
    url = f"{server.root_url}/update_weights_from_tensor"
    answer = httpx.post(
        url, json={"serialized_named_tensors": [payload]}, headers=server._headers(), timeout=10
    )
    assert answer.status_code == 400
    assert "pathlib" in answer.json()["message"] and "refused" in answer.json()["message"]
    assert not marker.exists()
    # The key gate is in front of it, as of every route but /health.
    assert httpx.post(url, json={"serialized_named_tensors": [payload]}).status_code == 401


def test_a_failing_fast_route_falls_back_to_disk_and_is_counted(
    server: BuiltinServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = load_model(str(server.model_path), dtype="float32", device="cpu")
    _perturb(model, seed=3)

    def broken(*_args) -> float:
        raise WeightSyncError("POST /update_weights_from_tensor failed: ReadTimeout")

    monkeypatch.setattr(server, "update_weights_from_tensor", broken)
    transfer = WeightSyncer.for_server(server, "shared")
    for attempt in range(1, MAX_FAILURES_IN_A_ROW + 1):
        result = transfer.sync(PolicyWeights(model), f"v{attempt}")
        assert result.transfer == "disk" and result.transfer_fallbacks == attempt
        assert "ReadTimeout" in (result.transfer_fallback_reason or "")
    assert _off(_served_top(server), _local(model)) < 1e-5  # from disk, just as well
    assert transfer.active_route == "disk"  # given up after MAX_FAILURES_IN_A_ROW
    result = transfer.sync(PolicyWeights(model), "v9")
    assert result.transfer_fallback_reason is None and result.transfer_fallbacks == 3
    record = {"weight_sync": weight_sync_record(WeightSync(_failed(), 0.1, 0.0))}
    assert record["weight_sync"] == {
        "mode": "in_place",
        "fell_back": False,
        "transfer": "disk",
        "transfer_fallbacks": 1,
        "transfer_fallback_reason": "WeightSyncError: timed out",
    }


def _failed() -> SyncResult:
    return SyncResult(
        0.1,
        "in_place",
        fell_back=False,
        transfer="disk",
        transfer_fallback_reason="WeightSyncError: timed out",
        transfer_fallbacks=1,
    )


def test_record_with_a_fallback_fits_the_schema() -> None:
    schema = load_schema("train_iteration")["properties"]["weight_sync"]
    record = weight_sync_record(WeightSync(_failed(), 0.1, 0.0))
    jsonschema.validate(record, schema)
    with pytest.raises(jsonschema.ValidationError, match="'ipc' is not one of"):
        jsonschema.validate({**record, "transfer": "ipc"}, schema)


class _StandInRoute:
    """A fast route that carries nothing and records where it was asked to write."""

    name = "shared"

    def __init__(self) -> None:
        self.written: list[Path] = []

    def send(self, weights: PolicyWeights, weight_version: str) -> SyncResult:
        return SyncResult(0.0, "in_place", fell_back=False, transfer=self.name)

    def write_served(self, directory: Path) -> None:
        self.written.append(directory)

    def close(self) -> None:
        pass


def test_restart_writes_the_served_weights_first(tmp_path: Path) -> None:
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    server = FakeBuiltinServer(model_dir, "p", log_dir=tmp_path / "logs", start_timeout=20)
    route = _StandInRoute()
    syncer = WeightSyncer(DiskRoute(server), route)
    with server:
        assert syncer.sync(PolicyWeights(torch.nn.Linear(2, 2)), "v1").transfer == "shared"
        syncer.recover()
        assert route.written == [model_dir.absolute()] and server.recoveries == 1
        syncer.recover()  # once written, never again
    assert len(route.written) == 1


# ---- a server that serves bfloat16 ---------------------------------------------------------


def test_a_bf16_server_gets_bf16_weights_and_serves_them(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    weights = tmp_path / "weights"
    model = load_model(str(tiny_model_dir), dtype="float32", device="cpu")
    model.save_pretrained(weights)
    server = BuiltinServer(weights, "p", log_dir=tmp_path / "logs", threads=1, dtype="bfloat16")
    assert server.served_dtype() == "bfloat16"
    with server:
        _perturb(model, seed=4)
        result = WeightSyncer.for_server(server, "disk").sync(PolicyWeights(model), "v1")
        assert (result.transfer, result.mode_used) == ("disk", "in_place")
        with safe_open(weights / "model.safetensors", "pt") as handle:
            assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}  # noqa: SIM118
        bf16 = load_model(str(weights), dtype="bfloat16", device="cpu")
        assert _off(_served_top(server), _local(bf16)) < 1e-3
        # and the shared route, in bf16 too
        _perturb(model, seed=5)
        result = WeightSyncer.for_server(server, "shared").sync(PolicyWeights(model), "v2")
        assert result.transfer == "shared"
        bf16.load_state_dict(PolicyWeights(model).state_dict(torch.bfloat16))
        assert _off(_served_top(server), _local(bf16)) < 1e-3
