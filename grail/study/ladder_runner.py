"""One invocation of a multi-fidelity race (grail/study/ladder.py): each rung a race of its own
(grail/study/race_runner.py) in `<sweep dir>/r<k>/`, over the settings the rung below promoted;
`<sweep dir>/verdict.json` the ladder's verdicts, rewritten as each rung ends.

Resume: each rung's race reads its runs as a race does; a rung whose race is over starts nothing
and hands its promotions on, so a resumed ladder climbs through what is done to where it stopped.
Runs of a lower rung are read, never run again.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from grail.core.records import (
    CHECKPOINTS_DIR,
    SUMMARY,
    atomic_write_text,
    eval_metrics_path,
    iteration_name,
    override_key,
)
from grail.study.ladder import TOP, Overturned, Rung, overturned, promoted
from grail.study.race import Race
from grail.study.race_runner import VERDICT, RaceRunner, Setting, overrides_dict, verdict_record
from grail.study.runs import append_attempt, read_config, run_status

log = logging.getLogger("grail.study.race")

LADDER_RECORD = "ladder.json"  # what defines the ladder, checked on resume
FIDELITY_KEY = "fidelity"  # grail/core/config.py Config.fidelity: each run's rung


def fidelity_override(rung: Rung) -> str:
    """The override that records a run's rung in its config (quoted: a rung holds `=`)."""
    return f"{FIDELITY_KEY}='{rung.name}'"


@dataclass
class Climbed:
    """A rung's race once it is over, and the settings it promoted (None: the top)."""

    rung: Rung
    race: Race
    settings: list[Setting]
    promoted: list[str] | None


def ladder_record(climbed: Sequence[Climbed], rungs: Sequence[Rung]) -> dict[str, Any]:
    """verdict.json of a ladder: every rung's verdicts (the shape of a race's verdict.json) with
    what it promoted; the top rung's verdicts as the study's (`best`, `decided`, `settings`:
    empty until the top is reached) and the lower verdicts the top overturned."""
    entries = []
    for c in climbed:
        by_label = {s.label: s for s in c.settings}
        entries.append(
            {
                "fidelity": c.rung.name,
                "overrides": list(c.rung.overrides),
                "directory": c.rung.directory,
                **verdict_record(c.race, c.settings),
                "promoted": None
                if c.promoted is None
                else [overrides_dict(by_label[label].overrides) for label in c.promoted],
            }
        )
    top = climbed[-1] if climbed and climbed[-1].rung.name == TOP else None
    flips: list[Overturned] = []
    if top is not None:
        outcomes = {v.label: v.outcome.value for v in top.race.verdicts()}
        lower = [
            (c.rung.name, {v.label: v.outcome.value for v in c.race.verdicts()})
            for c in climbed[:-1]
        ]
        flips = overturned(lower, outcomes)
    labels = {s.label: s for c in climbed for s in c.settings}
    return {
        "ladder": [r.name for r in rungs],
        "best": entries[-1]["best"] if top is not None else None,
        "decided": bool(top is not None and entries[-1]["decided"]),
        "runs": sum(c.race.ended for c in climbed),
        "settings": entries[-1]["settings"] if top is not None else [],
        "overturned": [
            {
                "fidelity": f.fidelity,
                "overrides": overrides_dict(labels[f.setting].overrides),
                "was": f.was,
                "now": f.now,
            }
            for f in flips
        ],
        "rungs": entries,
    }


def continue_run(
    lower: Path, run_dir: Path, iterations: int, fidelity: str, overrides: Sequence[str]
) -> bool:
    """Fill `run_dir` with the finished run `lower` as the run of `overrides` (train.iterations
    `iterations`, `fidelity`) would stand had it been stopped after lower's last iteration, so
    that grail-train resume=true trains it on from there: the iterations it adds, and so its
    metrics, are those of a run started with `iterations` (train.iterations is resumable: the
    schedule has no horizon; tests/test_ladder.py checks it bitwise). False, touching nothing,
    when there is nothing to continue: `run_dir` exists, `lower` did not complete, or it was
    pruned, or pipelined (a pipelined run's last iteration was never checked to leave the state
    a mid-run checkpoint holds)."""
    config = read_config(lower)
    train = config.get("train", {})
    if (
        run_dir.exists()
        or run_status(lower).status != "done"
        or train.get("pipeline")
        or config.get("prune", {}).get("pruner")
        or not isinstance(train.get("iterations"), int)
        or not (lower / CHECKPOINTS_DIR / iteration_name(train["iterations"] - 1)).is_dir()
    ):
        return False
    last = train["iterations"] - 1
    staging = run_dir.with_name(f".{run_dir.name}.continuing")
    shutil.rmtree(staging, ignore_errors=True)
    # Checkpoints are linked, not copied (a model's weights and optimizer state: gigabytes): a
    # run never writes into a checkpoint's files, it writes new ones and renames them in place.
    shutil.copytree(lower, staging, ignore=shutil.ignore_patterns(CHECKPOINTS_DIR, "*.lock"))
    shutil.copytree(lower / CHECKPOINTS_DIR, staging / CHECKPOINTS_DIR, copy_function=os.link)
    (staging / SUMMARY).unlink(missing_ok=True)  # a run stopped mid-way has no summary
    interval = config.get("eval", {}).get("interval")
    if isinstance(interval, int) and (last + 1) % interval:
        # the lower run's last evaluation, which the longer run does not make there
        eval_metrics_path(staging, last).unlink(missing_ok=True)
    hydra = staging / ".hydra"
    saved = OmegaConf.load(hydra / "config.yaml")
    OmegaConf.update(saved, "train.iterations", iterations)
    OmegaConf.update(saved, FIDELITY_KEY, fidelity)
    atomic_write_text(hydra / "config.yaml", OmegaConf.to_yaml(saved))
    task = [o for o in overrides if not o.startswith("hydra.") and override_key(o) != "resume"]
    atomic_write_text(hydra / "overrides.yaml", yaml.safe_dump(task))
    launch = yaml.safe_load((hydra / "hydra.yaml").read_text())
    launch["hydra"]["overrides"]["task"] = task
    launch["hydra"]["runtime"]["output_dir"] = str(run_dir.absolute())
    atomic_write_text(hydra / "hydra.yaml", yaml.safe_dump(launch, sort_keys=False))
    # the sweep job's history: from here on, this run's (grail.study.sweep.decide reads it)
    append_attempt(staging, f"continue {lower}", task, None)
    staging.rename(run_dir)
    log.info("race: %s continues %s (its %d iterations are reused)", run_dir, lower, last + 1)
    return True


def climb(
    rungs: Sequence[Rung],
    settings: list[Setting],
    start_rung: Callable[[Rung, list[Setting]], tuple[Race, RaceRunner]],
    sweep_dir: Path,
) -> list[Any]:
    """Race every rung in turn, each over what the one below promoted; returns the launcher's
    results. `start_rung(rung, settings)` makes a rung's race and its runner (the sweeper's
    launcher, judge, slots), with its runs read from its directory."""
    climbed: list[Climbed] = []
    returns: list[Any] = []
    members = list(settings)
    for rung in rungs:
        race, runner = start_rung(rung, members)
        log.info(
            "race rung %d of %d (%s): %d setting(s) in %s",
            rung.index + 1,
            len(rungs),
            rung.name,
            len(members),
            sweep_dir / rung.directory,
        )
        try:
            returns.extend(runner.run())
        finally:
            # what is known so far, also when a run's job raised or Ctrl-C stopped the rung
            climbed.append(Climbed(rung, race, members, None))
            record = _write(sweep_dir, climbed, rungs)
        if rung.name == TOP:
            break
        outcomes = {v.label: v.outcome.value for v in race.verdicts()}
        up = promoted(outcomes, [s.label for s in members])
        climbed[-1].promoted = up
        record = _write(sweep_dir, climbed, rungs)
        if not up:
            log.warning(
                "race: no setting of rung %s has a value (every run failed): nothing to promote; "
                "the ladder stops here",
                rung.name,
            )
            break
        log.info("race: rung %s promotes %s", rung.name, ", ".join(up))
        members = [s for s in members if s.label in up]
    for flip in record["overturned"]:
        log.info(
            "race: the top rung overturns %s's verdict on %s: %s there, %s at the top",
            flip["fidelity"],
            " ".join(f"{k}={v}" for k, v in flip["overrides"].items()),
            flip["was"],
            flip["now"],
        )
    return returns


def _write(sweep_dir: Path, climbed: Sequence[Climbed], rungs: Sequence[Rung]) -> dict[str, Any]:
    """verdict.json as it stands; returns it."""
    record = ladder_record(climbed, rungs)
    atomic_write_text(sweep_dir / VERDICT, json.dumps(record, indent=2) + "\n")
    return record
