"""File manifests: the size and sha256 of every file of a directory, recorded after the files are
written, so that a later check names any file that went missing, was cut short or was changed.
The tiny model's cache (grail/models/tiny.py) and checkpoints (grail/train/checkpoint.py) both
keep one."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_entry(path: Path) -> dict[str, Any]:
    """What a manifest records of the file at `path`."""
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def file_problem(path: Path, entry: Mapping[str, Any], *, hashes: bool = True) -> str | None:
    """What is wrong with the file at `path` against its manifest `entry` ("missing", "size A !=
    B", "sha256 mismatch"); None when it matches. Without `hashes` only presence and size are
    checked (cheap: no byte is read)."""
    if not path.is_file():
        return "missing"
    size = path.stat().st_size
    if size != entry.get("size"):
        return f"size {size} != {entry.get('size')}"
    if hashes and sha256_file(path) != entry.get("sha256"):
        return "sha256 mismatch"
    return None
