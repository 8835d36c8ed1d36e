"""The rollout servers behind `ServerManager` (grail/inference/process.py): the built-in server
(`builtin.py`), vLLM (`vllm.py`) and SGLang (`sglang.py`), with what the last two share in
`gpu.py`; and the one place that picks and sizes a server, from arguments or from the config.

Rollouts for every backend go through the one `CompletionClient` (`/v1/completions`, token ids in,
`return_token_ids`); the small differences in the answers are handled by the client's `backend`
argument (`ServerManager.kind`). The server facts the code relies on are in docs/protocols.md.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from grail.core.config import BACKENDS, Config
from grail.core.placement import cpu_threads, gpu_placement
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.backends.gpu import default_memory_fraction
from grail.inference.backends.sglang import SGLangServer
from grail.inference.backends.vllm import VLLMServer
from grail.inference.process import ServerManager, ServerStartError
from grail.inference.transfer import route_from_config


def make_server_manager(
    backend: str,
    model_path: str | os.PathLike[str],
    served_model_name: str,
    *,
    log_dir: str | os.PathLike[str],
    device: str,
    threads: int | None = None,
    start_timeout: float | None = None,
    dtype: str | None = None,
    gpu_memory_fraction: float | None = None,
    shares_gpu_with_trainer: bool = False,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
    seed: int | None = None,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    lora_dir: str | os.PathLike[str] | None = None,
    lora_rank: int | None = None,
    weight_transfer: str = "disk",
) -> ServerManager:
    """The `ServerManager` for `backend` ("builtin", "vllm" or "sglang").

    `weight_transfer` is the route its weight syncs take (grail/inference/transfer.py): vLLM
    needs `--weight-transfer-config` on its command line for "nccl".

    gpu_memory_fraction None picks `default_memory_fraction(shares_gpu_with_trainer)`;
    start_timeout None picks the backend's `default_start_timeout_s` (120 s for the built-in
    server, 900 s for vLLM and SGLang); dtype None means bfloat16 for the GPU servers and the
    server's default for the built-in one. Memory fraction, max_model_len and max_num_seqs apply
    to vLLM/SGLang only; the built-in server ignores them. `threads` applies to the built-in
    server on CPU.

    The built-in server always gets an API key: `api_key`, or when None a random one made here
    (`server.api_key`, which `ServerManager` and the rollout client send). Every route of it but
    `/health` needs the key, the weight reload included, so no other process that reaches the
    port can generate with it or swap its weights.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    common: dict[str, Any] = {
        "log_dir": log_dir,
        "device": device,
        "start_timeout": start_timeout,
        "extra_args": extra_args,
        "api_key": api_key,
        "port": port,
        "env": env,
        "lora_dir": lora_dir,
        "lora_rank": lora_rank,
    }
    if backend == "builtin":
        # "sk-" first: a URL-safe token starts with "-" one time in 64, and the server's argument
        # parser then reads `--api-key -xyz` as a missing value and exits.
        common["api_key"] = api_key or "sk-" + secrets.token_urlsafe(32)
        server: ServerManager = BuiltinServer(
            model_path, served_model_name, threads=threads, dtype=dtype, **common
        )
        server.weight_transfer = weight_transfer
        return server
    cls = VLLMServer if backend == "vllm" else SGLangServer
    if gpu_memory_fraction is None:
        gpu_memory_fraction = default_memory_fraction(shares_gpu_with_trainer)
    return cls(
        model_path,
        served_model_name,
        dtype="bfloat16" if dtype is None else dtype,
        gpu_memory_fraction=gpu_memory_fraction,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=seed,
        weight_transfer=weight_transfer,
        **common,
    )


def server_manager_from_config(
    cfg: Config,
    model_dir: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    cuda_available: bool | None = None,
    served_model_name: str = "policy",
    lora_dir: str | os.PathLike[str] | None = None,
) -> ServerManager:
    """The server `grail-train` runs for `cfg`: backend, GPU placement and sizes from the config.
    With `model.lora.enabled`, `lora_dir` is where the adapter the server serves is written.

    Placement: the server gets `gpu.server_gpu`; with `gpu.strategy=single` the trainer shares
    that GPU, so the memory fraction defaults low. The built-in server runs on CPU when CUDA is
    not available; vLLM and SGLang need CUDA and say so. `generation.start_timeout_s` null means
    the backend's default.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    gen = cfg.generation
    if gen.backend != "builtin" and not cuda_available:
        raise ServerStartError(
            f"generation.backend={gen.backend} needs a CUDA GPU, and torch sees none "
            "(torch.cuda.is_available() is False); on a CPU machine use generation.backend=builtin"
        )
    threads = None
    if not cuda_available:
        threads = cpu_threads(cfg.train.threads, gen.server_threads, pipelined=cfg.train.pipeline)[
            1
        ]
    model_dtype = cfg.model.dtype
    route, why = route_from_config(cfg, cuda_available)
    server = make_server_manager(
        gen.backend,
        model_dir,
        served_model_name,
        log_dir=Path(run_dir) / "logs",
        device=f"cuda:{gpu_placement(cfg.gpu)[0]}" if cuda_available else "cpu",
        threads=threads,
        start_timeout=gen.start_timeout_s,
        dtype=None if model_dtype == "auto" else model_dtype,
        gpu_memory_fraction=gen.gpu_memory_fraction,
        shares_gpu_with_trainer=cfg.gpu.strategy == "single",
        max_model_len=gen.max_model_len,
        max_num_seqs=gen.max_num_seqs,
        seed=cfg.seed,
        extra_args=list(gen.extra_args),
        lora_dir=lora_dir,
        lora_rank=cfg.model.lora.r if lora_dir is not None else None,
        weight_transfer=route,
    )
    server.weight_transfer_why = why
    return server
