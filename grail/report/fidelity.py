"""A study's runs grouped by fidelity: the statistics over seeds per fidelity, and each cheaper
fidelity's transfer to the top one (grail-report on a multi-fidelity race, grail/study/ladder.py).

A run's fidelity is its `fidelity=` override (grail/core/config.py Config.fidelity, set by the
race per rung). Within a fidelity the settings are labelled by the swept keys alone: the rung's
own overrides (from the ladder's ladder.json, e.g. train.iterations=67) and `fidelity=` are left
out, so that a setting has one label at every fidelity and the transfer pairs them.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console

from grail.core.records import atomic_write_text, override_key
from grail.report.load import RunReport
from grail.report.seeds import (
    STATS_CSV_COLUMNS,
    csv_text,
    print_seed_stats,
    seed_stats,
    stats_csv_rows,
)
from grail.report.transfer import report_transfer
from grail.study.ladder import TOP
from grail.study.ladder_runner import FIDELITY_KEY, LADDER_RECORD
from grail.study.stats import SettingStats
from grail.study.transfer import transfer
from grail.study.verdicts import VerdictSettings


def fidelity_of(run: RunReport) -> str | None:
    for override in run.overrides:
        if override_key(override) == FIDELITY_KEY:
            value = override.split("=", 1)[1]
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            return value
    return None


def _ladder(root: Path) -> list[tuple[str, list[str]]]:
    """(fidelity, its overrides) per rung of the ladder recorded under `root`; [] without one."""
    try:
        record = json.loads((root / LADDER_RECORD).read_text())
        return [(r["fidelity"], list(r["overrides"])) for r in record["ladder"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def by_fidelity(runs: Sequence[RunReport], root: Path) -> list[tuple[str, list[RunReport]]]:
    """The runs per fidelity, cheapest first (the ladder's order; else first seen, `full`
    last), each run's overrides without its fidelity's own; [] when no run has a fidelity."""
    ladder = _ladder(root)
    own = dict(ladder)
    groups: dict[str, list[RunReport]] = {}
    for run in runs:
        if (name := fidelity_of(run)) is not None:
            groups.setdefault(name, []).append(run)
    if not groups:
        return []
    order = [name for name, _ in ladder if name in groups]
    order += sorted((n for n in groups if n not in order), key=lambda n: n == TOP)
    result = []
    for name in order:
        drop = {FIDELITY_KEY, *(override_key(o) for o in own.get(name, []))}
        members = [
            dataclasses.replace(
                r, overrides=[o for o in r.overrides if override_key(o) not in drop]
            )
            for r in groups[name]
        ]
        result.append((name, members))
    return result


def report_fidelities(
    console: Console,
    groups: Sequence[tuple[str, list[RunReport]]],
    metric: str,
    settings: VerdictSettings,
    out: Path,
    stats_csv: Path,
) -> list[Path]:
    """Print the statistics per fidelity and each cheaper fidelity's transfer to the top one;
    write the statistics (one CSV, a `fidelity` column first) and each transfer's CSV and plot
    (`transfer_<k>.csv`, `.png`: the k-th fidelity, cheapest 0, to the top)."""
    per_fidelity: list[tuple[str, list[SettingStats]]] = []
    rows: list[dict[str, Any]] = []
    for name, members in groups:
        seed_groups, stats = seed_stats(members, metric, settings)
        console.print()
        console.print(f"[bold]fidelity {name}[/] ({len(members)} runs)")
        print_seed_stats(console, seed_groups, stats, metric, settings)
        per_fidelity.append((name, stats))
        rows += [{"fidelity": name, **row} for row in stats_csv_rows(stats)]
    atomic_write_text(stats_csv, csv_text(("fidelity", *STATS_CSV_COLUMNS), rows))
    written = [stats_csv]
    if len(per_fidelity) < 2:
        return written
    top_name, top_stats = per_fidelity[-1]
    for k, (name, stats) in enumerate(per_fidelity[:-1]):
        console.print()
        console.print(f"[bold]transfer: fidelity {name} -> {top_name}[/]")
        result = transfer(stats, top_stats)
        names = (name, top_name)
        written += report_transfer(console, result, metric, names, out, settings, f"transfer_{k}")
    return written
