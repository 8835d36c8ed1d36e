"""Where the test suite's time goes: CPU seconds per test and per file, subprocesses included.

    uv run python benchmarks/suite_cpu.py                     # the README's test command
    uv run python benchmarks/suite_cpu.py --top 40 -- tests/test_cli.py -n 0

Runs pytest (the arguments after `--`; none: the whole suite as the README runs it) with a
plugin that records, for each test, the CPU time its worker spent and the CPU time of every
process the test started and waited for (`getrusage(RUSAGE_CHILDREN)`: a grail-train the test
ran, and the inference server that grail-train stopped and waited for), setup and teardown
included: a module or session fixture is charged to the test that built it. Prints the suite's
wall time and CPU time, the files and the tests that cost most, and writes
benchmarks/results/suite_cpu.json.

Why CPU and not wall time: on the 2-core CI machine both cores are ~90% busy through the suite,
so what shortens it is CPU saved, and a test's wall time mixes its own cost with the other
worker's (docs/benchmarks.md, "The test suite's time").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

RECORDS_ENV = "GRAIL_SUITE_CPU_RECORDS"  # the JSON-lines file the plugin appends to
REPO = Path(__file__).resolve().parents[1]


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, object, object]:
    """The plugin (`-p suite_cpu`): one line per test, appended (one write of a short line:
    whole, with xdist's workers appending to one file)."""
    path = os.environ.get(RECORDS_ENV)
    own0, children0 = _cpu()
    start = time.monotonic()
    result = yield
    if path:
        own1, children1 = _cpu()
        line = {
            "test": item.nodeid,
            "wall_s": time.monotonic() - start,
            "own_cpu_s": own1 - own0,
            "children_cpu_s": children1 - children0,
        }
        with open(path, "a") as out:
            out.write(json.dumps(line) + "\n")
    return result


def summarize(records: list[dict[str, Any]], top: int) -> dict[str, Any]:
    for r in records:
        r["cpu_s"] = r["own_cpu_s"] + r["children_cpu_s"]
    files: collections.Counter[str] = collections.Counter()
    for r in records:
        files[r["test"].split("::")[0]] += r["cpu_s"]
    tests = sorted(records, key=lambda r: -r["cpu_s"])
    return {
        "tests": len(records),
        "cpu_s": sum(r["cpu_s"] for r in records),
        "files": dict(files.most_common()),
        "top_tests": tests[:top],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--top", type=int, default=25, help="tests and files to print")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default: benchmarks/results)")
    p.add_argument("pytest_args", nargs="*", help="after --: pytest's arguments")
    args = p.parse_args(argv)
    from common import print_table, write_results

    with tempfile.TemporaryDirectory(prefix="grail-suite-cpu-") as tmp:
        records_path = Path(tmp) / "records.jsonl"
        env = {**os.environ, RECORDS_ENV: str(records_path)}
        here = str(Path(__file__).parent)  # where pytest finds the plugin, `-p suite_cpu`
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH")]))
        start, before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
        code = subprocess.call(
            [sys.executable, "-m", "pytest", "-p", "suite_cpu", *args.pytest_args],
            cwd=REPO,
            env=env,
        )
        wall = time.monotonic() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        lines = records_path.read_text().splitlines() if records_path.exists() else []
    summary = summarize([json.loads(line) for line in lines], args.top)
    summary["wall_s"] = wall
    # Everything pytest and its descendants spent, attributed to a test or not (collection, the
    # workers' start-up, a server a session fixture stopped at the end).
    summary["suite_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    summary["pytest_exit_code"] = code
    cores = os.cpu_count() or 1
    print(
        f"\npytest exit code {code}: {wall:.0f} s wall, {summary['suite_cpu_s']:.0f} CPU-s "
        f"({summary['suite_cpu_s'] / wall / cores:.0%} of {cores} cores), "
        f"{summary['cpu_s']:.0f} CPU-s in {summary['tests']} tests"
    )
    files = list(summary["files"].items())[: args.top]
    print_table("CPU seconds per file", ["file", "CPU s"], files)
    rows = [
        (r["test"], r["cpu_s"], r["own_cpu_s"], r["children_cpu_s"], r["wall_s"])
        for r in summary["top_tests"]
    ]
    print_table("Tests that cost most", ["test", "CPU s", "worker", "children", "wall s"], rows)
    write_results("suite_cpu", summary, args.out)
    return 0 if code in (0, 5) else 1  # 5: no tests selected


if __name__ == "__main__":
    sys.exit(main())
