"""The study as one HTML page (grail/report/html.py): the race rewrites report.html after every run
(reloading while it runs, not once over), `grail-report --html` writes it for any sweep, every
text is escaped, and headless Chromium renders it without a console message, with its tables and
one SVG per chart. Run directories are synthetic (tests/helpers/run_dirs.py) and the race is
driven by test_race.py's fake launcher: no training."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers.run_dirs import make_run
from test_race import FakeLauncher, default_values, make_sweeper

from grail.core.records import write_summary
from grail.report import html as page_module
from grail.report.cli import main
from grail.report.html import REFRESH_S, REPORT_HTML, write_report
from grail.study import race_runner, race_sweeper

REFRESH = f'<meta http-equiv="refresh" content="{REFRESH_S}">'
TIMEOUT_S = 60  # one Chromium start; it takes 1-3 s


def _rows(page: str, table_class: str) -> list[str]:
    """The body rows of the page's table of that class."""
    match = re.search(rf'<table class="{table_class}">.*?<tbody>(.*?)</tbody>', page, re.S)
    assert match, f"no {table_class} table"
    return re.findall(r"<tr>.*?</tr>", match[1], re.S)


@pytest.fixture(scope="module")
def race(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """A race of two settings run through the race runner, one run at a time (two seeds each,
    then a third while not separated), and report.html as it stood when each run started: once
    it showed every run ended so far (its own thread draws it, a moment after verdict.json)."""
    sweep_dir = tmp_path_factory.mktemp("race")
    page = sweep_dir / REPORT_HTML
    seen: list[str] = []

    def values(kv: dict[str, str]) -> float | None:
        ended, deadline = len(seen), time.monotonic() + 30
        while ended and f"; {ended} runs ended" not in (text := _read(page)):
            assert time.monotonic() < deadline, f"report.html left at: {text[-2000:]}"
            time.sleep(0.02)
        seen.append(_read(page))
        return default_values(kv)

    sweeper = make_sweeper(FakeLauncher(sweep_dir, values), initial_seeds=2, max_seeds=3)
    sweeper.draw_page = write_report  # as the plugin Hydra instantiates does
    # as Hydra composes it: the page reads initial_seeds from the multirun.yaml the race saves
    sweeper.config.hydra.sweeper = {"initial_seeds": 2, "max_seeds": 3}
    sweeper.sweep(["train.lr=1e-3,2e-2", "train.iterations=2"])
    return sweep_dir, seen


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_the_race_rewrites_its_page_after_every_run_reloading_until_it_is_over(
    race: tuple[Path, list[str]],
) -> None:
    sweep_dir, seen = race
    assert seen[0] == ""  # nothing before the first run ended
    assert len(seen) == 6 and all(REFRESH in page for page in seen[1:])
    assert "the race is running" in seen[1]
    final = (sweep_dir / REPORT_HTML).read_text()
    assert REFRESH not in final and "6 runs ended; the race is over" in final
    assert not list(sweep_dir.glob(".report.html.*"))  # written atomically: no temporary left


def test_the_page_reads_the_race_files_by_their_names() -> None:
    # named in html.py, not imported, to keep Hydra's sweeper out of the report
    assert (
        page_module.RACE_RECORD == race_sweeper.RACE_RECORD
        and page_module.VERDICT == race_runner.VERDICT
    )
    assert page_module.RACE_RUN.pattern == race_runner.RUN_NAME.pattern


def test_the_race_page_holds_rounds_verdicts_and_a_chart_per_plot(
    race: tuple[Path, list[str]],
) -> None:
    page = (race[0] / REPORT_HTML).read_text()
    assert page.startswith("<!DOCTYPE html>") and "<script" not in page
    # a round per seed, then the verdicts now; each setting a column
    rounds = _rows(page, "rounds")
    assert len(rounds) == 4 and "verdict now" in rounds[-1]
    assert "initial round" in rounds[0] and "initial round" in rounds[1]
    assert "still racing the best" in rounds[2]
    assert "train.lr=0.001</th>" in page and "train.lr=0.02</th>" in page
    assert "0.020" in rounds[0] and "0.900" in rounds[0]  # each setting's auc on seed 0
    # a row per setting, with the interval inside [0, 1] drawn and captions saying what it is
    stats = _rows(page, "stats")
    assert len(stats) == 2 and all('class="bar"' in row for row in stats)
    assert "Chernoff-Hoeffding" in page and "<dt>seeds to separate</dt>" in page
    # one SVG per chart: the curves per setting and every run over training
    assert page.count("<svg") == page.count("</svg>") == 2
    assert "train.lr=0.001: auc" in page  # the legend, as text in the SVG
    assert len(_rows(page, "runs")) == 6


@pytest.fixture
def grid(tmp_path: Path) -> Path:
    """A 2 x 2 grid on two seeds, one of its keys' values and a failed run's error needing
    escaping in HTML."""
    root = tmp_path / "grid"
    job = 0
    for lr in ("1e-3", "5e-3"):
        for tag in ("<i>a&b</i>", "plain"):
            for seed in (0, 1, 2):
                overrides = [f"train.lr={lr}", f"+tag={tag}", f"seed={seed}"]
                level = 0.1 + 0.3 * (lr == "5e-3") + 0.1 * seed
                make_run(
                    root / str(job),
                    overrides,
                    iterations=4,
                    done=4 if job else 2,
                    success=lambda i, level=level: min(1.0, level + 0.1 * i),
                    completed=job > 0,
                )
                job += 1
    try:
        raise RuntimeError("<script>alert(1)</script> & more")
    except RuntimeError as exc:
        write_summary(root / "0", 5.0, error=exc, environment="copy_digits")
    return root


def test_grail_report_html_escapes_every_text(grid: Path) -> None:
    assert main([str(grid), "--html"]) == 0
    page = (grid / REPORT_HTML).read_text()
    assert REFRESH not in page  # no race rewrites it: nothing to reload
    assert "<script" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert "+tag=&lt;i&gt;a&amp;b&lt;/i&gt;" in page  # in the tables and the charts' legends
    # a 2-D study: the heat map too, its tag axis labelled
    assert page.count("<svg") == 3 and len(_rows(page, "stats")) == 4
    assert sum("failed 1" in row for row in _rows(page, "stats")) == 1


def test_an_explicit_path_and_a_grid_without_seeds(tmp_path: Path) -> None:
    make_run(tmp_path / "sweep" / "0", ["train.lr=1e-3"], iterations=2, done=2, completed=True)
    out = tmp_path / "pages" / "study.html"
    assert main([str(tmp_path / "sweep"), "--out", str(tmp_path / "o"), "--html", str(out)]) == 0
    page = out.read_text()
    assert 'id="verdicts"' not in page and page.count("<svg") == 1  # no seeds: no statistics
    assert len(_rows(page, "runs")) == 1


def test_a_search_lists_its_trials(tmp_path: Path) -> None:
    import optuna
    from optuna.distributions import FloatDistribution
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    from grail.study.search_study import JOURNAL, SEARCH_DIR, STUDY_ATTR

    (tmp_path / SEARCH_DIR).mkdir()
    storage = JournalStorage(JournalFileBackend(str(tmp_path / SEARCH_DIR / JOURNAL)))
    study = optuna.create_study(storage=storage, study_name="search", direction="maximize")
    study.set_user_attr(STUDY_ATTR, {"metric": "auc", "direction": "maximize"})
    for number, (lr, values) in enumerate([(1e-3, [0.2, 0.3]), (4e-3, [0.7, 0.9])]):
        setting = [f"train.lr={lr}"]
        for seed, job in enumerate((2 * number, 2 * number + 1)):
            make_run(tmp_path / str(job), [*setting, f"seed={seed}"], iterations=2, done=2)
        study.add_trial(
            optuna.trial.create_trial(
                params={"train.lr": lr},
                distributions={"train.lr": FloatDistribution(1e-4, 1e-2, log=True)},
                value=sum(values) / 2,
                user_attrs={
                    "overrides": setting,
                    "jobs": [2 * number, 2 * number + 1],
                    "values_by_seed": {str(s): v for s, v in enumerate(values)},
                },
            )
        )
    page = write_report(tmp_path).read_text()
    trials = _rows(page, "trials")
    assert len(trials) == 2 and "1 (best)" in trials[1] and "0: 0.700 1: 0.900" in trials[1]


# ---- in a browser -------------------------------------------------------------------------------


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if found := shutil.which(name):
            return found
    pytest.skip("no chromium binary on PATH (Debian: apt-get install chromium; .ci/run does)")


def _browse(page: Path, profile: Path, *flags: str) -> tuple[str, str]:
    """Chromium, headless, on `page`: (stdout, stderr); console messages go to stderr as
    `...:CONSOLE...] "..."`. Killed with its helper processes (its own session) if it hangs."""
    argv: Sequence[str] = [
        _chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={profile}",  # its own profile: other Chromiums may be running
        "--enable-logging=stderr",
        "--v=0",
        *flags,
        page.resolve().as_uri(),
    ]
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise
    assert process.returncode == 0, err[-3000:]
    return out, err


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_chromium_renders_the_page_without_a_console_message(
    race: tuple[Path, list[str]], tmp_path: Path
) -> None:
    # Its logging must show console messages, or "none" would prove nothing.
    control = tmp_path / "control.html"
    control.write_text("<!DOCTYPE html><p>x</p><script>console.error('seen')</script>")
    _, err = _browse(control, tmp_path / "p", "--dump-dom")
    assert any("seen" in line for line in _console(err)), err[-3000:]

    page = race[0] / REPORT_HTML
    shot = tmp_path / "shot.png"
    dom, err = _browse(page, tmp_path / "p", "--dump-dom")
    assert _console(err) == []
    assert dom.count("<svg") == 2
    assert re.search(r'<path [^>]*clip-path="url\(#f0-', dom)  # the curves, clipped to their axes
    ids = re.findall(r' id="([^"]+)"', dom)
    assert len(ids) == len(set(ids)), "an id twice: the figures' references would cross"
    assert "train.lr=0.02: auc" in dom  # the legend, as text
    assert len(re.findall(r"<tr>", dom)) >= 4 + 2 + 6  # rounds, settings, runs (and headers)

    _browse(
        page, tmp_path / "p", "--hide-scrollbars", "--window-size=1200,1600", f"--screenshot={shot}"
    )
    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1200, 1600)
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 16) or range(1 << 16)) > 50
