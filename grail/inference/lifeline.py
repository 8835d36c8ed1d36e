"""A server's lifeline: it ends when the process that started it dies, however that process died
(SIGKILL and the OOM killer included) and from whichever thread it started the server.

`grail.inference.os_process.spawn_server` starts two small processes with this script, both in
the server's own process group, both children of the starting process:

    python -I -S lifeline.py run -- COMMAND...   the server: waits for the starter's go, then
                                                 execs COMMAND (same pid: the starter's Popen
                                                 is the server's)
    python -I -S lifeline.py watch PID GRACE     the watchdog: blocks reading its stdin, a pipe
                                                 whose write end only the starter holds

The kernel closes the starter's end of the pipe when the starter exits, however it exits; the
watchdog then reads end-of-file, sends SIGTERM to the process group (the server and any workers it
started), waits up to GRACE seconds for the server to go, and sends SIGKILL to the group, itself
included. The go comes once the watchdog is in place, so that there is no moment at which the
server runs unwatched. A stopping starter kills the whole group, the watchdog with it, and reaps
both (`os_process.terminate_group`).

Unlike PR_SET_PDEATHSIG, which fires when the *thread* that forked the child ends, the pipe does
not care which thread started the server. One caveat: a child the starter forks without exec
inherits the pipe's write end (exec closes it), so the server then also waits for that child.

Standard library only, run with `-I -S`: it starts in milliseconds and imports nothing of grail's.
"""

from __future__ import annotations

import os
import signal
import sys
import time

EXEC_FAILED = 127  # the shell's code for a command that could not be run


def run(command: list[str]) -> None:
    """Wait for the starter's go, then become the server (exec)."""
    if not os.read(0, 1):  # the starter died before the watchdog was in place: run nothing
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDONLY)  # the server's stdin, as before the gate
    os.dup2(devnull, 0)
    os.close(devnull)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"grail: cannot start the server {command[0]!r}: {exc}", file=sys.stderr)
        os._exit(EXEC_FAILED)


def watch(server: int, grace: float) -> None:
    """Block until the starter's end of stdin closes, then stop the process group."""
    try:
        while os.read(0, 4096):  # the starter writes nothing: only end-of-file matters
            pass
    except OSError:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the others
    print(
        f"grail: the process that started this server (pid {server}) is gone; stopping it",
        file=sys.stderr,
        flush=True,
    )
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(group, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (its starter, which would reap it, is gone, and
    not every init reaps promptly)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[0] == "run" and argv[1] == "--":
        run(argv[2:])
    elif len(argv) == 3 and argv[0] == "watch":
        watch(int(argv[1]), float(argv[2]))
    else:
        sys.exit("usage: lifeline.py run -- COMMAND... | lifeline.py watch PID GRACE_S")


if __name__ == "__main__":
    main(sys.argv[1:])
