"""A run's built-in CPU servers are forked from its zygote (grail/inference/zygote.py): what a
forked server holds, and that losing the zygote costs a run nothing but the fast start. The
trainer's death stopping its servers through the zygote is tests/test_train_loop.py's
`killed_run` (SIGKILL, then `servers_of` must die) and test_run_safety's; a forked server
computing as a new interpreter's is the fingerprint test's (tests/test_fingerprint.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from helpers.grail_process import alive, finish, servers_of, train_process, wait_for

from grail.inference.zygote import FORKABLE, forkable


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_only_this_interpreter_running_a_forkable_module_is_forked() -> None:
    import sys

    assert forkable([sys.executable, "-m", FORKABLE[0], "--model", "tiny"])
    assert not forkable(["/usr/bin/python3", "-m", FORKABLE[0]])
    assert not forkable([sys.executable, "-m", "vllm.entrypoints.openai.api_server"])
    assert not forkable([sys.executable, FORKABLE[0]])


def test_a_forked_server_holds_none_of_the_trainers_files_and_a_lost_zygote_costs_nothing(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    proc = train_process(run_dir, "train.iterations=60", "eval.interval=30")
    log = run_dir / "logs" / "builtin-policy.log"
    first = run_dir / "metrics" / "train_iter_000.json"
    try:
        # Not before the trainer has seen it ready: a server lost in its start fails the run.
        wait_for(lambda: first.exists() or proc.poll() is not None, 120, "iteration 0")
        (server,) = servers_of(run_dir)  # its process title is its command line
        zygote = _parent(server)
        assert _parent(zygote) == proc.pid
        title = Path(f"/proc/{zygote}/cmdline").read_bytes().split(b"\0")[0]
        assert title.startswith(b"grail server zygote"), title
        assert os.getpgid(server) == server  # its own group, as spawn_server gives
        opened = {os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")}
        in_run = {path for path in opened if path.startswith(str(run_dir))}
        assert in_run == {str(log)}, opened  # the run's lock and the trainer's log are not held
        os.kill(zygote, signal.SIGKILL)
        # Its server ends (PR_SET_PDEATHSIG); the trainer starts the next as a new interpreter.
        wait_for(lambda: not alive(server), 30, "the zygote's server to end")
    finally:
        out = finish(proc)
    assert proc.returncode == 0, out[-3000:]
    assert "the server zygote" in out and "servers start anew" in out, out[-3000:]
    assert _text(log).count("starting builtin server") == 2
    assert (run_dir / "metrics" / "train_iter_059.json").exists()
