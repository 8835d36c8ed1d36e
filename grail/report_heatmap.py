"""The heat map of a 2-D study for `grail-report --plot`: one cell per setting of two swept keys
(e.g. `train.lr` × `train.kl_coef`), coloured by the mean of the metric over seeds, with the mean,
its 95% confidence interval and the number of seeds written in the cell.

`grid_of(stats)` decides whether the settings form such a grid (exactly two keys tell them apart)
and lays out the cells; `plot_heatmap` draws it. A grid with holes (a setting not run, or without
a completed seed) shows the hole as an empty cell rather than refusing the whole picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grail.records import override_key
from grail.report_stats import CI_METHOD, CONFIDENCE, SettingStats, setting_of
from grail.runs import natural_key


@dataclass(frozen=True)
class Grid:
    """Settings laid out on two keys: `cells[(x, y)]` is the setting whose `x_key` has value x and
    `y_key` value y (values as written in the overrides)."""

    x_key: str
    y_key: str
    xs: list[str]
    ys: list[str]
    cells: dict[tuple[str, str], SettingStats]


def _value_order(values: set[str]) -> list[str]:
    """Numbers by value (1e-3 before 5e-3 before 1e-2), anything else in natural order."""

    def key(v: str) -> tuple[int, float, list[object]]:
        try:
            return (0, float(v), [])
        except ValueError:
            return (1, 0.0, natural_key(v))

    return sorted(values, key=key)


def grid_of(stats: Sequence[SettingStats]) -> Grid | None:
    """The settings as a 2-D grid when exactly two override keys take more than one value across
    them (the others fixed); None otherwise (a 1-D sweep, three or more swept keys, a setting
    without one of the two keys). The learning rate goes on the x axis when it is swept."""
    settings: list[tuple[SettingStats, dict[str, str]]] = []
    for s in stats:
        if not s.runs:
            return None
        pairs = (o.split("=", 1) for o in setting_of(s.runs[0].overrides) if "=" in o)
        settings.append((s, {override_key(k): v for k, v in pairs}))
    if len(settings) < 2:
        return None
    keys = sorted({k for _, values in settings for k in values})
    swept = [k for k in keys if len({values.get(k) for _, values in settings}) > 1]
    if len(swept) != 2 or any(k not in values for _, values in settings for k in swept):
        return None
    x_key, y_key = sorted(swept, key=lambda k: (k != "train.lr", k))
    cells = {(values[x_key], values[y_key]): s for s, values in settings}
    if len(cells) != len(settings):  # two settings on one cell: a third key differs somewhere
        return None
    return Grid(
        x_key=x_key,
        y_key=y_key,
        xs=_value_order({x for x, _ in cells}),
        ys=_value_order({y for _, y in cells}),
        cells=cells,
    )


def cell_text(s: SettingStats | None) -> str:
    """What a cell says: mean, [lo, hi] and n, then "best" or "tied" (statistically
    indistinguishable from the best, as in the table); 'n/a' where no seed completed."""
    if s is None or s.interval.mean is None:
        return "n/a"
    lines = [f"{s.interval.mean:.3f}"]
    if s.interval.lo is not None and s.interval.hi is not None:
        lines.append(f"[{s.interval.lo:.2f}, {s.interval.hi:.2f}]")
    lines.append(f"n={s.n}")
    if s.is_best:
        lines.append("best")
    elif s.tie is not None and s.tie.tied:
        lines.append("tied")
    return "\n".join(lines)


def plot_heatmap(grid: Grid, path: Path, title: str) -> None:
    """Write the grid as a PNG heat map (viridis, the colour scale fixed to the metric's [0, 1])."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    means = np.full((len(grid.ys), len(grid.xs)), np.nan)
    for (x, y), s in grid.cells.items():
        if s.interval.mean is not None:
            means[grid.ys.index(y), grid.xs.index(x)] = s.interval.mean
    metric = next(iter(grid.cells.values())).metric
    width = max(5.0, 1.6 * len(grid.xs) + 2.5)
    height = max(3.5, 1.0 * len(grid.ys) + 2.0)
    fig, ax = plt.subplots(figsize=(width, height), constrained_layout=True)
    image = ax.imshow(
        np.ma.masked_invalid(means), cmap="viridis", vmin=0.0, vmax=1.0, origin="lower"
    )
    for (x, y), s in grid.cells.items():
        i, j = grid.ys.index(y), grid.xs.index(x)
        dark = s.interval.mean is not None and s.interval.mean < 0.5
        color = "white" if dark else "black"
        ax.text(j, i, cell_text(s), ha="center", va="center", fontsize=8, color=color)
    ax.set_xticks(range(len(grid.xs)), grid.xs)
    ax.set_yticks(range(len(grid.ys)), grid.ys)
    ax.set_xlabel(grid.x_key)
    ax.set_ylabel(grid.y_key)
    fig.colorbar(image, ax=ax, label=f"{metric}: mean over seeds")
    ax.set_title(f"{title}\n{CONFIDENCE:.0%} CI: {CI_METHOD}", fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def heatmap_path(plot_path: Path) -> Path:
    """Beside the learning-curve plot: `curves.png` → `curves_heatmap.png`."""
    return plot_path.with_name(f"{plot_path.stem}_heatmap{plot_path.suffix or '.png'}")
