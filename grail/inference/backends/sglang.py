"""SGLang (`python -m sglang.launch_server`) as a rollout server; facts in docs/protocols.md.

SGLang returns log softmax(logits / T) by default, what the trainer computes;
`SGLANG_RETURN_ORIGINAL_LOGPROB` (which would return log softmax(logits)) is removed from the
server's environment.

The key (`api_key`) goes in a YAML file that only this user can read (`key_file`, 0600), named by
`--config`, never on the command line, which `ps` shows every user: SGLang reads no environment
variable for it, and `prepare_server_args` merges a `--config` file's entries into the arguments
in its own process (sglang/srt/server_args.py, server_args_config_parser.py).

LoRA (`lora_dir` set), from SGLang 0.5.23's source (details and line numbers in
docs/protocols.md):
- `--lora-paths '{"lora_name", "lora_path", "pinned"}' --enable-lora --max-lora-rank R
  --max-loras-per-batch 2`: the adapter in lora_dir is loaded at start under `lora_name` (so a
  restart comes back serving the newest adapter), and the target modules are inferred from it
  (`--lora-target-modules` is needed only without an initial adapter); two adapter slots, the
  adapter's and the base's (SGLang counts base-only requests as one);
- requests name the adapter as `"<served name>:<adapter name>"` in `model` (SGLang's OpenAI
  routes read "base:adapter"; the adapter's name alone is taken as a base name, unchecked, and
  would generate without the adapter);
- SGLang refuses to load a name that is loaded, and has no in-place reload: an adapter sync is
  `/unload_lora_adapter` (it waits for the requests using the adapter) then
  `/load_lora_adapter` under the same name. Each load gets a fresh internal id, which SGLang's
  prefix cache keys on, so nothing cached with the old adapter is reused.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from grail.core.records import SECRET_FILE_MODE, atomic_write_text
from grail.inference.backends.gpu import GpuServer, _flag_name, server_error
from grail.inference.backends.nccl import SGLANG_GROUP_NAME, SGLangSender, dtype_name
from grail.inference.errors import WeightSyncError
from grail.inference.weights.shared import FlatWeights

#: adapter slots: the adapter's, and the one SGLang counts for base-only requests
LORA_SLOTS = 2


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
        "--api-key": "the api_key argument, in the --config file (off the command line)",
    }
    lora_flags = {
        "--enable-lora": "model.lora.enabled",
        "--max-lora-rank": "model.lora.r",
        "--lora-paths": "the adapter directory the trainer writes",
        "--max-loras-per-batch": f"always {LORA_SLOTS}: the adapter and the base",
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
        if self.api_key and any(_flag_name(arg) == "--config" for arg in self.extra_args):
            raise ValueError(
                "extra_args must not set --config with an api_key: the harness passes the key "
                "in a --config file of its own (SGLang takes one)"
            )

    @property
    def key_file(self) -> Path:
        """The 0600 file that carries `api_key` to the server (`--config`), beside its log."""
        return self.log_path.with_name(f"{self.log_path.stem}.key.yaml")

    @property
    def model_name(self) -> str:
        """`"<served name>:<adapter name>"` when serving an adapter (SGLang's OpenAI routes take
        the part after ':' as the adapter), else the served model name."""
        if self.lora_dir is None:
            return self.served_model_name
        return f"{self.served_model_name}:{self.lora_name}"

    def lora_args(self) -> list[str]:
        """The flags that serve the adapter in `lora_dir` from the start (none without it)."""
        if self.lora_dir is None:
            return []
        adapter = {"lora_name": self.lora_name, "lora_path": str(self.lora_dir), "pinned": False}
        # --lora-paths takes any number of values: a flag must follow it
        return [
            "--lora-paths", json.dumps(adapter),
            "--enable-lora",
            "--max-lora-rank", str(self.adapter_rank()),
            "--max-loras-per-batch", str(LORA_SLOTS),
        ]  # fmt: skip

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
            # Written at each start (a restart too), removed by stop(). JSON is YAML; quoted, so
            # a key like "yes" or "123" stays a string.
            text = json.dumps({"api-key": self.api_key}) + "\n"
            atomic_write_text(self.key_file, text, mode=SECRET_FILE_MODE)
            args += ["--config", str(self.key_file)]
        return args + self.lora_args() + self.extra_args

    def build_command(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, *self.server_args()]

    def child_env(self) -> dict[str, str]:
        env = super().child_env()
        # It would make the returned log-probabilities ignore the temperature.
        env.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)
        return env

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        self.key_file.unlink(missing_ok=True)

    def update_weights(
        self, checkpoint_dir: str | os.PathLike[str], weight_version: str | None = None
    ) -> float:
        """POST /update_weights_from_disk {model_path, weight_version}; return the seconds. For an
        adapter sync (`lora_dir`): POST /unload_lora_adapter, then /load_lora_adapter.

        HTTP 400 or `success: false` is a `WeightSyncError` carrying SGLang's message. SGLang
        renames its served model to the path afterwards; requests keep using our own name,
        which its completion route does not check.
        """
        path = self._prepare_update(checkpoint_dir)
        version = weight_version or path.name
        self.last_sync_timings = {}
        t0 = time.perf_counter()
        if self.is_adapter_sync(path):
            self._reload_adapter(path)
            return self._updated(path, version, t0)
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

    def _reload_adapter(self, path: os.PathLike[str]) -> None:
        """Unload the adapter, then load `path` under the same name. A failure of either is a
        `WeightSyncError` (the caller's restart fallback then starts with lora_dir's adapter)."""

        def step(name: str, route: str, body: dict[str, Any]) -> None:
            t = time.perf_counter()
            status, answer = self._control(route, body=body)
            self.last_sync_timings[name] = time.perf_counter() - t
            if status != 200 or not isinstance(answer, dict) or answer.get("success") is not True:
                message = (
                    answer.get("error_message") if isinstance(answer, dict) else None
                ) or server_error(answer)
                raise WeightSyncError(
                    f"SGLang POST {route} of LoRA adapter {self.lora_name!r} failed "
                    f"(HTTP {status}): {message}"
                )

        step("unload_adapter", "/unload_lora_adapter", self.lora_unload_body())
        step("load_adapter", "/load_lora_adapter", self.lora_load_body(path))

    def lora_unload_body(self) -> dict[str, Any]:
        """The JSON of `POST /unload_lora_adapter`."""
        return {"lora_name": self.lora_name}

    def lora_load_body(self, path: os.PathLike[str]) -> dict[str, Any]:
        """The JSON of `POST /load_lora_adapter` that loads `path` under the adapter's name."""
        return {"lora_name": self.lora_name, "lora_path": str(path), "pinned": False}

    # -- NCCL (weight_transfer=nccl, grail/inference/backends/nccl.py) ---------------------------

    def distributed_update_body(self, flat: FlatWeights, weight_version: str) -> dict[str, Any]:
        """The JSON of POST /update_weights_from_distributed (`UpdateWeightsFromDistributed
        ReqInput`): the weights in broadcast order; SGLang flushes its cache after loading."""
        views = flat.named_views()
        return {
            "names": [name for name, _ in views],
            "dtypes": [dtype_name(view.dtype) for _, view in views],
            "shapes": [list(view.shape) for _, view in views],
            "group_name": SGLANG_GROUP_NAME,
            "flush_cache": True,
            "weight_version": weight_version,
        }

    def update_weights_nccl(self, flat: FlatWeights, weight_version: str) -> float:
        """The weights in `flat` over NCCL: joins the group once per server process
        (POST /init_weights_update_group beside the trainer's join), then begin_weight_update →
        update_weights_from_distributed (its workers receive, load, flush the cache) beside the
        broadcasts → end_weight_update. SGLang waits for running requests itself, as its disk
        reload does. Seconds; any failure is a `WeightSyncError` (the caller syncs from disk)."""
        self._prepare_nccl()
        if self._sender is None or self._sender_pid != self.pid:
            self.close_weight_transfer()  # a restarted server left the old group
            sender = SGLangSender(1 + len(self.gpu_ids), timeout_s=self.nccl_timeout_s)
            sender.join(
                lambda: self._post_elsewhere("/init_weights_update_group", sender.init_body())
            )
            self._sender, self._sender_pid = sender, self.pid
        assert isinstance(self._sender, SGLangSender)  # the only kind this server makes
        sender = self._sender
        self.last_sync_timings = {}
        t0 = time.perf_counter()
        body = self.distributed_update_body(flat, weight_version)
        self._session("begin", "/begin_weight_update", {"selector": "all"})
        failure: BaseException | None = None
        try:
            receive = lambda: self._post_elsewhere("/update_weights_from_distributed", body)  # noqa: E731
            tensors = [view for _, view in flat.named_views()]
            self.last_sync_timings["broadcast"] = sender.send(tensors, receive)
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if not self.missed_deadline(failure):  # a hung fleet server restarts: no more calls
                try:
                    self._session("end", "/end_weight_update", {})
                except WeightSyncError:
                    if failure is None:
                        raise
        self.weight_version = weight_version
        seconds = time.perf_counter() - t0
        self.last_sync_timings["total"] = seconds
        return seconds

    def _session(self, name: str, route: str, body: dict[str, Any]) -> None:
        """begin/end_weight_update (required around a distributed update since SGLang 0.5.23;
        an older server without them answers 404, which is let pass)."""
        t = time.perf_counter()
        status, answer = self._control(route, body=body)
        self.last_sync_timings[name] = time.perf_counter() - t
        if status == 404:
            return
        if status != 200 or not isinstance(answer, dict) or answer.get("success") is not True:
            raise WeightSyncError(
                f"SGLang POST {route} failed (HTTP {status}): {server_error(answer)}"
            )
