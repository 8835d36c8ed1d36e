"""What vLLM and SGLang share as rollout servers: `GpuServer`, the memory-fraction defaults and
the checks on their command lines. Readiness, logs, death detection, restart fallback and
shutdown are `ServerManager`'s (grail/inference/process.py); the server facts relied on here are
in docs/protocols.md.

Why the command lines look the way they do (each flag is there for a reason a user can see):
- the model directory is the trainer's initial checkpoint, so server and trainer start from
  identical weights; `--host 127.0.0.1` because vLLM's reload routes are unauthenticated;
- `--dtype bfloat16` by default: the trainer computes in bf16 autocast, and vLLM's `auto` would
  serve a float32 checkpoint (what `save_pretrained` of an fp32 master copy writes) in float16;
- memory fraction: `DEFAULT_MEMORY_FRACTION_SHARED` (0.30) when `gpu.strategy=single` puts the
  trainer on the same GPU, `DEFAULT_MEMORY_FRACTION_OWN_GPU` (0.85) when the server has its own;
- the flags that fix what the log-probabilities mean are each backend's own (vllm.py, sglang.py);
- LoRA (`lora_dir` set): the server serves the base model at `model_path` with the adapter in
  `lora_dir` registered at start under one fixed name (`lora_name`), and an adapter sync reloads
  that name from `lora_dir`; the flags, routes and why the name stays fixed are in vllm.py,
  sglang.py and docs/protocols.md ("LoRA adapters").
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from grail.inference.backends.nccl import DEFAULT_TIMEOUT_S as DEFAULT_NCCL_TIMEOUT_S
from grail.inference.backends.nccl import NcclSender
from grail.inference.completions import error_message
from grail.inference.errors import ServerError, ServerStartError, WeightSyncError
from grail.inference.process import ServerManager

logger = logging.getLogger(__name__)

# Memory fraction for the server's weights + KV cache: small when the trainer (weights, gradients,
# AdamW state, activations) shares the GPU, large when the server has a GPU to itself.
DEFAULT_MEMORY_FRACTION_SHARED = 0.30
DEFAULT_MEMORY_FRACTION_OWN_GPU = 0.85
SERVER_DTYPES = ("auto", "bfloat16", "float16", "float32")


def default_memory_fraction(shares_gpu_with_trainer: bool) -> float:
    return (
        DEFAULT_MEMORY_FRACTION_SHARED
        if shares_gpu_with_trainer
        else DEFAULT_MEMORY_FRACTION_OWN_GPU
    )


def _flag_name(arg: str) -> str | None:
    """'--max_model_len=4' -> '--max-model-len'; None for values (both parsers accept '_')."""
    if not arg.startswith("--"):
        return None
    return "--" + arg[2:].split("=", 1)[0].replace("_", "-")


class GpuServer(ServerManager):
    """What vLLM and SGLang share: a GPU, an installed package, a command line built from the
    config with flags the harness owns, and a timed HTTP control sequence for weight reloads."""

    #: the Python package that must be importable in this environment
    package: str = ""
    #: `uv sync --extra NAME` installs it
    extra: str = ""
    #: flag -> config key that sets it; such a flag in extra_args is rejected (it would silently
    #: override what the harness relies on, or what the config says)
    owned_flags: Mapping[str, str] = {}
    #: extra flags that break rollouts, -> why
    forbidden_flags: Mapping[str, str] = {}
    #: flags the harness sets when it serves a LoRA adapter (`lora_dir`) -> what sets them; such
    #: a flag in extra_args is rejected then
    lora_flags: Mapping[str, str] = {}
    # Loading a multi-billion-parameter model, compiling and capturing CUDA graphs takes minutes.
    default_start_timeout_s = 900.0
    # nccl: its workers receive a broadcast from the trainer when it has its own GPU
    weight_routes = ("disk", "nccl")

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        served_model_name: str,
        *,
        log_dir: str | os.PathLike[str],
        device: str,
        dtype: str | None = "bfloat16",
        gpu_memory_fraction: float = DEFAULT_MEMORY_FRACTION_OWN_GPU,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        seed: int | None = None,
        extra_args: Sequence[str] = (),
        weight_transfer: str = "disk",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model_path,
            served_model_name,
            log_dir=log_dir,
            device=device,
            dtype=dtype,
            extra_args=extra_args,
            **kwargs,
        )
        name = type(self).__name__
        if not self.gpu_ids:
            raise ValueError(
                f"{name} serves on CUDA GPUs, got device={device!r}; on a CPU machine use "
                "generation.backend=builtin"
            )
        if dtype is not None and dtype not in SERVER_DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(SERVER_DTYPES)}, got {dtype!r}")
        if isinstance(gpu_memory_fraction, bool) or not 0 < gpu_memory_fraction < 1:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1) (generation.gpu_memory_fraction), "
                f"got {gpu_memory_fraction!r}"
            )
        for key, value in (("max_model_len", max_model_len), ("max_num_seqs", max_num_seqs)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{key} must be an int >= 1 or None, got {value!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        for arg in self.extra_args:
            flag = _flag_name(arg)
            if flag is None:  # a value, not a flag
                continue
            if flag in self.owned_flags:
                raise ValueError(
                    f"extra_args must not set {flag}: the harness sets it "
                    f"({self.owned_flags[flag]})"
                )
            if flag in self.forbidden_flags:
                raise ValueError(f"extra_args must not set {flag}: {self.forbidden_flags[flag]}")
            if self.lora_dir is not None and flag in self.lora_flags:
                raise ValueError(
                    f"extra_args must not set {flag}: the harness sets it when it serves the "
                    f"LoRA adapter ({self.lora_flags[flag]})"
                )
        rank = self.lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
            raise ValueError(f"lora_rank must be an int >= 1 or None, got {self.lora_rank!r}")
        self.gpu_memory_fraction = float(gpu_memory_fraction)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        if weight_transfer not in self.weight_routes:
            routes = " or ".join(map(repr, self.weight_routes))
            raise ValueError(f"{name} takes weight_transfer {routes}, got {weight_transfer!r}")
        #: the run's weight route, which the server must be started for (vLLM's
        #: --weight-transfer-config; grail/inference/weights/nccl.py sends over it)
        self.weight_transfer = weight_transfer
        self.weight_version: str | None = None
        #: seconds per step of the last in-place update, for metrics and diagnosis
        self.last_sync_timings: dict[str, float] = {}
        # The NCCL group of weight_transfer=nccl (nccl.py), made at the first sync of each
        # server process (`_sender_pid`): a restarted server has left the old one.
        self._sender: NcclSender | None = None
        self._sender_pid: int | None = None

    @property
    def nccl_timeout_s(self) -> float:
        """How long a join, a broadcast or the server's side of either may take: at most
        `weight_sync_timeout`, and a fleet's deadline (`call_deadline_s`)."""
        return self.call_timeout(min(self.weight_sync_timeout, DEFAULT_NCCL_TIMEOUT_S))

    # -- LoRA ---------------------------------------------------------------------------------

    @property
    def lora_name(self) -> str | None:
        """The name the adapter is served under, None without `lora_dir`.

        Fixed for the server's life: an adapter sync loads the new adapter under the same name
        (vLLM in place, SGLang unload + load), so a client made once keeps naming it."""
        return None if self.lora_dir is None else f"{self.served_model_name}-lora"

    def adapter_rank(self) -> int:
        """The largest LoRA rank the server must make room for: `lora_rank`, or the largest rank
        in `lora_dir`/adapter_config.json (its `r` and any `rank_pattern` entry) if larger.

        Raises `ServerStartError` when neither says (the start fails clearly rather than the
        server refusing the adapter later)."""
        assert self.lora_dir is not None
        ranks = [] if self.lora_rank is None else [self.lora_rank]
        config_path = self.lora_dir / "adapter_config.json"
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
                ranks += [int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                if self.lora_rank is None:
                    raise ServerStartError(
                        f"cannot read the LoRA rank from {config_path}: {exc!r}"
                    ) from exc
        if not ranks:
            raise ServerStartError(
                f"the LoRA rank is unknown: lora_rank is not set and {config_path} does not exist"
            )
        return max(ranks)

    # -- installation -----------------------------------------------------------------------

    def check_installed(self) -> None:
        """Raise `ServerStartError` if the backend package cannot be imported by this Python.

        Checked before spawning, so a missing extra is one clear line rather than a
        ModuleNotFoundError buried in a server log after the trainer has loaded its model."""
        if importlib.util.find_spec(self.package) is None:
            raise ServerStartError(
                f"generation.backend={self.kind} needs the '{self.package}' package, which is "
                f"not installed in this environment ({sys.executable}). Install it with "
                f"`uv sync --extra {self.extra}` (Linux with a CUDA GPU)."
            )

    def start(self) -> None:
        self.check_installed()
        super().start()

    def _prepare_update(self, checkpoint_dir: str | os.PathLike[str]) -> Path:
        path = Path(checkpoint_dir).absolute()
        if not path.is_dir():
            raise WeightSyncError(f"checkpoint directory {path} does not exist")
        if not any(path.glob("*.safetensors")):
            raise WeightSyncError(
                f"checkpoint directory {path} holds no *.safetensors file (save_pretrained with "
                "safe_serialization=True writes them)"
            )
        if self.is_adapter_sync(path) and not (path / "adapter_config.json").is_file():
            raise WeightSyncError(
                f"adapter directory {path} holds no adapter_config.json (peft's save_pretrained "
                "writes it)"
            )
        try:
            self.check_alive()
        except ServerError as exc:
            raise WeightSyncError(f"cannot update weights: {exc}") from exc
        return path

    # -- NCCL weight transfer -----------------------------------------------------------------

    def _prepare_nccl(self) -> None:
        try:
            self.check_alive()
        except ServerError as exc:
            raise WeightSyncError(f"cannot update weights: {exc}") from exc
        sender = self._sender
        if sender is not None and sender.broken is not None and self._sender_pid == self.pid:
            raise WeightSyncError(f"the NCCL group was given up: {sender.broken}")

    def _post_elsewhere(self, route: str, body: Mapping[str, Any]) -> Any:
        """POST `route` from a thread other than the control client's (the NCCL requests run
        beside the trainer's side of the same collective), with its own bounded client. Raises
        `WeightSyncError` unless the answer is 200 (and, with a `success` field, true); no answer
        within a fleet's deadline, a `ServerTimeoutError`."""
        seconds = self.nccl_timeout_s
        timeout = httpx.Timeout(seconds, connect=min(5.0, seconds))
        try:
            with httpx.Client(timeout=timeout, headers=self._headers()) as http:
                response = http.post(f"{self.root_url}{route}", json=dict(body))
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TimeoutException) and self.call_deadline_s is not None:
                raise self.missed(f"POST {route}", seconds) from exc
            raise WeightSyncError(f"POST {route} failed: {type(exc).__name__}: {exc}") from exc
        try:
            answer = response.json() if response.content else None
        except ValueError:
            answer = response.text[:500]
        refused = isinstance(answer, dict) and answer.get("success") is False
        if response.status_code != 200 or refused:
            raise WeightSyncError(
                f"{self.kind} POST {route} failed (HTTP {response.status_code}): "
                f"{server_error(answer)}"
            )
        return answer

    def close_weight_transfer(self) -> None:
        """Leave the NCCL group (this side), if one was made."""
        sender, self._sender, self._sender_pid = self._sender, None, None
        if sender is not None:
            try:
                sender.close()
            except Exception as exc:  # the group may be broken already: nothing more to free
                logger.warning("closing the NCCL weight-transfer group failed: %s", exc)

    def stop(self, timeout: float | None = None) -> None:
        self.close_weight_transfer()
        super().stop(timeout)

    def _updated(self, path: Path, version: str, t0: float) -> float:
        adapter = self.is_adapter_sync(path)
        if not adapter:
            # recover() and restarts start from the newest weights; an adapter sync leaves the
            # base there (a start loads the adapter from lora_dir, which now holds the newest)
            self.model_path = path
        self.weight_version = version
        seconds = time.perf_counter() - t0
        steps = ", ".join(f"{k} {v:.2f} s" for k, v in self.last_sync_timings.items())
        logger.info(
            "loaded %s %s into the %s server in %.2f s (%s)",
            "LoRA adapter" if adapter else "weights",
            version,
            self.kind,
            seconds,
            steps,
        )
        return seconds


def server_error(body: Any) -> str:
    """The error text in a control route's JSON answer, else the answer itself."""
    return error_message(body) or repr(body)[:500]
