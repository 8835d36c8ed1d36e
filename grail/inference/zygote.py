"""Built-in CPU servers forked from a process that has already imported what they run.

A built-in server started as a new interpreter spends ~5 CPU-s importing torch, transformers
and FastAPI before it loads its model, and grail-train has imported all of them already (the
server's own modules add 0.04 s to the trainer's imports). So grail-train forks a *zygote* once,
after its imports and before it runs anything (`prepare`, called by grail/train/launch.py), and
every built-in CPU server of the run is forked from the zygote: ready in a fraction of a second
(the model load) instead of ~5 s, a restart in a fleet likewise: a 3-iteration run of the tiny
model takes 9.9 CPU-s instead of 13.4 (docs/benchmarks.md, "The test suite's time").

Why a zygote and not a fork of the trainer at the server's start: by then the trainer has run
tensor operations (OpenMP's pool, ATen's chosen CPU kernels, MKL's mode) and threads (rollouts,
the environment's workers, tokenizers), and a child forked from a process with threads may
inherit a lock a thread held, forever. The zygote is forked while the trainer has one Python
thread and has run no tensor operation (`prepare` checks the first; the server's own
`check_torch_honours` the second: ATen and MKL read their variables at the first operation, in
the server, from the server's environment, as in a new interpreter). Native library pools
alive at that moment (OpenBLAS's, from numpy and scipy) stop themselves at a fork
(pthread_atfork) and start again on first use. Only CPU servers are forked: a process that has
touched the CUDA driver (device counting does) cannot give it to a child.

What a forked server gets, as `spawn_server`'s would: its own process group (its pid), its log
file as stdout and stderr, /dev/null as stdin, the environment `ServerManager.child_env` built,
the default signal dispositions, a process title that is its command line (`ps` shows the
server, not another grail-train), and no file the trainer held open (the run directory's lock
among them: each is pointed at /dev/null, so an object that later closes its number closes
nothing the server opened). Its lifeline: the zygote reads requests from a pipe only the trainer
writes, and when the trainer dies, by any signal, from any thread (the kernel closes the pipe),
it stops every server's group (SIGTERM, the grace, SIGKILL) and exits; each server has
PR_SET_PDEATHSIG=SIGTERM towards the zygote (one thread: the flag's thread caveat does not
apply), so a zygote that dies without cleaning up takes them along.

Protocol (JSON lines): the trainer writes {"argv", "env", "cwd", "log", "grace"}; the zygote
answers {"started": pid} (or {"error": text}) in request order, and {"exit": pid, "returncode":
rc} (subprocess's convention: -N for signal N) whenever a server ends. `ForkedServer` is the
subprocess.Popen surface the server manager uses (pid, returncode, poll, wait).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import setproctitle

from grail.inference import os_process

logger = logging.getLogger(__name__)

# The modules a zygote runs as `python -m MODULE ARGS`: what it has imported, it can run.
FORKABLE = ("grail.inference.builtin.server",)
_PR_SET_PDEATHSIG = 1
# How long the trainer waits for the zygote's answer to a start, and for it to end after close.
_ANSWER_TIMEOUT_S = 30.0
_POLL_S = 0.05

_current: Zygote | None = None
_current_lock = threading.Lock()


class ZygoteGone(RuntimeError):
    """The zygote did not answer (it died, or was stopped): start the server as a new process."""


def current() -> Zygote | None:
    """This process's zygote, if `prepare` made one and it still answers."""
    return _current if _current is not None and _current.alive else None


def prepare() -> Zygote | None:
    """Fork this process's zygote, once (later calls return it): None where forking is not
    safe (a second Python thread runs) or possible (no fork)."""
    global _current
    with _current_lock:
        if _current is not None:
            return _current if _current.alive else None
        if threading.active_count() > 1 or not hasattr(os, "fork"):
            logger.debug("no server zygote: %d threads run", threading.active_count())
            return None
        for module in FORKABLE:  # what the servers run, imported once here for all of them
            importlib.import_module(module)
        _current = Zygote.fork()
        atexit.register(_current.close)
        return _current


def forkable(command: Sequence[str]) -> bool:
    """Whether `command` is `python -m MODULE ...` with this interpreter and a forkable module."""
    return (
        len(command) >= 3
        and command[0] == sys.executable
        and command[1] == "-m"
        and command[2] in FORKABLE
    )


class ForkedServer:
    """A server the zygote forked: the part of subprocess.Popen that `ServerManager` and
    `os_process.terminate_group` use. Its returncode comes from the zygote, its parent."""

    def __init__(self, zygote: Zygote, pid: int, args: Sequence[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode


class Zygote:
    """The trainer's end of a zygote: start servers, learn how they ended, close."""

    def __init__(self, pid: int, requests: int, answers: int) -> None:
        self.pid, self._requests, self._answers = pid, requests, answers
        self._lock = threading.Lock()
        self._buffer = b""
        self._started: list[dict[str, Any]] = []  # answers to starts, in order
        self._exits: dict[int, int] = {}
        self.alive = True

    @classmethod
    def fork(cls) -> Zygote:
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote
            code = 1
            try:
                os.close(requests_w)
                os.close(answers_r)
                code = _zygote_main(requests_r, answers_w)
            finally:
                os._exit(code)
        os.close(requests_r)
        os.close(answers_w)
        logger.debug("server zygote forked (pid %d)", pid)
        return cls(pid, requests_w, answers_r)

    def spawn(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        log: Path,
        grace: float,
    ) -> ForkedServer:
        """Fork `command` (a `forkable` one) from the zygote, appending its output to `log`."""
        if not forkable(command):
            raise ValueError(f"the zygote runs only {FORKABLE} with this interpreter: {command}")
        request = {
            "argv": list(command),
            "env": dict(env),
            "cwd": os.getcwd(),
            "log": str(log),
            "grace": grace,
        }
        with self._lock:
            if not self.alive:
                raise ZygoteGone("the server zygote has ended")
            try:
                _write_all(self._requests, json.dumps(request).encode() + b"\n")
            except OSError as exc:
                self._gone()
                raise ZygoteGone(f"the server zygote does not take requests: {exc}") from exc
            deadline = time.monotonic() + _ANSWER_TIMEOUT_S
            while not self._started:
                if not self.alive or time.monotonic() >= deadline:
                    self._gone()
                    raise ZygoteGone("the server zygote did not answer a start")
                self._pump(_POLL_S)
            answer = self._started.pop(0)
        if "error" in answer:
            raise OSError(f"the server zygote could not fork the server: {answer['error']}")
        return ForkedServer(self, int(answer["started"]), command)

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """How server `pid` ended, waiting up to `timeout` seconds (None: for good); None while
        it runs."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if pid in self._exits:
                    return self._exits[pid]
                if not self.alive:
                    # Its exit notice died with the zygote; PR_SET_PDEATHSIG sent it SIGTERM.
                    if not os_process.process_alive(pid):
                        return -signal.SIGTERM
                else:
                    left = _POLL_S if deadline is None else deadline - time.monotonic()
                    self._pump(max(0.0, min(_POLL_S, left)))
                    if pid in self._exits:
                        return self._exits[pid]
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if not self.alive:
                time.sleep(_POLL_S)

    def close(self, timeout: float = 30.0) -> None:
        """End the zygote: it stops the servers still running (SIGTERM, their grace, SIGKILL)
        and exits. Waits up to `timeout` seconds for it."""
        with self._lock:
            if self._requests < 0:
                return
            os.close(self._requests)
            self._requests = -1
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    if os.waitpid(self.pid, os.WNOHANG)[0] != 0:
                        break
                time.sleep(_POLL_S)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
            os.close(self._answers)
            self.alive = False

    def _pump(self, timeout: float) -> None:
        """Read what the zygote has said within `timeout` seconds (the lock held)."""
        ready, _, _ = select.select([self._answers], [], [], timeout)
        if not ready:
            return
        data = os.read(self._answers, 65536)
        if not data:
            self._gone()
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            message = json.loads(line)
            if "exit" in message:
                self._exits[int(message["exit"])] = int(message["returncode"])
            else:
                self._started.append(message)

    def _gone(self) -> None:
        if self.alive:
            logger.warning("the server zygote (pid %d) has ended: servers start anew", self.pid)
        self.alive = False


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- in the zygote -------------------------------------------------------------------------------


def _zygote_main(requests: int, answers: int) -> int:
    """Serve start requests until the trainer's end of the pipe closes; then stop every server."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the trainer's to handle
    setproctitle.setproctitle(f"grail server zygote (of pid {os.getppid()})")
    release_inherited_files(keep={0, 1, 2, requests, answers})
    graces: dict[int, float] = {}
    buffer = b""
    while True:
        ready, _, _ = select.select([requests], [], [], _POLL_S)
        if ready:
            data = os.read(requests, 1 << 20)
            if not data:
                break
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                request = json.loads(line)
                try:
                    pid = _fork_server(request, requests, answers)
                except OSError as exc:
                    _answer(answers, {"error": f"{type(exc).__name__}: {exc}"})
                else:
                    graces[pid] = float(request["grace"])
                    _answer(answers, {"started": pid})
        for pid, returncode in _reap():
            graces.pop(pid, None)
            _answer(answers, {"exit": pid, "returncode": returncode})
    _stop_all(graces)
    return 0


def _answer(answers: int, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the trainer is gone: nobody reads
        _write_all(answers, json.dumps(message).encode() + b"\n")


def _reap() -> list[tuple[int, int]]:
    ended: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _stop_all(graces: dict[int, float]) -> None:
    """The trainer is gone: SIGTERM every server's group, wait their grace, SIGKILL, reap."""
    for pid in graces:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)
    deadline = time.monotonic() + max(graces.values(), default=0.0)
    running = set(graces)
    while running and time.monotonic() < deadline:
        running -= {pid for pid, _ in _reap()}
        time.sleep(_POLL_S)
    for pid in graces:  # the leader's own children stay in its group after it ends
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        while running:
            running.discard(os.waitpid(-1, 0)[0])


def fresh_interpreter_signals() -> None:
    """Signal dispositions and mask as a new CPython interpreter starts with: SIGINT raises
    KeyboardInterrupt (SIG_DFL would kill the process without its clean-up), SIGPIPE and SIGXFSZ
    ignored, every other signal at its default, none blocked (a rank blocks SIGINT from birth)."""
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        handler: Any = signal.SIG_DFL
        if sig == signal.SIGINT:
            handler = signal.default_int_handler
        elif sig in (signal.SIGPIPE, signal.SIGXFSZ):
            handler = signal.SIG_IGN
        with contextlib.suppress(OSError, ValueError):  # the real-time ones Python cannot set
            signal.signal(sig, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())


def release_inherited_files(keep: set[int]) -> None:
    """Point every inherited descriptor but `keep` at /dev/null: the files (the run's lock) are
    released, and a number stays taken, so an inherited object that closes it later cannot
    close a socket the server opened under that number."""
    null = os.open(os.devnull, os.O_RDWR)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep and fd != null:
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
    os.close(null)


def _fork_server(request: Mapping[str, Any], requests: int, answers: int) -> int:
    argv = [str(a) for a in request["argv"]]
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    zygote = os.getpid()
    pid = os.fork()
    if pid != 0:
        os.close(log)
        return pid
    run_as_process(lambda: _server_main(argv, request, log, zygote, (requests, answers)))


def run_as_process(main: Callable[[], int]) -> NoReturn:
    """In a forked child: run `main` and end the process with its code as an interpreter would
    end (`sys.exit(None)` 0, a message 1 after printing it, an exception's traceback 1), after
    the exit functions `main` registered and a flush of stdout and stderr, never returning into
    the code that forked."""
    code = 1
    try:
        code = main()
    except SystemExit as exit_:
        if exit_.code is None or isinstance(exit_.code, int):
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _server_main(
    argv: list[str], request: Mapping[str, Any], log: int, zygote: int, pipes: tuple[int, int]
) -> int:
    """In the forked server: become what a new interpreter running `argv` would be, run it."""
    os.setpgid(0, 0)
    setproctitle.setproctitle(" ".join(argv))  # before the environment changes: it moves it
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != zygote:  # it died before the flag was set
        return 1
    fresh_interpreter_signals()
    for fd in pipes:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    for stream in (sys.stdout, sys.stderr):  # as PYTHONUNBUFFERED=1 would
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True, write_through=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    atexit._clear()
    # The trainer's logging went to its files and console: the server configures its own.
    for each in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        if isinstance(each, logging.Logger):
            each.handlers.clear()
    sys.argv = [argv[2], *argv[3:]]
    main = importlib.import_module(argv[2]).main
    return int(main(argv[3:]))
