"""The study as one HTML page: `grail-report DIR --html`, and the `report.html` a race rewrites
beside its verdict.json after every run (grail/study/race_runner.py).

One self-contained file, no script, no server, no network: the verdicts over seeds with their
intervals and what each column means, the learning curves as inline SVG drawn by the same
matplotlib code as the PNGs (grail/report/plots.py), a race's rounds (which settings got which
seed, and why), a search's trials, and every run. While a race runs the page reloads itself every
REFRESH_S seconds, so a tab left open follows it; once the race is over it no longer does.
"""

from __future__ import annotations

import html
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from grail.core.records import atomic_write_text, read_json
from grail.report.load import RunReport, _get, load_runs
from grail.report.plots import grid_of, plot, plot_heatmap, plot_seeds
from grail.report.seeds import METRIC_HELP, seed_stats, stats_captions, verdict_text
from grail.report.table import format_duration
from grail.study.stats import CI_METHOD, REPORT_SETTINGS, SettingStats
from grail.study.verdicts import VerdictSettings

REPORT_HTML = "report.html"
REFRESH_S = 30
# What a race writes (grail/study/race_sweeper.py RACE_RECORD, race_runner.py VERDICT): named here
# rather than imported so that the report does not load Hydra's sweeper machinery.
RACE_RECORD, VERDICT = "race.json", "verdict.json"
RACE_RUN = re.compile(r"s(\d+)_seed(\d+)")  # race_runner.RUN_NAME


@dataclass(frozen=True)
class RaceInfo:
    """What a race directory records about the race itself."""

    settings: list[str]  # labels in the race's order: setting i runs in s<i>_seed<seed>/
    metric: str
    initial_seeds: int
    verdict_settings: VerdictSettings
    verdict: dict[str, Any] | None  # verdict.json: None until a run ended


@dataclass(frozen=True)
class Trial:
    """One trial of a search (grail/study/search_runner.py), as its Optuna journal holds it."""

    number: int
    state: str  # complete | pruned | fail | running
    value: float | None  # the mean of its seeds' metric, when complete
    values_by_seed: dict[str, float]
    setting: list[str]
    jobs: list[int]  # its run directories' names


@dataclass(frozen=True)
class Search:
    metric: str
    maximize: bool
    trials: list[Trial]


def load_race(root: Path) -> RaceInfo | None:
    """The race in `root` (race.json), its options as the sweeper saved them (multirun.yaml; the
    defaults of conf/hydra/sweeper/grail_race.yaml where absent); None when `root` is no race."""
    record = read_json(root / RACE_RECORD)
    if record is None:
        return None
    try:
        sweeper = yaml.safe_load((root / "multirun.yaml").read_text())["hydra"]["sweeper"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        sweeper = {}
    sweeper = sweeper if isinstance(sweeper, dict) else {}
    alpha, delta = float(sweeper.get("alpha", 0.05)), float(sweeper.get("delta", 0.02))
    return RaceInfo(
        settings=[" ".join(s) for s in record.get("settings", [])],
        metric=str(record.get("metric", "auc")),
        initial_seeds=int(sweeper.get("initial_seeds", 3)),
        verdict_settings=VerdictSettings(alpha=alpha, delta=delta, bounds=REPORT_SETTINGS.bounds),
        verdict=read_json(root / VERDICT),
    )


def load_search(root: Path) -> Search | None:
    """The search in `root` (optuna/search.journal), its trials by number; None without one."""
    from grail.study.search_study import JOURNAL, SEARCH_DIR, STUDY_ATTR

    journal = root / SEARCH_DIR / JOURNAL
    if not journal.is_file():
        return None
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(journal)))
    names = optuna.get_all_study_names(storage)
    if not names:
        return None
    study = optuna.load_study(study_name=names[0], storage=storage)
    signature = study.user_attrs.get(STUDY_ATTR) or {}
    trials = []
    for t in study.get_trials(deepcopy=False):
        attrs = t.user_attrs
        by_seed = attrs.get("values_by_seed") or {}
        setting = attrs.get("overrides") or [f"{k}={v}" for k, v in t.params.items()]
        value = t.value if t.state == optuna.trial.TrialState.COMPLETE else None
        trials.append(Trial(
            t.number, t.state.name.lower(), value, {str(k): float(v) for k, v in by_seed.items()},
            [str(o) for o in setting], [int(j) for j in attrs.get("jobs") or []],
        ))  # fmt: skip
    return Search(
        metric=str(signature.get("metric", "auc")),
        maximize=signature.get("direction", "maximize") == "maximize",
        trials=trials,
    )


# ---- pieces of the page -------------------------------------------------------------------------


def _e(value: object) -> str:
    return html.escape(str(value))


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _table(head: Sequence[tuple[str, str]], rows: Sequence[Sequence[str]], cls: str) -> str:
    """`head`: (column, what it means: its tooltip); cells are HTML already."""
    ths = "".join(f'<th title="{_e(tip)}">{_e(name)}</th>' for name, tip in head)
    trs = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>\n" for row in rows)
    return f'<table class="{cls}"><thead><tr>{ths}</tr></thead><tbody>\n{trs}</tbody></table>'


def _captions(head: Sequence[tuple[str, str]]) -> str:
    items = "".join(f"<dt>{_e(name)}</dt><dd>{_e(tip)}</dd>" for name, tip in head if tip)
    return f'<dl class="captions">{items}</dl>'


def _status(status: str, text: str | None = None) -> str:
    return f'<span class="{_e(status)}">{_e(text or status)}</span>'


def svg_of(draw: Callable[[Path], None], scope: str) -> str:
    """What `draw` (a plots.py function given its path) writes as SVG, ready to inline: matplotlib
    picks the format from the suffix, so the PNGs' code draws it unchanged. Text stays text (not
    paths): smaller, quicker, and readable in the page's DOM. Every id gets the prefix `scope`,
    since the figures share one document and matplotlib numbers each one's ids from 1."""
    import matplotlib

    # a fixed salt: the same figure, the same ids (matplotlib salts them at random otherwise)
    rc = matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "grail"})
    with tempfile.TemporaryDirectory() as tmp, rc:
        path = Path(tmp) / "figure.svg"
        draw(path)
        text = path.read_text()
    # HTML takes <svg> itself; the XML prolog, doctype and RDF metadata have no place in it.
    text = re.sub(r"<metadata>.*?</metadata>\s*", "", text[text.index("<svg") :], flags=re.S)
    for reference in (' id="', "url(#", 'href="#'):
        text = text.replace(reference, reference + scope)
    return text


def _ci_bar(s: SettingStats, bounds: tuple[float, float] | None) -> str:
    """The interval drawn on the metric's whole range, the mean a tick: CSS only, not a chart."""
    lo, hi, mean = s.interval.lo, s.interval.hi, s.interval.mean
    if bounds is None or lo is None or hi is None or mean is None:
        return ""
    low, span = bounds[0], bounds[1] - bounds[0]
    at = [100 * (v - low) / span for v in (lo, hi, mean)]
    return (
        f'<span class="bar"><span style="left:{at[0]:.1f}%;width:{at[1] - at[0]:.1f}%"></span>'
        f'<i style="left:{at[2]:.1f}%"></i></span>'
    )


def stats_section(stats: Sequence[SettingStats], metric: str, settings: VerdictSettings) -> str:
    head = [
        ("#", "rank by mean over seeds, 1 = best (none when nothing was learnt)"),
        ("setting", "the runs' overrides minus seed"),
        ("n", "seeds counted: completed runs, and pruned ones censored"),
        ("censored", "of those, pruned runs: counted at their value where they were stopped"),
        (f"mean {metric}", f"{metric}: {METRIC_HELP[metric]}; mean over the seeds counted"),
        (f"{settings.confidence:.0%} CI", f"the interval of the mean: {CI_METHOD}"),
        ("median", "median over the seeds counted"),
        ("min", "the lowest seed"),
        ("max", "the highest seed"),
        ("verdict vs best", "paired over the seeds shared with the best setting (notes below)"),
        ("seeds to separate", f"not separated yet: estimated seeds per setting that would show "
         f"it worse than the best with {settings.power:.0%} power"),
        ("not counted", "runs left out: failed, incomplete (running or killed), repeated seeds"),
    ]  # fmt: skip
    rows = []
    for s in stats:
        v, lo, hi = s.verdict, s.interval.lo, s.interval.hi
        counts = (("failed", s.failed), ("incomplete", s.incomplete), ("repeated", s.repeated))
        left_out = ", ".join(f"{k} {n}" for k, n in counts if n) or "–"
        ci = "n/a" if lo is None or hi is None else f"[{lo:.3f}, {hi:.3f}]"
        to_separate = v.seeds_to_separate if v and v.seeds_to_separate is not None else "–"
        rows.append([
            str(s.rank or "–"), f"<code>{_e(s.label)}</code>", str(s.n),
            str(s.n_censored or "–"), _num(s.interval.mean),
            f'<span class="nw">{_e(ci)}</span>{_ci_bar(s, settings.bounds)}',
            _num(s.median), _num(s.min), _num(s.max), _e(verdict_text(s, settings)),
            str(to_separate), _e(left_out),
        ])  # fmt: skip
    notes = "".join(f"<li>{_e(line)}</li>" for line in stats_captions(stats, metric, settings))
    return (
        f'<section id="verdicts"><h2>Statistics over seeds: {_e(metric)}</h2>'
        f'{_table(head, rows, "stats")}<ul class="notes">{notes}</ul>{_captions(head)}</section>'
    )


def curves_section(
    runs: Sequence[RunReport], stats: Sequence[SettingStats] | None, settings: VerdictSettings
) -> str:
    charts: list[tuple[Callable[[Path], None], str]] = []
    if stats:
        title = f"{stats[0].metric} over seeds"
        charts.append((
            lambda p: plot_seeds(stats, p, title, settings),
            "Eval success rate per setting: each seed a thin line (a pruned one ends in x, then "
            "dotted at the value it counts with), the mean over seeds bold with the table's "
            "interval as its band.",
        ))  # fmt: skip
        if (grid := grid_of(stats)) is not None:
            charts.append((
                lambda p: plot_heatmap(grid, p, title),
                "The two swept keys as a grid: a cell per setting, coloured by its mean, with its "
                "interval, seeds and verdict.",
            ))  # fmt: skip
    charts.append((
        lambda p: plot(runs, p, "every run over training"),
        "Key metrics over policy versions (updates applied; the baseline eval is 0), a line per "
        "run: solid done, dashed incomplete, dotted ending in x failed, dash-dotted pruned.",
    ))  # fmt: skip
    figures = "".join(
        f"<figure>{svg_of(draw, f'f{i}-')}<figcaption>{_e(caption)}</figcaption></figure>"
        for i, (draw, caption) in enumerate(charts)
    )
    return f'<section id="curves"><h2>Learning curves</h2>{figures}</section>'


def _race_state(race: RaceInfo, over: bool | None) -> str:
    v = race.verdict or {}
    if v.get("nothing_learnt"):
        state = "nothing learnt: every run of every setting is at 0, so no seed is added"
    elif v.get("decided"):
        state = "decided: best " + " ".join(f"{k}={x}" for k, x in (v.get("best") or {}).items())
    else:
        state = "stopped undecided" if over else "not decided yet"
    going = {None: "", True: "; the race is over", False: "; the race is running"}[over]
    rules = race.verdict_settings
    return (
        f"{state}; {v.get('runs', 0)} runs ended{going}. Metric {race.metric}, first "
        f"{race.initial_seeds} seeds per setting, alpha {rules.alpha:g}, delta {rules.delta:g}"
    )


def _race_verdict(entry: dict[str, Any] | None) -> str:
    """A setting's verdict as the race's verdict.json gives it (the race's own alpha and delta)."""
    if entry is None or not entry.get("n_seeds") or entry.get("mean") is None:
        return "no value yet"
    text = str(entry["outcome"]).replace("_", " ")
    if entry.get("p") is not None and entry["outcome"] == "worse":
        text += f" p={entry['p']:.2g}"
    if entry.get("seeds_to_separate") is not None:
        text += f", ~{entry['seeds_to_separate']} seeds to separate"
    lo, hi = entry.get("ci") or (None, None)
    return (
        f"{text}; mean {_num(entry['mean'])} [{_num(lo)}, {_num(hi)}] over {entry['n_seeds']} seeds"
    )


def race_section(race: RaceInfo, stats: Sequence[SettingStats], over: bool | None) -> str:
    """The race's state, then a row per round (seed): each setting's value on it, and why the
    seed went to the settings it went to; last, each setting's verdict now (verdict.json)."""
    runs = {r.name: (s, r) for s in stats for r in s.runs}
    seeds = [int(m[2]) for name in runs if (m := RACE_RUN.fullmatch(name))]
    entries = (race.verdict or {}).get("settings", [])
    by_label = {" ".join(f"{k}={v}" for k, v in e["overrides"].items()): e for e in entries}
    verdicts = [_race_verdict(by_label.get(label)) for label in race.settings]
    head = [("seed", "a round: the settings' runs on this seed")]
    head += [(label, f"its {race.metric} on each seed") for label in race.settings]
    head.append(("why", "why the seed went to these settings"))
    k, rows = race.initial_seeds, []
    for seed in range(max(seeds, default=-1) + 1):
        cells, left = [str(seed)], []
        for i, label in enumerate(race.settings):
            if (entry := runs.get(f"s{i}_seed{seed}")) is None:
                cells.append("–")
                left.append(f"{label} (now {verdicts[i]})")
                continue
            s, run = entry
            value = s.values_by_seed.get(run.seed)
            text = run.status if value is None else _num(value)
            cells.append(_status(run.status, text + " (pruned)" * (run.status == "pruned")))
        if seed < k:
            why = f"the initial round: every setting runs seeds 0–{k - 1} before any is dropped"
        else:
            why = "the settings still racing the best: the best, and those not separated from it"
            if left:
                why += "; not to " + ", ".join(left)
        rows.append([*cells, _e(why)])
    rows.append(["verdict now", *map(_e, verdicts), ""])
    return (
        f'<section id="race"><h2>Race</h2><p>{_e(_race_state(race, over))}</p>'
        f"{_table(head, rows, 'rounds')}</section>"
    )


def trials_section(search: Search) -> str:
    done = [t for t in search.trials if t.value is not None]
    sign = 1.0 if search.maximize else -1.0
    best = max(done, key=lambda t: sign * (t.value or 0.0)).number if done else None
    head = [
        ("trial", "TPE proposes each trial from the trials that ended before it"),
        ("state", "complete; pruned or fail when one of its runs was; running: not finished"),
        (search.metric, f"{METRIC_HELP.get(search.metric, '')}: mean over the trial's seeds"),
        ("per seed", "seed: the value of its run"),
        ("setting", "the searched keys' values"),
        ("runs", "its run directories, one per seed"),
    ]
    rows = [[
        f"{t.number}{' (best)' if t.number == best else ''}", _status(t.state), _num(t.value),
        _e(" ".join(f"{seed}: {x:.3f}" for seed, x in t.values_by_seed.items()) or "–"),
        f"<code>{_e(' '.join(t.setting))}</code>", _e(", ".join(map(str, t.jobs)) or "–"),
    ] for t in search.trials]  # fmt: skip
    table = _table(head, rows, "trials")
    return f'<section id="trials"><h2>Search trials</h2>{table}{_captions(head)}</section>'


def runs_section(runs: Sequence[RunReport]) -> str:
    head = [
        ("run", "its directory"),
        ("setting", "its overrides, minus those every run shares"),
        ("status", "done, failed, pruned, or incomplete: no summary yet (running, or killed)"),
        ("iters", "train iterations with metrics / planned"),
        ("final success", "eval success rate at its last eval"),
        ("best success", "the highest eval success rate after training started"),
        ("train time", "iterations and evals, summed over resumed attempts"),
        ("error", "why it failed"),
    ]
    rows = [[
        _e(r.name), f"<code>{_e(r.label or '–')}</code>", _status(r.status),
        f"{r.iterations}" + (f"/{r.target_iterations}" if r.target_iterations else ""),
        _num(_get(r.final, "success_rate")), _num(_get(r.best_success, "success_rate")),
        _e(format_duration(r.time_s)), _e(r.error.splitlines()[0]) if r.error else "",
    ] for r in runs]  # fmt: skip
    return f'<section id="runs"><h2>Runs</h2>{_table(head, rows, "runs")}</section>'


STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 6px;
text-align:left;vertical-align:top}th{background:#f3f3f3}code,.nw{white-space:nowrap}
.bar{display:block;position:relative;height:6px;background:#eee;margin-top:3px;min-width:80px}
.bar span{position:absolute;top:0;height:6px;background:#6a9fd8}
.bar i{position:absolute;top:-2px;width:2px;height:10px;background:#123}
.done{color:#1a7f37}.failed{color:#c62828}.pruned{color:#8e24aa}.incomplete,.running{color:#b26a00}
figure{margin:1em 0}figure svg{max-width:100%;height:auto}figcaption{color:#555}
.captions dt{font-weight:600;float:left;clear:left;margin-right:.5em}.captions dd{margin:0 0 .2em}
.notes,.captions,.meta{color:#444;font-size:.92em}
"""


def render(
    runs: Sequence[RunReport],
    title: str,
    *,
    stats: Sequence[SettingStats] | None = None,
    settings: VerdictSettings = REPORT_SETTINGS,
    race: RaceInfo | None = None,
    search: Search | None = None,
    race_over: bool | None = None,
) -> str:
    """The page: `stats` None leaves out the statistics over seeds (and a race's rounds, which
    need them). `race_over` False (a race writing its own page while it runs) makes the browser
    reload it every REFRESH_S seconds; None (a report of whatever is there) says nothing of it."""
    refresh = race_over is False
    counts = ", ".join(
        f"{n} {s}"
        for s in ("done", "failed", "pruned", "incomplete")
        if (n := sum(r.status == s for r in runs))
    )
    metric = stats[0].metric if stats else "auc"
    written = time.strftime("%Y-%m-%d %H:%M:%S")
    meta = f"{len(runs)} runs: {counts or 'none yet'}; written {written}" + (
        f"; reloads every {REFRESH_S} s while the race runs" if refresh else ""
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{REFRESH_S}">' if refresh else "",
        f"<title>{_e(title)}</title><style>{STYLE}</style></head><body>",
        f'<h1>{_e(title)}</h1><p class="meta">{_e(meta)}</p>',
    ]
    if race is not None and stats is not None:
        parts.append(race_section(race, stats, race_over))
    if stats:
        parts.append(stats_section(stats, metric, settings))
    parts.append(curves_section(runs, stats, settings))
    if search is not None:
        parts.append(trials_section(search))
    parts.append(runs_section(runs))
    parts.append("</body></html>\n")
    return "\n".join(p for p in parts if p)


def write_report(
    root: Path,
    path: Path | None = None,
    *,
    runs: Sequence[RunReport] | None = None,
    stats: Sequence[SettingStats] | None = None,
    settings: VerdictSettings | None = None,
    race_over: bool | None = None,
) -> Path:
    """Write the page of the study in `root` atomically to `path` (default root/report.html).
    Without `runs` they are loaded, with the statistics over seeds (a race's metric, alpha and
    delta for a race); with `runs`, `stats` as the caller has them (None: no statistics)."""
    race = load_race(root)
    if settings is None:
        settings = race.verdict_settings if race is not None else REPORT_SETTINGS
    if runs is None:
        runs = load_runs(root)
        _, stats = seed_stats(runs, race.metric if race else "auc", settings)
    search = load_search(root)
    page = render(runs, str(root), stats=stats, settings=settings, race=race, search=search,
                  race_over=race_over)  # fmt: skip
    path = path if path is not None else root / REPORT_HTML
    atomic_write_text(path, page)
    return path
