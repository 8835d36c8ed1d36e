"""Inference-server processes: start a server in its own process, wait until it answers, hand its
weights a new checkpoint, and stop it without ever leaving a process behind.

One `ServerManager` interface covers the built-in server, vLLM and SGLang (their classes are in
`grail.inference.backends`). A backend supplies only what differs between them: its command line
(`build_command`), its readiness route (`ready_path`), extra environment (`extra_env`), its
default start timeout (`default_start_timeout_s`) and its in-place weight update
(`update_weights`). Everything else (ports, logs, environment, readiness polling, death
detection, restart fallback, shutdown) lives here once.

How a server never outlives the harness:
- it runs in its own process group, so `stop()` can signal the whole group (a server's own
  workers included) and a Ctrl-C in the terminal reaches only the harness, which then stops the
  server in an orderly way;
- `stop()` sends SIGTERM to the group, waits, then SIGKILL; it is idempotent and never raises for a
  process that is already gone;
- the context manager stops the server on any exit, KeyboardInterrupt included, and also when
  start-up itself is interrupted;
- a `weakref.finalize` per started process stops it when its manager is garbage collected and at
  interpreter exit (finalize registers itself with `atexit`);
- a watchdog in the server's group stops it when the harness dies, even by SIGKILL, whichever
  thread started it: it waits for end-of-file on a pipe only the harness writes to (see
  `grail.inference.os_process` and `grail.inference.lifeline`, which hold these mechanisms).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shlex
import subprocess
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, ClassVar, Self

import httpx

from grail.core.choices import WeightSyncMode
from grail.core.placement import prefer_passive_openmp
from grail.inference import os_process, zygote
from grail.inference.errors import (
    ServerDiedError,
    ServerError,
    ServerStartError,
    ServerTimeoutError,
    WeightSyncError,
)

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class SyncResult:
    """Outcome of `ServerManager.sync_weights`.

    `seconds` is the wall time of the whole sync, a failed in-place attempt included, because that
    is what the iteration loop waited for. `fallback_reason` says why in-place failed when it did.
    """

    seconds: float
    mode_used: WeightSyncMode
    fell_back: bool
    fallback_reason: str | None = None
    #: the weight transfer route that carried the weights: disk | shared | nccl
    #: (grail/inference/weights/); why a fast route failed and disk was used instead, and
    #: how many times that has happened so far in the run
    transfer: str = "disk"
    transfer_fallback_reason: str | None = None
    transfer_fallbacks: int = 0


# --------------------------------------------------------------------------------------------
# the manager


class ServerManager(ABC):
    """Lifecycle of one inference server process. Not thread-safe: drive it from one thread.

    `base_url` (and the port) stays the same across `restart()`, so clients built once keep
    working after a restart-based weight sync.
    """

    #: short backend name, used in log file names and messages
    kind: str = "server"
    #: route polled by `wait_ready` until it answers 200
    ready_path: str = "/health"
    #: the start timeout (seconds) when `start_timeout` is None; every backend sets its own
    default_start_timeout_s: ClassVar[float]
    #: the weight routes this backend takes (grail/inference/weights/route.py): disk always,
    #: and the fast route its server has
    weight_routes: ClassVar[tuple[str, ...]] = ("disk",)

    def __init__(
        self,
        model_path: str | os.PathLike[str],
        served_model_name: str,
        *,
        log_dir: str | os.PathLike[str],
        device: str = "cpu",
        threads: int | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        start_timeout: float | None = None,
        stop_timeout: float = 15.0,
        api_key: str | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        weight_sync_timeout: float = 600.0,
        lora_dir: str | os.PathLike[str] | None = None,
        lora_rank: int | None = None,
    ) -> None:
        if not served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535 or None (pick a free one), got {port}")
        if start_timeout is None:
            start_timeout = self.default_start_timeout_s
        for name, value in (
            ("start_timeout", start_timeout),
            ("stop_timeout", stop_timeout),
            ("weight_sync_timeout", weight_sync_timeout),
        ):
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        self.model_path = Path(model_path).absolute()
        self.served_model_name = served_model_name
        self.device = device
        self.gpu_ids = os_process.parse_device(device)
        # fail early on a GPU index this process cannot see
        os_process.visible_devices(self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.threads = threads
        self.host = host
        self.requested_port = port
        self.port: int | None = port
        self.log_dir = Path(log_dir)
        self.start_timeout = float(start_timeout)
        self.stop_timeout = float(stop_timeout)
        self.api_key = api_key
        self.dtype = dtype
        self.extra_args = list(extra_args)
        self.env_overrides = dict(env or {})
        self.weight_sync_timeout = float(weight_sync_timeout)
        # LoRA (model.lora.enabled): the server serves the base at `model_path` with the adapter
        # in `lora_dir` (a peft directory of rank at most `lora_rank`), which exists before the
        # server starts and which every adapter sync rewrites. A (re)start loads the adapter
        # there, so recovery and the restart fallback come back with the newest adapter.
        self.lora_dir = None if lora_dir is None else Path(lora_dir).absolute()
        self.lora_rank = lora_rank
        safe_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", served_model_name)
        self.log_path = self.log_dir / f"{self.kind}-{safe_name}.log"

        self._proc: os_process.ServerChild | None = None
        self._control_client: httpx.Client | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_offset = 0
        self._started_at = 0.0
        self._stopped_by_us = False
        self._ready = False
        self._command: list[str] = []
        #: restarts done by `recover()` (a dead server brought back), for metrics
        self.recoveries = 0
        #: The deadline of each call to the server (seconds), set by the fleet it serves in
        #: (grail/rollouts/fleet.py: generation.request_timeout_s): a call that misses it
        #: raises `ServerTimeoutError`, and no fallback (disk after a fast route, a restart
        #: after an in-place reload) calls the server again: the fleet sets it aside, restarts
        #: it in the background and goes on with the others. None (a lone server): each call
        #: waits up to `weight_sync_timeout`, and a timeout falls back as any failure does.
        self.call_deadline_s: float | None = None

    # -- what a backend supplies -------------------------------------------------------------

    @abstractmethod
    def build_command(self) -> list[str]:
        """The server's argv; start it with `sys.executable` so it runs in the harness's venv."""

    def extra_env(self) -> dict[str, str]:
        """Backend-specific environment variables (e.g. vLLM's dev-mode switch)."""
        return {}

    def is_adapter_sync(self, checkpoint_dir: str | os.PathLike[str]) -> bool:
        """Whether a sync of `checkpoint_dir` is of the LoRA adapter (`lora_dir`), not of the
        whole model."""
        return self.lora_dir is not None and Path(checkpoint_dir).absolute() == self.lora_dir

    def served_dtype(self) -> str | None:
        """The dtype the server computes in ("float32", "bfloat16", "float16"), which a weight
        sync sends; None when the server picks it from the checkpoint (`auto`): the sync then
        keeps the trainer's dtype, as the server's first load saw it."""
        return None if self.dtype in (None, "auto") else self.dtype

    def update_weights(
        self, checkpoint_dir: str | os.PathLike[str], weight_version: str | None = None
    ) -> float:
        """Load the weights in `checkpoint_dir` into the running server; return seconds taken.

        Raises `WeightSyncError` on any failure. `weight_version` labels the weights in the
        server's logs and model card (default: the directory name)."""
        raise WeightSyncError(
            f"{self.kind} server has no in-place weight update; use sync_weights(mode='restart')"
        )

    # -- addresses ------------------------------------------------------------------------------

    @property
    def root_url(self) -> str:
        if self.port is None:
            raise ServerError(f"{self.kind} server has no port yet: call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        """OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1."""
        return f"{self.root_url}/v1"

    @property
    def model_name(self) -> str:
        """The name to send as `model` in requests (a backend serving the adapter under its own
        name returns that name here)."""
        return self.served_model_name

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def control_http(self) -> httpx.Client:
        """The client for control calls (weight updates), made once per server process: a new
        httpx client costs ~20 ms (it loads the CA bundle), as much as a tiny model's whole
        in-place update."""
        if self._control_client is None:
            self._control_client = httpx.Client(
                timeout=httpx.Timeout(self.weight_sync_timeout, connect=5.0),
                headers=self._headers(),
            )
        return self._control_client

    def call_timeout(self, most: float) -> float:
        """Seconds one call to the server may wait: `most`, or the fleet's deadline when
        shorter (`call_deadline_s`)."""
        return most if self.call_deadline_s is None else min(most, self.call_deadline_s)

    def missed_deadline(self, exc: BaseException | None) -> bool:
        """Whether `exc` is this server missing its fleet's deadline: then nothing calls it
        again (no fallback, no clean-up request), as each call would wait out the deadline
        again; the fleet sets it aside and restarts it."""
        return self.call_deadline_s is not None and isinstance(exc, ServerTimeoutError)

    def missed(self, what: str, seconds: float) -> ServerTimeoutError:
        """The error of a call (`what`) that got no answer within the fleet's deadline."""
        return ServerTimeoutError(
            f"{what} got no answer within {seconds:g} s, the deadline of each call to a server "
            "of the fleet (generation.request_timeout_s): the server is hung or far too slow"
        )

    def _control(
        self,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> tuple[int, Any]:
        """POST a control route; return (status, decoded JSON or None). A transport failure is
        a `WeightSyncError` that says whether the server died meanwhile; no answer within
        `call_timeout` under a fleet's deadline, a `ServerTimeoutError`."""
        url = f"{self.root_url}{path}"
        seconds = self.call_timeout(self.weight_sync_timeout)
        timeout = httpx.Timeout(seconds, connect=min(5.0, seconds))
        try:
            response = self.control_http().post(url, json=body, params=params, timeout=timeout)
        except httpx.HTTPError as exc:
            detail = f"{type(exc).__name__}: {exc}"
            timed_out = isinstance(exc, httpx.TimeoutException)
            if self._proc is not None and not timed_out:
                # A crashing server drops its connections a moment before its process is gone;
                # wait a little so that a death is reported as one rather than as a network error.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=1.0)
            try:
                self.check_alive()
            except ServerDiedError as died:
                raise WeightSyncError(f"POST {path} failed ({detail}); {died}") from died
            except ServerError:
                pass
            if timed_out and self.call_deadline_s is not None:
                raise self.missed(f"POST {url}", seconds) from exc
            raise WeightSyncError(f"POST {url} failed: {detail}") from exc
        try:
            decoded = response.json() if response.content else None
        except ValueError:
            decoded = response.text[:500]
        return response.status_code, decoded

    # -- start ----------------------------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        """The server's environment: ours, plus device and thread pinning.

        CUDA_VISIBLE_DEVICES is always set ("" for CPU) so a CPU server cannot grab a GPU and a
        GPU server sees only its own (as cuda:0). Thread variables stop the trainer and the server
        from oversubscribing the same cores.
        """
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = os_process.visible_devices(
            self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["MKL_NUM_THREADS"] = str(self.threads)
            prefer_passive_openmp(env)
        env["PYTHONUNBUFFERED"] = "1"  # so the log tail is current when we report a failure
        env["TOKENIZERS_PARALLELISM"] = "false"
        env.update(self.extra_env())
        env.update(self.env_overrides)
        return env

    def _redacted(self, command: Sequence[str]) -> str:
        text = shlex.join(command)
        return text.replace(self.api_key, "***") if self.api_key else text

    def start(self) -> None:
        """Launch the server process (does not wait for readiness: see `wait_ready`)."""
        if self.is_alive():
            raise ServerError(f"{self.kind} server already running (pid {self.pid})")
        self.stop()  # a previous process that died on its own: reap its group, drop its finalizer
        if self.requested_port is None:
            self.port = os_process.free_port(self.host)
        elif not os_process.port_is_free(self.host, self.requested_port):
            raise ServerStartError(
                f"port {self.requested_port} on {self.host} is already in use; "
                "pick another port or leave it unset to get a free one"
            )
        else:
            self.port = self.requested_port
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = self.build_command()
        env = self.child_env()
        self._command = command
        with open(self.log_path, "ab") as log:
            # Appending keeps the history of restarts; the tail we report starts at this offset.
            self._log_offset = log.tell()
            header = (
                f"# grail: {time.strftime('%Y-%m-%d %H:%M:%S')} starting {self.kind} server\n"
                f"# command: {self._redacted(command)}\n"
                f"# CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} "
                f"OMP_NUM_THREADS={env.get('OMP_NUM_THREADS', '(inherited)')}\n"
            )
            log.write(header.encode())
            log.flush()
            proc = self._spawn(command, env, log)
        self._proc = proc
        self._ready = False
        self._started_at = time.monotonic()
        self._stopped_by_us = False
        # The server's process group id is its pid; the finalizer holds the Popen, never `self`.
        self._finalizer = weakref.finalize(
            self, os_process.terminate_group, proc, proc.pid, self.stop_timeout
        )
        logger.info(
            "started %s server %r (pid %d) on %s, log %s",
            self.kind,
            self.served_model_name,
            proc.pid,
            self.root_url,
            self.log_path,
        )

    def _spawn(
        self, command: list[str], env: dict[str, str], log: IO[bytes]
    ) -> os_process.ServerChild:
        """Fork a CPU server from this process's zygote when it has one (grail/inference/zygote.py:
        no ~5 s of imports), else start it as a new process (`spawn_server`)."""
        forker = zygote.current() if not self.gpu_ids else None
        if forker is not None and zygote.forkable(command):
            try:
                child = forker.spawn(command, env=env, log=self.log_path, grace=self.stop_timeout)
            except zygote.ZygoteGone as exc:
                logger.warning("%s; starting the server as a new process", exc)
            else:
                os_process.STARTED_GROUPS.add(child.pid)
                return child
        return os_process.spawn_server(command, stdout=log, env=env, grace=self.stop_timeout)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Poll the readiness route until it answers 200; return the seconds waited.

        Raises `ServerStartError` with the exit code and log tail if the process exits meanwhile,
        or, after stopping the process, with the timeout and log tail if it never gets ready.
        """
        if self._proc is None:
            raise ServerError(f"{self.kind} server was never started: call start() first")
        timeout = self.start_timeout if timeout is None else float(timeout)
        url = f"{self.root_url}{self.ready_path}"
        assert self.port is not None  # start() chose it
        t0 = time.monotonic()
        deadline = t0 + timeout
        delay = 0.05
        last = "no answer yet"
        with httpx.Client(timeout=httpx.Timeout(2.0, connect=1.0), headers=self._headers()) as http:
            while True:
                if self._proc.poll() is not None:
                    self.stop()  # the exited leader may leave workers in its group
                    raise ServerStartError(
                        f"{self.kind} server {self.served_model_name!r} exited during start-up "
                        f"with {os_process.describe_exit(self._proc.returncode)} after "
                        f"{time.monotonic() - t0:.1f} s.\n{self._failure_context()}"
                    )
                try:
                    response = http.get(url)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                else:
                    if response.status_code != 200:
                        last = f"HTTP {response.status_code}"
                    elif os_process.port_held_by_group(self.port, self._proc.pid) is False:
                        last = (
                            f"HTTP 200 from a process outside this server's process group "
                            f"(port {self.port} is taken by someone else)"
                        )
                    else:
                        self._ready = True
                        waited = time.monotonic() - t0
                        logger.info("%s server ready after %.1f s", self.kind, waited)
                        return waited
                now = time.monotonic()
                if now >= deadline:
                    context = self._failure_context()
                    self.stop()
                    raise ServerStartError(
                        f"{self.kind} server {self.served_model_name!r} was not ready after "
                        f"{timeout:.1f} s (start_timeout): GET {url} never answered 200 "
                        f"(last: {last}). The process has been stopped.\n{context}"
                    )
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 1.5, 1.0)

    def launch(self, timeout: float | None = None) -> float:
        """`start()` + `wait_ready()`; return the seconds waited for readiness.

        Stops the process if waiting fails or is interrupted. When the port was picked
        automatically, another process can take it between our probe and the server's bind
        (parallel sweeps do this); that case is retried on a new port. A no-op returning 0.0 when
        this manager's server is already running and was ready (e.g. `launch()` inside `with`).
        """
        if self._ready and self.is_alive():
            return 0.0
        for attempt in range(3):
            self.start()
            try:
                return self.wait_ready(timeout)
            except ServerStartError:
                if (
                    self.requested_port is None
                    and attempt < 2
                    and "address already in use" in self.log_tail().lower()
                ):
                    logger.warning("port %s was taken during start-up; retrying", self.port)
                    self.stop()
                    continue
                self.stop()
                raise
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    # -- health -----------------------------------------------------------------------------------

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def check_alive(self) -> None:
        """Raise `ServerDiedError` (exit code + log tail) if the server process has exited.

        The rollout code calls this when requests fail, to tell "server is gone" (restart or
        abort) from "request failed" (retry).
        """
        if self._proc is None:
            raise ServerError(f"{self.kind} server was never started")
        if self._proc.poll() is None:
            return
        if self._stopped_by_us:
            raise ServerError(f"{self.kind} server {self.served_model_name!r} was stopped")
        raise ServerDiedError(
            f"{self.kind} server {self.served_model_name!r} (pid {self._proc.pid}) died with "
            f"{os_process.describe_exit(self._proc.returncode)} after "
            f"{time.monotonic() - self._started_at:.1f} s.\n{self._failure_context()}"
        )

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """Last `lines` lines the current process wrote to its log."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_offset)
                tail = deque(log, maxlen=lines)
        except OSError:
            return ""
        return b"".join(tail).decode(errors="replace")

    def _failure_context(self) -> str:
        tail = self.log_tail().rstrip("\n") or "(empty)"
        indented = "\n".join(f"  | {line}" for line in tail.splitlines())
        return (
            f"command: {self._redacted(self._command)}\n"
            f"log {self.log_path} (last {LOG_TAIL_LINES} lines):\n{indented}"
        )

    # -- stop -----------------------------------------------------------------------------------

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the server's process group, wait up to `timeout` s, then SIGKILL. Idempotent."""
        if self._control_client is not None:
            self._control_client.close()
            self._control_client = None
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            self._stopped_by_us = True
        grace = self.stop_timeout if timeout is None else float(timeout)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        os_process.terminate_group(proc, proc.pid, grace)
        logger.info(
            "stopped %s server (pid %d, %s)",
            self.kind,
            proc.pid,
            os_process.describe_exit(proc.poll()),
        )

    def __enter__(self) -> Self:
        self.launch()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- weights ----------------------------------------------------------------------------------

    def restart(self, model_path: str | os.PathLike[str]) -> float:
        """Stop, start on `model_path` (same port), wait until ready; return the seconds taken."""
        model_path = Path(model_path).absolute()
        if not model_path.is_dir():
            raise ServerStartError(f"cannot restart on {model_path}: not a directory")
        t0 = time.perf_counter()
        self.stop()
        self.model_path = model_path
        # Keep the port: clients hold base_url. It was ours a moment ago, so it is free again.
        requested, self.requested_port = self.requested_port, self.port
        try:
            self.start()
            try:
                self.wait_ready(self.start_timeout)
            except BaseException:
                self.stop()
                raise
        finally:
            self.requested_port = requested
        return time.perf_counter() - t0

    def recover(self) -> float:
        """Bring back a server that died (or stopped answering): restart it on the newest weights
        it was given (`model_path`, which every successful weight sync from disk updates), on
        the same port. Returns the seconds taken; raises `ServerStartError` if it does not come
        back. After a fast weight route, `WeightSyncer.recover` writes the served weights there
        first (grail/inference/weights/syncer.py)."""
        logger.warning(
            "restarting the %s server %r from %s (recovery %d)",
            self.kind,
            self.served_model_name,
            self.model_path,
            self.recoveries + 1,
        )
        seconds = self.restart(self.model_path)
        self.recoveries += 1
        return seconds

    def sync_weights(
        self,
        checkpoint_dir: str | os.PathLike[str],
        mode: WeightSyncMode = WeightSyncMode.in_place,
        *,
        fallback: bool = True,
        weight_version: str | None = None,
    ) -> SyncResult:
        """Give the server the weights in `checkpoint_dir`.

        mode="in_place" reloads weights in the running server; if that fails and `fallback` is
        set, it logs a warning and restarts the server on the checkpoint instead (slow but sure).
        mode="restart" always restarts. Raises `WeightSyncError` when nothing worked, and at
        once when the server missed its fleet's deadline (`missed_deadline`).
        """
        if mode not in tuple(WeightSyncMode):
            raise ValueError(f"weight sync mode must be 'in_place' or 'restart', got {mode!r}")
        t0 = time.perf_counter()
        reason: str | None = None
        if mode == "in_place":
            try:
                self.update_weights(checkpoint_dir, weight_version)
                return SyncResult(
                    time.perf_counter() - t0, WeightSyncMode.in_place, fell_back=False
                )
            except WeightSyncError as exc:
                if not fallback or self.missed_deadline(exc):
                    raise
                reason = str(exc)
                logger.warning(
                    "in-place weight update of the %s server failed, falling back to a restart "
                    "(slow): %s",
                    self.kind,
                    reason,
                )
        # An adapter restarts on the base: the start loads the adapter from lora_dir.
        restart_on = self.model_path if self.is_adapter_sync(checkpoint_dir) else checkpoint_dir
        try:
            self.restart(restart_on)
        except ServerError as exc:
            prefix = f"in-place update failed ({reason}); " if reason else ""
            raise WeightSyncError(
                f"{prefix}restarting the {self.kind} server on {checkpoint_dir} failed: {exc}"
            ) from exc
        return SyncResult(
            time.perf_counter() - t0,
            WeightSyncMode.restart,
            fell_back=reason is not None,
            fallback_reason=reason,
        )
