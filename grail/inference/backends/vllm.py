"""vLLM (`vllm serve`, OpenAI-compatible) as a rollout server; facts in docs/protocols.md.

- `--logprobs-mode processed_logprobs`: the behaviour log-probability is then
  log softmax(logits / T) after top-k/top-p, which is what the trainer computes when sampling with
  top_p = 1 and no top-k (vLLM's default, raw_logprobs, ignores the temperature);
- `--generation-config vllm`: the model's generation_config.json must not fill in sampling
  fields (the client sends all of them anyway).

LoRA (`lora_dir` set), from vLLM 0.33's source (details and line numbers in docs/protocols.md):
- `--lora-modules '{"name", "path", "base_model_name"}' --enable-lora --max-lora-rank R
  --max-loras 1`: the adapter in lora_dir is loaded at start under `lora_name`, so a
  restart (the fallback of a failed sync, or recovery) comes back serving the newest adapter;
  R is the adapter's rank rounded up to one of vLLM's allowed values (`VLLM_LORA_RANKS`);
- env `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` registers `POST /v1/load_lora_adapter`;
- requests name the adapter (`model_name` is `lora_name`); an adapter sync reloads it under the
  same name with `load_inplace: true` (without it vLLM refuses a loaded name), inside the same
  pause/resume as a full reload: in flight requests finish on the old adapter, none starts
  until the new one is in, and the prefix cache is reset (its block hashes key a LoRA by name
  and path, both unchanged, so blocks of the old adapter would otherwise be reused).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from grail.inference.backends.gpu import GpuServer, server_error
from grail.inference.backends.nccl import VLLMSender, dtype_name
from grail.inference.errors import ServerStartError, WeightSyncError
from grail.inference.weights.shared import FlatWeights

logger = logging.getLogger(__name__)

#: the values `--max-lora-rank` accepts (vllm/config/lora.py, `MaxLoRARanks`, vLLM 0.33)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: the runtime adapter load route (vllm/entrypoints/serve/lora/api_router.py)
LOAD_LORA_ROUTE = "/v1/load_lora_adapter"


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM accepts that holds an adapter of rank `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(
        f"LoRA rank {rank} is above the largest --max-lora-rank vLLM accepts "
        f"({VLLM_LORA_RANKS[-1]}; allowed: {', '.join(map(str, VLLM_LORA_RANKS))}): lower "
        "model.lora.r, or serve with generation.backend=sglang"
    )


class VLLMServer(GpuServer):
    """`vllm serve` (OpenAI-compatible) on one or more GPUs (tensor parallel over all of them).

    In-place weight reload needs the server's dev-mode routes (env `VLLM_SERVER_DEV_MODE=1`, set
    here): pause (waiting for in-flight requests) → collective_rpc `reload_weights` from the
    checkpoint directory → reset the prefix cache (stale KV entries computed with the old weights
    must go) → resume, the last in a `finally` so the server never stays paused. An adapter sync
    (LoRA) is the same sequence with `/v1/load_lora_adapter` (in place) as the load step.
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
        "--api-key": "the api_key argument, passed as VLLM_API_KEY (off the command line)",
        "--weight-transfer-config": "generation.weight_transfer (nccl)",
    }
    lora_flags = {
        "--enable-lora": "model.lora.enabled",
        "--max-lora-rank": "model.lora.r, rounded up to a rank vLLM accepts",
        "--max-loras": "always 1: one adapter, reloaded in place",
        "--lora-modules": "the adapter directory the trainer writes",
    }

    def __init__(self, model_path: str | os.PathLike[str], served_model_name: str, **kwargs: Any):
        super().__init__(model_path, served_model_name, **kwargs)
        if self.lora_dir is not None and self.lora_rank is not None:
            vllm_max_lora_rank(self.lora_rank)  # fail now, not when the server starts

    @property
    def model_name(self) -> str:
        """The adapter's name when serving one (vLLM routes a request to an adapter by its name
        in `model`; the base's name would generate without it), else the served model name."""
        return self.lora_name or self.served_model_name

    def lora_args(self) -> list[str]:
        """The flags that serve the adapter in `lora_dir` from the start (none without it)."""
        if self.lora_dir is None:
            return []
        try:
            rank = vllm_max_lora_rank(self.adapter_rank())
        except ValueError as exc:
            raise ServerStartError(str(exc)) from exc
        module = {
            "name": self.lora_name,
            "path": str(self.lora_dir),
            "base_model_name": self.served_model_name,
        }
        # --lora-modules takes one or more values: a flag must follow it
        return [
            "--lora-modules", json.dumps(module),
            "--enable-lora",
            "--max-lora-rank", str(rank),
            "--max-loras", "1",
        ]  # fmt: skip

    def lora_load_body(self, path: os.PathLike[str]) -> dict[str, Any]:
        """The JSON of `POST /v1/load_lora_adapter` that reloads the adapter from `path` under
        its name (vLLM refuses a loaded name without `load_inplace`)."""
        return {"lora_name": self.lora_name, "lora_path": str(path), "load_inplace": True}

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
        if self.weight_transfer == "nccl":
            # registers the NCCL weight-transfer engine behind /init_weight_transfer_engine
            args += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        return args + self.lora_args() + self.extra_args

    def build_command(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, "serve", *self.server_args()]

    def extra_env(self) -> dict[str, str]:
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if self.lora_dir is not None:
            # registers /v1/load_lora_adapter (vllm/envs.py reads "1" or "true", any case)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return env

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        # vLLM takes its key from VLLM_API_KEY when --api-key is absent (api_server.py: `args.
        # api_key or envs.VLLM_API_KEY`): the key stays off the command line, which `ps` shows
        # every user. One this process inherited is dropped: the server's key is the one the
        # harness sends.
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

    def update_weights(
        self, checkpoint_dir: str | os.PathLike[str], weight_version: str | None = None
    ) -> float:
        """pause?mode=wait → collective_rpc reload_weights → reset_prefix_cache → resume; for an
        adapter sync (`lora_dir`), load_lora_adapter in place instead of reload_weights.

        Returns the seconds taken; `last_sync_timings` has each step. Any failure is a
        `WeightSyncError` (the caller falls back to a restart); resume is attempted whatever
        happened after a successful pause.
        """
        path = self._prepare_update(checkpoint_dir)
        version = weight_version or path.name
        t0 = time.perf_counter()
        adapter = self.is_adapter_sync(path)

        def load() -> None:
            if adapter:
                # Same name, same lora_int_id, re-read from lora_dir; vLLM loads the new adapter
                # before dropping the old one, so a refused adapter leaves the old one serving.
                self._step("load_adapter", LOAD_LORA_ROUTE, body=self.lora_load_body(path))
            else:
                body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
                self._step("reload", "/collective_rpc", body=body)

        self._paused(load)
        return self._updated(path, version, t0)

    def _step(self, name: str, route: str, **kwargs: Any) -> Any:
        """POST a control route, timed into `last_sync_timings`; the decoded answer. Anything but
        200 is a `WeightSyncError` naming the route and vLLM's message."""
        t = time.perf_counter()
        status, body = self._control(route, **kwargs)
        timings = self.last_sync_timings
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t
        # vLLM answers 404 for an adapter it cannot find too, with an OpenAI error body.
        if status == 404 and route == LOAD_LORA_ROUTE and body == {"detail": "Not Found"}:
            raise WeightSyncError(
                f"vLLM has no route POST {route} (HTTP 404): it needs "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in the server's environment"
            )
        if status == 404 and route != LOAD_LORA_ROUTE:
            raise WeightSyncError(
                f"vLLM has no route POST {route} (HTTP 404): the reload routes need "
                "VLLM_SERVER_DEV_MODE=1 in the server's environment and vLLM >= 0.11"
            )
        if status != 200:
            raise WeightSyncError(
                f"vLLM POST {route} failed with HTTP {status}: {server_error(body)}"
            )
        return body

    def _paused(self, load: Callable[[], None]) -> None:
        """pause?mode=wait → `load()` → reset_prefix_cache (retried while requests hold blocks)
        → resume, the last whatever happened after the pause (unless the server missed its
        fleet's deadline: it is restarted): in-flight requests finish on the old weights, none
        starts until the new ones are in, and no cached block of the old weights is reused."""
        self.last_sync_timings = {}
        self._step("pause", "/pause", params={"mode": "wait"})
        failure: BaseException | None = None
        try:
            load()
            for attempt in range(1, self.reset_attempts + 1):
                body = self._step("reset_prefix_cache", "/reset_prefix_cache")
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
            if not self.missed_deadline(failure):  # a hung fleet server restarts: no more calls
                try:
                    self._step("resume", "/resume")
                except WeightSyncError as exc:
                    if failure is None:
                        raise
                    logger.error("could not resume vLLM after a failed reload: %s", exc)

    # -- NCCL (weight_transfer=nccl, grail/inference/backends/nccl.py) ---------------------------

    def update_info(self, flat: FlatWeights) -> dict[str, Any]:
        """`update_info` of POST /update_weights (vLLM's `NCCLWeightTransferUpdateInfo`): the
        weights in the order they are broadcast, with their HF checkpoint names."""
        views = flat.named_views()
        return {
            "names": [name for name, _ in views],
            "dtype_names": [dtype_name(view.dtype) for _, view in views],
            "shapes": [list(view.shape) for _, view in views],
        }

    def update_weights_nccl(self, flat: FlatWeights, weight_version: str) -> float:
        """The weights in `flat` over NCCL: joins the group once per server process
        (POST /init_weight_transfer_engine beside the trainer's join), then pause →
        start_weight_update → update_weights (its workers receive) beside the broadcasts →
        finish_weight_update {weight_version} → reset_prefix_cache → resume. Seconds taken;
        any failure is a `WeightSyncError` (the caller syncs from disk instead)."""
        sender = self._nccl_sender()
        t0 = time.perf_counter()
        update_info = self.update_info(flat)
        tensors = [view for _, view in flat.named_views()]

        def load() -> None:
            self._step("start", "/start_weight_update")
            receive = lambda: self._post_elsewhere("/update_weights", {"update_info": update_info})  # noqa: E731
            self.last_sync_timings["broadcast"] = sender.send(tensors, receive)
            self._step("finish", "/finish_weight_update", body={"weight_version": weight_version})

        self._paused(load)
        self.weight_version = weight_version
        seconds = time.perf_counter() - t0
        logger.info("sent weights %s to vLLM over NCCL in %.2f s", weight_version, seconds)
        return seconds

    def _nccl_sender(self) -> VLLMSender:
        if self.weight_transfer != "nccl":
            raise WeightSyncError(
                "this vLLM server was started without --weight-transfer-config (its weight "
                "transfer is not nccl)"
            )
        self._prepare_nccl()
        if self._sender is None or self._sender_pid != self.pid:
            self.close_weight_transfer()  # a restarted server left the old group
            sender = VLLMSender(1 + len(self.gpu_ids), timeout_s=self.nccl_timeout_s)
            sender.join(
                lambda: self._post_elsewhere(
                    "/init_weight_transfer_engine", {"init_info": sender.init_info()}
                )
            )
            self._sender, self._sender_pid = sender, self.pid
        assert isinstance(self._sender, VLLMSender)  # the only kind this server makes
        return self._sender
