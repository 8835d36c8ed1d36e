"""CPU buffers another process maps by name, with no helper process: a file in /dev/shm.

The shared route (shared.py) hands the built-in server its flat weight buffers. On a GPU the
handles are CUDA IPC handles. On CPU they used to be torch's "file_system" sharing strategy,
which starts `torch_shm_manager`, a daemon child that lives as long as its client (the trainer
process) and 2 s more: every in-process run (the smoke test, the tests, a service) ended with a
child still alive. Python's `multiprocessing.shared_memory` starts a `resource_tracker` process
instead. So the buffer is a plain file in the RAM-backed /dev/shm (the system's temporary
directory where there is none), mapped with `mmap` and viewed by `torch.frombuffer`, named after
the trainer's pid:

- the trainer creates it (mode 0600, never reused: a new name per buffer) and unlinks it when the
  route closes or the buffer is collected;
- a trainer killed with SIGKILL cannot unlink: the next route made on this machine removes the
  files of pids no longer alive (`remove_stale`), as torch's daemon would have;
- the server (grail/inference/builtin/tensor_update.py) maps a file only under this directory and
  with this prefix, privately (copy-on-write: it cannot write into the trainer's buffer), for one
  weight update at a time.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import uuid
import weakref
from pathlib import Path

import torch

from grail.inference.weights.policy import DTYPES as SERVED_DTYPES

PREFIX = "grail-weights-"
# The served dtypes (policy.DTYPES) and int64, the integer buffers a model may hold.
DTYPES = {**SERVED_DTYPES, "int64": torch.int64}


def shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_stale(directory: Path | None = None) -> list[Path]:
    """Unlink the buffer files of trainers that are no longer alive; the paths removed."""
    removed = []
    for path in (directory or shm_dir()).glob(PREFIX + "*"):
        pid = path.name[len(PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(path)
    return removed


class SharedFile:
    """One buffer file, mapped read-write in this process, unlinked by `close` (or when this
    object is collected, or at interpreter exit)."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.numel = numel
        nbytes = max(1, numel) * dtype.itemsize
        self.path = shm_dir() / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._unlink = weakref.finalize(self, _unlink, self.path)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self._map, dtype=dtype, count=numel)

    def close(self) -> None:
        """Unlink the file; the mapping (and `tensor`) stays valid while referenced."""
        self._unlink()


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def open_shared(path: str, dtype: str, numel: int) -> torch.Tensor:
    """The server side: a private (copy-on-write) map of the trainer's buffer file `path` as a
    flat tensor of `numel` elements of `dtype`. Raises ValueError naming the problem for a path
    outside the buffer directory, an unknown dtype or a file too short."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    file = Path(path)
    if file.parent != shm_dir() or not file.name.startswith(PREFIX) or file.is_symlink():
        raise ValueError(f"{path} is not a weight buffer file ({shm_dir()}/{PREFIX}*)")
    torch_dtype = DTYPES[dtype]
    nbytes = numel * torch_dtype.itemsize
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if numel < 0 or size < nbytes:
            raise ValueError(f"{path} holds {size} bytes, not {numel} x {dtype}")
        if numel == 0:
            return torch.empty(0, dtype=torch_dtype)
        mapped = mmap.mmap(f.fileno(), nbytes, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mapped, dtype=torch_dtype, count=numel)
