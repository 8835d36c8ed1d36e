"""The rollout servers behind `ServerManager` (grail/inference/process.py): the built-in server
(`builtin.py`), vLLM (`vllm.py`) and SGLang (`sglang.py`), with what the last two share in
`gpu.py`; and `make_server_manager`, which picks and sizes one from explicit arguments (the run's
config is turned into them in grail/train/components.py, with the weight route its syncs take).

Rollouts for every backend go through the one `CompletionClient` (`/v1/completions`, token ids in,
`return_token_ids`); the small differences in the answers are handled by the client's `backend`
argument (`ServerManager.kind`). The server facts the code relies on are in docs/protocols.md.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from grail.core.choices import BACKENDS
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.backends.gpu import default_memory_fraction
from grail.inference.backends.sglang import SGLangServer
from grail.inference.backends.vllm import VLLMServer
from grail.inference.process import ServerManager

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
    reproducible: bool = True,
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
    server on CPU, and `reproducible` False starts it with its CPU's own kernels
    (`--no-reproducible`).

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
        return BuiltinServer(
            model_path,
            served_model_name,
            threads=threads,
            dtype=dtype,
            reproducible=reproducible,
            **common,
        )
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
