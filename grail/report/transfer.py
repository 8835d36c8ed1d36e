"""`grail-report CHEAP --transfer EXPENSIVE`: does the cheap study's answer hold at the expensive
fidelity? The table, transfer.csv and transfer.png (the math: grail/study/transfer.py).

The settings are matched by the overrides that tell them apart within each study (train.lr=...);
what differs between the two studies (keys with one value in every run of a study, such as
train.iterations=67 or model=tiny) is their fidelity, printed above the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from grail.core.records import LAUNCH_KEYS, atomic_write_text, override_key
from grail.report.load import RunReport
from grail.report.seeds import csv_text, verdict_text
from grail.study.stats import SEED_KEY
from grail.study.transfer import Transfer
from grail.study.verdicts import VerdictSettings


def fidelity(runs: Sequence[RunReport]) -> list[str]:
    """The overrides every run of a study shares (its fixed settings, seed and launch keys
    left out): what the study's fidelity is, next to another study's."""
    per_run = [
        {o for o in r.overrides if override_key(o) not in {SEED_KEY, *LAUNCH_KEYS}} for r in runs
    ]
    return sorted(set.intersection(*per_run)) if per_run else []


def fidelity_names(cheap: Sequence[RunReport], expensive: Sequence[RunReport]) -> tuple[str, str]:
    """Each study's fixed overrides that the other does not share ("(defaults)": none)."""
    a, b = fidelity(cheap), fidelity(expensive)
    only_a, only_b = [o for o in a if o not in b], [o for o in b if o not in a]
    return " ".join(only_a) or "(defaults)", " ".join(only_b) or "(defaults)"


def _mean(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def summary_lines(result: Transfer, metric: str) -> list[str]:
    """What the transfer says, in words: the cheap best's fate and the rank agreement."""
    lines = []
    if result.cheap_best is None:
        lines.append("the cheap study has no best setting (nothing learnt, or no values)")
    elif result.outcome is None:
        lines.append(f"the cheap study's best, {result.cheap_best}, has no expensive runs")
    else:
        settle = (
            f": ~{result.seeds_to_settle} expensive seeds per setting would separate it"
            if result.seeds_to_settle is not None
            else ""
        )
        outcome = result.outcome.value.replace("_", " ")
        lines.append(
            f"the cheap study's best, {result.cheap_best}, is {outcome} at the expensive "
            f"fidelity{settle}"
        )
    if result.tau is None:
        lines.append(f"rank agreement: needs 2 settings with different means at both ({metric})")
    else:
        interval = (
            f", 95% bootstrap interval over seeds [{result.tau_interval[0]:+.2f}, "
            f"{result.tau_interval[1]:+.2f}]"
            if result.tau_interval is not None
            else ""
        )
        lines.append(
            f"rank agreement: Kendall's tau {result.tau:+.2f} over {result.shared} settings "
            f"(1: the same order, -1: reversed){interval}"
        )
    return lines


def build_transfer_table(
    result: Transfer, metric: str, names: tuple[str, str], settings: VerdictSettings
) -> Table:
    cheap, expensive = names
    table = Table(title=f"transfer — metric {metric}: {cheap} → {expensive}")
    for column in ("setting", "cheap mean", "cheap rank", "expensive mean", "expensive rank"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    table.add_column("verdict at the expensive fidelity")
    for row in result.rows:
        mark = " (cheap best)" if row.label == result.cheap_best else ""
        table.add_row(
            escape(row.label) + mark,
            _mean(row.cheap_mean),
            str(row.cheap_rank or "–"),
            _mean(row.expensive_mean),
            str(row.expensive_rank or "–"),
            escape(verdict_text(row.expensive, settings)) if row.expensive else "not run",
        )
    return table


def transfer_csv_text(result: Transfer) -> str:
    columns = [
        "setting",
        "cheap_mean",
        "cheap_rank",
        "expensive_mean",
        "expensive_rank",
        "expensive_outcome",
        "expensive_p",
        "cheap_best",
    ]
    rows = [
        {
            "setting": r.label,
            "cheap_mean": r.cheap_mean,
            "cheap_rank": r.cheap_rank or None,
            "expensive_mean": r.expensive_mean,
            "expensive_rank": r.expensive_rank or None,
            "expensive_outcome": (
                r.expensive.verdict.outcome.value if r.expensive and r.expensive.verdict else None
            ),
            "expensive_p": r.expensive.verdict.p if r.expensive and r.expensive.verdict else None,
            "cheap_best": r.label == result.cheap_best,
        }
        for r in result.rows
    ]
    return csv_text(columns, rows)


def plot_transfer(result: Transfer, names: tuple[str, str], metric: str, path: Path) -> None:
    """Each setting's mean at the two fidelities, joined by a line (crossing lines: the order
    changed), the cheap best drawn bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
    for row in result.rows:
        if row.cheap_mean is None or row.expensive_mean is None:
            continue
        bold = row.label == result.cheap_best
        ax.plot(
            [0, 1],
            [row.cheap_mean, row.expensive_mean],
            marker="o",
            linewidth=2.5 if bold else 1.2,
            label=row.label + (" (cheap best)" if bold else ""),
        )
    ax.set_xticks([0, 1], [f"cheap\n{names[0]}", f"expensive\n{names[1]}"])
    ax.set_xlim(-0.3, 1.3)
    ax.set_ylabel(f"mean {metric} over seeds")
    tau = "" if result.tau is None else f"; Kendall's tau {result.tau:+.2f}"
    ax.set_title(f"does the cheap answer transfer? ({metric}{tau})")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def report_transfer(
    console: Console,
    result: Transfer,
    metric: str,
    names: tuple[str, str],
    out: Path,
    settings: VerdictSettings,
    name: str = "transfer",
) -> list[Path]:
    """Print the transfer table and its summary; write `name`.csv and `name`.png (transfer.csv
    and transfer.png by default) to `out`."""
    console.print(build_transfer_table(result, metric, names, settings))
    for line in summary_lines(result, metric):
        console.print(escape(line))
    csv_path, png_path = out / f"{name}.csv", out / f"{name}.png"
    atomic_write_text(csv_path, transfer_csv_text(result))
    plot_transfer(result, names, metric, png_path)
    return [csv_path, png_path]
