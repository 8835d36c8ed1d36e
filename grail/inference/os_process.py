"""OS-level helpers for running server processes: process groups, signals, ports and GPU
visibility. Nothing here knows about HTTP, logs or weights: `grail.inference.process.ServerManager`
builds on these, and the test suite's leak check reads `started_process_groups`.

The leak-proofing mechanisms that live here:
- `terminate_group` sends SIGTERM to a whole process group, waits, then SIGKILL, so a server's own
  workers go too (they stay in its group after the leader exits); a second Ctrl-C while waiting
  skips straight to SIGKILL;
- on Linux, `make_preexec` has the child ask the kernel for SIGKILL when its parent dies
  (`PR_SET_PDEATHSIG`), which covers the one case no Python code can handle: the harness itself
  being SIGKILLed (or OOM-killed). The kernel ties that signal to the *thread* that forked the
  child, so it is only requested when a server is started from the main thread; a server started
  from a worker thread relies on the other mechanisms, since the worker thread ending would
  otherwise kill a healthy server;
- `STARTED_GROUPS` records every server process group this interpreter started, so leak checks
  can find workers that outlive a killed leader.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence

# Process-group ids of every server this interpreter started, for leak checks: a server's workers
# outlive a killed leader in its group, where a walk over our own children no longer finds them.
STARTED_GROUPS: set[int] = set()


def started_process_groups() -> frozenset[int]:
    """Process-group ids of all servers started by this process (alive or not)."""
    return frozenset(STARTED_GROUPS)


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


def make_preexec(parent_pid: int):
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


def terminate_group(proc: subprocess.Popen, pgid: int, grace: float) -> None:
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


def port_is_free(host: str, port: int) -> bool:
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


def port_held_by_group(port: int, pgid: int) -> bool | None:
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
