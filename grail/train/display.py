"""What a run shows on the terminal: rich progress bars on a terminal, plain log lines otherwise
(CI, files, pipes), and the summary table at the end."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from grail.core.records import CHECKPOINTS_DIR, LOGS_DIR, METRICS_DIR, SUMMARY

log = logging.getLogger("grail.train")


class Display:
    """Progress bars for generation, training and evaluation, one line per finished step."""

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
            transient=True,
        )

    def __enter__(self) -> Display:
        self.progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.progress.stop()

    def task(self, description: str, total: int) -> Callable[[int], None]:
        """A new bar; returns `advance(k)` (safe to call from any thread)."""
        task_id = self.progress.add_task(description, total=total)
        return lambda k: self.progress.advance(task_id, k)

    def done(self, description: str) -> None:
        """Clear the bars and print `description`."""
        for task in list(self.progress.tasks):
            self.progress.remove_task(task.id)
        self.console.log(description) if self.console.is_terminal else log.info(description)

    def summary(self, summary: dict[str, Any], run_dir: Path) -> None:
        """The eval table, totals, and where the run's files are."""
        table = Table(title="grail run summary")
        table.add_column("eval")
        table.add_column("iteration", justify="right")
        table.add_column("success", justify="right")
        table.add_column("reward", justify="right")
        for name in ("baseline_eval", "final_eval", "best_eval"):
            record = summary[name]
            if record is not None:
                table.add_row(
                    name.removesuffix("_eval"),
                    str(record["iteration"]),
                    f"{record['success_rate']:.3f}",
                    f"{record['reward_mean']:.3f}",
                )
        self.console.print(table)
        resumes = len(summary.get("parts", [])) - 1
        lines = [
            f"{summary['iterations']} iterations, {summary['tokens']['completion']} completion "
            f"tokens, {summary['wall_time_s']:.1f}s wall"
            + (f" (the start and {resumes} resume{'s' * (resumes > 1)})" if resumes > 0 else "")
            + f", {summary.get('trainer_processes', 1)} trainer process(es)",
            f"run directory: {run_dir}",
            *(f"  {name:<16}{what}" for name, what in run_files(run_dir)),
        ]
        if pruned := summary.get("pruned"):
            why = (
                f": at rung {pruned['rung']} its setting was worse than {pruned['best']} over "
                f"{pruned['seeds']} seeds"
                if "rung" in pruned
                else ""
            )
            lines.insert(
                1,
                f"pruned after iteration {pruned['iteration']} ({pruned['metric']} "
                f"{pruned['value']:.4f}, prune.pruner={pruned['pruner']}){why}; stopped early, "
                "its checkpoint and metrics kept",
            )
        # Printed whole (soft wrap, no markup) so that paths can be copied from the terminal.
        self.console.print(escape("\n".join(lines)), soft_wrap=True, highlight=False)


def run_files(run_dir: Path) -> list[tuple[str, str]]:
    """The files of `run_dir` a user opens first, each with what it holds (those that exist)."""
    described = [
        (SUMMARY, "this summary, with the config and, for a failed run, the error"),
        (f"{METRICS_DIR}/", "one JSON file per iteration and per evaluation"),
        (f"{CHECKPOINTS_DIR}/", "the newest checkpoints (resume=true continues from them)"),
        (f"{LOGS_DIR}/", "the inference server's log"),
    ]
    # The training process's own log, which Hydra names after the program (e.g. grail-train.log).
    described += [(p.name, "this program's log") for p in sorted(run_dir.glob("*.log"))]
    return [(name, what) for name, what in described if (run_dir / name).exists()]
