"""Server lifecycle: start, readiness, death detection, weight sync, and never leaking a process.

These run against `tests/helpers/fake_server.py` (the built-in server's command line, no model),
so they test the manager's logic in well under a second per server.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from helpers.fake_server import FakeBuiltinServer
from helpers.rank_runs import members

from grail.inference import os_process
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.errors import ServerDiedError, ServerError, ServerStartError, WeightSyncError
from grail.inference.os_process import parse_device

TESTS_DIR = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="process checks read /proc (Linux only)"
)


def process_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an exited, unreaped process)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return raw[raw.rindex(")") + 2] not in "ZX"


def wait_until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_dead(pid: int, timeout: float = 5.0) -> bool:
    return wait_until(lambda: not process_alive(pid), timeout)


def debug_info(server: BuiltinServer) -> dict:
    return httpx.get(f"{server.root_url}/debug/info", timeout=5).json()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "model"
    path.mkdir()
    return path


@pytest.fixture
def make_server(tmp_path: Path, model_dir: Path):
    """Build fake servers that are always stopped at the end of the test, pass or fail."""
    made: list[FakeBuiltinServer] = []

    def make(*extra_args: str, **kwargs) -> FakeBuiltinServer:
        kwargs.setdefault("log_dir", tmp_path / "logs")
        kwargs.setdefault("start_timeout", 20.0)
        kwargs.setdefault("stop_timeout", 5.0)
        server = FakeBuiltinServer(
            kwargs.pop("model_path", model_dir), "tiny", extra_args=extra_args, **kwargs
        )
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop(timeout=1.0)


# ---- start / ready / stop ----------------------------------------------------------------------


def test_start_ready_stop_leaves_no_process(make_server, model_dir: Path) -> None:
    server = make_server(threads=1)
    server.launch()
    pid = server.pid
    assert pid is not None and server.is_alive()
    assert server.base_url == f"http://127.0.0.1:{server.port}/v1"
    models = httpx.get(f"{server.base_url}/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == [server.model_name] == ["tiny"]
    info = debug_info(server)
    assert info["pid"] == pid
    # CPU server: no GPU visible, threads pinned both in env and on the command line
    assert info["env"] == {
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    argv = info["argv"]
    assert argv[argv.index("--model") + 1] == str(model_dir.absolute())
    assert argv[argv.index("--threads") + 1] == "1"
    assert argv[argv.index("--device") + 1] == "cpu"
    # own process group, so a terminal Ctrl-C reaches only the harness; its watchdog there too
    assert os.getpgid(pid) == pid != os.getpgid(0)
    assert len(members(pid)) == 2

    server.stop()
    assert not process_alive(pid)
    assert not server.is_alive()
    server.stop()  # idempotent
    with pytest.raises(ServerError, match="was stopped"):
        server.check_alive()


def test_gpu_server_sees_only_its_gpu_as_cuda0(make_server, monkeypatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    server = make_server(device="cuda:3")
    server.launch()
    info = debug_info(server)
    assert info["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert info["argv"][info["argv"].index("--device") + 1] == "cuda:0"


def test_slow_start_is_waited_for(make_server) -> None:
    server = make_server("--start-delay", "0.8")
    waited = server.launch()
    assert waited >= 0.7
    assert server.is_alive()


def test_busy_port_is_refused_clearly(make_server) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        server = make_server(port=busy)
        with pytest.raises(ServerStartError, match=f"port {busy} .* already in use"):
            server.launch()
    assert server.pid is None


def test_port_taken_during_startup_is_retried_on_a_new_port(make_server, monkeypatch) -> None:
    # The race between picking a free port and the server binding it, forced: the first "free"
    # port is taken by another job's server, which even answers GET /health with 200.
    class Foreign(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    foreign = ThreadingHTTPServer(("127.0.0.1", 0), Foreign)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        taken = foreign.server_address[1]
        ports = iter([taken])
        real = os_process.free_port
        monkeypatch.setattr(os_process, "free_port", lambda host: next(ports, None) or real(host))
        server = make_server("--start-delay", "0.3")  # the foreign 200 comes first
        server.launch()
        assert server.port != taken
        assert debug_info(server)["pid"] == server.pid  # talking to our own server
    finally:
        foreign.shutdown()
        foreign.server_close()


def test_api_key_is_passed_by_the_environment_never_argv_nor_logged(
    make_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the command line (--api-key) the key was in `ps` for every user of the machine."""
    monkeypatch.setenv("GRAIL_API_KEY", "sk-inherited")  # not the server's key: replaced
    server = make_server(api_key="sk-secret-123")
    server.launch()
    info = debug_info(server)
    assert info["key"] == "sk-secret-123"
    assert "--api-key" not in info["argv"] and "sk-secret-123" not in " ".join(info["argv"])
    assert "sk-secret-123" not in server.log_path.read_text()
    keyless = make_server()  # a GRAIL_API_KEY of the harness's own environment is not passed on
    keyless.launch()
    assert debug_info(keyless)["key"] is None


# ---- failures during start-up ------------------------------------------------------------------


def test_failed_start_reports_exit_code_and_log_tail(make_server, model_dir: Path) -> None:
    (model_dir / "FAIL_START").touch()
    server = make_server()
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        server.launch()
    assert time.monotonic() - t0 < 10
    message = str(info.value)
    assert "exited during start-up with exit code 3" in message
    assert "FAIL_START marker present" in message  # the server's own words, from its log
    assert str(server.log_path) in message
    assert not process_alive(server.pid)


def test_start_timeout_reports_clearly_and_leaves_no_process(make_server) -> None:
    server = make_server("--health-status", "503", start_timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        server.launch()
    elapsed = time.monotonic() - t0
    assert 1.0 <= elapsed < 5.0
    message = str(info.value)
    assert "not ready after 1.0 s" in message
    assert "HTTP 503" in message
    assert "listening on" in message  # log tail
    assert not process_alive(server.pid)


# ---- death while serving -----------------------------------------------------------------------


def test_sigkilled_server_is_detected(make_server) -> None:
    server = make_server()
    server.launch()
    server.check_alive()  # healthy: no error
    os.kill(server.pid, signal.SIGKILL)
    # a zombie leader is reported by waitpid only once all its threads are gone
    assert wait_until(lambda: not server.is_alive())
    with pytest.raises(ServerDiedError, match="killed by SIGKILL") as info:
        server.check_alive()
    assert "listening on" in str(info.value)


def test_crashed_server_reports_exit_code_and_its_last_words(make_server) -> None:
    server = make_server("--die-after", "0.3")
    server.launch()
    pid = server.pid
    assert wait_until(lambda: not server.is_alive())
    with pytest.raises(ServerDiedError) as info:
        server.check_alive()
    message = str(info.value)
    assert f"pid {pid}" in message and "exit code 7" in message
    assert "simulated crash (CUDA error: illegal memory access)" in message


# ---- stopping ----------------------------------------------------------------------------------


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored(make_server) -> None:
    server = make_server("--ignore-sigterm")
    server.launch()
    t0 = time.monotonic()
    server.stop(timeout=0.5)
    assert time.monotonic() - t0 < 3.0
    assert server.returncode == -signal.SIGKILL
    assert not process_alive(server.pid)


def test_stop_kills_the_servers_workers_too(make_server) -> None:
    server = make_server("--spawn-worker")
    server.launch()
    worker = debug_info(server)["worker_pid"]
    assert process_alive(worker)
    server.stop(timeout=2.0)
    # the leader exits on SIGTERM; the worker ignores it and must still be gone
    assert wait_dead(worker, 3.0), "worker process survived stop()"


def test_context_manager_stops_on_exception(make_server) -> None:
    server = make_server()
    with pytest.raises(RuntimeError, match="boom"), server as running:
        pid = running.pid
        assert process_alive(pid)
        raise RuntimeError("boom")
    assert not process_alive(pid)


def test_launch_inside_with_is_a_no_op(make_server) -> None:
    with make_server() as server:
        pid = server.pid
        assert server.launch() == 0.0
        assert server.pid == pid and server.is_alive()
    assert not process_alive(pid)


def test_interrupted_startup_stops_the_server(make_server, monkeypatch) -> None:
    server = make_server()

    def interrupted(timeout=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "wait_ready", interrupted)
    with pytest.raises(KeyboardInterrupt), server:
        pass
    assert not process_alive(server.pid)  # stopped by launch(), with the manager still referenced


def test_garbage_collected_manager_stops_its_server(tmp_path: Path, model_dir: Path) -> None:
    server = FakeBuiltinServer(model_dir, "tiny", log_dir=tmp_path, start_timeout=20)
    server.launch()
    pid = server.pid
    del server
    gc.collect()
    assert wait_dead(pid), "server outlived its (garbage collected) manager"


# ---- parent processes that die -----------------------------------------------------------------


PARENT_SCRIPT = """
import signal, sys, time
sys.path.insert(0, {tests_dir!r})
signal.signal(signal.SIGINT, signal.default_int_handler)  # even if launched with SIGINT ignored
from helpers.fake_server import FakeBuiltinServer
from helpers.rank_runs import members
server = FakeBuiltinServer({model!r}, "tiny", log_dir={log_dir!r}, start_timeout=20,
                           extra_args={extra!r}, stop_timeout={stop_timeout!r})
{body}
"""


def run_parent(
    tmp_path: Path,
    model_dir: Path,
    body: str,
    extra: tuple[str, ...] = (),
    stop_timeout: float = 15.0,
):
    code = PARENT_SCRIPT.format(
        tests_dir=str(TESTS_DIR),
        model=str(model_dir),
        log_dir=str(tmp_path / "parent-logs"),
        extra=list(extra),
        stop_timeout=stop_timeout,
        body=textwrap.dedent(body),
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def read_line(proc: subprocess.Popen, timeout: float = 20.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        proc.kill()
        raise AssertionError(f"parent script printed nothing in {timeout} s: {proc.stderr.read()}")
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise AssertionError(f"parent script exited early: {proc.stderr.read()}")
    return line.strip()


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)


# A server started from a worker thread whose thread has ended: PR_SET_PDEATHSIG, tied to the
# thread that forked, would have killed it then, or (not asked for) never.
STARTERS = {
    "main thread": "server.launch()",
    "worker thread": "import threading\n"
    "starter = threading.Thread(target=server.launch)\nstarter.start()\nstarter.join()",
}


@pytest.mark.parametrize("starter", STARTERS)
def test_sigkilled_parent_leaves_no_orphan(tmp_path: Path, model_dir: Path, starter: str) -> None:
    body = f"{STARTERS[starter]}\nprint(server.pid, flush=True)\ntime.sleep(60)"
    parent = run_parent(tmp_path, model_dir, body, stop_timeout=2.0)
    child = int(read_line(parent))
    try:
        assert process_alive(child)
        assert len(members(child)) == 2  # the server and its watchdog
        parent.send_signal(signal.SIGKILL)  # no finally, no atexit: only the kernel can help
        parent.wait(timeout=10)
        assert wait_until(lambda: not members(child), 5.0), (
            f"server group survived its SIGKILLed parent: {members(child)}"
        )
        log = (tmp_path / "parent-logs" / "builtin-tiny.log").read_text()
        assert "is gone; stopping it" in log
    finally:
        with contextlib.suppress(OSError):
            os.killpg(child, signal.SIGKILL)
        parent.kill()
        parent.wait()


def test_ctrl_c_in_parent_stops_the_server(tmp_path: Path, model_dir: Path) -> None:
    body = """
    with server:
        print(server.pid, flush=True)
        time.sleep(60)
    """
    parent = run_parent(tmp_path, model_dir, body)
    child = int(read_line(parent))
    try:
        parent.send_signal(signal.SIGINT)
        _, stderr = parent.communicate(timeout=15)
        assert "KeyboardInterrupt" in stderr
        # stopped by the context manager before the parent exited, not later by the kernel
        assert not process_alive(child)
    finally:
        kill_quietly(child)
        parent.kill()
        parent.wait()


def test_ctrl_c_during_startup_stops_the_server(tmp_path: Path, model_dir: Path) -> None:
    body = """
    print("starting", flush=True)
    with server:
        pass
    """
    parent = run_parent(tmp_path, model_dir, body, extra=("--start-delay", "30"))
    assert read_line(parent) == "starting"
    log = tmp_path / "parent-logs" / "builtin-tiny.log"
    deadline = time.monotonic() + 15
    while "pid=" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, "fake server never wrote its pid"
        time.sleep(0.05)
    child = int(log.read_text().split("pid=")[1].split()[0])
    try:
        parent.send_signal(signal.SIGINT)  # lands while launch() polls /health
        parent.communicate(timeout=15)
        assert not process_alive(child)
    finally:
        kill_quietly(child)
        parent.kill()
        parent.wait()


# ---- weight sync -------------------------------------------------------------------------------


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "iter_001"
    path.mkdir()
    return path


def test_in_place_update_keeps_the_process(make_server, checkpoint: Path) -> None:
    server = make_server()
    server.launch()
    pid = server.pid
    result = server.sync_weights(checkpoint)
    assert (result.mode_used, result.fell_back, result.fallback_reason) == ("in_place", False, None)
    assert result.seconds > 0
    info = debug_info(server)
    assert info["pid"] == pid
    assert info["model"] == str(checkpoint) and info["weight_version"] == "iter_001"
    assert server.weight_version == "iter_001"


def test_failed_in_place_update_falls_back_to_restart_with_warning(
    make_server, checkpoint: Path, caplog
) -> None:
    (checkpoint / "FAIL_UPDATE").touch()
    server = make_server()
    server.launch()
    old_pid, old_url = server.pid, server.base_url
    with caplog.at_level(logging.WARNING, logger="grail.inference.process"):
        result = server.sync_weights(checkpoint)
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert "shape mismatch in layer 0" in result.fallback_reason
    assert any("falling back to a restart" in r.getMessage() for r in caplog.records)
    assert not process_alive(old_pid)
    assert server.pid != old_pid and server.is_alive()
    assert server.base_url == old_url  # clients built on base_url keep working
    assert debug_info(server)["model"] == str(checkpoint)


def test_in_place_failure_without_fallback_raises(make_server, checkpoint: Path) -> None:
    (checkpoint / "FAIL_UPDATE").touch()
    server = make_server()
    server.launch()
    pid = server.pid
    with pytest.raises(WeightSyncError, match="HTTP 400.*shape mismatch in layer 0"):
        server.sync_weights(checkpoint, fallback=False)
    assert server.pid == pid and server.is_alive()


def test_failed_restart_fallback_raises_and_leaves_no_process(
    make_server, checkpoint: Path
) -> None:
    (checkpoint / "FAIL_UPDATE").touch()
    (checkpoint / "FAIL_START").touch()
    server = make_server()
    server.launch()
    with pytest.raises(WeightSyncError) as info:
        server.sync_weights(checkpoint)
    message = str(info.value)
    assert "in-place update failed" in message and "shape mismatch" in message
    assert "restarting the builtin server" in message and "exit code 3" in message
    assert not server.is_alive() and not process_alive(server.pid)


def test_update_on_a_dead_server_says_so_and_restart_recovers(
    make_server, checkpoint: Path
) -> None:
    server = make_server()
    server.launch()
    os.kill(server.pid, signal.SIGKILL)
    assert wait_until(lambda: not server.is_alive())
    with pytest.raises(WeightSyncError, match="died with exit code -9"):
        server.update_weights(checkpoint)
    result = server.sync_weights(checkpoint)
    assert (result.mode_used, result.fell_back) == ("restart", True)
    assert server.is_alive()


def test_restart_mode_and_bad_arguments(make_server, checkpoint: Path, tmp_path: Path) -> None:
    server = make_server()
    server.launch()
    pid = server.pid
    result = server.sync_weights(checkpoint, mode="restart")
    assert (result.mode_used, result.fell_back) == ("restart", False)
    assert server.pid != pid and debug_info(server)["model"] == str(checkpoint)
    missing = tmp_path / "nope"
    with pytest.raises(WeightSyncError, match=f"{missing} does not exist"):
        server.update_weights(missing)
    with pytest.raises(ValueError, match="'in_place' or 'restart'"):
        server.sync_weights(checkpoint, mode="nccl")  # type: ignore[arg-type]


# ---- construction ------------------------------------------------------------------------------


def test_parse_device() -> None:
    assert parse_device("cpu") == ()
    assert parse_device("cuda") == (0,)
    assert parse_device("cuda:2") == (2,)
    assert parse_device("cuda:0,1") == (0, 1)
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:1,1"):
        with pytest.raises(ValueError, match="device"):
            parse_device(bad)


def test_bad_construction_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="device"):
        BuiltinServer(tmp_path, "m", log_dir=tmp_path, device="tpu")
    with pytest.raises(ValueError, match="one device"):
        BuiltinServer(tmp_path, "m", log_dir=tmp_path, device="cuda:0,1")
    with pytest.raises(ValueError, match="port"):
        BuiltinServer(tmp_path, "m", log_dir=tmp_path, port=70000)
    with pytest.raises(ValueError, match="threads"):
        BuiltinServer(tmp_path, "m", log_dir=tmp_path, threads=0)
    with pytest.raises(ValueError, match="start_timeout"):
        BuiltinServer(tmp_path, "m", log_dir=tmp_path, start_timeout=0)
    with pytest.raises(ServerError, match="never started"):
        BuiltinServer(tmp_path, "m", log_dir=tmp_path).wait_ready(1)


# ---- the session's own leak check (tests/conftest.py) ------------------------------------------


LEAK_CONFTEST = """
import importlib.util
spec = importlib.util.spec_from_file_location("grail_conftest", {conftest!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
pytest_sessionfinish = module.pytest_sessionfinish
"""

LEAKY_TEST = """
import subprocess, sys
def test_leaks():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)
    print("LEAKED", proc.pid)
"""


def test_session_leak_check_fails_a_leaky_session(tmp_path: Path) -> None:
    # (The clean case is every other session: a false alarm would fail them all.)
    (tmp_path / "conftest.py").write_text(
        LEAK_CONFTEST.format(conftest=str(TESTS_DIR / "conftest.py"))
    )
    (tmp_path / "test_leaky.py").write_text(LEAKY_TEST)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = result.stdout + result.stderr
    pid = int(out.split("LEAKED ")[1].split()[0])
    assert result.returncode == 1, out
    assert "1 passed" in out  # the test itself passed: the session check is what failed it
    assert "PROCESS LEAK" in out and f"pid {pid}:" in out and "time.sleep(60)" in out
    assert wait_dead(pid), "the leak check did not kill the leaked process"


# ---- against the real built-in server (tiny model, CPU) ----------------------------------------


@pytest.fixture(scope="module")
def tiny_model(request: pytest.FixtureRequest) -> Path:
    """The shared `tiny_model_dir` fixture where conftest provides it, else the cached build."""
    try:
        return request.getfixturevalue("tiny_model_dir")
    except pytest.FixtureLookupError:
        from grail.models.tiny import ensure_tiny_model

        return ensure_tiny_model()


@pytest.fixture(scope="module")
def real_server(tiny_server: BuiltinServer) -> BuiltinServer:
    """The session's built-in server on the tiny model (conftest.py, which checks that its stop
    ends the process); the test that reloads weights in it loads the tiny model back."""
    return tiny_server


def _perturbed_copy(src: Path, dst: Path) -> Path:
    """A checkpoint with the same layout as `src` and visibly different weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    changed = {
        name: (t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype)).contiguous()
        for name, t in tensors.items()
    }
    save_file(changed, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _sample(server: BuiltinServer, seed: int = 3) -> list:
    from grail.inference.client import CompletionClient
    from grail.inference.completions import SamplingParams

    client = CompletionClient(
        server.base_url, server.model_name, timeout=60, liveness_check=server.check_alive
    )

    async def go():
        try:
            return await client.complete([1, 2, 3, 4], 3, SamplingParams(max_tokens=6), seed)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_real_server_serves_token_ids_and_logprobs(real_server: BuiltinServer) -> None:
    completions = _sample(real_server)
    assert len(completions) == 3
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) == 6 and c.finish_reason == "length"
        assert all(lp <= 0 for lp in c.logprobs)
    assert _sample(real_server) == completions  # same seed, same samples
    assert _sample(real_server, seed=4) != completions


def test_real_server_reloads_weights_in_place(
    real_server: BuiltinServer, tiny_model: Path, tmp_path: Path
) -> None:
    before, pid = _sample(real_server), real_server.pid
    changed = _perturbed_copy(tiny_model, tmp_path / "iter_001")
    result = real_server.sync_weights(changed)
    assert (result.mode_used, result.fell_back) == ("in_place", False)
    assert real_server.pid == pid
    after = _sample(real_server)
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    real_server.sync_weights(tiny_model)
    assert _sample(real_server) == before  # the original weights, exactly


def test_real_server_refuses_a_bad_checkpoint_and_keeps_serving(
    real_server: BuiltinServer, tmp_path: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    before = _sample(real_server)
    with pytest.raises(WeightSyncError, match="HTTP 400.*no \\*.safetensors weights"):
        real_server.sync_weights(empty, fallback=False)
    real_server.check_alive()
    assert _sample(real_server) == before
