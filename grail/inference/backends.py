"""vLLM and SGLang as rollout servers, behind the same `ServerManager` as the built-in server.

What a backend adds to `ServerManager` is its command line, its environment and its in-place
weight reload; readiness, logs, death detection, restart fallback and shutdown are shared. Facts
about each server are in PROTOCOLS.md; what was checked against the installed packages is noted
where it matters.

Why the command lines look the way they do (each flag is there for a reason a user can see):
- the model directory is the trainer's initial checkpoint, so server and trainer start from
  identical weights; `--host 127.0.0.1` because vLLM's reload routes are unauthenticated;
- `--dtype bfloat16` by default: the trainer computes in bf16 autocast, and vLLM's `auto` would
  serve a float32 checkpoint (what `save_pretrained` of an fp32 master copy writes) in float16;
- memory fraction: `DEFAULT_MEMORY_FRACTION_SHARED` (0.30) when `gpu.strategy=single` puts the
  trainer on the same GPU, `DEFAULT_MEMORY_FRACTION_OWN_GPU` (0.85) when the server has its own;
- vLLM `--logprobs-mode processed_logprobs`: the behaviour log-probability is then
  log softmax(logits / T) after top-k/top-p, which is what the trainer computes when sampling with
  top_p = 1 and no top-k (vLLM's default, raw_logprobs, ignores the temperature);
  `--generation-config vllm`: the model's generation_config.json must not fill in sampling
  fields (the client sends all of them anyway);
- SGLang returns log softmax(logits / T) by default; `SGLANG_RETURN_ORIGINAL_LOGPROB` (which
  would return log softmax(logits)) is removed from the server's environment.

Rollouts for every backend go through the one `CompletionClient` (`/v1/completions`, token ids in,
`return_token_ids`); the small differences in the answers are handled by the client's `backend`
argument (`ServerManager.kind`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grail.inference.servers import (
    BuiltinServer,
    ServerError,
    ServerManager,
    ServerStartError,
    WeightSyncError,
)

if TYPE_CHECKING:
    from grail.config import Config

logger = logging.getLogger(__name__)

BACKENDS = ("builtin", "vllm", "sglang")
# Memory fraction for the server's weights + KV cache: small when the trainer (weights, gradients,
# AdamW state, activations) shares the GPU, large when the server has a GPU to itself.
DEFAULT_MEMORY_FRACTION_SHARED = 0.30
DEFAULT_MEMORY_FRACTION_OWN_GPU = 0.85
# Loading a multi-billion-parameter model, compiling and capturing CUDA graphs takes minutes.
DEFAULT_START_TIMEOUT_S = 900.0
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
        start_timeout: float = DEFAULT_START_TIMEOUT_S,
        extra_args: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(
            model_path,
            served_model_name,
            log_dir=log_dir,
            device=device,
            dtype=dtype,
            start_timeout=start_timeout,
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
            if flag in self.owned_flags:
                raise ValueError(
                    f"extra_args must not set {flag}: the harness sets it "
                    f"({self.owned_flags[flag]})"
                )
            if flag in self.forbidden_flags:
                raise ValueError(f"extra_args must not set {flag}: {self.forbidden_flags[flag]}")
        self.gpu_memory_fraction = float(gpu_memory_fraction)
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.seed = seed
        self.weight_version: str | None = None
        #: seconds per step of the last in-place update, for metrics and diagnosis
        self.last_sync_timings: dict[str, float] = {}

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
        try:
            self.check_alive()
        except ServerError as exc:
            raise WeightSyncError(f"cannot update weights: {exc}") from exc
        return path

    def _updated(self, path: Path, version: str, t0: float) -> float:
        self.model_path = path  # recover() and restarts start from the newest weights
        self.weight_version = version
        seconds = time.perf_counter() - t0
        steps = ", ".join(f"{k} {v:.2f} s" for k, v in self.last_sync_timings.items())
        logger.info(
            "loaded weights %s into the %s server in %.2f s (%s)",
            version,
            self.kind,
            seconds,
            steps,
        )
        return seconds


def _message(body: Any) -> str:
    if isinstance(body, dict):
        for key in ("message", "error", "detail"):
            value = body.get(key)
            if value:
                if isinstance(value, dict) and value.get("message"):
                    return str(value["message"])
                return str(value)
    return repr(body)[:500]


# --------------------------------------------------------------------------------------------
# vLLM


class VLLMServer(GpuServer):
    """`vllm serve` (OpenAI-compatible) on one or more GPUs (tensor parallel over all of them).

    In-place weight reload needs the server's dev-mode routes (env `VLLM_SERVER_DEV_MODE=1`, set
    here): pause (waiting for in-flight requests) → collective_rpc `reload_weights` from the
    checkpoint directory → reset the prefix cache (stale KV entries computed with the old weights
    must go) → resume, the last in a `finally` so the server never stays paused.
    """

    kind = "vllm"
    package = "vllm"
    extra = "vllm"
    # `vllm serve` is the console script for this module's main(); running the module keeps the
    # server on this venv's Python without relying on PATH.
    server_module = "vllm.entrypoints.cli.main"
    #: reset_prefix_cache answers success=false while requests still hold cache blocks
    reset_attempts = 5
    reset_backoff_s = 0.2
    owned_flags = {
        "--model": "the model directory",
        "--host": "always 127.0.0.1",
        "--port": "picked free, kept across restarts",
        "--served-model-name": "the served model name",
        "--dtype": "model.dtype",
        "--gpu-memory-utilization": "generation.gpu_memory_fraction",
        "--max-model-len": "generation.max_model_len",
        "--max-num-seqs": "generation.max_num_seqs",
        "--seed": "seed",
        "--generation-config": "always 'vllm': the model's defaults must not fill sampling fields",
        "--logprobs-mode": "always processed_logprobs, what the trainer computes",
        "--tensor-parallel-size": "the number of GPUs in the server's device",
        "--api-key": "the api_key argument",
    }

    def server_args(self) -> list[str]:
        args = [
            str(self.model_path),
            "--host", self.host,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            "--gpu-memory-utilization", f"{self.gpu_memory_fraction:g}",
            "--generation-config", "vllm",
            "--logprobs-mode", "processed_logprobs",
        ]  # fmt: skip
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_seqs is not None:
            args += ["--max-num-seqs", str(self.max_num_seqs)]
        if self.seed is not None:
            args += ["--seed", str(self.seed)]
        if len(self.gpu_ids) > 1:
            args += ["--tensor-parallel-size", str(len(self.gpu_ids))]
        if self.api_key:
            args += ["--api-key", self.api_key]
        return args + self.extra_args

    def build_command(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, "serve", *self.server_args()]

    def extra_env(self) -> dict[str, str]:
        return {"VLLM_SERVER_DEV_MODE": "1"}

    def update_weights(
        self, checkpoint_dir: str | os.PathLike[str], weight_version: str | None = None
    ) -> float:
        """pause?mode=wait → collective_rpc reload_weights → reset_prefix_cache → resume.

        Returns the seconds taken; `last_sync_timings` has each step. Any failure is a
        `WeightSyncError` (the caller falls back to a restart); resume is attempted whatever
        happened after a successful pause.
        """
        path = self._prepare_update(checkpoint_dir)
        version = weight_version or path.name
        timings: dict[str, float] = {}
        self.last_sync_timings = timings
        t0 = time.perf_counter()

        def step(name: str, route: str, **kwargs: Any) -> Any:
            t = time.perf_counter()
            status, body = self._control(route, **kwargs)
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
            if status == 404:
                raise WeightSyncError(
                    f"vLLM has no route POST {route} (HTTP 404): the reload routes need "
                    "VLLM_SERVER_DEV_MODE=1 in the server's environment and vLLM >= 0.11"
                )
            if status != 200:
                raise WeightSyncError(
                    f"vLLM POST {route} failed with HTTP {status}: {_message(body)}"
                )
            return body

        step("pause", "/pause", params={"mode": "wait"})
        failure: BaseException | None = None
        try:
            step(
                "reload",
                "/collective_rpc",
                body={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            )
            for attempt in range(1, self.reset_attempts + 1):
                body = step("reset_prefix_cache", "/reset_prefix_cache")
                if isinstance(body, dict) and body.get("success") is True:
                    break
                if attempt == self.reset_attempts:
                    raise WeightSyncError(
                        f"vLLM could not reset its prefix cache after {attempt} attempts "
                        f"(last answer: {body!r}); rollouts would mix old and new weights"
                    )
                time.sleep(self.reset_backoff_s * 2 ** (attempt - 1))
        except BaseException as exc:
            failure = exc
            raise
        finally:
            try:
                step("resume", "/resume")
            except WeightSyncError as exc:
                if failure is None:
                    raise
                logger.error("could not resume vLLM after a failed reload: %s", exc)
        return self._updated(path, version, t0)


# --------------------------------------------------------------------------------------------
# SGLang


class SGLangServer(GpuServer):
    """`python -m sglang.launch_server` on one or more GPUs (tensor parallel over all of them).

    In-place weight reload is one call, `/update_weights_from_disk`, which waits for running
    requests and flushes the prefix cache itself (it fails rather than keep a stale cache).
    """

    kind = "sglang"
    package = "sglang"
    extra = "sglang"
    # `sglang serve` is the newer spelling; this module is what it runs for a language model and
    # still works (with a deprecation warning in the log).
    server_module = "sglang.launch_server"
    owned_flags = {
        "--model-path": "the model directory",
        "--host": "always 127.0.0.1",
        "--port": "picked free, kept across restarts",
        "--served-model-name": "the served model name",
        "--dtype": "model.dtype",
        "--mem-fraction-static": "generation.gpu_memory_fraction",
        "--context-length": "generation.max_model_len",
        "--max-running-requests": "generation.max_num_seqs",
        "--random-seed": "seed",
        "--tp-size": "the number of GPUs in the server's device",
        "--api-key": "the api_key argument",
    }
    forbidden_flags = {
        "--enable-deterministic-inference": (
            "with it SGLang samples from the request's seed alone, and the n samples of one "
            "request share that seed, so every sample of a GRPO group would be identical"
        ),
    }

    def __init__(self, model_path: str | os.PathLike[str], served_model_name: str, **kwargs):
        if ":" in served_model_name:
            # SGLang reads "base:adapter" in the request's model field as a LoRA adapter name.
            raise ValueError(
                f"served_model_name must not contain ':' for SGLang, got {served_model_name!r}"
            )
        super().__init__(model_path, served_model_name, **kwargs)

    def server_args(self) -> list[str]:
        args = [
            "--model-path", str(self.model_path),
            "--host", self.host,
            "--port", str(self.port),
            "--served-model-name", self.served_model_name,
            "--mem-fraction-static", f"{self.gpu_memory_fraction:g}",
        ]  # fmt: skip
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if self.max_model_len is not None:
            args += ["--context-length", str(self.max_model_len)]
        if self.max_num_seqs is not None:
            args += ["--max-running-requests", str(self.max_num_seqs)]
        if self.seed is not None:
            args += ["--random-seed", str(self.seed)]
        if len(self.gpu_ids) > 1:
            args += ["--tp-size", str(len(self.gpu_ids))]
        if self.api_key:
            args += ["--api-key", self.api_key]
        return args + self.extra_args

    def build_command(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, *self.server_args()]

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        # It would make the returned log-probabilities ignore the temperature.
        env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        return env

    def update_weights(
        self, checkpoint_dir: str | os.PathLike[str], weight_version: str | None = None
    ) -> float:
        """POST /update_weights_from_disk {model_path, weight_version}; return the seconds.

        HTTP 400 or `success: false` is a `WeightSyncError` carrying SGLang's message. SGLang
        renames its served model to the path afterwards; requests keep using our own name,
        which its completion route does not check.
        """
        path = self._prepare_update(checkpoint_dir)
        version = weight_version or path.name
        self.last_sync_timings = {}
        t0 = time.perf_counter()
        status, body = self._control(
            "/update_weights_from_disk",
            body={"model_path": str(path), "weight_version": version},
        )
        self.last_sync_timings["reload"] = time.perf_counter() - t0
        if status != 200 or not isinstance(body, dict) or body.get("success") is not True:
            raise WeightSyncError(
                f"SGLang refused weights from {path} (HTTP {status}): {_message(body)}"
            )
        return self._updated(path, version, t0)


# --------------------------------------------------------------------------------------------
# factory


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
) -> ServerManager:
    """The `ServerManager` for `backend` ("builtin", "vllm" or "sglang").

    gpu_memory_fraction None picks `default_memory_fraction(shares_gpu_with_trainer)`;
    start_timeout None picks 120 s for the built-in server and `DEFAULT_START_TIMEOUT_S` for the
    GPU servers; dtype None means bfloat16 for the GPU servers and the server's default for the
    built-in one. Memory fraction, max_model_len and max_num_seqs apply to vLLM/SGLang only;
    the built-in server ignores them. `threads` applies to the built-in server on CPU.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    common: dict[str, Any] = {
        "log_dir": log_dir,
        "device": device,
        "extra_args": extra_args,
        "api_key": api_key,
        "port": port,
        "env": env,
    }
    if backend == "builtin":
        return BuiltinServer(
            model_path,
            served_model_name,
            threads=threads,
            start_timeout=120.0 if start_timeout is None else start_timeout,
            dtype=dtype,
            **common,
        )
    cls = VLLMServer if backend == "vllm" else SGLangServer
    if gpu_memory_fraction is None:
        gpu_memory_fraction = default_memory_fraction(shares_gpu_with_trainer)
    return cls(
        model_path,
        served_model_name,
        start_timeout=DEFAULT_START_TIMEOUT_S if start_timeout is None else start_timeout,
        dtype="bfloat16" if dtype is None else dtype,
        gpu_memory_fraction=gpu_memory_fraction,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        seed=seed,
        **common,
    )


def server_manager_from_config(
    cfg: Config,
    model_dir: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    cuda_available: bool | None = None,
    served_model_name: str = "policy",
) -> ServerManager:
    """The server `grail-train` runs for `cfg`: backend, GPU placement and sizes from the config.

    Placement: the server gets `gpu.server_gpu`; with `gpu.strategy=single` the trainer shares
    that GPU, so the memory fraction defaults low. The built-in server runs on CPU when CUDA is
    not available; vLLM and SGLang need CUDA and say so.
    """
    from grail.config import GenerationConfig, cpu_threads

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
        threads = cpu_threads(cfg)[1]
    start_timeout = gen.start_timeout_s
    if gen.backend != "builtin" and start_timeout == GenerationConfig.start_timeout_s:
        # `generation.backend=vllm` without the preset keeps the built-in server's default,
        # which is far too short for loading a real model; an explicit value is respected.
        start_timeout = DEFAULT_START_TIMEOUT_S
    model_dtype = cfg.model.dtype
    return make_server_manager(
        gen.backend,
        model_dir,
        served_model_name,
        log_dir=Path(run_dir) / "logs",
        device=f"cuda:{cfg.gpu.server_gpu}" if cuda_available else "cpu",
        threads=threads,
        start_timeout=start_timeout,
        dtype=None if model_dtype == "auto" else model_dtype,
        gpu_memory_fraction=gen.gpu_memory_fraction,
        shares_gpu_with_trainer=cfg.gpu.strategy == "single",
        max_model_len=gen.max_model_len,
        max_num_seqs=gen.max_num_seqs,
        seed=cfg.seed,
        extra_args=list(gen.extra_args),
    )
