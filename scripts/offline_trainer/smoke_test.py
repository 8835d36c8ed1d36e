"""CPU smoke test: two iterations end to end through the built-in server, no GPU, no network.

    uv run python scripts/offline_trainer/smoke_test.py

Runs generate → train → sync → evaluate → checkpoint twice on the tiny model in a temporary run
directory, then checks what a run must leave behind. Prints one line per check and a closing
`N passed, N failed`; exits non-zero when a check fails.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from grail.core.config import Config
from grail.core.records import read_metrics, validate_metrics
from grail.train.checkpoint import latest_checkpoint
from grail.train.cli import CONF_DIR

OVERRIDES = [
    "train.iterations=2",
    "data.problems_per_iteration=4",
    "data.rollouts_per_problem=4",
    "eval.num_ids=8",
    "eval.replicates=2",
    "eval.report_ks=[1,2]",
    "eval.interval=2",
    "checkpoint.save_interval=1",
]


def _children_alive() -> list[int]:
    me = str(os.getpid())
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def main() -> int:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg: Config = OmegaConf.to_object(compose("offline_grpo", overrides=OVERRIDES))  # type: ignore[assignment]

    from grail.train.loop import run

    results: list[tuple[str, bool, str]] = []

    def check(name: str, fn: Callable[[], object]) -> None:
        try:
            outcome = fn()
            ok, detail = outcome is not False, ""
        except Exception as exc:  # a failed check is reported, never fatal
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}{' — ' + detail if detail else ''}", flush=True)

    with tempfile.TemporaryDirectory(prefix="grail-smoke-") as tmp:
        run_dir = Path(tmp)
        t0 = time.perf_counter()
        try:
            run(cfg, run_dir)
            ran = True
        except Exception:
            traceback.print_exc()
            ran = False
        elapsed = time.perf_counter() - t0
        results.append(("run completes", ran, f"{elapsed:.1f}s"))
        print(f"{'PASS' if ran else 'FAIL'} run completes ({elapsed:.1f}s)", flush=True)
        metrics = run_dir / "metrics"

        def train_files_valid() -> None:
            for it in range(2):
                validate_metrics(
                    read_metrics(metrics / f"train_iter_{it:03d}.json"), "train_iteration"
                )

        def eval_files_valid() -> None:
            for name in ("baseline", "iter_001"):
                validate_metrics(read_metrics(metrics / f"eval_{name}.json"), "eval")

        def checkpoint_loads() -> None:
            ref = latest_checkpoint(run_dir / "checkpoints")
            assert ref is not None and ref.iteration == 1, f"newest checkpoint is {ref}"
            from grail.models.loading import load_model

            load_model(str(ref.path))

        def no_process_left() -> None:
            alive = _children_alive()
            assert not alive, f"child processes still alive: {alive}"

        def fast_enough() -> None:
            assert elapsed < 60, f"took {elapsed:.1f}s"

        check("train metrics written and valid", train_files_valid)
        check("eval metrics written and valid", eval_files_valid)
        check(
            "summary written and valid",
            lambda: validate_metrics(read_metrics(run_dir / "summary.json"), "summary"),
        )
        check("newest checkpoint loads with transformers", checkpoint_loads)
        check("server log in the run directory", lambda: any((run_dir / "logs").glob("*.log")))
        check("no server process left", no_process_left)
        check("under 60 seconds", fast_enough)

    passed = sum(ok for _, ok, _ in results)
    failed = len(results) - passed
    print(f"{passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
