"""The rollout servers behind `ServerManager` (grail/inference/process.py): the built-in server
(`builtin.py`), vLLM (`vllm.py`) and SGLang (`sglang.py`), with what the last two share in
`gpu.py`; and the one place that picks and sizes a server, from arguments or from the config,
with the weight route its syncs take (grail/inference/weights/).

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

from grail.core.choices import BACKENDS
from grail.core.config import Config
from grail.core.placement import cpu_threads, gpu_placement
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.backends.gpu import default_memory_fraction
from grail.inference.backends.sglang import SGLangServer
from grail.inference.backends.vllm import VLLMServer
from grail.inference.process import ServerManager, ServerStartError
from grail.inference.weights.route import RouteChoice, route_from_config
from grail.inference.weights.syncer import WeightSyncer

#: the server class of each `generation.backend`
BACKEND_CLASSES: dict[str, type[ServerManager]] = {
    "builtin": BuiltinServer,
    "vllm": VLLMServer,
    "sglang": SGLangServer,
}


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

    `weight_transfer` is the route its weight syncs take (grail/inference/weights/), which vLLM
    and SGLang check against what they take and vLLM needs on its command line for "nccl"; the
    built-in server needs nothing at start for either of its routes.

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
        return BuiltinServer(model_path, served_model_name, threads=threads, dtype=dtype, **common)
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
    weight_transfer: str = "disk",
) -> ServerManager:
    """The server `grail-train` runs for `cfg`: backend, GPU placement and sizes from the config.
    With `model.lora.enabled`, `lora_dir` is where the adapter the server serves is written;
    `weight_transfer` is the run's route (`server_and_syncer_from_config` picks it).

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
    return make_server_manager(
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
        weight_transfer=weight_transfer,
    )


def weight_route_from_config(cfg: Config, cuda_available: bool) -> RouteChoice:
    """The run's weight route (grail/inference/weights/route.py): `generation.weight_transfer`
    among the routes its backend takes (`weight_routes`), given where server and trainer are."""
    supported = BACKEND_CLASSES[cfg.generation.backend].weight_routes
    return route_from_config(cfg, supported, cuda_available)


def server_and_syncer_from_config(
    cfg: Config,
    model_dir: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    cuda_available: bool | None = None,
    lora_dir: str | os.PathLike[str] | None = None,
) -> tuple[ServerManager, WeightSyncer]:
    """The server of `server_manager_from_config` and the `WeightSyncer` that gives it the
    trainer's weights, through the run's route, chosen once here: the server is started for it
    (vLLM's nccl) and the syncer sends through it, disk as the fallback."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    route = weight_route_from_config(cfg, cuda_available)
    server = server_manager_from_config(
        cfg,
        model_dir,
        run_dir,
        cuda_available=cuda_available,
        lora_dir=lora_dir,
        weight_transfer=route.name,
    )
    return server, WeightSyncer.for_server(server, route, cfg.generation.weight_sync)  # type: ignore[arg-type]
