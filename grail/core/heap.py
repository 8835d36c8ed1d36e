"""The garbage collector's view of a long-lived process (`frozen_heap`)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Inside the block, what exists at its start (modules, models, tokenizers, the server's
    client) is out of the garbage collector's view, and back in it after.

    Why: a full collection walks every object the process holds, ~570k once torch and
    transformers are loaded, a ~300 ms pause of the rollout client every few batches (measured
    in benchmarks/episodes.py: a 250 KB answer's JSON decoding took 300 ms once, ~2 ms
    otherwise). Unfrozen at the end, so that a process running several runs one after another (a
    sweep's runs in one process) frees what a finished run left behind, and whatever garbage was
    frozen with the rest. (No collection first: it took ~0.3 s, paid by every run of a test
    suite that starts hundreds.)"""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
