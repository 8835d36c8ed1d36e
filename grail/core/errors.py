"""Errors a user can act on: shown as one line, never as a traceback."""

from __future__ import annotations

import errno


def first_line(exc: BaseException) -> str:
    """An exception's message cut to its first line, or its type's name when it has none: what a
    one-line warning or error quotes of a cause."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class UserError(Exception):
    """An error the user fixes from its message alone: a bad config value, a missing data file or
    model path, a reward plugin that cannot load, a run directory another run holds. `grail-train`
    prints the message as one line (the run's log file keeps the traceback) and exits non-zero;
    any other exception keeps its traceback. Raise a subclass (also deriving from the built-in
    type callers may catch, e.g. `class X(UserError, FileNotFoundError)`) whose message names the
    bad thing and what to do."""


class ConfigError(UserError, ValueError):
    """A configuration value that cannot work; the message names the key."""


class DiskFullError(UserError, OSError):
    """No space was left on the device while a run's file was being written (a checkpoint, metrics,
    the summary, the server's weights, an export). What was being written is discarded and what
    was written before stays intact, so the run resumes once space is freed."""

    def __init__(self, path: object) -> None:
        super().__init__(f"no space left on device while writing {path}")
        self.errno = errno.ENOSPC
        self.path = path
