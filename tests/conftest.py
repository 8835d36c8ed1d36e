"""Shared test fixtures and session checks."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from grail.core.reproducible import pin_this_process

# Runs are reproducible=true by default, the runs tests make in this process included: pin this
# process's kernels as grail-train pins its own, so a test's numbers are the same on every x86-64
# CPU with AVX2 (AVX-512 ones too) and in-process runs pass their check. The environment children
# inherit is left as it was: each run they start must pin its own kernels, which .ci/run checks by
# running the learning tests again under an exported ATEN_CPU_CAPABILITY=default.
pin_this_process()

# A test session started in the background of a non-interactive shell (`cmd &`) inherits SIGINT
# ignored, and so would every grail-train it starts (an ignored signal stays ignored across exec):
# the Ctrl-C tests would see their runs carry on. A handled SIGINT is reset to the default in a
# child, where Python installs its KeyboardInterrupt handler again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# --------------------------------------------------------------------------------------------
# Process-leak check: "no child process is left after the test session".
#
# At the very end of the session (after every fixture, session-scoped servers included, has been
# torn down) list the processes that are still alive and are either children of this pytest
# process or members of a process group that an inference server started by this process owned
# (a server's workers stay in its group after the leader dies). Any such process fails the
# session loudly, is listed, and is then killed so that it does not outlive the run.


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, pgid) of a live process from /proc/PID/stat; None if gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = raw[raw.rindex(")") + 2 :].split()
    state, ppid, pgid = fields[0], int(fields[1]), int(fields[2])
    if state in ("Z", "X"):
        return None
    return state, ppid, pgid


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def leaked_processes() -> dict[int, str]:
    """Live children of this process and live members of server process groups: pid -> command."""
    if not Path("/proc/self/stat").exists():
        return {}
    try:
        from grail.inference.os_process import started_process_groups

        server_groups = started_process_groups()
    except ImportError:
        server_groups = frozenset()
    me = os.getpid()
    leaked: dict[int, str] = {}
    child_groups: set[int] = set()
    stats: dict[int, tuple[str, int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != me:
            stat = _proc_stat(int(entry))
            if stat is not None:
                stats[int(entry)] = stat
    for pid, (_, ppid, pgid) in stats.items():
        if ppid == me:
            leaked[pid] = _cmdline(pid)
            if pgid != os.getpgid(0):
                child_groups.add(pgid)
    for pid, (_, _, pgid) in stats.items():
        if pgid in child_groups or pgid in server_groups:
            leaked.setdefault(pid, _cmdline(pid))
    return leaked


@pytest.hookimpl(trylast=True)  # after the runner has torn down session-scoped fixtures
def pytest_sessionfinish(session: pytest.Session) -> None:
    forked = sys.modules.get("helpers.forked")  # its runner is this session's child, no leak
    if forked is not None:
        forked.close_runner()
    leaked = leaked_processes()
    if not leaked:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"  pid {pid}: {cmd}" for pid, cmd in sorted(leaked.items())]
    message = (
        f"{len(leaked)} process(es) started by this test session are still alive "
        "(an inference server or its worker leaked); killing them:\n" + "\n".join(lines)
    )
    if reporter is not None:
        reporter.write_sep("!", "PROCESS LEAK", red=True, bold=True)
        reporter.write_line(message, red=True)
    else:
        print(message)
    for pid in leaked:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


# --------------------------------------------------------------------------------------------
# Heaviest files first. `-n 2 --dist loadfile` hands each worker one file at a time in collection
# order (with --no-loadscope-reorder: xdist's own reorder puts files with MANY tests first, which
# sent the few-but-long run tests to the end, where one worker ran them while the other sat idle:
# the last 5% of a run took 3 of its 17.5 minutes). Longest first is the classic schedule that
# keeps that tail short. Seconds per file measured with `uv run pytest --durations=0` (summed per
# file) on the 2-core CI-like machine; a file not listed runs after these, in its usual order. The
# files whose tests start from `warm_base` (lora, service, tinker) stand apart: the first builds
# it (~80 s), and a worker that asks while the other builds waits idle (test_service's setup
# waited 40 s when it came right after test_lora).
HEAVIEST_FILES = (  # seconds per file, 2026-11-30
    "test_distributed_run.py",  # 140
    "test_benchmarks.py",  # 134
    "test_lora.py",  # 86 (builds the warm base)
    "test_fleet.py",  # 71
    "test_cli.py",  # 46
    "test_packing.py",  # 44
    "test_service.py",  # 46
    "test_ladder.py",  # 43
    "test_server_rollouts.py",  # 41
    "test_tinker.py",  # 38
    "test_external_servers.py",  # 36
    "test_train_loop.py",  # 32
    "test_trl_parity.py",  # 31
    "test_server_hardening.py",  # 30
    "test_two_nodes.py",  # 30
    "test_sweep.py",  # 26
    "test_fingerprint.py",  # 25
    "test_zygote.py",  # 25
    "test_tinker_server_sampler.py",  # 24
    "test_prune.py",  # 23
    "test_run_safety.py",  # 23
    "test_episode_runs.py",  # 23
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within kept


# --------------------------------------------------------------------------------------------
# The tiny offline model (grail.models.tiny), shared by every test that needs a real model.


# The held-out success from which the learning tests start: the warm base is the default job's
# first checkpoint that reaches it. Where that is differs by CPU vendor and torch (the jump from
# copying the digit to stopping after it comes between iterations ~80 and ~140), so a fixed
# iteration count could leave a base that has not begun to stop (success 0.004 after 80
# iterations on an Intel Xeon, 0.086 on an AMD EPYC), from which LoRA barely learns.
WARM_BASE_SUCCESS = 0.3


def built_once(
    tmp_path_factory: pytest.TempPathFactory,
    testrun_uid: str,
    name: str,
    build: Callable[[Path], Any],
) -> Path:
    """`build(run_dir)` once per test run, whichever xdist worker asks first (the others wait on
    the lock, then read what it built): a reference run every worker's tests assert on."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # every xdist worker's base's parent
    run_dir = shared / f"{name}-{testrun_uid}"
    with FileLock(str(shared / f"{name}-{testrun_uid}.lock"), timeout=900):
        if not (run_dir / "built").exists():
            build(run_dir)
            (run_dir / "built").touch()
    return run_dir


@pytest.fixture(scope="session")
def warm_base(tmp_path_factory: pytest.TempPathFactory, testrun_uid: str) -> Path:
    """A base that knows its tokens and has begun to stop after them: the default job's first
    checkpoint (every 4 iterations) whose held-out success reaches `WARM_BASE_SUCCESS`
    (helpers/warm_base.py). Built once per test run (`built_once`): the LoRA, service and Tinker
    learning tests start from it."""
    from helpers.warm_base import build_warm_base, first_reaching

    run_dir = built_once(
        tmp_path_factory,
        testrun_uid,
        "warm-base",
        lambda path: build_warm_base(path, WARM_BASE_SUCCESS),
    )
    base = first_reaching(run_dir, WARM_BASE_SUCCESS)
    return run_dir / "checkpoints" / f"iter_{base:03d}"


@pytest.fixture(scope="session")
def one_server_run(tmp_path_factory: pytest.TempPathFactory, testrun_uid: str) -> Path:
    """The short default job (helpers/short_runs.py) with the one server grail starts: what a
    fleet and servers started by hand must reproduce. Built once per test run (`built_once`)."""
    from helpers.short_runs import short_config

    from grail.train.loop import run

    return built_once(
        tmp_path_factory, testrun_uid, "one-server", lambda path: run(short_config(), path)
    )


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory: pytest.TempPathFactory, testrun_uid: str) -> Path:
    """grail-train on the SMALL workload (helpers/grail_process.py) for one iteration in one
    trainer process, evaluation off: the iteration 0 that two ranks and two nodes must compute
    as one process does (their tests compare its update, which neither the length of the run,
    evaluation nor the collective timeout changes). Built once per test run (`built_once`)."""
    from helpers.rank_runs import grail_train

    def build(run_dir: Path) -> None:
        code, out, _ = grail_train(run_dir, "train.iterations=1", "eval.enabled=false")
        assert code == 0, out[-3000:]

    return built_once(tmp_path_factory, testrun_uid, "one-process", build)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, built once into the user cache ($GRAIL_CACHE_DIR or ~/.cache/grail) so
    repeated test runs reuse it; a session temp dir when that cache is not writable."""
    from grail.models.tiny import ensure_tiny_model

    try:
        return ensure_tiny_model()
    except PermissionError:
        return ensure_tiny_model(tmp_path_factory.mktemp("grail-cache"))


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`grail-serve` on the tiny model (CPU, one thread: batch-invariant) served as "tiny",
    started once for the session (a start costs seconds of imports) and shared by the tests that
    sample from it. A test that loads other weights into it loads the tiny model back."""
    from grail.inference.backends.builtin import BuiltinServer

    server = BuiltinServer(
        tiny_model_dir,
        "tiny",
        log_dir=tmp_path_factory.mktemp("tiny-server"),
        threads=1,
        start_timeout=180,
    )
    with server:
        yield server
    assert _proc_stat(server.pid) is None, "the tiny server outlived its stop"
