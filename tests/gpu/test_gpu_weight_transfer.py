"""Weight transfer on GPUs (grail/inference/weights/): the built-in server on the trainer's GPU
reading the trainer's bf16 buffer through CUDA IPC, and vLLM/SGLang on a second GPU receiving an
NCCL broadcast; each checked by what the server then serves. Skipped without CUDA (and without
a second GPU or the package for NCCL)."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
import torch
from gpu_helpers import require_package

from grail.inference.backends import make_server_manager
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.weights.policy import PolicyWeights
from grail.inference.weights.syncer import WeightSyncer
from grail.models.loading import load_model
from grail.models.tiny import ensure_tiny_model

PROMPT = [1, 5, 9, 13, 4]


def _weights_dir(tmp_path: Path) -> Path:
    src = ensure_tiny_model()
    dst = tmp_path / "weights"
    shutil.copytree(src, dst)
    return dst


def _served_top(server) -> dict[int, float]:
    body = {
        "model": server.model_name,
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0.0,
        "logprobs": 5,
        "return_tokens_as_token_ids": True,
    }
    response = httpx.post(
        f"{server.base_url}/completions", json=body, headers=server._headers(), timeout=120
    )
    response.raise_for_status()
    top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(k.removeprefix("token_id:")): v for k, v in top.items()}


def _local(model: torch.nn.Module) -> torch.Tensor:
    served = load_model_like(model)
    device = next(served.parameters()).device
    with torch.inference_mode():
        logits = served(torch.tensor([PROMPT], device=device)).logits[0, -1].float()
    return torch.log_softmax(logits, -1).cpu()


def load_model_like(model: torch.nn.Module) -> torch.nn.Module:
    """The trainer's model as a bf16 server computes with it."""
    import copy

    return copy.deepcopy(model).to(torch.bfloat16).eval()


def _perturb(model: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator, device="cuda")
            param.add_(0.05 * noise)


def test_shared_route_over_cuda_ipc(tmp_path: Path) -> None:
    torch.cuda.set_device(0)
    weights = _weights_dir(tmp_path)
    model = load_model(str(weights), dtype="float32", device="cuda")
    server = BuiltinServer(weights, "p", log_dir=tmp_path / "logs", device="cuda:0", api_key="k")
    with server:
        before = _served_top(server)
        _perturb(model, 1)
        transfer = WeightSyncer.for_server(server, "shared")
        result = transfer.sync(PolicyWeights(model), "v1")
        assert result.transfer == "shared", result.transfer_fallback_reason
        served = _served_top(server)
        local = _local(model)
        assert max(abs(v - float(local[k])) for k, v in served.items()) < 0.05
        assert served != before
        # the server's directory gets the served weights before a restart
        transfer.recover()
        assert _served_top(server) == pytest.approx(served, abs=1e-3)


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_nccl_route_to_a_server_on_its_own_gpu(backend: str, tmp_path: Path) -> None:
    require_package(backend)
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: the server on one, the trainer on the other")
    torch.cuda.set_device(1)
    weights = _weights_dir(tmp_path)
    model = load_model(str(weights), dtype="float32", device="cuda:1")
    server = make_server_manager(
        backend,
        weights,
        "p",
        log_dir=tmp_path / "logs",
        device="cuda:0",
        gpu_memory_fraction=0.5,
        max_model_len=512,
        weight_transfer="nccl",
    )
    with server:
        before = _served_top(server)
        transfer = WeightSyncer.for_server(server, "nccl")
        for version in ("v1", "v2"):
            _perturb(model, hash(version) % 1000)
            result = transfer.sync(PolicyWeights(model), version)
            assert result.transfer == "nccl", result.transfer_fallback_reason
        served = _served_top(server)
        local = _local(model)
        assert max(abs(v - float(local[k])) for k, v in served.items()) < 0.1
        assert served != before
        transfer.close()
