"""What a study shows while it runs (a race, grail/study/race_runner.py; a search,
grail/study/search_runner.py): per setting its seeds ended and running and its verdict so far,
the runs ended, running and left to start, and the time elapsed.

The runner gives a `snapshot` (the `State` now) and calls `update` whenever a run starts or ends;
how the state is shown depends on where the output goes:

- a terminal the runs do not print on (the submitit launchers send each job's output to its
  .submitit/ files): a rich Live table, redrawn twice a second, left on screen at the end;
- a terminal shared with the runs (the basic launcher runs each job in this process, with its own
  progress bars: two live displays would draw over each other): the table printed whenever runs
  start, and once at the end;
- anything else (piped, CI, tests): one log line per change (logger grail.study.progress).

A display error is logged once and turns the display off: it never stops a study.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

log = logging.getLogger("grail.study.progress")

REFRESH_S = 0.5  # the Live table's redraw interval: the clock ticks, a change shows within it
# Verdict outcomes (grail.study.verdicts.Outcome's values) as a sentence reads them.
OUTCOME_TEXT = {"not_separated": "not separated yet", "nothing_learnt": "nothing learnt"}


@dataclass(frozen=True)
class Row:
    """One setting (or trial): its seeds ended and running, its verdict and value so far."""

    label: str
    ended: int
    running: int
    outcome: str | None  # a verdict outcome or a trial's state; None: no value yet
    mean: float | None = None
    ci: tuple[float, float] | None = None


@dataclass(frozen=True)
class State:
    """A study at one moment; `left`: runs (or trials) that may still start, an upper bound when
    `bounded` (a race's verdicts may stop it before its budget is spent)."""

    title: str  # "race", "search 'name'"
    unit: str  # "runs", "trials"
    metric: str
    ended: int
    running: int
    left: int
    bounded: bool = False
    rows: tuple[Row, ...] = ()
    note: str = ""  # e.g. "decided"
    judged_by: str = "verdict"  # the outcome column's heading


def elapsed_text(seconds: float) -> str:
    minutes, s = divmod(int(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def headline(state: State, elapsed: float) -> str:
    def at_most(n: int) -> str:
        return f"≤{n}" if state.bounded and state.left else str(n)

    total = state.ended + state.running + state.left
    return (
        f"{state.title}: {state.ended}/{at_most(total)} {state.unit} ended, {state.running} "
        f"running, {at_most(state.left)} left to start, {elapsed_text(elapsed)} elapsed"
        + (f", {state.note}" if state.note else "")
    )


def _outcome(row: Row) -> str:
    if row.outcome is None:
        return "no value yet"
    return OUTCOME_TEXT.get(row.outcome, row.outcome.replace("_", " "))


def line(state: State, elapsed: float) -> str:
    """The plain form: the headline, then each row as a phrase."""
    rows = []
    for row in state.rows:
        value = f" {row.mean:.3f}" if row.mean is not None else ""
        seeds = f"{row.ended} seed{'s' * (row.ended != 1)}"
        running = f", {row.running} running" if row.running else ""
        rows.append(f"{row.label} {_outcome(row)}{value} ({seeds}{running})")
    return headline(state, elapsed) + ("; " + ", ".join(rows) if rows else "")


def table(state: State, elapsed: float) -> Table:
    grid = Table(title=Text(headline(state, elapsed)), title_justify="left")
    for column in ("setting", "seeds ended", "running", state.judged_by, state.metric, "CI"):
        grid.add_column(
            column, justify="left" if column in ("setting", state.judged_by) else "right"
        )
    for row in state.rows:
        grid.add_row(
            Text(row.label),  # Text: an override like a=[1,2] is not markup
            str(row.ended),
            str(row.running or ""),
            _outcome(row),
            "" if row.mean is None else f"{row.mean:.3f}",
            "" if row.ci is None else f"[{row.ci[0]:.3f}, {row.ci[1]:.3f}]",
        )
    return grid


def terminal() -> Console:
    """The console a display writes to (tests put their own in its place)."""
    return Console()


class StudyProgress:
    """start(), update() after each run starts or ends, stop() in the runner's `finally`."""

    def __init__(self, snapshot: Callable[[], State], *, in_process: bool) -> None:
        """`in_process`: runs print on this process's terminal (see the module doc)."""
        self.snapshot = snapshot
        self.in_process = in_process
        self.mode = "off"  # live | tables | lines | off
        self.failed = False
        self.console: Console | None = None
        self.state: State | None = None
        self.shown: State | None = None  # the last state printed or logged
        self.t0 = time.monotonic()
        self.lock = threading.Lock()  # the ticker's redraws against update and stop
        self.live: Live | None = None
        self.ticker: threading.Thread | None = None
        self.stopping = threading.Event()
        self.rerouted: list[tuple[logging.StreamHandler[Any], IO[str]]] = []

    def start(self) -> None:
        with self._guard():
            self.t0 = time.monotonic()
            self.state = self.snapshot()
            self.console = console = terminal()
            if not console.is_terminal:
                self.mode = "lines"
            elif self.in_process:
                self.mode = "tables"
            else:
                self.mode = "live"
                self._start_live()

    def update(self) -> None:
        if self.mode == "off":
            return
        with self._guard():
            before, self.state = self.state, self.snapshot()
            if self.mode == "lines":
                self._log()
            elif self.mode == "tables" and self.state.running > (before.running if before else 0):
                self._print()  # before a run takes this terminal, what it starts into

    def stop(self) -> None:
        with self._guard():
            if self.mode == "live":
                self._close()
            elif self.mode == "lines":
                self._log()
            elif self.mode == "tables":
                self._print()
        self.mode = "off"

    # -- the modes --

    def _elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _log(self) -> None:
        if self.state != self.shown and log.isEnabledFor(logging.INFO):
            assert self.state is not None
            log.info("%s", line(self.state, self._elapsed()))
            self.shown = self.state

    def _print(self) -> None:
        if self.state is not None and self.state != self.shown:
            assert self.console is not None
            self.console.print(table(self.state, self._elapsed()))
            self.shown = self.state

    def _frame(self) -> Table:
        assert self.state is not None
        return table(self.state, self._elapsed())

    def _start_live(self) -> None:
        # print() and log lines written straight to the terminal would scroll the table apart:
        # while it is up they go through rich's proxies of stdout and stderr, printed above it.
        assert self.console is not None
        streams = sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__
        redirect = self.console.file in streams
        self.live = Live(
            console=self.console,
            auto_refresh=False,  # our ticker redraws, so that its errors reach _guard
            transient=False,
            redirect_stdout=redirect,
            redirect_stderr=redirect,
            get_renderable=self._frame,
        )
        self.live.start(refresh=True)
        if redirect:  # Hydra's console handlers hold the streams they were configured with
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream in streams:
                    err = handler.stream in (streams[1], streams[3])
                    self.rerouted.append((handler, handler.stream))
                    handler.setStream(sys.stderr if err else sys.stdout)
        self.ticker = threading.Thread(target=self._tick, name="study-progress", daemon=True)
        self.ticker.start()

    def _tick(self) -> None:
        while not self.stopping.wait(REFRESH_S):
            with self._guard(), self.lock:  # the lock released before _guard's _close takes it
                if self.live is not None:
                    self.live.refresh()

    def _close(self) -> None:
        """Stop the ticker, give the log handlers their streams back, draw the last frame."""
        self.stopping.set()
        if self.ticker is not None and self.ticker is not threading.current_thread():
            self.ticker.join()
        with self.lock:
            for handler, stream in self.rerouted:
                with contextlib.suppress(Exception):
                    handler.setStream(stream)
            self.rerouted = []
            live, self.live = self.live, None
            if live is not None:
                live.stop()

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        try:
            yield
        except Exception:
            if self.failed:
                return  # said once already
            self.failed, self.mode = True, "off"
            with contextlib.suppress(Exception):
                self._close()  # the handlers their streams back before the warning goes through
            log.warning("the progress display failed and is off; the study goes on", exc_info=True)
