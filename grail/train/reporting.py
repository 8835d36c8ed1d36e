"""How grail-train reports the end of a run that did not complete: a known user error as one line
on the console (its traceback in the run's log file), an interrupt (Ctrl-C, or SIGTERM as
`Terminated`) with the command that resumes the run. Shared by grail-train's process
(grail/train/cli.py) and rank 0 of a multi-process run (grail/train/distributed.py)."""

from __future__ import annotations

import logging
import os
import shlex
import signal
from pathlib import Path

from grail.core.errors import ConfigError, DiskFullError, UserError

log = logging.getLogger("grail.train")


class Terminated(KeyboardInterrupt):
    """SIGTERM, which SLURM, `timeout` and process managers send to stop a job, as an interrupt:
    it stops the run exactly as Ctrl-C does (every context manager's cleanup runs, the inference
    server is stopped, the resume command is printed), exiting with 128 + the signal's number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def interrupt_on_sigterm(signum: int, _frame: object) -> None:
    raise Terminated(signum)


def interrupt_exit_code(exc: KeyboardInterrupt) -> int:
    """130 after Ctrl-C (128 + SIGINT), 143 after SIGTERM."""
    return 128 + (exc.signum if isinstance(exc, Terminated) else int(signal.SIGINT))


def interrupt_message(exc: KeyboardInterrupt) -> str:
    return f"stopped by {exc.args[0]}" if isinstance(exc, Terminated) else "interrupted"


def log_files() -> list[logging.FileHandler]:
    """The handlers writing the run's log file (Hydra's `RUN_DIR/<job>.log`)."""
    handlers = logging.getLogger().handlers
    return [
        h for h in handlers if isinstance(h, logging.FileHandler) and h.baseFilename != os.devnull
    ]


def report(message: str, exc: BaseException, then: str = "") -> None:
    """`message` and `then` as one line on the console (and in the log file); the traceback of
    `exc` in the log file only, where a user who wants the details finds them."""
    files = log_files()
    where = f" (details: {files[0].baseFilename})" if files else ""
    log.error("%s%s%s", message, where, then)
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, "traceback:", (), (type(exc), exc, exc.__traceback__)
    )
    for handler in files:
        handler.handle(record)


def resume_command(run_dir: Path) -> str:
    """The command that continues the run in `run_dir`: a resume takes the run's saved config
    (grail/train/resume.py), so no override is needed."""
    return shlex.join(["uv", "run", "grail-train", "resume=true", f"hydra.run.dir={run_dir}"])


def report_run_error(exc: BaseException, run_dir: Path) -> int | None:
    """Report a known user error of a run as one line (the traceback in the log file) and return
    the exit code it ends the run with; None for any other exception (which keeps its traceback).
    Also what rank 0 of a multi-process run reports its errors with (grail/train/distributed.py)."""
    if isinstance(exc, ConfigError):
        report(f"invalid configuration: {exc}", exc)
        return 2
    if isinstance(exc, DiskFullError):
        # What was being written is discarded, what was written before is intact (the newest
        # checkpoint and its metrics): the run goes on from there once there is space.
        command = resume_command(run_dir.absolute())
        report(str(exc), exc, f"; free some space, then continue the run: {command}")
        return 1
    if isinstance(exc, UserError):
        report(str(exc), exc)
        return 1
    return None
