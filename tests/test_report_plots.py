"""The heat map of grail-report (grail/report/plots.py): which studies form an lr × kl_coef grid,
how it is laid out and labelled, and that the PNG is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from grail.report.plots import cell_text, grid_of, heatmap_path, plot_heatmap
from grail.study.stats import SeedRun, group_by_setting, summarize


def _runs(settings: dict[tuple[str, ...], list[float]]) -> list[SeedRun]:
    """One completed run per (setting, seed), its auc the given value."""
    runs = []
    for overrides, values in settings.items():
        for seed, v in enumerate(values):
            runs.append(
                SeedRun(
                    name=f"{len(runs)}",
                    overrides=[*overrides, f"seed={seed}", "train.iterations=50"],
                    status="done",
                    final=v,
                    best=v,
                    auc=v,
                )
            )
    return runs


def _stats(settings: dict[tuple[str, ...], list[float]]):  # type: ignore[no-untyped-def]
    return summarize(group_by_setting(_runs(settings), lambda r: r.overrides), "auc")


def test_a_two_key_study_is_a_grid_with_numeric_axes_and_lr_on_x() -> None:
    settings = {
        (f"train.kl_coef={kl}", f"train.lr={lr}"): [0.1 * i + 0.01 * j for j in range(3)]
        for i, lr in enumerate(["1e-2", "1e-3", "5e-3"])
        for kl in ["0.1", "0"]
    }
    grid = grid_of(_stats(settings))
    assert grid is not None
    assert (grid.x_key, grid.y_key) == ("train.lr", "train.kl_coef")
    assert grid.xs == ["1e-3", "5e-3", "1e-2"]  # by value, not as text
    assert grid.ys == ["0", "0.1"]
    cell = grid.cells[("5e-3", "0.1")]
    assert cell.interval.mean == pytest.approx((0.2 + 0.21 + 0.22) / 3)
    assert cell.n == 3


def test_not_a_grid_one_key_three_keys_or_a_key_missing() -> None:
    one_key = {(f"train.lr={lr}",): [0.5, 0.6] for lr in ["1e-3", "1e-2"]}
    assert grid_of(_stats(one_key)) is None
    three = {
        (f"train.lr={lr}", f"train.kl_coef={kl}", f"train.loss_type={lt}"): [0.5, 0.6]
        for lr in ["1e-3", "1e-2"]
        for kl in ["0", "0.1"]
        for lt in ["grpo", "dapo"]
    }
    assert grid_of(_stats(three)) is None
    missing = {("train.lr=1e-3", "train.kl_coef=0"): [0.5], ("train.lr=1e-2",): [0.6]}
    assert grid_of(_stats(missing)) is None


def test_a_grid_with_a_hole_and_a_setting_without_completed_seeds() -> None:
    settings = {
        ("train.lr=1e-3", "train.kl_coef=0"): [0.5, 0.7],
        ("train.lr=1e-2", "train.kl_coef=0"): [0.9],
        ("train.lr=1e-3", "train.kl_coef=0.1"): [0.2, 0.4],
    }
    runs = _runs(settings)
    runs.append(
        SeedRun(
            name="x",
            overrides=["train.lr=1e-2", "train.kl_coef=0.1", "seed=0", "train.iterations=50"],
            status="failed",
            error="boom",
        )
    )
    runs_by_setting = group_by_setting(runs, lambda r: r.overrides)
    grid = grid_of(summarize(runs_by_setting, "auc"))
    assert grid is not None and len(grid.cells) == 4
    assert cell_text(grid.cells[("1e-2", "0.1")]) == "n/a"  # its only seed failed
    # one seed: an interval all the same (valid for any distribution); the best mean, so best
    one = cell_text(grid.cells[("1e-2", "0")]).splitlines()
    assert one[0] == "0.900" and one[1].startswith("[0.") and one[2:] == ["n=1", "best"]
    two = cell_text(grid.cells[("1e-3", "0")]).splitlines()
    assert two[0] == "0.600" and two[1].startswith("[") and two[2] == "n=2"
    assert two[3] == "not separated"  # one shared seed with the best: no test


def test_plot_heatmap_writes_a_png(tmp_path: Path) -> None:
    settings = {
        (f"train.lr={lr}", f"train.kl_coef={kl}"): [0.3, 0.5, 0.4]
        for lr in ["1e-3", "1e-2"]
        for kl in ["0", "0.05"]
    }
    grid = grid_of(_stats(settings))
    assert grid is not None
    out = heatmap_path(tmp_path / "plots" / "curves.png")
    assert out.name == "curves_heatmap.png"
    plot_heatmap(grid, out, "study")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_seeds_draws_every_seed_and_a_pruned_one(tmp_path: Path) -> None:
    from grail.report.plots import plot_seeds
    from grail.study.stats import summarize

    def run(name: str, seed: int, status: str, curve: list[tuple[int, float]]) -> SeedRun:
        last = curve[-1][1]
        return SeedRun(name, [f"seed={seed}"], status, final=last, best=last, auc=last, curve=curve)

    groups = {
        "a": [
            run("0", 0, "done", [(0, 0.0), (2, 0.5), (4, 1.0)]),
            run("1", 1, "pruned", [(0, 0.0), (2, 0.2)]),
        ],
        "b": [run("2", 0, "done", [(0, 0.0), (2, 0.1), (4, 0.0)])],
    }
    out = tmp_path / "curves.png"
    plot_seeds(summarize(groups, "final"), out, "study")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = tmp_path / "empty.png"
    plot_seeds([], empty, "nothing yet")
    assert empty.stat().st_size > 0
