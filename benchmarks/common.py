"""What every CPU benchmark in this folder shares: timing statistics, peak memory, the closing
table, and the JSON of results. Run the benchmarks as scripts (`uv run python benchmarks/X.py`);
the script's own folder is on sys.path, so they import this module as `common`."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def print_profile(run: Any, on_cuda: bool, rows: int = 30) -> None:
    """`run()` once under torch.profiler: its operators by self device (or CPU) time, to stderr
    (the CUDA kernels of every thread, an engine's worker included)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        run()
    key = "self_cuda_time_total" if on_cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=rows), file=sys.stderr)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min, max and the interquartile range of repeated timings."""
    if not values:
        raise ValueError("no measurements")
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else (ordered[0],) * 3
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "iqr": q3 - q1,
        "n": len(ordered),
    }


def core_iteration_s(timings: dict[str, float]) -> float:
    """An iteration's `timings.iteration_s` from its metrics file without evaluation and the
    checkpoint, which run at intervals the user picks: generation + training + weight sync."""
    return timings["iteration_s"] - timings.get("eval_s", 0.0) - timings.get("checkpoint_s", 0.0)


def _status_mb(field: str, pid: int | None) -> float:
    status = Path(f"/proc/{pid or os.getpid()}/status")
    for line in status.read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in {status}")


def peak_rss_mb(pid: int | None = None) -> float:
    """Peak resident memory (VmHWM) of a live process, this one by default, in MiB (Linux)."""
    return _status_mb("VmHWM", pid)


def rss_mb(pid: int | None = None) -> float:
    """Resident memory now (VmRSS) of a live process, this one by default, in MiB (Linux)."""
    return _status_mb("VmRSS", pid)


def machine() -> dict[str, Any]:
    """Where the numbers were measured, stored beside them."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return {
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cores": cores,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(f"{v:.3g}" if isinstance(v, float) else str(v) for v in row))
    # Piped (logs, CI), rich would size the table to 80 columns and truncate its cells; a
    # terminal keeps its own width.
    Console(width=None if sys.stdout.isatty() else 160).print(table)


def write_results(name: str, results: dict[str, Any], out: Path | None = None) -> Path:
    """Write `{machine, results}` atomically to `out` (default benchmarks/results/NAME.json)."""
    path = out or RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"benchmark": name, "machine": machine(), **results}, indent=2))
    tmp.replace(path)
    print(f"results written to {path}")
    return path


class ServerPeakRss:
    """Records the peak VmHWM of the inference servers `grail.train.loop.run` starts in this
    process, read just before the harness stops each one.

    Wraps `ServerManager.stop` in this process only. Reading /proc/PID/status of the
    live server is exact; `getrusage(RUSAGE_CHILDREN)` is not usable here, because it reports the
    largest child of any kind, and a short-lived child forked to run `ldconfig` (ctypes does that
    while torch loads) counts the parent's whole resident set as its own.
    """

    def __init__(self) -> None:
        self.peak_mb = 0.0
        self.pids: list[int] = []  # every server stopped meanwhile (restarts included)

    def __enter__(self) -> ServerPeakRss:
        from grail.inference.process import ServerManager

        original = ServerManager.stop
        self._restore = lambda: setattr(ServerManager, "stop", original)
        recorder = self

        def stop(manager: Any, *args: Any, **kwargs: Any) -> None:
            pid = manager.pid
            # start() stops first, and a stopped manager still names its last process
            if pid is not None and pid not in recorder.pids:
                recorder.pids.append(pid)
                with contextlib.suppress(OSError, RuntimeError):  # already gone: nothing to read
                    recorder.peak_mb = max(recorder.peak_mb, peak_rss_mb(pid))
            original(manager, *args, **kwargs)

        ServerManager.stop = stop  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()


def stop_worker(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM first, so that a worker's `grail.train.loop.run` stops its inference server and
    removes its temporary files; then SIGKILL to the worker's group if it has not exited within
    `grace_s` (its server, asked of the kernel to die with its parent, goes too)."""
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_worker(
    cmd: Sequence[str], env: dict[str, str], log_path: Path, timeout_s: float, what: str
) -> None:
    """Run a benchmark worker in a session of its own, its output in `log_path`. Raises
    RuntimeError naming `what` with the output's tail when it fails or outlives `timeout_s`; on
    a timeout or Ctrl-C it is stopped (`stop_worker`) before anything else happens."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(cmd),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException as exc:  # timeout, Ctrl-C: never leave a worker or its server behind
            stop_worker(proc)
            if isinstance(exc, subprocess.TimeoutExpired):
                raise RuntimeError(
                    f"{what} did not finish within {timeout_s:g} s and was stopped; last "
                    f"output:\n{log_path.read_text(errors='replace')[-4000:]}"
                ) from None
            raise
    if code != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{what} failed (exit {code}); last output:\n{tail}")


def synthetic_batch(
    groups: int, group_size: int, *, prompt_len: int, completion_len: int, vocab: int, seed: int = 0
) -> Any:
    """A scored rollout batch of random tokens with 0/1 rewards and their group advantages: an
    update's real shape without generating anything."""
    from grail.envs.base import Problem
    from grail.rollouts.batch import Group, RolloutBatch, Sample
    from grail.train.trainer import assign_advantages

    gen = torch.Generator().manual_seed(seed)
    made = []
    for g in range(groups):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        samples = []
        for _ in range(group_size):
            ids = torch.randint(3, vocab, (completion_len,), generator=gen).tolist()
            reward = float(torch.randint(0, 2, (), generator=gen))
            samples.append(Sample(ids, [-6.0] * len(ids), "length", "", reward, {}, reward > 0))
        made.append(Group(Problem(g, [], ""), prompt, samples))
    assign_advantages(made, "group")
    return RolloutBatch(made)
