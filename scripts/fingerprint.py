"""The default job's fingerprint: the metrics of its first iterations, sync and pipelined, against
the committed ones in tests/data/fingerprint.json (tests/test_fingerprint.py runs the check).

    uv run python scripts/fingerprint.py          # print the key, compare; exit 1: mismatch
    uv run python scripts/fingerprint.py --write  # renew the file with this machine's fingerprint
    uv run python scripts/fingerprint.py --add    # add this machine's key, keeping the others

On a machine without uv (grail and its dependencies installed, or the checkout on PYTHONPATH):
    python3 scripts/fingerprint.py

A fingerprint holds every metric a run writes except timings, exact floats included, and the tiny
model's sha256. Its key says what decides the numbers besides the code and the config
(`grail.core.reproducible.fingerprint_key`): torch's version, its CPU capability, MKL's branch and
the CPU's vendor and the thread counts. The default job runs with `reproducible=true` (its
default), so the key is the same on every x86-64 CPU with AVX2 of one vendor and the check is
exact across them (Intel and AMD CPUs differ from the second iteration on, in the 7th digit:
docs/benchmarks.md); a key with no fingerprint (another torch, a CPU without AVX2) is reported,
and the test skips it. The key is read in a child process, as the runs see it.

A deliberate change of the numbers (the objective, the model, the task, a dependency) renews the
fingerprint (`--write`, which drops the other machines' keys: they would be stale) and the README's
default-job numbers in the same commit.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing grail

FINGERPRINT_FILE = ROOT / "tests" / "data" / "fingerprint.json"
ITERATIONS = 3  # iteration 0 is the baseline eval and the first update; 3 show the updates compound
MODES = {"sync": [], "pipelined": ["train.pipeline=true"]}
REPRODUCIBLE = ["reproducible=true"]  # the default; said, so a changed default cannot hide
# What varies from run to run or machine to machine without changing the numbers.
_NOT_COMPARED = ("timings", "tokens_per_s", "eval_s", "weight_sync")


def run_metrics(run_dir: Path) -> dict[str, Any]:
    """Every metrics file of a run, file stem -> record, without the fields in `_NOT_COMPARED`."""
    metrics = {}
    for path in sorted((run_dir / "metrics").glob("*.json")):
        record = json.loads(path.read_text())
        metrics[path.stem] = {k: v for k, v in record.items() if k not in _NOT_COMPARED}
    return metrics


def run_default_job(run_dir: Path, overrides: list[str], iterations: int) -> dict[str, Any]:
    """The default job's first `iterations` iterations in `run_dir`, on CPU (grail-train's code
    path, in a child process: torch reads the reproducible variables at its first operation)."""
    command = [
        sys.executable,
        "-m",
        "grail.train.cli",
        f"train.iterations={iterations}",
        f"hydra.run.dir={run_dir}",
        *overrides,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "CUDA_VISIBLE_DEVICES": "",  # the CPU job, also on a machine with a GPU
    }
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return run_metrics(run_dir)


def current_key(reproducible: bool) -> dict[str, Any]:
    """This machine's fingerprint key for the default job, as the job's processes see it: read in
    a fresh child process under the variables they get. Not in this one: a process that already
    ran a tensor operation keeps the kernels it started with (a pytest process on an AVX-512 CPU
    runs AVX-512 ones, although the runs it checks are pinned to AVX2)."""
    command = [sys.executable, str(Path(__file__).resolve()), "--key"]
    done = subprocess.run(
        [*command, *([] if reproducible else ["--native"])],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout))


def _key_here(reproducible: bool) -> dict[str, Any]:
    """The key in this process (`current_key`'s child), before any tensor operation ran here."""
    from grail.core.placement import cpu_threads
    from grail.core.reproducible import apply_reproducible_env, fingerprint_key

    if reproducible:
        apply_reproducible_env(os.environ)
    import torch

    torch.zeros(1).sum()  # the first operation: torch reads ATEN_CPU_CAPABILITY now
    threads = {
        mode: cpu_threads(None, None, pipelined=mode == "pipelined", reproducible=reproducible)
        for mode in MODES
    }
    key = fingerprint_key(*threads["sync"])
    del key["trainer_threads"], key["server_threads"]
    key["threads"] = {mode: list(pair) for mode, pair in threads.items()}  # [trainer, server]
    return key


def tiny_model_sha256() -> str:
    from grail.models.tiny import ensure_tiny_model

    return hashlib.sha256((ensure_tiny_model() / "model.safetensors").read_bytes()).hexdigest()


def fingerprint(reproducible: bool = True, iterations: int = ITERATIONS) -> dict[str, Any]:
    """This machine's fingerprint of the default job: key, model hash, metrics per mode."""
    key = current_key(reproducible)
    extra = REPRODUCIBLE if reproducible else ["reproducible=false"]
    with tempfile.TemporaryDirectory(prefix="grail-fingerprint-") as tmp:
        runs = {
            mode: run_default_job(Path(tmp) / mode, overrides + extra, iterations)
            for mode, overrides in MODES.items()
        }
    return {"key": key, "iterations": iterations, "model_sha256": tiny_model_sha256(), "runs": runs}


def first_difference(expected: Any, actual: Any, path: str = "") -> str | None:
    """Where two fingerprints first differ (`path: expected != actual`), or None."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        for name in sorted(set(expected) | set(actual)):
            found = first_difference(expected.get(name), actual.get(name), f"{path}.{name}")
            if found:
                return found
        return None
    return None if expected == actual else f"{path.lstrip('.')}: {expected!r} != {actual!r}"


def load(path: Path = FINGERPRINT_FILE) -> list[dict[str, Any]]:
    return list(json.loads(path.read_text())["fingerprints"]) if path.exists() else []


def committed_for(key: dict[str, Any], path: Path = FINGERPRINT_FILE) -> dict[str, Any] | None:
    return next((f for f in load(path) if f["key"] == key), None)


def save(fingerprints: list[dict[str, Any]], path: Path = FINGERPRINT_FILE) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"renew": "uv run python scripts/fingerprint.py --write", "fingerprints": fingerprints}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="replace the file with this machine's")
    action.add_argument("--add", action="store_true", help="add or replace this machine's key")
    parser.add_argument(
        "--native", action="store_true", help="reproducible=false: this machine's own kernels"
    )
    parser.add_argument("--key", action="store_true", help="print this machine's key only")
    args = parser.parse_args(argv)
    if args.key:
        print(json.dumps(_key_here(reproducible=not args.native)))
        return 0
    mine = fingerprint(reproducible=not args.native)
    print("key:", json.dumps(mine["key"], sort_keys=True))
    if args.write or args.add:
        others = [] if args.write else [f for f in load() if f["key"] != mine["key"]]
        save([*others, mine])
        print(f"wrote {FINGERPRINT_FILE}")
        return 0
    committed = load()
    for entry in committed:
        if entry["key"] == mine["key"]:
            diff = first_difference(
                {k: entry[k] for k in ("model_sha256", "runs")},
                {k: mine[k] for k in ("model_sha256", "runs")},
            )
            print("MATCH" if diff is None else f"MISMATCH at {diff}")
            return 0 if diff is None else 1
    # No fingerprint for this key: compare with each committed one anyway, to tell how far off.
    print("no committed fingerprint has this key; committed keys:")
    for entry in committed:
        diff = first_difference(entry["runs"], mine["runs"])
        print(" ", json.dumps(entry["key"], sort_keys=True))
        model = "same" if entry["model_sha256"] == mine["model_sha256"] else "DIFFERS"
        print(f"    model {model};", "metrics identical" if diff is None else f"differ at {diff}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
