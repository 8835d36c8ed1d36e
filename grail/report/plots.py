"""The PNGs of `grail-report`: the runs' key metrics over training (`plot`), the learning curve
of each setting, every seed thin and the mean over seeds bold with the table's interval as its band
(`plot_seeds`), and the heat map of a 2-D study such as `train.lr` × `train.kl_coef` (`grid_of`,
`plot_heatmap`).

The heat map: one cell per setting of the two swept keys, coloured by the mean of the metric over
seeds, with the mean, its 95% confidence interval, the number of seeds and the verdict against the
best (grail/study/verdicts.py) written in the cell. `grid_of(stats)` decides whether the settings
form such a grid (exactly two keys tell them apart) and lays out the cells; a grid with holes (a
setting not run, or without a seed with a value) shows the hole as an empty cell rather than
refusing the whole picture.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from grail.core.records import override_key
from grail.report.load import PLOT_PANELS
from grail.study.runs import natural_key
from grail.study.stats import (
    CI_METHOD,
    CONFIDENCE,
    REPORT_SETTINGS,
    SeedRun,
    SettingStats,
    mean_curve,
    setting_of,
)
from grail.study.verdicts import Outcome, VerdictSettings

if TYPE_CHECKING:
    from grail.report.load import RunReport


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


# The verdicts as a cell or a legend says them.
SHORT_OUTCOME = {
    Outcome.BEST: "best",
    Outcome.WORSE: "worse",
    Outcome.NOT_SEPARATED: "not separated",
    Outcome.EQUIVALENT: "equivalent",
    Outcome.NOTHING_LEARNT: "nothing learnt",
}


def cell_text(s: SettingStats | None) -> str:
    """What a cell says: mean, [lo, hi] and n, then the verdict against the best (as in the
    table); 'n/a' where no seed has a value."""
    if s is None or s.interval.mean is None:
        return "n/a"
    lines = [f"{s.interval.mean:.3f}"]
    if s.interval.lo is not None and s.interval.hi is not None:
        lines.append(f"[{s.interval.lo:.2f}, {s.interval.hi:.2f}]")
    lines.append(f"n={s.n}" + (f" ({s.n_censored} censored)" if s.n_censored else ""))
    if s.verdict is not None:
        lines.append(SHORT_OUTCOME[s.verdict.outcome])
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


# ---- runs and settings over training ----------------------------------------------------------

# What an empty panel says: why there may be nothing to draw.
_EMPTY = {"kl": "no KL recorded\n(it needs train.kl_coef > 0)"}

_LINESTYLE = {"done": "-", "incomplete": "--", "failed": ":", "pruned": "-."}


def _palette(count: int) -> list[Any]:
    """Distinct colours for `count` lines (tab10, or tab20 past 10)."""
    from matplotlib import colormaps

    cmap = colormaps["tab10" if count <= 10 else "tab20"]
    return [cmap(i) for i in range(cmap.N)]


def plot(runs: Sequence[RunReport], path: Path, title: str) -> None:
    """One panel per key metric over policy versions, one line per run (solid: done, dashed:
    incomplete, dotted with an x at its last point: failed, dash-dotted: pruned); the legend fills
    the last panel."""
    import matplotlib

    matplotlib.use("Agg")  # files only: never needs a display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 3, figsize=(16, 9), constrained_layout=True)
    flat = axes.ravel()
    colors = _palette(len(runs))
    # Colours follow run names, not the sort order, so a run keeps its colour between reports.
    by_name = {r.name: i for i, r in enumerate(sorted(runs, key=lambda r: natural_key(r.name)))}
    handles = []
    for order, r in enumerate(runs):
        color = colors[by_name[r.name] % len(colors)]
        # Runs with identical curves (common early in a sweep) would hide each other: lines drawn
        # first are wider, so each later one shows inside the earlier ones.
        width = max(1.2, 5.0 - 1.3 * order)
        label = f"{r.name}: {r.label}" if r.label else r.name
        if r.status != "done":
            label += f" [{r.status}]"
        handle = None
        for ax, (key, _) in zip(flat, PLOT_PANELS, strict=False):
            points = r.series.get(key, [])
            if not points:
                continue
            xs, ys = zip(*points, strict=True)
            (line,) = ax.plot(
                xs,
                ys,
                linestyle=_LINESTYLE[r.status],
                marker="o" if len(points) <= 30 else None,
                markersize=3,
                color=color,
                linewidth=width,
            )
            if r.status == "failed":
                ax.plot(xs[-1], ys[-1], marker="x", markersize=9, color=color, mew=2)
            handle = handle or line
        if handle is None:  # no metrics yet: still listed in the legend
            (handle,) = flat[0].plot([], [], linestyle=_LINESTYLE[r.status], color=color)
        handle.set_label(label)
        handles.append(handle)

    for ax, (key, name) in zip(flat, PLOT_PANELS, strict=False):
        ax.set_title(name)
        ax.set_xlabel("policy version (updates applied)")
        ax.grid(alpha=0.3)
        if key == "eval_success":
            ax.set_ylim(-0.03, 1.03)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # versions are whole numbers
        if not any(len(line.get_xdata()) for line in ax.lines):
            ax.text(
                0.5,
                0.5,
                _EMPTY.get(key, "no data yet"),
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
    legend_ax = flat[-1]
    legend_ax.axis("off")
    if handles:
        legend_ax.legend(
            handles=handles,
            loc="upper left",
            fontsize=9 if len(handles) <= 12 else 7,
            ncol=1 if len(handles) <= 16 else 2,
            frameon=False,
            title="run: overrides",
        )
    fig.suptitle(title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def seed_curves(s: SettingStats) -> list[tuple[SeedRun, list[tuple[int, float]]]]:
    """The curves the statistics count, by run: completed runs as they are, pruned ones (censored)
    held at their last eval up to the setting's last version, as the table counts them at that
    value rather than dropping them."""
    counted = [r for r in s.runs if r.status in ("done", "pruned") and r.curve]
    versions = sorted({x for r in counted for x, _ in r.curve})
    curves = []
    for r in counted:
        curve = list(r.curve)
        if r.status == "pruned":
            last_x, last_y = curve[-1]
            curve += [(x, last_y) for x in versions if x > last_x]
        curves.append((r, curve))
    return curves


def plot_seeds(
    stats: Sequence[SettingStats],
    path: Path,
    title: str,
    settings: VerdictSettings = REPORT_SETTINGS,
) -> None:
    """Eval success rate over policy versions per setting: each seed a thin line (a pruned one
    dash-dotted, ending in x where it stopped, then dotted at the value it counts with), the mean
    over the seeds bold with the table's interval as a band (inside [0, 1] by construction:
    nothing is clipped). The legend gives each setting's ranking metric and verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(10, 6), constrained_layout=True)
    colors = _palette(len(stats))
    metric = stats[0].metric if stats else "auc"
    for i, s in enumerate(stats):
        curves = seed_curves(s)
        if not curves:
            continue
        color = colors[i % len(colors)]
        for r, counted in curves:
            seed_xs, seed_ys = zip(*r.curve, strict=True)
            style = _LINESTYLE[r.status]
            ax.plot(seed_xs, seed_ys, linestyle=style, linewidth=0.7, alpha=0.45, color=color)
            if r.status == "pruned":  # where it stopped, then the value it counts with, dotted
                ax.plot(seed_xs[-1], seed_ys[-1], marker="x", markersize=6, color=color, alpha=0.7)
                held_xs, held_ys = zip(*counted[len(r.curve) - 1 :], strict=True)
                ax.plot(held_xs, held_ys, linestyle=":", linewidth=0.7, alpha=0.45, color=color)
        points = mean_curve([curve for _, curve in curves], settings)
        xs = [p.version for p in points]
        ys = [cast(float, p.interval.mean) for p in points]  # each point has >= 1 value
        verdict = SHORT_OUTCOME[s.verdict.outcome] if s.verdict is not None else "–"
        censored = f", {s.n_censored} censored" if s.n_censored else ""
        label = f"{s.label}: {metric} {s.interval.mean:.3f}, {verdict} (n={s.n}{censored})"
        ax.plot(xs, ys, marker="o", markersize=3, linewidth=2.2, color=color, label=label)
        ax.fill_between(
            xs,
            [cast(float, p.interval.lo) for p in points],
            [cast(float, p.interval.hi) for p in points],
            color=color,
            alpha=0.12,
            linewidth=0,
        )
    ax.set_xlabel("policy version (updates applied)")
    ax.set_ylabel(
        f"eval success rate: seeds (thin), mean (bold), {settings.confidence:.0%} CI band"
    )
    ax.set_ylim(-0.03, 1.03)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(
            fontsize=8, frameon=False, title=f"setting: {metric} (ranks the settings), verdict"
        )
    else:
        ax.text(
            0.5, 0.5, "no run with a value yet", ha="center", va="center", transform=ax.transAxes
        )
    ax.set_title(
        f"{title}\nlearning curves; settings ranked by {metric} over seeds; band: {CI_METHOD}",
        fontsize=10,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
