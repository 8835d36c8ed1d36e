"""What grail's Hydra sweepers share: the race (race_sweeper.py) and the search (search.py) each
read their swept keys from `hydra.sweeper.params` and the command line, refuse a swept seed
(they set it themselves), and launch through the launcher Hydra's config names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import HydraException
from hydra.plugins.launcher import Launcher
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from grail.core.records import override_key
from grail.study.stats import SEED_KEY
from grail.study.sweep import SweepError


class GrailSweeper(Sweeper):
    """A Hydra sweeper with `params` (swept keys, as on the command line) and `max_batch_size`
    (runs at once), which `setup` gives the launcher to run its jobs with."""

    def __init__(self, params: Mapping[str, Any] | None, max_batch_size: int | None) -> None:
        super().__init__()
        if isinstance(params, DictConfig):
            params = OmegaConf.to_container(params)  # type: ignore[assignment]
        self.params = dict(params or {})
        self.max_batch_size = max_batch_size
        self.hydra_context: HydraContext | None = None
        self.config: DictConfig | None = None
        self.launcher: Launcher | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            hydra_context=hydra_context, task_function=task_function, config=config
        )


def sweep_overrides(
    params: Mapping[str, Any] | None,
    arguments: Sequence[str],
    parser: OverridesParser,
    who_sets_the_seed: str,
) -> Iterator[tuple[str, str, Override]]:
    """(where, text, override) for each entry of `params`, then of the command line, parsed;
    Hydra's own overrides (applied by Hydra already) left out. A seed is refused, naming the
    entry, with `who_sets_the_seed` (e.g. "the race chooses itself (...)"). Raises SweepError."""
    entries = [(f"hydra.sweeper.params.{k}", f"{k}={v}") for k, v in (params or {}).items()]
    entries += [("the command line", a) for a in arguments]
    for where, text in entries:
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            raise SweepError(f"{where}: cannot parse {text!r}: {exc}") from exc
        if override.is_hydra_override():
            continue
        if override_key(override.get_key_element()) == SEED_KEY:
            raise SweepError(f"{where}: {text!r} sets the seed, which {who_sets_the_seed}")
        yield where, text, override
