"""The per-run table (rich) and its CSV."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

from grail.report.load import SORT_KEYS, RunReport, _get
from grail.study.runs import (
    natural_key,
)

SPARK = "▁▂▃▄▅▆▇█"


CSV_NAME = "summary.csv"


def sparkline(values: Sequence[float], width: int = 16) -> str:
    """Values as block characters, lowest ▁ to highest █; longer series are averaged into `width`
    buckets. A flat series is drawn mid-height."""
    if not values:
        return ""
    if len(values) > width:
        edges = [round(i * len(values) / width) for i in range(width + 1)]
        values = [
            sum(values[a:b]) / (b - a) for a, b in zip(edges, edges[1:], strict=False) if b > a
        ]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[len(SPARK) // 2] * len(values)
    top = len(SPARK) - 1
    return "".join(SPARK[round((v - lo) / (hi - lo) * top)] for v in values)


def sort_runs(runs: list[RunReport], key: str, reverse: bool = False) -> list[RunReport]:
    """Best first by `key` (highest, or lowest for time); runs without a value last, in name
    order. `reverse` flips the order of the runs that have a value."""
    if key == "name":
        return sorted(runs, key=lambda r: natural_key(r.name), reverse=reverse)
    if key not in SORT_KEYS:
        raise ValueError(f"unknown sort key {key!r}; known: name, {', '.join(SORT_KEYS)}")
    higher_is_better = SORT_KEYS[key][1]
    have = [r for r in runs if r.value(key) is not None]
    missing = sorted((r for r in runs if r.value(key) is None), key=lambda r: natural_key(r.name))
    # Stable sorts: ties keep name order whichever way the values go.
    have.sort(key=lambda r: natural_key(r.name))
    have.sort(key=lambda r: r.value(key), reverse=higher_is_better != reverse)  # type: ignore[arg-type,return-value]
    return have + missing


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{s:02d}s"
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m"


def _num(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _at(record: dict[str, Any] | None, key: str) -> str:
    value = _get(record, key)
    return "–" if value is None or record is None else f"{value:.3f} @{record['iteration']}"


def trend(rewards: Sequence[float]) -> str:
    if not rewards:
        return "–"
    return f"{rewards[0]:.3f}→{rewards[-1]:.3f} {sparkline(rewards)}"


_STATUS_STYLE = {"done": "green", "failed": "red", "pruned": "magenta", "incomplete": "yellow"}


def build_table(runs: Sequence[RunReport], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("run", no_wrap=True)
    table.add_column("overrides")
    table.add_column("status", no_wrap=True)
    table.add_column("iters", justify="right", no_wrap=True)
    table.add_column("final success", justify="right")
    table.add_column("best success", justify="right")
    table.add_column("final reward", justify="right")
    table.add_column("best reward", justify="right")
    table.add_column("train reward first→last", no_wrap=True)
    table.add_column("train time", justify="right", no_wrap=True)
    for r in runs:
        target = f"/{r.target_iterations}" if r.target_iterations is not None else ""
        table.add_row(
            escape(r.name),
            escape(r.label or "–"),
            f"[{_STATUS_STYLE[r.status]}]{r.status}[/]",
            f"{r.iterations}{target}",
            _num(_get(r.final, "success_rate")),
            _at(r.best_success, "success_rate"),
            _num(_get(r.final, "reward_mean")),
            _at(r.best_reward, "reward_mean"),
            trend(r.train_rewards),
            format_duration(r.time_s),
        )
    return table


CSV_COLUMNS = (
    "run",
    "overrides",
    "label",
    "status",
    "iterations",
    "target_iterations",
    "baseline_success",
    "baseline_reward",
    "final_iteration",
    "final_success",
    "final_reward",
    "best_success_iteration",
    "best_success",
    "best_reward_iteration",
    "best_reward",
    "first_train_reward",
    "last_train_reward",
    "time_s",
    "wall_time_s",
    "error",
    "path",
)


def csv_row(r: RunReport) -> dict[str, Any]:
    def iteration(record: dict[str, Any] | None) -> int | None:
        return None if record is None else record["iteration"]

    return {
        "run": r.name,
        "overrides": " ".join(r.overrides),
        "label": r.label,
        "status": r.status,
        "iterations": r.iterations,
        "target_iterations": r.target_iterations,
        "baseline_success": _get(r.baseline, "success_rate"),
        "baseline_reward": _get(r.baseline, "reward_mean"),
        "final_iteration": iteration(r.final),
        "final_success": _get(r.final, "success_rate"),
        "final_reward": _get(r.final, "reward_mean"),
        "best_success_iteration": iteration(r.best_success),
        "best_success": _get(r.best_success, "success_rate"),
        "best_reward_iteration": iteration(r.best_reward),
        "best_reward": _get(r.best_reward, "reward_mean"),
        "first_train_reward": r.train_rewards[0] if r.train_rewards else None,
        "last_train_reward": r.train_rewards[-1] if r.train_rewards else None,
        "time_s": r.time_s,
        "wall_time_s": r.wall_time_s,
        "error": r.error,
        "path": str(r.path),
    }


def write_csv(runs: Sequence[RunReport], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for r in runs:
            writer.writerow({k: "" if v is None else v for k, v in csv_row(r).items()})
