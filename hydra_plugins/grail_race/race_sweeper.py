"""hydra/sweeper=grail_race: the racing sweeper of grail/study/race_sweeper.py, under the name
Hydra accepts (plugins must live in the `hydra_plugins` namespace package, which Hydra scans on
start)."""

from __future__ import annotations

from grail.report.html import write_report
from grail.study import race_sweeper


class RaceSweeper(race_sweeper.RaceSweeper):
    """See grail/study/race_sweeper.py; it draws report.html beside verdict.json."""

    draw_page = staticmethod(write_report)
