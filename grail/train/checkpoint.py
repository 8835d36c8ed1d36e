"""Checkpoints: `checkpoints/iter_XXX/` = a `save_pretrained` directory (which vLLM, SGLang and
transformers load as it is) + tokenizer + `trainer_state.pt` (optimizer, scheduler, RNG states,
iteration, config: tensors and plain values only, loaded with `weights_only=True`) +
`rollout_source.json` when the rollout source keeps something (`RolloutSource.state`: a
pipelined run's pending batch, in the JSON form of grail/rollouts/codec.py).

A checkpoint is written into a hidden temporary directory and renamed into place once every file
is on disk, so a run killed at any moment never leaves a half-written `iter_XXX`. What the rename
cannot guard against (a disk that fills or a copy cut short later, a file edited or truncated by
hand) the manifest catches: `manifest.json`, written last into the staged directory, records the
size and sha256 of every other file. Resuming verifies the newest checkpoint against it and falls
back, with a warning naming the damaged file, to the newest intact one; pruning keeps the newest
`keep_last_k` that pass the cheap part of that check (every file there, at its size) and removes
the ones that fail it, so a damaged directory never displaces an intact one.

Checkpoints written before manifests existed are accepted with a warning when the files a resume
loads are there (the model's config and weights, checked against the safetensors header, and
trainer_state.pt): refusing them would make `resume=true` start an upgraded run over from scratch.
So are those whose trainer_state.pt holds numpy's RNG state as an array (an older form of it). One
that holds a pickled pending batch (older pipelined runs) is refused with an `OldCheckpoint` that
says what to do: unpickling arbitrary objects could run code, and would tie the file to module
paths.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from grail.core.disk import writing
from grail.core.errors import UserError
from grail.core.manifest import file_entry, file_problem
from grail.core.records import (
    atomic_write_text,
    checkpoint_iteration,
    follow_umask,
    iteration_name,
)
from grail.models.loading import model_dir_problems

log = logging.getLogger("grail.train")

STATE_FILE = "trainer_state.pt"
SOURCE_STATE_FILE = "rollout_source.json"
MANIFEST = "manifest.json"

# What numpy's RNG state as an array (checkpoints of older versions) needs from the unpickler.
_NUMPY_ARRAY_GLOBALS: list[Any] = [
    np.ndarray.__reduce__(np.zeros(1))[0],  # numpy's array constructor, wherever numpy keeps it
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]


class OldCheckpoint(UserError, ValueError):
    """A checkpoint whose trainer_state.pt this version cannot load safely."""


def rng_state() -> dict[str, Any]:
    name, keys, position, has_gauss, gauss = cast(
        tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True)
    )
    state: dict[str, Any] = {
        "python": random.getstate(),
        # Plain values, not an array: what `torch.load(weights_only=True)` reads by default.
        "numpy": (name, keys.tolist(), position, has_gauss, gauss),
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


def _seal(root: Path) -> None:
    """fsync every file under `root`, then write the manifest of their sizes and hashes (last, and
    atomically, so a manifest only ever describes files already on disk)."""
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        # Hashed right after the write, while the file is still in the page cache.
        files[path.relative_to(root).as_posix()] = file_entry(path)
    atomic_write_text(root / MANIFEST, json.dumps({"files": files}, indent=2) + "\n")


def stage_checkpoint(
    checkpoints_dir: Path,
    iteration: int,
    model: Any,
    tokenizer: Any,
    trainer_state: dict[str, Any],
    source_state: dict[str, Any] | None = None,
    write_more: Callable[[Path], None] | None = None,
) -> Path:
    """Write checkpoint `iter_XXX` into a hidden temporary directory; `commit_checkpoint` publishes
    it. Between the two the caller writes the iteration's metrics, so a committed checkpoint
    always has its metrics beside it. `source_state`: the rollout source's (JSON-able);
    `write_more(directory)` writes further files before the manifest seals them (a multi-process
    run's sharded optimizer state)."""
    tmp = checkpoints_dir / f".{iteration_name(iteration)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        # A full disk is named by the checkpoint it was to become (DiskFullError).
        with writing(checkpoints_dir / iteration_name(iteration)):
            tmp.mkdir(parents=True)
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            state = {**trainer_state, "iteration": iteration, "rng": rng_state()}
            torch.save(state, tmp / STATE_FILE)
            if source_state:
                # NaN and infinities allowed: a -inf log-probability must round-trip.
                atomic_write_text(tmp / SOURCE_STATE_FILE, json.dumps(source_state) + "\n")
            if write_more is not None:
                write_more(tmp)
            follow_umask(tmp)
            _seal(tmp)
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
    """Every committed checkpoint directory (`iter_XXX`), intact or not, oldest first; temporary
    directories are left out. `checkpoint_problems` says which can be trusted."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for path in checkpoints_dir.iterdir():
        iteration = checkpoint_iteration(path.name)
        if iteration is not None and path.is_dir():
            found.append(CheckpointRef(iteration, path))
    return sorted(found, key=lambda c: c.iteration)


def checkpoint_problems(checkpoint: Path, *, hashes: bool = True) -> list[str]:
    """Why `checkpoint` cannot be resumed from, each naming a file; [] when it is intact. Checks
    every file of its manifest is there at its recorded size and, with `hashes`, has its recorded
    sha256 (reads every byte: what resume does, once per candidate). Without a manifest (an older
    checkpoint, or not a checkpoint at all): the files a resume loads are there."""
    manifest_path = checkpoint / MANIFEST
    if not any(checkpoint.iterdir()):
        return [f"{checkpoint} is empty"]
    if not manifest_path.is_file():
        state = checkpoint / STATE_FILE
        problems = model_dir_problems(checkpoint)
        if not state.is_file() or state.stat().st_size == 0:
            problems.append(f"{state} is missing or empty")
        # Nothing wrong but the missing manifest: a checkpoint from before manifests, accepted.
        return [f"{manifest_path} is missing", *problems] if problems else []
    try:
        files: dict[str, dict[str, Any]] = json.loads(manifest_path.read_text())["files"]
        entries = {
            name: {"size": int(i["size"]), "sha256": str(i["sha256"])} for name, i in files.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return [f"{manifest_path} is unreadable ({exc})"]
    problems = []
    for name, entry in entries.items():
        if problem := file_problem(checkpoint / name, entry, hashes=hashes):
            problems.append(f"{checkpoint / name}: {problem}")
    return problems


def latest_checkpoint(checkpoints_dir: Path) -> CheckpointRef | None:
    """The newest intact checkpoint (verified against its manifest); each newer damaged one is
    skipped with a warning naming its damaged files."""
    for ref in reversed(list_checkpoints(checkpoints_dir)):
        problems = checkpoint_problems(ref.path)
        if not problems:
            if not (ref.path / MANIFEST).is_file():
                log.warning(
                    "checkpoint %s has no %s (written by an older version of grail): resuming "
                    "from it with its files checked for presence only",
                    ref.path,
                    MANIFEST,
                )
            return ref
        log.warning(
            "checkpoint %s is damaged, falling back to an older one:\n  %s",
            ref.path,
            "\n  ".join(problems),
        )
    return None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """trainer_state.pt, loaded without unpickling arbitrary objects; an `OldCheckpoint` when it
    holds some (see the module docstring)."""
    path = checkpoint / STATE_FILE
    try:
        with torch.serialization.safe_globals(_NUMPY_ARRAY_GLOBALS):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise OldCheckpoint(
            f"{path} was written by an older version of grail and holds pickled Python objects "
            "(a pipelined run's pending batch) that this version does not load: resume the run "
            "with the grail version that wrote it, or start it over in a new hydra.run.dir"
        ) from None


def load_source_state(checkpoint: Path) -> dict[str, Any]:
    """What the rollout source kept in `checkpoint`; {} when it kept nothing."""
    path = checkpoint / SOURCE_STATE_FILE
    if not path.is_file():
        return {}
    return json.loads(path.read_text())


def prune_checkpoints(checkpoints_dir: Path, keep_last_k: int) -> list[Path]:
    """Keep the newest `keep_last_k` checkpoints whose files are all there at their recorded
    sizes; delete the others, the damaged ones (with a warning naming what is wrong) and stale
    temporaries. Sizes only: hashing every kept checkpoint at every save would cost as much as
    writing it, and `latest_checkpoint` hashes before a resume trusts one."""
    removed, kept = [], 0
    for ref in reversed(list_checkpoints(checkpoints_dir)):
        problems = checkpoint_problems(ref.path, hashes=False)
        if problems:
            log.warning("removing damaged checkpoint %s:\n  %s", ref.path, "\n  ".join(problems))
        elif kept < keep_last_k:
            kept += 1
            continue
        shutil.rmtree(ref.path)
        removed.append(ref.path)
    for tmp in checkpoints_dir.glob(".iter_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    return removed
