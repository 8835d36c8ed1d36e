"""One invocation of a race (grail/study/race_sweeper.py): read what the run directories of the
race hold, launch what the race (grail/study/race.py) asks for in free slots, feed back each run's
result as grail-report computes it, and write verdict.json as results come in.

Threads: the submitit launchers (local, SLURM) get one job per `launch` call, from a thread per
running job, so a slot is refilled as soon as its run ends. Any other launcher (the basic one runs
the job in this process, and `grail-train` installs a signal handler, which only the main thread
may) runs one job at a time, in the main thread.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.plugins.launcher import Launcher

from grail.core.records import atomic_write_text, metric_records, override_key
from grail.study.progress import Row, State, StudyProgress
from grail.study.race import BEST, IN_RACE, NOT_SEPARATED, Race, Run
from grail.study.runs import read_overrides, run_status
from grail.study.stats import SEED_KEY, censored_value, seed_run
from grail.study.sweep import SUBMITIT_LOCAL, SUBMITIT_SLURM, SweepError

log = logging.getLogger("grail.study.race")

VERDICT = "verdict.json"
THREADED_LAUNCHERS = (SUBMITIT_LOCAL, SUBMITIT_SLURM)
# What a launching thread hands back: (slot, run, what the job raised, if anything)
Ended = queue.Queue[tuple[int, Run, BaseException | None]]


# ---- the settings' runs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One point of the race's grid: its index in the grid's order names its run directories."""

    index: int
    overrides: list[str]  # the swept keys' values, in the command's order

    @property
    def label(self) -> str:
        return " ".join(self.overrides)


def run_name(setting: Setting, seed: int) -> str:
    return f"s{setting.index}_seed{seed}"


RUN_NAME = re.compile(r"s(\d+)_seed(\d+)")  # run_name's pattern: setting index, seed


# ---- a run's result -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """How a run directory stands for the race: `ended` (completed, pruned or failed) and its
    value (None for a failed run, or one without an eval after training started)."""

    ended: bool
    value: float | None
    status: str


def read_result(run_dir: Path, metric: str) -> Result:
    """The run's `metric` as grail-report computes it from its eval records; a pruned run's
    censored as the report counts it (grail.study.stats.censored_value: over the evaluations it
    reached, at most its success rate where it was stopped)."""
    status = run_status(run_dir).status
    if status not in ("done", "pruned"):
        return Result(status == "failed", None, status)
    run = seed_run(run_dir.name, [], status, metric_records(run_dir, "eval"))
    value = run.metric(metric) if status == "done" else censored_value(run, metric)
    return Result(True, value, status)


# ---- verdict.json -------------------------------------------------------------------------------


def overrides_dict(overrides: Sequence[str]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in overrides)


def _optional(kind: type, value: Any) -> Any:
    """A number as JSON writes it (numpy's as Python's), None as null."""
    return None if value is None else kind(value)


def verdict_record(race: Race, settings: Sequence[Setting]) -> dict[str, Any]:
    """verdict.json: the verdicts over the results so far, one entry per setting (judged ones in
    the judge's order, best first; settings without any value yet last, with n_seeds 0)."""
    by_label = {s.label: s for s in settings}
    verdicts = race.verdicts()
    entries = []
    best = None
    for v in verdicts:
        overrides = overrides_dict(by_label[v.label].overrides)
        if v.outcome == BEST:
            best = overrides
        entries.append(
            {
                "overrides": overrides,
                "outcome": v.outcome.value,
                "n_seeds": int(v.n_seeds),
                "mean": float(v.mean),
                "ci": [float(x) for x in v.ci],
                "p": _optional(float, v.p),
                "seeds_to_separate": _optional(int, v.seeds_to_separate),
            }
        )
    judged = {v.label for v in verdicts}
    for s in settings:
        if s.label not in judged:
            entries.append(
                {
                    "overrides": overrides_dict(s.overrides),
                    "outcome": NOT_SEPARATED,
                    "n_seeds": len(race.values[s.label]),
                    "mean": None,
                    "ci": None,
                    "p": None,
                    "seeds_to_separate": None,
                }
            )
    return {
        "best": best,
        "decided": race.is_decided(),
        # every run of every setting at 0: no best, and the race adds no seeds (race.py, step 4)
        "nothing_learnt": race.nothing_learnt(),
        "runs": race.ended,
        "settings": entries,
    }


def runs_left(race: Race) -> int:
    """At most how many more runs the race starts, by its budget and the verdicts so far: the rest
    of the initial round, then up to max_seeds for each setting still in the race (a setting
    without a value counts in it until its initial round ended), within max_runs. An upper
    bound: the verdicts may be decided sooner."""
    if race.over():
        return 0
    options = race.options
    judged = {v.label: v.outcome for v in race.verdicts()}
    in_race = {
        label
        for label, seeds in race.started.items()
        if judged.get(label) in IN_RACE
        or (
            label not in judged
            and (len(seeds) < options.initial_seeds or any(r[0] == label for r in race.running))
        )
    }
    if race.is_decided() or race.nothing_learnt():
        in_race = set()
    left = sum(
        max(0, (options.max_seeds if label in in_race else options.initial_seeds) - len(seeds))
        for label, seeds in race.started.items()
    )
    return left if options.max_runs is None else min(left, max(0, options.max_runs - race.runs))


def progress_state(
    race: Race, settings: Sequence[Setting], metric: str, title: str = "race"
) -> State:
    """What the terminal shows of the race (grail/study/progress.py), per setting from the same
    verdicts as verdict.json."""
    record = verdict_record(race, settings)
    running = Counter(label for label, _ in race.running)
    rows = []
    for entry in record["settings"]:
        label = " ".join(f"{k}={v}" for k, v in entry["overrides"].items())
        judged = entry["mean"] is not None
        rows.append(
            Row(
                label,
                ended=len(race.started[label]) - running[label],
                running=running[label],
                outcome=entry["outcome"] if judged else None,
                mean=entry["mean"],
                ci=tuple(entry["ci"]) if entry["ci"] is not None else None,
            )
        )
    note = "nothing learnt" if record["nothing_learnt"] else "decided" if record["decided"] else ""
    return State(
        title,
        "runs",
        metric,
        ended=race.ended,
        running=len(race.running),
        left=runs_left(race),
        bounded=True,
        rows=tuple(rows),
        note=note,
    )


def check_record(path: Path, record: Mapping[str, Any], resume: bool, what: str) -> None:
    """A directory that holds a study (its record at `path`: race.json, a ladder's ladder.json)
    continues only with resume=true and the same study; `what` names it in the messages."""
    if not path.is_file():
        return
    if not resume:
        raise SweepError(
            f"{path.parent} holds {what} already ({path.name}): add resume=true to continue it, "
            "or choose another hydra.sweep.dir"
        )
    stored = json.loads(path.read_text())
    changed = [k for k in record if stored.get(k) != record[k]]
    if changed:
        diff = "; ".join(f"{k}: {stored.get(k)} before, {record[k]} now" for k in changed)
        raise SweepError(
            f"{path.parent} holds another {what.removeprefix('a ')} ({diff}): rerun its own "
            "command with resume=true, or start a new one (a new hydra.sweep.dir)"
        )


# ---- report.html ------------------------------------------------------------------------------


class PageWriter:
    """report.html, drawn by `draw(sweep_dir, race_over=...)` (grail/report/html.py's
    write_report, given by the layer above: hydra_plugins/grail_race) on a thread of its own
    each time verdict.json is written: drawing takes about 0.5 s (matplotlib), which must not
    hold up the launch of the next run in a free slot. Requests made while it draws fold into
    one, drawn next from the newest state, so a burst of runs ending costs two pages, not one
    per run."""

    def __init__(self, sweep_dir: Path, draw: Callable[..., Any]) -> None:
        self.sweep_dir, self.draw = sweep_dir, draw
        self.lock = threading.Lock()
        self.wanted: bool | None = None  # race_over of the newest request not drawn yet
        self.thread: threading.Thread | None = None

    def request(self, race_over: bool) -> None:
        with self.lock:
            self.wanted = race_over
            if self.thread is None:
                self.thread = threading.Thread(target=self._draw, name="race-page", daemon=True)
                self.thread.start()

    def wait(self) -> None:
        """Until every request made so far is drawn."""
        with self.lock:
            thread = self.thread
        if thread is not None:
            thread.join()

    def _draw(self) -> None:
        while True:
            with self.lock:
                race_over, self.wanted = self.wanted, None
                if race_over is None:
                    self.thread = None
                    return
            try:
                self.draw(self.sweep_dir, race_over=race_over)
            except Exception:  # the page costs a warning, never the race
                log.warning("race: could not draw its page in %s", self.sweep_dir, exc_info=True)


# ---- the runner ---------------------------------------------------------------------------------


class RaceRunner:
    """One invocation of a race: read what the run directories hold, launch what the race asks
    in free slots, feed back each run's result, write verdict.json as results come in."""

    def __init__(
        self,
        race: Race,
        settings: list[Setting],
        fixed: list[str],
        sweep_dir: Path,
        *,
        launcher: Launcher,
        launcher_target: str | None,
        metric: str,
        parallel: int | None,
        page: Callable[..., Any] | None = None,
        subdir: str = "",
        grid_size: int | None = None,
        title: str = "race",
        reuse: Callable[[Setting, int, Path], bool] | None = None,
    ) -> None:
        """`page(sweep_dir, race_over=...)`: draws report.html after each verdict.json, if given.
        A rung of a multi-fidelity race (grail/study/ladder.py) is a race in a directory below
        the sweep's: `subdir` (e.g. "r1/") names it for hydra.sweep.subdir, and `grid_size` is
        the number of the study's settings, of which `settings` (those promoted to the rung) may
        be a few."""
        self.race = race
        self.settings = {s.label: s for s in settings}
        self.fixed = fixed
        self.sweep_dir = sweep_dir
        self.subdir = subdir
        self.grid_size = len(settings) if grid_size is None else grid_size
        # `reuse(setting, seed, run_dir)`: before a run's first launch, may fill its directory
        # with a run to continue (a ladder's cheaper rung, grail/study/ladder_runner.py); True:
        # it did, and the run is launched with resume=true
        self.reuse = reuse
        self.resumed: set[Run] = set()
        self._resuming = any(override_key(o) == "resume" for o in fixed)
        self.launcher = launcher
        self.metric = metric
        self.threaded = launcher_target in THREADED_LAUNCHERS
        # One slot per running job; without a batch size (SLURM) as many as the race asks for.
        self.slots = (parallel or len(settings) * race.options.max_seeds) if self.threaded else 1
        self.jobs_in_slot = [0] * self.slots
        self.returns: list[Any] = []
        self.to_relaunch: list[Run] = []
        self.page = PageWriter(sweep_dir, page) if page is not None else None
        self.progress = StudyProgress(
            lambda: progress_state(self.race, settings, metric, title), in_process=not self.threaded
        )

    def run_dir(self, run: Run) -> Path:
        label, seed = run
        return self.sweep_dir / run_name(self.settings[label], seed)

    def overrides(self, run: Run) -> list[str]:
        label, seed = run
        name = run_name(self.settings[label], seed)
        return [
            *self.fixed,
            *self.settings[label].overrides,
            f"{SEED_KEY}={seed}",
            f"hydra.sweep.subdir={self.subdir}{name}",
            *(["resume=true"] if run in self.resumed and not self._resuming else []),
        ]

    def load(self) -> None:
        """Every run an earlier invocation started (whatever max_seeds was then): ended ones
        read, the others (killed, failed) to be launched again first. A directory made for
        another setting raises SweepError."""
        by_index = {s.index: s for s in self.settings.values()}
        found = []
        for path in self.sweep_dir.iterdir() if self.sweep_dir.is_dir() else []:
            if path.is_dir() and (match := RUN_NAME.fullmatch(path.name)):
                index, seed = int(match[1]), int(match[2])
                if index >= self.grid_size:
                    raise SweepError(
                        f"{path} is not a run of this race's {self.grid_size} settings"
                    )
                if index not in by_index:
                    # a rung's run of a setting no longer promoted to it (a resume retried a
                    # failed run below, which changed the verdicts): kept, not raced
                    log.warning("race: %s is not a run of a setting in this rung; left out", path)
                    continue
                found.append((seed, index, path))
        for seed, index, run_dir in sorted(found):
            setting = by_index[index]
            recorded = [o for o in read_overrides(run_dir) if override_key(o) != SEED_KEY]
            if recorded and not set(setting.overrides) <= set(recorded):
                raise SweepError(
                    f"{run_dir} holds a run of {' '.join(recorded)}, not {setting.label}: the "
                    "sweep's values or their order changed. Rerun the original command with "
                    "resume=true, or start a new race (a new hydra.sweep.dir)"
                )
            run = (setting.label, seed)
            self.race.start(run)
            result = read_result(run_dir, self.metric)
            if result.status in ("done", "pruned"):
                self.race.end(run, result.value)
            else:
                self.to_relaunch.append(run)
        if self.to_relaunch:
            names = ", ".join(self.run_dir(r).name for r in self.to_relaunch)
            log.info("race: launching again what an earlier attempt left unfinished: %s", names)

    def _job_number(self, slot: int) -> int:
        """A job number that `grail-train` reads as `slot`: job mod slots == slot (slots is
        hydra.sweeper.max_batch_size, the `parallel` of grail.study.sweep.assign_resources)."""
        number = self.jobs_in_slot[slot] * self.slots + slot
        self.jobs_in_slot[slot] += 1
        return number

    def _launch(self, run: Run, slot: int, job: int, done: Ended) -> None:
        error: BaseException | None = None
        try:
            results = self.launcher.launch([self.overrides(run)], initial_job_idx=job)
            for r in results:
                _ = r.return_value  # a job that raised (not a failed run: those end in summary)
            self.returns.append(results)
        except BaseException as exc:
            if not self.threaded and not isinstance(exc, Exception):
                raise  # Ctrl-C in a job run in this process: stop here, as a grid does
            error = exc  # handed to the main thread, which stops the race once its runs ended
        done.put((slot, run, error))

    def _next(self) -> tuple[Run, bool] | None:
        if self.to_relaunch:
            return self.to_relaunch.pop(0), True
        run = self.race.next_run()
        return (run, False) if run is not None else None

    def run(self) -> list[Any]:
        done: Ended = queue.Queue()
        free = list(range(self.slots))
        running: dict[int, Run] = {}
        error: BaseException | None = None
        self.progress.start()
        try:
            while True:
                while free and error is None and (nxt := self._next()) is not None:
                    run, again = nxt
                    if not again:
                        self.race.start(run)
                        if self.reuse is not None and self.reuse(
                            self.settings[run[0]], run[1], self.run_dir(run)
                        ):
                            self.resumed.add(run)
                    slot = free.pop(0)
                    running[slot] = run
                    log.info(
                        "race: %s seed %d -> %s (slot %d)",
                        run[0],
                        run[1],
                        self.run_dir(run).name,
                        slot,
                    )
                    self.progress.update()
                    job = self._job_number(slot)
                    if self.threaded:
                        threading.Thread(
                            target=self._launch, args=(run, slot, job, done), daemon=True
                        ).start()
                    else:
                        self._launch(run, slot, job, done)
                if not running:
                    break
                slot, run, raised = _get(done)
                del running[slot]
                free.append(slot)
                free.sort()
                error = error or raised
                self._ended(run)
        except KeyboardInterrupt:
            # The runs got the same Ctrl-C; what they wrote is kept, so say how to go on.
            log.warning(
                "race interrupted with %d run(s) going; to continue it, rerun the same command "
                "with resume=true hydra.sweep.dir=%s",
                len(running),
                self.sweep_dir.absolute(),
            )
            raise SystemExit(130) from None
        finally:
            try:
                self._write_verdict()
            finally:
                self.progress.stop()  # before the page's wait: the last state on screen at once
            if self.page is not None:
                self.page.wait()  # the last page drawn, without its reload once the race is over
        if error is not None:
            raise error
        self._finish()
        return self.returns

    def _ended(self, run: Run) -> None:
        result = read_result(self.run_dir(run), self.metric)
        if not result.ended:
            log.warning(
                "race: %s ended without a summary (killed?); rerun with resume=true to finish it",
                self.run_dir(run),
            )
        elif result.value is None:
            log.warning("race: %s has no %s (%s)", self.run_dir(run), self.metric, result.status)
        self.race.end(run, result.value)
        self._write_verdict()
        self.progress.update()

    def _write_verdict(self) -> None:
        record = verdict_record(self.race, list(self.settings.values()))
        atomic_write_text(self.sweep_dir / VERDICT, json.dumps(record, indent=2) + "\n")
        # and report.html beside it: a browser tab left open on it follows the race
        if self.page is not None:
            self.page.request(race_over=self.race.over())

    def _finish(self) -> None:
        record = verdict_record(self.race, list(self.settings.values()))
        if record["nothing_learnt"]:
            log.warning(
                "race over after %d runs: nothing learnt: every run of every setting has %s 0 "
                "(no held-out problem solved), so no setting is best and none is equivalent; "
                "train longer (train.iterations) or race other values. Verdicts in %s",
                record["runs"],
                self.metric,
                self.sweep_dir / VERDICT,
            )
        else:
            state = "decided" if record["decided"] else "not decided"
            log.info(
                "race %s after %d runs: best %s; verdicts in %s",
                state,
                record["runs"],
                record["best"],
                self.sweep_dir / VERDICT,
            )
        for entry in record["settings"]:
            log.info(
                "  %s: %s, %s %s over %d seeds, CI %s, p %s",
                " ".join(f"{k}={v}" for k, v in entry["overrides"].items()),
                entry["outcome"],
                self.metric,
                entry["mean"],
                entry["n_seeds"],
                entry["ci"],
                entry["p"],
            )


def _get(done: Ended) -> tuple[int, Run, BaseException | None]:
    """The next ended run; polling, so Ctrl-C reaches the main thread while it waits."""
    while True:
        try:
            return done.get(timeout=0.5)
        except queue.Empty:
            continue
