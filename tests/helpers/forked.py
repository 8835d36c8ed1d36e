"""grail-train processes for the tests, forked from a runner that has imported grail already.

A grail-train started as a new interpreter spends ~6 CPU-s importing torch, transformers and
grail before it reads its config, and the suite starts ~150 of them: most of the suite's time on
a 2-core machine (docs/benchmarks.md, "The test suite's time"). So each pytest worker starts, at
its first grail-train, one *runner* (this file as a script): a process that imports what
grail-train imports, runs nothing, and forks a grail-train for each request. `popen` is
subprocess.Popen for the tests; for `python -m grail.train.cli ...` it returns a `ForkedPopen`,
a real subprocess.Popen whose child the runner forked instead of this process exec'ing it.

What the forked grail-train gets is what `python -m grail.train.cli ARGS` would have: the
arguments (`runpy`, as `-m` runs it), the environment, the working directory, stdin, stdout and
stderr as Popen set them up, its own session or process group when asked, the default signal
dispositions, a process title that is its command line (tests find processes by it), and none of
the runner's files. Where it could differ it is not forked: a request whose environment differs
from the runner's in any variable a module may read at import time (all but `LAZY`: a test's
PYTHONPATH hook, another HF_HOME; unless the request names it as read only by the interpreters
grail-train starts, `for_its_children`), any other command, or any Popen option this module
does not reproduce (`preexec_fn`, `pass_fds`, `user`, ...) starts a new interpreter as before.
torch reads ATEN_CPU_CAPABILITY at the first tensor operation and MKL its variables at the first
GEMM, which the runner never runs: a forked run picks its kernels from its own environment, as a
new interpreter does (the fingerprint test checks it bitwise). grail-serve (`python -m
grail.inference.builtin.server`) is forked the same way, as grail-train's zygote forks its
servers, and so are grail-tinker (`python -m grail.tinker.cli`) and a `python -c PROGRAM` that a
test marks as running grail-train (`popen`'s `program`). What a forked process does not do is a
new interpreter's own exit: it ends with os._exit after its atexit functions, without waiting for
its non-daemon threads, so a test of how a process ends with a thread still running starts a new
interpreter.

Exit statuses: the forked grail-train is the runner's child; the runner reaps it and sends its
raw wait status over the request's connection, which `ForkedPopen._try_wait` reads where Popen
would call waitpid. Everything else (pipes, communicate, signals to `pid`) is Popen's own.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path
from typing import Any

from grail.inference.zygote import (
    fresh_interpreter_signals,
    release_inherited_files,
    run_as_process,
)

FORKED_MODULE = "grail.train.cli"
# What else a request may run (`python -m MODULE`): grail-serve, which the runner imports for
# grail-train's zygote anyway, and which grail-train's runs fork from their zygote just so; and
# grail-tinker (~9 starts in the suite, each ~6 CPU-s of imports as a new interpreter).
FORKED_MODULES = (FORKED_MODULE, "grail.inference.builtin.server", "grail.tinker.cli")
# Imported by the runner beyond grail-train's imports, so that a forked process does not pay for
# them each time: every resource of the openai SDK, which the client's first
# `AsyncOpenAI.completions` imports (~0.5 s, ~520 modules, in each run), and what grail-tinker's
# main imports after its argument checks.
_PRELOADED = (
    "openai.resources",
    "uvicorn",
    "grail.tinker.cli",
    "grail.tinker.app",
    "grail.tinker.checkpoints",
    "grail.tinker.core",
    "grail.tinker.sampler",
    "grail.tinker.trainer",
)
# Variables read when they are used, not when a module is imported: a request may differ from
# the runner in these and still be forked.
LAZY = frozenset(
    {
        "PYTHONUNBUFFERED",
        "ATEN_CPU_CAPABILITY",
        "MKL_CBWR",
        "CUDA_VISIBLE_DEVICES",
        "PYTEST_CURRENT_TEST",  # pytest sets it for each test
        # The Tinker SDK reads it as a client starts (tinker.lib.telemetry). The worker gets it
        # (setdefault) when helpers/tinker_server.py or benchmarks/tinker_overhead.py is
        # imported: after that, in a worker whose runner had started, every run was exec'd.
        "TINKER_TELEMETRY",
        "GRAIL_TEST_STUCK_MARKER",  # tests/cli_plugins.py reads it as its plugin is called
    }
)
_SUPPORTED = {"executable": None, "preexec_fn": None, "shell": False, "pass_fds": ()}
_RUNNER_START_TIMEOUT_S = 120.0

_runner: _Runner | None = None
_runner_lock = threading.Lock()


def popen(
    args: list[str],
    *,
    for_its_children: frozenset[str] = frozenset(),
    program: bool = False,
    **kwargs: Any,
) -> subprocess.Popen[Any]:
    """subprocess.Popen(args, **kwargs), forked from this worker's runner when `args` is
    `sys.executable -m grail.train.cli ...` (or another of `FORKED_MODULES`) and nothing asks for
    more than the runner gives.
    `for_its_children`: variables the environment may set apart from the runner's because only
    the new interpreters grail-train starts read them (a PYTHONPATH hook for the trainer ranks,
    which torch spawns): the forked grail-train has them in its environment, which they
    inherit. `program`: `sys.executable -c PROGRAM ...` too, for a PROGRAM that patches
    grail-train's own process and runs it (`grail.train.cli.main()`); the forked child runs it
    as a new interpreter's `__main__`."""
    env = kwargs.get("env")
    env = dict(os.environ if env is None else env)
    head, what = list(args[:2]), args[2] if len(args) >= 3 else None
    known = what is not None and (
        (head == [sys.executable, "-m"] and what in FORKED_MODULES)
        or (program and head == [sys.executable, "-c"])
    )
    forkable = (
        known
        and all(kwargs.get(key, default) == default for key, default in _SUPPORTED.items())
        and not set(kwargs) - _KNOWN_KWARGS
        and os.environ.get("GRAIL_TEST_EXEC") != "1"  # the escape hatch: every run exec'd
    )
    if forkable:
        runner = _runner_for(env, for_its_children)
        if runner is not None:
            return ForkedPopen(args, runner=runner, **kwargs)
    return subprocess.Popen(args, **kwargs)


_KNOWN_KWARGS = frozenset(
    {
        "stdin",
        "stdout",
        "stderr",
        "text",
        "universal_newlines",
        "encoding",
        "errors",
        "bufsize",
        "cwd",
        "env",
        "start_new_session",
        "process_group",
        "close_fds",
        *_SUPPORTED,
    }
)


def run(args: list[str], *, timeout: float | None = None, **kwargs: Any) -> Any:
    """subprocess.run over `popen`: the CompletedProcess, output captured as asked."""
    if kwargs.pop("capture_output", False):
        kwargs["stdout"] = kwargs["stderr"] = subprocess.PIPE
    with popen(args, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class ForkedPopen(subprocess.Popen[Any]):
    """A Popen whose child the runner forks; its wait status comes over the runner's socket."""

    def __init__(self, args: list[str], *, runner: _Runner, **kwargs: Any) -> None:
        self._runner = runner
        self._connection: socket.socket | None = None
        self._answer = b""
        super().__init__(args, **kwargs)

    def _execute_child(self, *args: Any) -> None:
        bound = _EXECUTE.bind(self, *args).arguments
        fds = [
            bound["p2cread"] if bound["p2cread"] != -1 else 0,
            bound["c2pwrite"] if bound["c2pwrite"] != -1 else 1,
            bound["errwrite"] if bound["errwrite"] != -1 else 2,
        ]
        request = {
            "argv": [os.fsdecode(a) for a in bound["args"]],
            "env": dict(os.environ if bound["env"] is None else bound["env"]),
            "cwd": os.fsdecode(bound["cwd"]) if bound["cwd"] is not None else os.getcwd(),
            "session": bool(bound["start_new_session"]),
            "group": bound["process_group"],
        }
        try:
            self._connection, self.pid, self._answer = self._runner.fork(request, fds)
            self._child_created = True
        finally:
            self._close_pipe_fds(  # type: ignore[attr-defined]
                bound["p2cread"],
                bound["p2cwrite"],
                bound["c2pread"],
                bound["c2pwrite"],
                bound["errread"],
                bound["errwrite"],
            )

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        connection = self._connection
        assert connection is not None
        while b"\n" not in self._answer:
            timeout = 0.0 if wait_flags & os.WNOHANG else None
            ready, _, _ = select.select([connection], [], [], timeout)
            if not ready:
                return (0, 0)
            data = connection.recv(4096)
            if not data:  # the runner died: its child got SIGKILL (PR_SET_PDEATHSIG)
                return (self.pid, signal.SIGKILL)
            self._answer += data
        status = json.loads(self._answer.split(b"\n", 1)[0])["status"]
        connection.close()
        return (self.pid, int(status))

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self.returncode is None and self._waitpid_lock.acquire(False):  # type: ignore[attr-defined]
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)  # type: ignore[attr-defined]
            finally:
                self._waitpid_lock.release()  # type: ignore[attr-defined]
        return self.returncode


_EXECUTE = inspect.signature(subprocess.Popen._execute_child)  # type: ignore[attr-defined]


class _Runner:
    """This worker's end of its runner."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.address = Path(tempfile.mkdtemp(prefix="grail-runner-")) / "socket"
        self.process = subprocess.Popen(
            [sys.executable, __file__, str(self.address)],
            stdin=subprocess.PIPE,  # its end-of-file (this worker gone) ends it
            env=env,
        )
        deadline = time.monotonic() + _RUNNER_START_TIMEOUT_S
        while not self.address.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the test runner did not start ({self.process.returncode})")
            time.sleep(0.05)

    def fork(self, request: dict[str, Any], fds: list[int]) -> tuple[socket.socket, int, bytes]:
        """Ask the runner to fork `request` with `fds` as its stdin, stdout and stderr: the
        connection its wait status will come over, its pid, and what came after the pid."""
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(str(self.address))
        socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], fds)
        answer = b""
        while b"\n" not in answer:
            data = connection.recv(4096)
            if not data:
                raise OSError("the test runner closed the connection before forking")
            answer += data
        line, rest = answer.split(b"\n", 1)
        return connection, int(json.loads(line)["pid"]), rest

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=10)
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def close_runner() -> None:
    """Close this worker's runner, if one was started (the session's end does, before it looks
    for processes left behind: at exit, the runner looked like one of them)."""
    global _runner
    with _runner_lock:
        runner, _runner = _runner, None
    if runner is not None:
        atexit.unregister(runner.close)
        runner.close()


def _runner_for(env: dict[str, str], for_its_children: frozenset[str]) -> _Runner | None:
    """This worker's runner, started at the first request, if `env` may be forked from it."""
    global _runner
    with _runner_lock:
        if _runner is None:
            _runner = _Runner({**os.environ, "PYTHONUNBUFFERED": "1"})
            atexit.register(_runner.close)
        runner = _runner
    differs = {k for k in set(env) | set(runner.env) if env.get(k) != runner.env.get(k)}
    return None if differs - LAZY - for_its_children else runner


# -- the runner ----------------------------------------------------------------------------------


def _runner_main(address: str) -> None:
    """Import what grail-train imports, then fork one for each request until stdin closes."""
    from grail.core.placement import prefer_passive_openmp

    prefer_passive_openmp(os.environ)  # before torch loads, as grail.train.cli does
    import setproctitle

    import grail.train.cli  # noqa: F401
    import grail.train.loop  # noqa: F401
    from grail.inference import zygote

    for module in (*zygote.FORKABLE, *_PRELOADED):  # FORKABLE: what a run's zygote imports
        __import__(module)
    setproctitle.setproctitle(f"grail test runner (of pid {os.getppid()})")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a test's Ctrl-C is for its grail-train
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    partial = address + ".partial"
    listener.bind(partial)
    listener.listen(64)
    os.rename(partial, address)  # the worker waits for the name: it appears listening
    waiting: dict[int, socket.socket] = {}  # each child's connection
    while True:
        ready, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            return  # the worker has gone
        if listener in ready:
            connection, _ = listener.accept()
            try:
                pid = _fork_request(connection)
            except (OSError, ValueError) as exc:  # a broken request: that test's to report
                print(f"grail test runner: {exc!r}", file=sys.stderr, flush=True)
                connection.close()
                pid = None
            if pid is not None:
                waiting[pid] = connection
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            connection = waiting.pop(pid, None)
            if connection is not None:
                with contextlib.suppress(OSError):
                    connection.sendall(json.dumps({"status": status}).encode() + b"\n")
                connection.close()


def _fork_request(connection: socket.socket) -> int | None:
    message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    while not message.endswith(b"\n"):
        more = connection.recv(1 << 20)
        if not more:
            connection.close()
            return None
        message += more
    request = json.loads(message)
    settled_r, settled_w = os.pipe()
    pid = os.fork()
    if pid != 0:
        os.close(settled_w)
        os.read(settled_r, 1)  # its session and group are set, as Popen's child's before exec
        os.close(settled_r)
        for fd in fds:
            os.close(fd)
        connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        return pid
    os.close(settled_r)
    run_as_process(lambda: _forked_main(request, fds, settled_w))


def _forked_main(request: dict[str, Any], fds: list[int], settled: int) -> int:
    """In the forked grail-train: become what `python -m grail.train.cli ARGS` would be."""
    import ctypes
    import runpy

    import setproctitle

    argv = request["argv"]
    if request["session"]:
        os.setsid()
    elif request["group"] not in (None, -1):
        os.setpgid(0, request["group"])
    os.close(settled)
    setproctitle.setproctitle(" ".join(argv))  # before the environment changes: it moves it
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    fresh_interpreter_signals()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    release_inherited_files(keep={0, 1, 2})  # the runner's sockets, the fds as received
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    atexit._clear()
    if argv[1] == "-c":  # popen's `program`
        sys.argv = ["-c", *argv[3:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(argv[2], "<string>", "exec"), main.__dict__)
        return 0
    sys.argv = [argv[0], *argv[3:]]
    # `-m` runs the module as __main__ only: imported under its name too only if another module
    # imports it, as in a new interpreter.
    sys.modules.pop(argv[2], None)
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    _runner_main(sys.argv[1])
