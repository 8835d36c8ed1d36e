"""A full disk, said as such. A write that runs out of space fails in many ways: Python's own
files raise `OSError(ENOSPC)`, safetensors wraps it in its own error (whose text keeps "No space
left on device"), and `torch.save` loses it altogether (`RuntimeError: ... unexpected pos 147840
vs 147728`). `writing(path)` turns each into one `DiskFullError` naming what was being written,
which `grail-train` prints as one line with the command that resumes the run."""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

from grail.core.errors import DiskFullError

_FULL = (errno.ENOSPC, errno.EDQUOT)
# What the errors of libraries that wrap the OSError still say (safetensors: its text).
_FULL_TEXT = ("No space left on device", "Disk quota exceeded")
# Free space below which a failed write is put down to a full disk although its error does not
# say so (torch.save): a write fails for want of space with less than one write's worth left.
NEARLY_FULL_BYTES = 1 << 20


def free_bytes(path: Path) -> int | None:
    """Bytes available to this user on the file system holding `path` (or its nearest existing
    parent); None when that cannot be told."""
    for candidate in (Path(path), *Path(path).parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def is_disk_full(exc: BaseException, path: Path) -> bool:
    """Whether `exc`, raised writing under `path`, comes from a full disk: an ENOSPC (or quota)
    error in its chain of causes, a message that says so, or, for an error that carries no
    OS error number (torch.save's), almost no space left at `path` right now (checked before
    what was written is cleaned up)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    os_error = False  # an OS error number in the chain says what went wrong
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            if current.errno in _FULL:
                return True
            os_error = True
        if any(text in str(current) for text in _FULL_TEXT):
            return True
        current = current.__cause__ or current.__context__
    if os_error:
        return False
    free = free_bytes(path)
    return free is not None and free < NEARLY_FULL_BYTES


@contextlib.contextmanager
def writing(path: Path) -> Iterator[None]:
    """Run the block's writes of `path` (a file or a directory): an error that comes from a full
    disk leaves it as a `DiskFullError` naming `path`, chained to the original; any other error
    passes unchanged. Nested blocks are named by the outermost (a checkpoint rather than one of
    its files). Clean up what was written after this block, not in it: the free space it checks
    is the space left when the write failed."""
    try:
        yield
    except DiskFullError as exc:
        if exc.path == path:
            raise
        raise DiskFullError(path) from exc
    except Exception as exc:
        if is_disk_full(exc, Path(path)):
            raise DiskFullError(path) from exc
        raise
