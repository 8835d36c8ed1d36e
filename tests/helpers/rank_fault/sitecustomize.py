"""A rank that fails mid-run, for tests/test_distributed_run.py: put this directory on PYTHONPATH
and set GRAIL_TEST_RANK_FAULT=RANK:ACTION:N, and rank RANK's N-th policy update raises a
RuntimeError (ACTION=raise), SIGKILLs its own process (ACTION=kill), as a crash or the OOM
killer would, or sleeps for good before the update's first collective (ACTION=hang), as a rank
stuck in a driver call or a deadlock would.
Python imports `sitecustomize` at the start of every new interpreter of the run (its ranks, a
server started anew; grail-train itself where it is not forked from the test runner,
helpers/rank_runs.py); only grail.train.sharded is patched, when it is imported: by the ranks."""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import signal
import sys
import time
from typing import Any

_SPEC = os.environ.get("GRAIL_TEST_RANK_FAULT")
_MODULE = "grail.train.sharded"


def _install(module: Any) -> None:
    rank, action, nth = _SPEC.split(":")  # type: ignore[union-attr]
    original = module.ShardedTrainer.update
    calls = [0]

    def update(self: Any, batch: Any, on_progress: Any = None) -> Any:
        if self.rank == int(rank):
            calls[0] += 1
            if calls[0] == int(nth):
                if action == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if action == "hang":
                    while True:  # until a signal ends the process
                        time.sleep(3600)
                raise RuntimeError(f"injected fault in rank {rank}'s update {nth}")
        return original(self, batch, on_progress)

    module.ShardedTrainer.update = update


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.loader is not None
        load = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            load(module)
            _install(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if _SPEC:
    sys.meta_path.insert(0, _Patch())
