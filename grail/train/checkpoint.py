"""Checkpoints: `checkpoints/iter_XXX/` = a `save_pretrained` directory (which vLLM, SGLang and
transformers load as it is) + tokenizer + `trainer_state.pt` (optimizer, scheduler, RNG states,
iteration, config).

A checkpoint is written into a hidden temporary directory and renamed into place once every file
is on disk, so a directory named `iter_XXX` is always complete: a run killed at any moment resumes
from the newest one and loses at most the iterations after it.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from grail.records import checkpoint_iteration, iteration_name

STATE_FILE = "trainer_state.pt"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_tree(root: Path) -> None:
    for path in root.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def stage_checkpoint(
    checkpoints_dir: Path,
    iteration: int,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
) -> Path:
    """Write checkpoint `iter_XXX` into a hidden temporary directory; `commit_checkpoint` publishes
    it. Between the two the caller writes the iteration's metrics, so a committed checkpoint
    always has its metrics beside it."""
    tmp = checkpoints_dir / f".{iteration_name(iteration)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        torch.save({**trainer_state, "iteration": iteration, "rng": rng_state()}, tmp / STATE_FILE)
        _fsync_tree(tmp)
    except BaseException:  # Ctrl-C or a full disk mid-write: leave nothing half-written behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def commit_checkpoint(staged: Path) -> Path:
    """Atomically rename a staged checkpoint into place; returns its final directory."""
    final = staged.parent / staged.name.removeprefix(".").removesuffix(".tmp")
    if final.exists():  # a rerun of the same iteration replaces the older copy
        shutil.rmtree(final)
    os.replace(staged, final)
    return final


@dataclass(frozen=True)
class CheckpointRef:
    iteration: int
    path: Path


def list_checkpoints(checkpoints_dir: Path) -> list[CheckpointRef]:
    """Complete checkpoints, oldest first (temporary directories are ignored)."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.iterdir():
        iteration = checkpoint_iteration(path.name)
        if iteration is not None and (path / STATE_FILE).is_file():
            found.append(CheckpointRef(iteration, path))
    return sorted(found, key=lambda c: c.iteration)


def latest_checkpoint(checkpoints_dir: Path) -> CheckpointRef | None:
    found = list_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    # Our own file: optimizer and RNG states need full unpickling (weights_only cannot hold them).
    return torch.load(checkpoint / STATE_FILE, map_location="cpu", weights_only=False)


def prune_checkpoints(checkpoints_dir: Path, keep_last_k: int) -> list[Path]:
    """Delete all but the newest `keep_last_k` checkpoints and stale temporaries."""
    removed = []
    for ref in list_checkpoints(checkpoints_dir)[:-keep_last_k]:
        shutil.rmtree(ref.path)
        removed.append(ref.path)
    for tmp in checkpoints_dir.glob(".iter_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    return removed
