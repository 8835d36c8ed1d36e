"""SGLang (`python -m sglang.launch_server`) as a rollout server; facts in docs/protocols.md.

SGLang returns log softmax(logits / T) by default, what the trainer computes;
`SGLANG_RETURN_ORIGINAL_LOGPROB` (which would return log softmax(logits)) is removed from the
server's environment.
"""

from __future__ import annotations

import os
import sys
import time

from grail.inference.backends.gpu import GpuServer, server_error
from grail.inference.process import WeightSyncError


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
                f"SGLang refused weights from {path} (HTTP {status}): {server_error(body)}"
            )
        return self._updated(path, version, t0)
