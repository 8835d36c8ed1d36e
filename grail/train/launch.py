"""One run from a composed config, whatever started it (`grail-train` alone, a sweep job, another
node of a multi-node run): the checks before anything loads (`preflight`), and the run itself on
this process or on its ranks (`train`). grail/train/cli.py decides what a command line asks for
and reports how it ended; grail/train/sweep_job.py runs one job of a sweep.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from grail.core.config import Config
from grail.core.errors import ConfigError, UserError
from grail.core.nodes import NodePlan
from grail.core.placement import (
    forks_its_servers,
    trainer_devices,
    trainer_processes,
    visible_gpus,
)
from grail.core.records import write_summary
from grail.core.reproducible import apply_reproducible_env
from grail.core.validate import validate
from grail.train.reporting import log_files, resume_command
from grail.train.resume import Resume, saved_choices

log = logging.getLogger("grail.train")


def preflight(config: Config, env_group: str | None = None) -> None:
    """Check what can be checked before anything loads or starts, raising a UserError that names
    the bad key: the schema and combinations (`validate`), the environment and its arguments,
    the reward plugins (imported) and their names against the environment's score components,
    and that model paths exist. `env_group`: the `env=` choice the config was composed with."""
    from grail.envs import ENVIRONMENTS, env_factory, make_env
    from grail.envs.rewards.base import RewardError
    from grail.envs.rewards.plugins import RewardFunctions
    from grail.models import TINY_MODEL_NAMES
    from grail.models.lr_transfer import check_lr_transfer

    validate(config)
    check_lr_transfer(
        config.train, config.model
    )  # the effective lr a train.lr_rule makes, held to train.lr's bound
    # The GPUs named for the trainer ranks and the server exist on this machine.
    trainer_devices(config.gpu, config.train.processes, visible_gpus(), config.generation.servers)
    name = config.data.environment
    factory = env_factory(name)
    if env_group in ENVIRONMENTS and env_group != name:
        raise ConfigError(
            f"data.environment={name} but the config group env={env_group} set its arguments "
            f"(data.env_kwargs); choose the environment with env={name} instead"
        )
    # Built once here to check the values as well as the names (a bad difficulty, a missing data
    # file): answered in ~1.5 s instead of after torch and transformers load (~8 s).
    make_env(name, **config.data.env_kwargs)
    rewards = RewardFunctions.from_specs(list(config.data.rewards))
    try:
        rewards.check_names(name, factory.components)
    except RewardError as exc:  # a name the config gave: a configuration error (exit 2)
        raise ConfigError(str(exc)) from exc
    for key in ("train_id", "ref_id"):
        model_id = getattr(config.model, key)
        if model_id is not None and model_id not in TINY_MODEL_NAMES:
            from grail.models.loading import check_hub_source, resolve_source

            try:
                check_hub_source(resolve_source(model_id))
            except OSError as exc:  # missing path, a file, a hub id the hub cannot give
                raise ConfigError(f"model.{key}: {exc}") from exc


def train(
    config: Config, run_dir: Path, resume: Resume | None = None, plan: NodePlan | None = None
) -> None:
    if config.reproducible:
        # Before torch's first tensor operation, when torch and MKL read them (the server child
        # gets them in its environment); setup_torch checks that torch took them.
        apply_reproducible_env(os.environ)
    # N ranks (on this node), this process their agent (distributed.py)
    plan = plan or NodePlan.single()
    if plan.nodes > 1 or trainer_processes(config.gpu, config.train.processes) > 1:
        from grail.train.distributed import launch

        files = log_files()
        try:
            launch(config, run_dir, resume, files[0].baseFilename if files else None, plan)
        except UserError as exc:  # a rank failed: rank 0 could not write summary.json
            failed_summary(config, run_dir, exc)
            command = resume_command(run_dir.absolute())
            raise type(exc)(f"{exc}; to continue from the newest checkpoint: {command}") from exc
        return
    # Imported here so that `--help` and config errors answer before torch and transformers load.
    from grail.train.loop import run

    if forks_its_servers(config.generation.backend, config.generation.urls):
        from grail.inference import zygote

        zygote.prepare()  # after the imports, before any thread or tensor operation
    run(config, run_dir, resume)


def failed_summary(config: Config, run_dir: Path, exc: BaseException) -> None:
    from grail.train.loop import config_record

    try:
        write_summary(
            run_dir,
            0.0,
            error=exc,
            environment=config.data.environment,
            config=config_record(config),
        )
    except OSError as unwritten:  # a full disk, say: the error that stopped the run matters
        log.warning("summary.json not written: %s", unwritten)


def checked_config(cfg: DictConfig, hydra_cfg: Any, run_dir: Path, resume: Resume | None) -> Config:
    """The run's typed config from the composed one, through `preflight` (with the `env=` choice
    it was composed with)."""
    config: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    preflight(config, _env_choice(hydra_cfg, run_dir, resume))
    return config


def _env_choice(hydra_cfg: Any, run_dir: Path, resume: Resume | None) -> str | None:
    """The `env=` choice the run's config was composed with: the saved one for a resume."""
    if resume is not None:
        env = saved_choices(run_dir).get("env")
        return str(env) if env is not None else None
    return hydra_cfg.runtime.choices.get("env")
