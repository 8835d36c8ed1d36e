"""hydra/sweeper=grail_optuna: the search sweeper of grail/study/search.py, under the name Hydra
accepts (plugins must live in the `hydra_plugins` namespace package, which Hydra scans on start)."""

from __future__ import annotations

from grail.study import search


class OptunaSearchSweeper(search.OptunaSearchSweeper):
    """See grail/study/search.py."""
