"""hydra/sweeper=grail_optuna: the search sweeper of grail/search.py, under the name Hydra accepts
(plugins must live in the `hydra_plugins` namespace package, which Hydra scans on start)."""

from __future__ import annotations

from grail import search


class OptunaSearchSweeper(search.OptunaSearchSweeper):
    """See grail/search.py."""
