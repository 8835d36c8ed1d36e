"""OS-level helpers for running server processes: process groups, signals, ports and GPU
visibility. Nothing here knows about HTTP, logs or weights: `grail.inference.process.ServerManager`
builds on these, and the test suite's leak check reads `started_process_groups`.

The leak-proofing mechanisms that live here:
- `spawn_server` starts a server in its own process group with a watchdog beside it in that group
  (grail/inference/lifeline.py): the watchdog holds the read end of a pipe whose write end only
  this process holds, and stops the group when the kernel closes that end, which covers the case
  no Python code can handle: this process being SIGKILLed (or OOM-killed), whichever thread
  started the server. (PR_SET_PDEATHSIG, used before, is tied to the *thread* that forked the
  child: a server started from a worker thread went without it.)
- `terminate_group` sends SIGTERM to a whole process group, waits, then SIGKILL, so a server's own
  workers and its watchdog go too (they stay in its group after the leader exits); a second
  Ctrl-C while waiting skips straight to SIGKILL;
- `STARTED_GROUPS` records every server process group this interpreter started, so leak checks
  can find workers that outlive a killed leader.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Protocol

# Process-group ids of every server this interpreter started, for leak checks: a server's workers
# outlive a killed leader in its group, where a walk over our own children no longer finds them.
STARTED_GROUPS: set[int] = set()


class ServerChild(Protocol):
    """What the server manager needs of a server's process: a subprocess.Popen, or a server
    forked by the zygote (grail/inference/zygote.py's `ForkedServer`)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (ended, not yet reaped): for a process
    that is not this one's child, whose exit status no waitpid here can give."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def started_process_groups() -> frozenset[int]:
    """Process-group ids of all servers started by this process (alive or not)."""
    return frozenset(STARTED_GROUPS)


LIFELINE = str(Path(__file__).with_name("lifeline.py"))


class Leashed(subprocess.Popen[bytes]):
    """A server started by `spawn_server`, with the watchdog that stops its process group when
    this process dies (`terminate_group` reaps it with the server)."""

    watchdog: subprocess.Popen[bytes] | None = None


def _lifeline(*args: str) -> list[str]:
    # -I -S: the script needs the standard library only; it then starts in a few milliseconds.
    return [sys.executable, "-I", "-S", LIFELINE, *args]


def spawn_server(
    command: Sequence[str], *, stdout: IO[bytes], env: Mapping[str, str], grace: float
) -> Leashed:
    """Start `command` in a new process group (its pid is the group's id), writing to `stdout`,
    with its watchdog (grail/inference/lifeline.py): if this process dies, the watchdog sends the
    group SIGTERM, waits up to `grace` seconds, then SIGKILL. The server runs only once the
    watchdog is in place. A new process group, not a new session: the watchdog must join the
    server's group, which no process of another session can; a terminal's Ctrl-C reaches only
    the foreground group, this process's, either way."""
    server = Leashed(
        _lifeline("run", "--", *command),
        bufsize=0,  # the go is written at once, and a server already gone cannot fail a flush
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=subprocess.STDOUT,
        env=env,
        process_group=0,
        close_fds=True,
    )
    STARTED_GROUPS.add(server.pid)
    assert server.stdin is not None
    try:
        server.watchdog = subprocess.Popen(
            _lifeline("watch", str(server.pid), f"{grace:g}"),
            stdin=subprocess.PIPE,
            stdout=stdout,
            stderr=subprocess.STDOUT,
            process_group=server.pid,
            close_fds=True,
        )
    except BaseException:
        server.stdin.close()  # end-of-file instead of the go: the server runs nothing
        terminate_group(server, server.pid, grace=1.0)
        raise
    with contextlib.suppress(BrokenPipeError):  # it died already: wait_ready says how
        server.stdin.write(b"\n")
    server.stdin.close()
    return server


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def terminate_group(proc: ServerChild, pgid: int, grace: float) -> None:
    """SIGTERM the process group, wait up to `grace` seconds, then SIGKILL it; reap the child (and
    its watchdog, for a server `spawn_server` started).

    The final SIGKILL to the group is sent even when the leader exited on SIGTERM: a server's worker
    processes stay in its group after the leader is gone, and the group id cannot be reused while
    any member lives. A second Ctrl-C while waiting skips straight to SIGKILL.
    """
    try:
        if proc.poll() is None:
            _signal_group(pgid, signal.SIGTERM)
            # A stopped server (SIGSTOP, a debugger's, a job's) acts on SIGTERM only once
            # continued: else a hung fleet server's restart waited out the whole grace.
            _signal_group(pgid, signal.SIGCONT)
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
    finally:
        watchdog = proc.watchdog if isinstance(proc, Leashed) else None
        if watchdog is not None:
            # Killed with its group above; closing its pipe before it is gone would set it off.
            watchdog.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                watchdog.wait(timeout=5.0)
            if watchdog.stdin is not None:
                watchdog.stdin.close()


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
