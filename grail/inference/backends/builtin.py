"""The built-in server (`grail-serve`) as a rollout server: its command line, its in-place
weight reload (`POST /update_weights_from_disk`, SGLang's shape; see docs/protocols.md) and its
zero-copy one (`POST /update_weights_from_tensor`, the shared weight route)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from grail.inference.builtin import API_KEY_ENV
from grail.inference.errors import ServerError, WeightSyncError
from grail.inference.process import ServerManager

logger = logging.getLogger(__name__)


class BuiltinServer(ServerManager):
    """The harness's own FastAPI server (`grail.inference.builtin.server`), CPU or one GPU.

    With `api_key` the server needs it on every route but `/health`; `make_server_manager` (and
    so `grail-train`) always gives it a random one. The key goes to the server in its environment
    (`GRAIL_API_KEY`, readable by this user and root only), never on its command line, which
    `ps` shows every user of the machine."""

    kind = "builtin"
    server_module = "grail.inference.builtin.server"
    # One HF model loaded by transformers: no compilation, no CUDA graphs.
    default_start_timeout_s = 120.0
    # shared: it reads the trainer's tensors through handles when on the trainer's device
    weight_routes = ("disk", "shared")

    def __init__(self, *args, reproducible: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reproducible = reproducible  # grail-serve pins its kernels unless told otherwise
        if len(self.gpu_ids) > 1:
            raise ValueError(f"the built-in server runs on one device, got {self.device!r}")
        self.weight_version: str | None = None

    def server_args(self) -> list[str]:
        # The child sees only its own GPU (CUDA_VISIBLE_DEVICES), which it addresses as cuda:0.
        args = [
            "--model", str(self.model_path),
            "--served-model-name", self.served_model_name,
            "--host", self.host,
            "--port", str(self.port),
            "--device", "cuda:0" if self.gpu_ids else "cpu",
        ]  # fmt: skip
        if self.dtype is not None:
            args += ["--dtype", self.dtype]
        if self.threads is not None:
            args += ["--threads", str(self.threads)]
        if self.lora_dir is not None:
            args += ["--lora-dir", str(self.lora_dir)]
        if not self.reproducible:
            args.append("--no-reproducible")
        return args + self.extra_args

    def build_command(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, *self.server_args()]

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        # Ours only: a GRAIL_API_KEY this process inherited is not the key the manager sends.
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key
        return env

    def served_dtype(self) -> str:
        """`dtype`, or what the engine picks without one: float32 on CPU, bfloat16 on CUDA
        (grail/inference/builtin/engine.py `resolve_dtype`)."""
        return self.dtype or ("bfloat16" if self.gpu_ids else "float32")

    def update_weights_from_tensor(self, body: dict[str, Any]) -> float:
        """POST /update_weights_from_tensor with `body`, handles to the trainer's buffers and
        the `weight_version` (the shared route builds it: grail/inference/weights/shared.py
        `tensor_payload`); return seconds. Any failure is a `WeightSyncError`."""
        self._check_running()
        t0 = time.perf_counter()
        status, answer = self._control("/update_weights_from_tensor", body=body)
        self._check_answer("/update_weights_from_tensor", status, answer, "the trainer's tensors")
        self.weight_version = body["weight_version"]
        seconds = time.perf_counter() - t0
        logger.info("gave the builtin server weights %s in %.3f s", self.weight_version, seconds)
        return seconds

    def _check_running(self) -> None:
        if not self.is_alive():
            try:
                self.check_alive()
            except ServerError as exc:
                raise WeightSyncError(f"cannot update weights: {exc}") from exc

    @staticmethod
    def _check_answer(route: str, status: int, body: object, what: str) -> None:
        if not isinstance(body, dict):
            raise WeightSyncError(
                f"POST {route} answered HTTP {status} with a non-JSON-object body: {body!r}"
            )
        if status != 200 or body.get("success") is not True:
            message = body.get("message") or body.get("detail") or body
            raise WeightSyncError(f"server refused {what} (HTTP {status}): {message}")

    def update_weights(
        self, checkpoint_dir: str | os.PathLike[str], weight_version: str | None = None
    ) -> float:
        """POST /update_weights_from_disk with the absolute checkpoint path; return seconds.

        `weight_version` labels the weights (default: the directory name) so responses and logs
        can be keyed by version rather than by path.
        """
        path = Path(checkpoint_dir).absolute()
        if not path.is_dir():
            raise WeightSyncError(f"checkpoint directory {path} does not exist")
        self._check_running()
        version = weight_version or path.name
        t0 = time.perf_counter()
        status, body = self._control(
            "/update_weights_from_disk", body={"model_path": str(path), "weight_version": version}
        )
        self._check_answer("/update_weights_from_disk", status, body, f"weights from {path}")
        if not self.is_adapter_sync(path):  # an adapter leaves the base being served as it is
            self.model_path = path
        self.weight_version = version
        seconds = time.perf_counter() - t0
        logger.info("loaded weights %s into the builtin server in %.2f s", version, seconds)
        return seconds
