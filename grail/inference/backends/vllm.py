"""vLLM (`vllm serve`, OpenAI-compatible) as a rollout server; facts in docs/protocols.md.

- `--logprobs-mode processed_logprobs`: the behaviour log-probability is then
  log softmax(logits / T) after top-k/top-p, which is what the trainer computes when sampling with
  top_p = 1 and no top-k (vLLM's default, raw_logprobs, ignores the temperature);
- `--generation-config vllm`: the model's generation_config.json must not fill in sampling
  fields (the client sends all of them anyway).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from grail.inference.backends.gpu import GpuServer, server_error
from grail.inference.process import WeightSyncError

logger = logging.getLogger(__name__)


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
                    f"vLLM POST {route} failed with HTTP {status}: {server_error(body)}"
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
