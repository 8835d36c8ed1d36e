"""Inference-server lifecycle: start a server in its own process, wait until it answers, hand its
weights a new checkpoint, and stop it without ever leaving a process behind.

One `ServerManager` interface covers the built-in server, vLLM and SGLang. A backend supplies only
what differs between them: its command line (`build_command`), its readiness route (`ready_path`),
extra environment (`extra_env`) and its in-place weight update (`update_weights`). Everything else
(ports, logs, environment, readiness polling, death detection, restart fallback, shutdown) lives
here once.

How a server never outlives the harness:
- it runs in its own session and process group (`start_new_session=True`), so `stop()` can signal
  the whole group (a server's own workers included) and a Ctrl-C in the terminal reaches only the
  harness, which then stops the server in an orderly way;
- `stop()` sends SIGTERM to the group, waits, then SIGKILL; it is idempotent and never raises for a
  process that is already gone;
- the context manager stops the server on any exit, KeyboardInterrupt included, and also when
  start-up itself is interrupted;
- a `weakref.finalize` per started process stops it when its manager is garbage collected and at
  interpreter exit (finalize registers itself with `atexit`);
- on Linux the child asks the kernel for SIGKILL when its parent dies (`PR_SET_PDEATHSIG`), which
  covers the one case no Python code can handle: the harness itself being SIGKILLed (or OOM-killed).
  The kernel ties that signal to the *thread* that forked the child, so it is only requested when a
  server is started from the main thread; a server started from a worker thread relies on the other
  mechanisms, since the worker thread ending would otherwise kill a healthy server.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Self, TypeVar

import httpx

logger = logging.getLogger(__name__)

LOG_TAIL_LINES = 40
SyncMode = Literal["in_place", "restart"]


class ServerError(RuntimeError):
    """Base class of every server lifecycle error."""


class ServerStartError(ServerError):
    """The server exited during start-up, or did not become ready in time."""


class ServerDiedError(ServerError):
    """The server process exited while it was supposed to be serving."""


class WeightSyncError(ServerError):
    """New weights could not be loaded into the server."""


@dataclass(frozen=True)
class SyncResult:
    """Outcome of `ServerManager.sync_weights`.

    `seconds` is the wall time of the whole sync, a failed in-place attempt included, because that
    is what the iteration loop waited for. `fallback_reason` says why in-place failed when it did.
    """

    seconds: float
    mode_used: SyncMode
    fell_back: bool
    fallback_reason: str | None = None


# --------------------------------------------------------------------------------------------
# process helpers

# Process-group ids of every server this interpreter started, for leak checks: a server's workers
# outlive a killed leader in its group, where a walk over our own children no longer finds them.
_STARTED_GROUPS: set[int] = set()


def started_process_groups() -> frozenset[int]:
    """Process-group ids of all servers started by this process (alive or not)."""
    return frozenset(_STARTED_GROUPS)


_PR_SET_PDEATHSIG = 1


def _load_prctl():  # pragma: no cover - depends on the platform
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


# Resolved once in the parent: the pre-exec hook runs between fork and exec, where loading a
# library (which takes locks another thread may hold) is not safe.
_PRCTL = _load_prctl()


def _make_preexec(parent_pid: int):
    """Return a pre-exec hook that asks for SIGKILL when the parent dies, or None if unsupported.

    If the parent already died between fork and prctl, the child would be orphaned without the
    signal ever firing; comparing getppid() with the parent's pid closes that window.
    """
    if _PRCTL is None or threading.current_thread() is not threading.main_thread():
        return None
    prctl = _PRCTL

    def preexec() -> None:  # runs in the child
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _terminate(proc: subprocess.Popen, pgid: int, grace: float) -> None:
    """SIGTERM the process group, wait up to `grace` seconds, then SIGKILL it; reap the child.

    The final SIGKILL to the group is sent even when the leader exited on SIGTERM: a server's worker
    processes stay in its group after the leader is gone, and the group id cannot be reused while
    any member lives. A second Ctrl-C while waiting skips straight to SIGKILL.
    """
    if proc.poll() is None:
        _signal_group(pgid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        except KeyboardInterrupt:
            _signal_group(pgid, signal.SIGKILL)
            proc.wait()
            raise
    _signal_group(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


def describe_exit(returncode: int | None) -> str:
    """Human words for a Popen return code (negative means killed by that signal)."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = (
            " (the kernel's OOM killer sends SIGKILL when memory runs out)"
            if name == "SIGKILL"
            else ""
        )
        return f"exit code {returncode}, killed by {name}{hint}"
    return f"exit code {returncode}"


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the kernel for a free TCP port on `host` (bind to port 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_is_free(host: str, port: int) -> bool:
    # SO_REUSEADDR as the servers themselves set it, so that a port with connections lingering in
    # TIME_WAIT after a restart counts as free.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _listening_inodes(port: int) -> set[str] | None:
    """Socket inodes listening on TCP `port` (IPv4 or IPv6), from /proc/net; None off Linux."""
    inodes: set[str] = set()
    found_table = False
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as rows:
                found_table = True
                next(rows)
                for row in rows:
                    fields = row.split()
                    if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes if found_table else None


def _port_held_by_group(port: int, pgid: int) -> bool | None:
    """Whether a process in group `pgid` listens on `port`; None where /proc cannot tell.

    A readiness probe only proves that *something* answers on the port. Between picking a free
    port and a slow server binding it (minutes for a large model), another job can take the port;
    its 200 must not be mistaken for ours.
    """
    inodes = _listening_inodes(port)
    if inodes is None:
        return None
    targets = {f"socket:[{inode}]" for inode in inodes}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) != pgid:
                continue
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in targets:
                    return True
            except OSError:
                continue
    return False


def parse_device(device: str) -> tuple[int, ...]:
    """'cpu' -> (); 'cuda' -> (0,); 'cuda:1' -> (1,); 'cuda:0,1' -> (0, 1)."""
    text = device.strip().lower()
    if text == "cpu":
        return ()
    if text == "cuda":
        return (0,)
    match = re.fullmatch(r"cuda:(\d+(?:,\d+)*)", text)
    if match is None:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N[,M...]', got {device!r}")
    ids = tuple(int(part) for part in match.group(1).split(","))
    if len(set(ids)) != len(ids):
        raise ValueError(f"device {device!r} names a GPU twice")
    return ids


def visible_devices(gpu_ids: Sequence[int], parent_visible: str | None) -> str:
    """The child's CUDA_VISIBLE_DEVICES for the GPUs the harness calls `gpu_ids`.

    GPU indices in the config are the harness's own CUDA indices, which are positions in *its*
    CUDA_VISIBLE_DEVICES when that is set (SLURM and shared boxes set it). The child must get the
    entries at those positions, not the bare numbers: with CUDA_VISIBLE_DEVICES=4,5 the harness's
    cuda:1 is physical GPU 5. Entries may be UUIDs (GPU-...), which are passed through as text.
    """
    if not gpu_ids:
        return ""
    if parent_visible is None or not parent_visible.strip():
        return ",".join(str(i) for i in gpu_ids)
    entries = [e.strip() for e in parent_visible.split(",") if e.strip()]
    outside = [i for i in gpu_ids if i >= len(entries)]
    if outside:
        raise ValueError(
            f"GPU index {outside[0]} does not exist: this process sees {len(entries)} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={parent_visible!r}), numbered 0..{len(entries) - 1}"
        )
    return ",".join(entries[i] for i in gpu_ids)


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
        start_timeout: float = 600.0,
        stop_timeout: float = 15.0,
        api_key: str | None = None,
        dtype: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        weight_sync_timeout: float = 600.0,
    ) -> None:
        if not served_model_name:
            raise ValueError("served_model_name must be a non-empty string")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535 or None (pick a free one), got {port}")
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
        self.gpu_ids = parse_device(device)
        visible_devices(self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES"))  # fail early
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
        safe_name = re.sub(r"[^A-Za-z0-9_.-]+", "_", served_model_name)
        self.log_path = self.log_dir / f"{self.kind}-{safe_name}.log"

        self._proc: subprocess.Popen | None = None
        self._control_client: httpx.Client | None = None
        self._finalizer: weakref.finalize | None = None
        self._log_offset = 0
        self._started_at = 0.0
        self._stopped_by_us = False
        self._ready = False
        self._command: list[str] = []
        #: restarts done by `recover()` (a dead server brought back), for metrics
        self.recoveries = 0

    # -- what a backend supplies -------------------------------------------------------------

    @abstractmethod
    def build_command(self) -> list[str]:
        """The server's argv; start it with `sys.executable` so it runs in the harness's venv."""

    def extra_env(self) -> dict[str, str]:
        """Backend-specific environment variables (e.g. vLLM's dev-mode switch)."""
        return {}

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
        """The name to send as `model` in requests."""
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

    def _control(
        self,
        path: str,
        *,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> tuple[int, Any]:
        """POST a control route; return (status, decoded JSON or None). A transport failure is
        a `WeightSyncError` that says whether the server died meanwhile."""
        url = f"{self.root_url}{path}"
        try:
            response = self.control_http().post(url, json=body, params=params)
        except httpx.HTTPError as exc:
            detail = f"{type(exc).__name__}: {exc}"
            if self._proc is not None:
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
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(
            self.gpu_ids, os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
            env["MKL_NUM_THREADS"] = str(self.threads)
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
            self.port = free_port(self.host)
        elif not _port_is_free(self.host, self.requested_port):
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
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_make_preexec(os.getpid()),
                close_fds=True,
            )
        self._proc = proc
        self._ready = False
        _STARTED_GROUPS.add(proc.pid)
        self._started_at = time.monotonic()
        self._stopped_by_us = False
        # The server's session id is its pid; the finalizer holds the Popen, never `self`.
        self._finalizer = weakref.finalize(self, _terminate, proc, proc.pid, self.stop_timeout)
        logger.info(
            "started %s server %r (pid %d) on %s, log %s",
            self.kind,
            self.served_model_name,
            proc.pid,
            self.root_url,
            self.log_path,
        )

    def wait_ready(self, timeout: float | None = None) -> float:
        """Poll the readiness route until it answers 200; return the seconds waited.

        Raises `ServerStartError` with the exit code and log tail if the process exits meanwhile,
        or, after stopping the process, with the timeout and log tail if it never gets ready.
        """
        if self._proc is None:
            raise ServerError(f"{self.kind} server was never started: call start() first")
        timeout = self.start_timeout if timeout is None else float(timeout)
        url = f"{self.root_url}{self.ready_path}"
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
                        f"with {describe_exit(self._proc.returncode)} after "
                        f"{time.monotonic() - t0:.1f} s.\n{self._failure_context()}"
                    )
                try:
                    response = http.get(url)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                else:
                    if response.status_code != 200:
                        last = f"HTTP {response.status_code}"
                    elif _port_held_by_group(self.port, self._proc.pid) is False:
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
            f"{describe_exit(self._proc.returncode)} after "
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
        _terminate(proc, proc.pid, grace)
        logger.info(
            "stopped %s server (pid %d, %s)", self.kind, proc.pid, describe_exit(proc.poll())
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
        it was given (`model_path`, which every successful weight sync updates), on the same
        port. Returns the seconds taken; raises `ServerStartError` if it does not come back."""
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
        mode: SyncMode = "in_place",
        *,
        fallback: bool = True,
        weight_version: str | None = None,
    ) -> SyncResult:
        """Give the server the weights in `checkpoint_dir`.

        mode="in_place" reloads weights in the running server; if that fails and `fallback` is
        set, it logs a warning and restarts the server on the checkpoint instead (slow but sure).
        mode="restart" always restarts. Raises `WeightSyncError` when nothing worked.
        """
        if mode not in ("in_place", "restart"):
            raise ValueError(f"weight sync mode must be 'in_place' or 'restart', got {mode!r}")
        t0 = time.perf_counter()
        reason: str | None = None
        if mode == "in_place":
            try:
                self.update_weights(checkpoint_dir, weight_version)
                return SyncResult(time.perf_counter() - t0, "in_place", fell_back=False)
            except WeightSyncError as exc:
                if not fallback:
                    raise
                reason = str(exc)
                logger.warning(
                    "in-place weight update of the %s server failed, falling back to a restart "
                    "(slow): %s",
                    self.kind,
                    reason,
                )
        try:
            self.restart(checkpoint_dir)
        except ServerError as exc:
            prefix = f"in-place update failed ({reason}); " if reason else ""
            raise WeightSyncError(
                f"{prefix}restarting the {self.kind} server on {checkpoint_dir} failed: {exc}"
            ) from exc
        return SyncResult(
            time.perf_counter() - t0,
            "restart",
            fell_back=reason is not None,
            fallback_reason=reason,
        )


class BuiltinServer(ServerManager):
    """The harness's own FastAPI server (`grail.inference.builtin.server`), CPU or one GPU."""

    kind = "builtin"
    server_module = "grail.inference.builtin.server"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
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
        if self.api_key:
            args += ["--api-key", self.api_key]
        return args + self.extra_args

    def build_command(self) -> list[str]:
        return [sys.executable, "-m", self.server_module, *self.server_args()]

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
        if not self.is_alive():
            try:
                self.check_alive()
            except ServerError as exc:
                raise WeightSyncError(f"cannot update weights: {exc}") from exc
        version = weight_version or path.name
        t0 = time.perf_counter()
        status, body = self._control(
            "/update_weights_from_disk", body={"model_path": str(path), "weight_version": version}
        )
        if not isinstance(body, dict):
            raise WeightSyncError(
                f"POST /update_weights_from_disk answered HTTP {status} with a non-JSON-object "
                f"body: {body!r}"
            )
        if status != 200 or body.get("success") is not True:
            message = body.get("message") or body.get("detail") or body
            raise WeightSyncError(f"server refused weights from {path} (HTTP {status}): {message}")
        self.model_path = path
        self.weight_version = version
        seconds = time.perf_counter() - t0
        logger.info("loaded weights %s into the builtin server in %.2f s", version, seconds)
        return seconds


# --------------------------------------------------------------------------------------------
# surviving a server that dies mid-run

T = TypeVar("T")


def call_with_recovery(
    server: ServerManager,
    call: Callable[[], T],
    *,
    max_restarts: int,
    what: str = "generation",
) -> T:
    """Run `call` (e.g. one generation batch); if it fails because the server died, restart the
    server from its newest weights (`ServerManager.recover`) and run `call` again, at most
    `max_restarts` times.

    "Because the server died" means the failure is a `ServerDiedError` (the completion client's
    liveness check raises it) or the server process is gone when the failure arrives. Any other
    failure (a bad request, a bug in scoring) is re-raised at once: restarting would not help.
    The retried call starts over, so `call` must be safe to repeat (a generation batch is: its
    seeds are fixed). Raises `ServerDiedError` naming the attempts once restarts are used up, and
    `ServerStartError` if a restart itself fails.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
    restarts = 0
    while True:
        try:
            return call()
        except Exception as exc:
            died = isinstance(exc, ServerDiedError) or (
                server.pid is not None and not server.is_alive() and not server._stopped_by_us
            )
            if not died:
                raise
            if restarts >= max_restarts:
                raise ServerDiedError(
                    f"{what} failed: the {server.kind} server died {restarts + 1} time(s) and "
                    f"was restarted {restarts} time(s) (max_restarts={max_restarts}); giving "
                    f"up. Last failure: {exc}"
                ) from exc
            restarts += 1
            logger.warning(
                "%s failed because the %s server died (%s); restart %d/%d and retry",
                what,
                server.kind,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                restarts,
                max_restarts,
            )
            server.recover()
