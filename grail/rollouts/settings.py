"""What the rollout layer reads of a run's config. The whole `Config` belongs to the layers that
own the run (grail/train/components.py `rollout_settings` builds this from it): a source that
holds only these sections cannot come to depend on `train.*` or `model.*` unnoticed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from grail.core.config import DataConfig, EvalConfig, GenerationConfig


@dataclass(frozen=True)
class RolloutSettings:
    seed: int  # every request's sampling seed derives from it (grail/rollouts/seeds.py)
    data: DataConfig
    generation: GenerationConfig
    eval: EvalConfig
    pipeline: bool  # train.pipeline: generate iteration i+1 while iteration i trains
    iterations: int  # train.iterations: the last one prefetches nothing
    study_dir: str | None  # where iteration 0's batch is shared (grail/rollouts/shared.py)
