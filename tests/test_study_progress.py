"""What a race or a search shows while it runs (grail/study/progress.py): one log line per change
when the output is not a terminal, a rich Live table on one (tables printed between runs when the
runs share it), and a display that breaks turns itself off without stopping the study. Races are
test_race.py's fakes (no training); the search is test_search.py's."""

from __future__ import annotations

import io
import json
import logging
import re
import sys
import threading
from pathlib import Path

import pytest
from rich.console import Console
from test_race import LRS, FakeLauncher, Values, default_values, make_sweeper
from test_search import SEARCH, _sweeper

from grail.study import progress, race_runner
from grail.study.progress import Row, State, StudyProgress
from grail.study.race import Run
from grail.study.race_runner import VERDICT
from grail.study.race_sweeper import RaceSweeper
from grail.study.sweep import SUBMITIT_LOCAL

PROGRESS = "grail.study.progress"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _console(file: io.StringIO | None = None) -> Console:
    return Console(file=file or io.StringIO(), force_terminal=True, width=120, color_system=None)


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PROGRESS]


def _threaded(tmp_path: Path, values: Values = default_values) -> tuple[FakeLauncher, RaceSweeper]:
    """A race on three slots of the submitit local launcher: its runs print elsewhere."""
    launcher = FakeLauncher(tmp_path, values, parallel=3, delay=lambda overrides: 0.02)
    return launcher, make_sweeper(launcher, launcher_target=SUBMITIT_LOCAL, max_batch_size=3)


def test_a_piped_race_logs_a_line_per_run_started_and_ended(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    launcher = FakeLauncher(tmp_path)
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        make_sweeper(launcher).sweep(LRS)
    lines = _lines(caplog)
    runs = len(launcher.runs())
    assert len(lines) == 2 * runs  # one run at a time: each start and each end is a change
    # 3 settings x max_seeds 6 is the budget before any verdict
    assert lines[0].startswith("race: 0/≤18 runs ended, 1 running, ≤17 left to start, 0:0")
    assert "train.lr=0.001 no value yet (0 seeds, 1 running)" in lines[0]
    ended = [int(re.match(r"race: (\d+)/", line)[1]) for line in lines]  # type: ignore[index]
    assert ended == sorted(ended) and ended[-1] == runs
    # the end: every setting with the verdict verdict.json holds, best first
    verdict = json.loads((tmp_path / VERDICT).read_text())
    assert lines[-1].startswith(f"race: {runs}/{runs} runs ended, 0 running, 0 left to start, ")
    assert ", decided; " in lines[-1]
    phrases = lines[-1].split("; ", 1)[1].split(", ")
    for entry, phrase in zip(verdict["settings"], phrases, strict=True):
        lr, n = entry["overrides"]["train.lr"], entry["n_seeds"]
        assert phrase == f"train.lr={lr} {entry['outcome']} {entry['mean']:.3f} ({n} seeds)"


def test_a_piped_search_logs_its_trials_and_the_best_so_far(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    sweeper, _ = _sweeper(tmp_path, lambda job: None, n_trials=3, max_batch_size=4)
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        sweeper.sweep(SEARCH)
    lines = _lines(caplog)
    assert lines[0].startswith("search 'search': 0/3 trials ended, 2 running, 1 left to start")
    assert "trial 0 train.lr=" in lines[0] and "running (0 seeds, 2 running)" in lines[0]
    assert lines[-1].startswith("search 'search': 3/3 trials ended, 0 running, 0 left to start")
    assert re.search(r"; trial \d train\.lr=\S+ best \d\.\d{3} \(2 seeds\)", lines[-1])
    assert lines[-1].count(" complete ") == 2


def test_the_live_table_on_a_terminal_shows_settings_verdicts_and_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(progress, "terminal", lambda: _console(screen))
    launcher, sweeper = _threaded(tmp_path)
    sweeper.sweep(LRS)
    out = screen.getvalue()
    assert "\x1b[1A" in out  # redrawn in place: a Live display, not printed tables
    last = ANSI.sub("", out).rsplit("race: ", 1)[1]  # the frame left on screen
    runs = len(launcher.runs())
    assert last.startswith(f"{runs}/{runs} runs ended, 0 running, 0 left to start")
    assert "decided" in last.splitlines()[0]
    for heading in ("setting", "seeds ended", "running", "verdict", "auc", "CI"):
        assert heading in last
    verdict = json.loads((tmp_path / VERDICT).read_text())
    rows = [line for line in last.splitlines() if "train.lr=" in line]
    for entry, row in zip(verdict["settings"], rows, strict=True):
        cells = [c.strip() for c in row.strip("│ ").split("│")]
        lo, hi = entry["ci"]
        assert cells == [
            f"train.lr={entry['overrides']['train.lr']}",
            str(entry["n_seeds"]),
            "",
            entry["outcome"],
            f"{entry['mean']:.3f}",
            f"[{lo:.3f}, {hi:.3f}]",
        ]
    assert not [t for t in threading.enumerate() if t.name == "study-progress"]


def test_the_live_table_redraws_the_clock_and_says_at_most_for_a_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = State(
        "race",
        "runs",
        "auc",
        ended=7,
        running=2,
        left=9,
        bounded=True,
        rows=(
            Row("train.lr=5e-3", 3, 1, "best", 0.56, (0.4, 0.7)),
            Row("train.lr=[1,2]", 3, 0, "not_separated", 0.5, (0.3, 0.7)),
            Row("train.lr=1e-3", 0, 1, None),
        ),
    )
    screen = io.StringIO()
    monkeypatch.setattr(progress, "terminal", lambda: _console(screen))
    display = StudyProgress(lambda: state, in_process=False)
    display.start()
    assert display.mode == "live"
    display.stopping.wait(1.2)  # two redraws of the ticker
    display.stop()
    out = ANSI.sub("", screen.getvalue())
    assert out.count("race: 7/≤18 runs ended, 2 running, ≤9 left to start, 0:0") >= 3
    assert "train.lr=[1,2]" in out and "not separated yet" in out  # a value, not markup
    assert "no value yet" in out and "[0.400, 0.700]" in out
    assert progress.line(state, 151) == (
        "race: 7/≤18 runs ended, 2 running, ≤9 left to start, 2:31 elapsed; "
        "train.lr=5e-3 best 0.560 (3 seeds, 1 running), "
        "train.lr=[1,2] not separated yet 0.500 (3 seeds), "
        "train.lr=1e-3 no value yet (0 seeds, 1 running)"
    )


def test_runs_in_this_process_get_a_table_as_each_starts_not_a_live_display(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(progress, "terminal", lambda: _console(screen))
    launcher = FakeLauncher(tmp_path)  # the basic launcher: each run in this process
    make_sweeper(launcher).sweep(LRS)
    out = screen.getvalue()
    assert "\x1b[1A" not in out  # nothing drawn over what the runs print
    runs = len(launcher.runs())
    assert out.count("runs ended") == runs + 1  # one as each run starts, one at the end
    last = ANSI.sub("", out).rsplit("race: ", 1)[1]
    assert last.startswith(f"{runs}/{runs} runs ended, 0 running, 0 left to start")


def test_log_lines_go_above_the_live_table_and_their_streams_come_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Hydra's console handler holds sys.stdout as it was: while the table is up it writes
    through rich's proxy (printed above the table), and gets its stream back at the end."""
    monkeypatch.setattr(progress, "terminal", lambda: _console(sys.stdout))  # type: ignore[arg-type]
    handler = logging.StreamHandler(sys.stdout)
    logging.getLogger().addHandler(handler)
    streams = []

    def values(kv: dict[str, str]) -> float:
        streams.append(handler.stream)
        return default_values(kv)

    try:
        _, sweeper = _threaded(tmp_path, values)
        sweeper.sweep(LRS)
        assert handler.stream is sys.stdout  # back to the stream it held
    finally:
        logging.getLogger().removeHandler(handler)
    assert streams and all(type(s).__name__ == "FileProxy" for s in streams)


def test_a_display_that_breaks_is_said_once_and_the_race_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> str:
        raise RuntimeError("no display today")

    monkeypatch.setattr(progress, "line", broken)
    with caplog.at_level(logging.INFO, logger=PROGRESS):
        make_sweeper(FakeLauncher(tmp_path / "lines")).sweep(LRS)
    assert json.loads((tmp_path / "lines" / VERDICT).read_text())["decided"]
    said = [r for r in caplog.records if r.name == PROGRESS]
    assert len(said) == 1 and "display failed and is off" in said[0].getMessage()
    assert said[0].levelno == logging.WARNING and said[0].exc_info is not None

    class Gone(io.StringIO):  # a terminal that went away mid-race
        writes = 0

        def write(self, text: str) -> int:
            Gone.writes += 1
            if Gone.writes > 1:  # the first frame drawn, no other
                raise OSError("terminal gone")
            return super().write(text)

    caplog.clear()
    monkeypatch.setattr(progress, "terminal", lambda: _console(Gone()))
    _, sweeper = _threaded(tmp_path / "live")
    sweeper.sweep(LRS)
    assert json.loads((tmp_path / "live" / VERDICT).read_text())["decided"]
    said = [r for r in caplog.records if r.name == PROGRESS]
    assert len(said) == 1 and "display failed and is off" in said[0].getMessage()
    assert not [t for t in threading.enumerate() if t.name == "study-progress"]


def test_ctrl_c_stops_the_live_table_with_the_race(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(progress, "terminal", lambda: _console(screen))
    waits = 0

    def wait_then_ctrl_c(done: race_runner.Ended) -> tuple[int, Run, BaseException | None]:
        nonlocal waits  # Ctrl-C reaches the main thread where it waits for runs to end
        waits += 1
        if waits > 5:
            raise KeyboardInterrupt
        return get(done)

    get = race_runner._get
    monkeypatch.setattr(race_runner, "_get", wait_then_ctrl_c)
    _, sweeper = _threaded(tmp_path)
    with pytest.raises(SystemExit, match="130"):
        sweeper.sweep(LRS)
    assert not [t for t in threading.enumerate() if t.name == "study-progress"]
    assert "runs ended" in ANSI.sub("", screen.getvalue()).rsplit("race: ", 1)[1]
