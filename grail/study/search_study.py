"""The search's Optuna study (grail/study/search.py): kept in Optuna's journal storage at
`<sweep dir>/optuna/search.journal`, holding what defines the search (its signature) so that a
rerun with `resume=true` continues the same search and refuses another one.

Optuna is imported inside the functions only (see grail/study/search.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grail.core.records import LAUNCH_KEYS
from grail.study.search_space import Space
from grail.study.sweep import SweepError

if TYPE_CHECKING:
    import optuna

SEARCH_DIR = "optuna"  # below the sweep directory
JOURNAL = "search.journal"
BEST = "best.yaml"
STUDY_ATTR = "grail_search"  # the study's user attribute holding what defines the search


def study_signature(
    space: Space, seeds: Sequence[int], metric: str, direction: str
) -> dict[str, Any]:
    """What makes two invocations the same search (stored with the study, checked on resume)."""
    from optuna.distributions import distribution_to_json

    fixed = {}
    for o in space.fixed:
        key = o.split("=", 1)[0]
        if key.lstrip("+~") not in LAUNCH_KEYS:
            fixed[key] = o
    return {
        "params": {k: distribution_to_json(d) for k, d in space.distributions.items()},
        "fixed": fixed,
        "seeds": list(seeds),
        "metric": metric,
        "direction": direction,
    }


def check_signature(stored: Mapping[str, Any], now: Mapping[str, Any], journal: Path) -> None:
    """Raise SweepError when this invocation is another search than the one stored: other
    distributions, seeds, metric or direction, or a fixed key given another value (the runs of
    one study would then differ in more than their parameters). Fixed keys added or dropped are
    allowed, as for a grid's rerun (say, a longer request timeout)."""
    changes = []
    for key in ("params", "seeds", "metric", "direction"):
        if stored.get(key) != now.get(key):
            changes.append(f"{key}: {stored.get(key)} before, {now.get(key)} now")
    before, after = stored.get("fixed", {}), now.get("fixed", {})
    for key in sorted(before.keys() & after.keys()):
        if before[key] != after[key]:
            changes.append(f"{before[key]} before, {after[key]} now")
    if changes:
        raise SweepError(
            f"the study in {journal} was made by a different search ("
            + "; ".join(changes)
            + "). Rerun the original command with resume=true, or start a new search (a new "
            "hydra.sweep.dir)"
        )


def open_study(
    journal: Path,
    name: str,
    signature: Mapping[str, Any],
    *,
    resume: bool,
) -> optuna.Study:
    """The study in `journal`: created (holding `signature`) when absent; loaded and checked with
    `resume`; refused without it, since starting over would mix two searches in one directory.
    Its sampler is set for each trial (`trial_sampler`)."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    journal.parent.mkdir(parents=True, exist_ok=True)
    storage = JournalStorage(JournalFileBackend(str(journal)))
    exists = name in optuna.study.get_all_study_names(storage)
    if exists and not resume:
        sweep_dir = journal.parent.parent
        raise SweepError(
            f"{sweep_dir} already holds the search {name!r} ({journal}): to continue it, rerun "
            f"the same command with resume=true hydra.sweep.dir={sweep_dir}; or start a new "
            "search (a new hydra.sweep.dir)"
        )
    study = optuna.create_study(
        study_name=name,
        storage=storage,
        direction=signature["direction"],
        load_if_exists=True,
    )
    stored = study.user_attrs.get(STUDY_ATTR)
    if stored is None:
        study.set_user_attr(STUDY_ATTR, dict(signature))
    else:
        check_signature(stored, signature, journal)
    return study


def trial_sampler(
    seed: int | None, n_startup_trials: int, number: int
) -> optuna.samplers.TPESampler:
    """The sampler that proposes trial `number`: TPE seeded from (`seed`, `number`), so what it
    proposes depends on the search's seed, the trial's number and the trials told before it, and
    not on how many invocations the search took. One sampler seeded once per invocation replays
    its random stream after a resume: the resumed search's first new trials proposed the settings
    of the first trials again. `seed` None: a fresh random seed for each trial."""
    import numpy as np
    import optuna

    trial_seed = None
    if seed is not None:
        trial_seed = int(np.random.SeedSequence([seed, number]).generate_state(1)[0])
    return optuna.samplers.TPESampler(seed=trial_seed, n_startup_trials=n_startup_trials)
