"""The Config turned into a run's parts, in one place: the trainer, the inference server with
the weight route its backend takes and the syncer that owns it, the rollout source (the server's,
or the service's fed by clients), the environments and the metric loggers. With
`generation.urls` the servers are the user's (`external_server_and_syncer`), which grail checks
and syncs but never starts or stops. The layers below take the values they need, not the Config:
the inference servers their sizes and places, the objective its `GRPOLossConfig`, the rollout
sources their `RolloutSettings` (`rollout_settings`), the service its `ServiceConfig`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from grail.core.choices import WeightSyncMode
from grail.core.config import Config
from grail.core.placement import (
    GpuLayout,
    cpu_threads,
    fleet_size,
    gpu_layout,
    trainer_ranks,
)
from grail.core.records import without_secrets
from grail.core.reproducible import apply_reproducible_env
from grail.envs import AnyEnvironment, env_arguments, make_env
from grail.envs.rewards.plugins import RewardFunctions
from grail.inference.backends import BACKEND_CLASSES, make_server_manager
from grail.inference.errors import ServerStartError
from grail.inference.external import external_server
from grail.inference.process import ServerManager
from grail.inference.weights.route import RouteChoice, resolve_route
from grail.inference.weights.syncer import WeightSyncer
from grail.rollouts.fleet import Fleet
from grail.rollouts.server import ServerRollouts
from grail.rollouts.settings import RolloutSettings
from grail.rollouts.shared import SharedRollouts
from grail.service.source import ServiceRollouts
from grail.train.checkpoint import CheckpointRef
from grail.train.display import Display
from grail.train.loggers import MetricLoggers
from grail.train.trainer import Trainer, setup_torch

ADAPTER_DIR = "adapter"  # weights/adapter/: the LoRA adapter the inference server serves


@dataclass
class RunParts:
    trainer: Trainer
    source: ServerRollouts | ServiceRollouts
    extra_rewards: RewardFunctions  # closed with the run: remote scorers hold connections
    display: Display


def build_run(cfg: Config, run_dir: Path, resume_from: CheckpointRef | None) -> RunParts:
    """Everything a run's loop works with, built from `cfg`."""
    env, eval_env = make_envs(cfg)
    extra_rewards = RewardFunctions.from_specs(list(cfg.data.rewards))
    trainer: Trainer
    # Rank 0 of a sharded run: the others build theirs with it.
    if trainer_ranks(cfg.gpu, cfg.train.processes, cfg.train.nodes) > 1:
        from grail.train.sharded import driver_trainer

        trainer = driver_trainer(cfg, resume_from)
    else:
        trainer = Trainer(cfg, setup_torch(cfg), resume_from)

    # The server starts from exactly the trainer's weights, saved where later syncs go.
    weights_dir = run_dir / "weights"
    trainer.save_server_model(weights_dir)
    lora_dir = None
    if trainer.lora:  # the server serves the base with this adapter, which every sync rewrites
        lora_dir = weights_dir / ADAPTER_DIR
        trainer.save_weights(lora_dir)
    if cfg.generation.urls:  # servers the user runs: one per URL, grail starts none
        members = [
            external_server_and_syncer(cfg, url, weights_dir, run_dir)
            for url in cfg.generation.urls
        ]
    else:
        members = [
            server_and_syncer_from_config(cfg, weights_dir, run_dir, lora_dir=lora_dir, member=i)
            for i in range(fleet_size(cfg.gpu, cfg.generation.servers))
        ]
    server, syncer = members[0]
    # A fresh run's iteration 0 may come from its study's store, keyed by these initial weights.
    fresh = trainer.start_iteration == 0
    settings = rollout_settings(cfg)
    shared = SharedRollouts.for_run(settings, weights_dir, server) if fresh else None

    display = Display()
    server_rollouts = ServerRollouts(
        settings,
        server,
        env,
        eval_env,
        trainer.tokenizer,
        syncer=syncer,
        extra_rewards=extra_rewards,
        progress=display.task,
        state=trainer.source_state,
        shared=shared,
        fleet=(
            Fleet(members, deadline_s=cfg.generation.request_timeout_s)
            if len(members) > 1
            else None
        ),
    )
    source: ServerRollouts | ServiceRollouts = server_rollouts
    if cfg.mode == "service":  # clients send the prompts and rewards (grail/service/)
        source = ServiceRollouts(
            cfg.service,
            run_dir,
            server_rollouts,
            trainer.tokenizer,
            resume=cfg.resume,
            start_iteration=trainer.start_iteration,
            progress=display.task,
        )
    return RunParts(trainer, source, extra_rewards, display)


def rollout_settings(cfg: Config) -> RolloutSettings:
    """What the rollout sources read of `cfg` (grail/rollouts/settings.py)."""
    return RolloutSettings(
        seed=cfg.seed,
        data=cfg.data,
        generation=cfg.generation,
        eval=cfg.eval,
        pipeline=cfg.train.pipeline,
        iterations=cfg.train.iterations,
        study_dir=cfg.study_dir,
    )


def open_loggers(cfg: Config, run_dir: Path) -> MetricLoggers:
    """The metric loggers `logging.*` asks for, given the run's config (secrets redacted)."""
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    return MetricLoggers.from_config(cfg.logging, run_dir, without_secrets(config))  # type: ignore[arg-type]


def make_envs(cfg: Config) -> tuple[AnyEnvironment, AnyEnvironment]:
    """The training environment and the evaluation one: a dataset task with splits (gsm8k)
    evaluates on its test split; procedural tasks evaluate on held-out seeds of the same task."""
    name, kwargs = cfg.data.environment, dict(cfg.data.env_kwargs)
    train_env = make_env(name, **kwargs)
    if "split" in env_arguments(name):
        return train_env, make_env(name, **{**kwargs, "split": "test"})
    return train_env, train_env


def server_manager_from_config(
    cfg: Config,
    model_dir: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    cuda_available: bool | None = None,
    served_model_name: str = "policy",
    lora_dir: str | os.PathLike[str] | None = None,
    weight_transfer: str = "disk",
    member: int = 0,
) -> ServerManager:
    """The server `grail-train` runs for `cfg`: backend, GPU placement and sizes from the config.
    With `model.lora.enabled`, `lora_dir` is where the adapter the server serves is written;
    `weight_transfer` is the run's route (`server_and_syncer_from_config` picks it). In a fleet
    (`generation.servers` > 1) this is server `member`: its own log directory
    (`logs/server-<member>`), the servers' CPU share split between them unless
    `generation.server_threads` says each one's, the server GPUs taken in turn.

    Placement: the server gets its first GPU of `gpu_layout`; when the trainer shares it
    (`gpu.strategy=single`, or the lists overlap) the memory fraction defaults low. The built-in
    server runs on CPU when CUDA is not available; vLLM and SGLang need CUDA and say so.
    `generation.start_timeout_s` null means the backend's default.
    """
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    gen = cfg.generation
    servers = fleet_size(cfg.gpu, gen.servers)
    if gen.backend != "builtin" and not cuda_available:
        raise ServerStartError(
            f"generation.backend={gen.backend} needs a CUDA GPU, and torch sees none "
            "(torch.cuda.is_available() is False); on a CPU machine use generation.backend=builtin"
        )
    threads = None
    env: dict[str, str] = {}
    if not cuda_available:
        _, threads = cpu_threads(
            cfg.train.threads,
            gen.server_threads,
            pipelined=cfg.train.pipeline,
            reproducible=cfg.reproducible,
            model_dir=model_dir,
        )
        if gen.server_threads is None and not cfg.reproducible:
            threads = max(1, threads // servers)  # the fleet shares the servers' cores
        if cfg.reproducible:  # the server's kernels too (grail/core/reproducible.py)
            apply_reproducible_env(env)
    model_dtype = cfg.model.dtype
    log_dir = Path(run_dir) / "logs"
    layout = run_layout(cfg)
    return make_server_manager(
        gen.backend,
        model_dir,
        served_model_name,
        log_dir=log_dir if servers == 1 else log_dir / f"server-{member}",
        device=f"cuda:{server_gpu(layout, member)}" if cuda_available else "cpu",
        threads=threads,
        start_timeout=gen.start_timeout_s,
        dtype=None if model_dtype == "auto" else model_dtype,
        gpu_memory_fraction=gen.gpu_memory_fraction,
        shares_gpu_with_trainer=layout.shared,
        max_model_len=gen.max_model_len,
        max_num_seqs=gen.max_num_seqs,
        seed=cfg.seed,
        extra_args=list(gen.extra_args),
        lora_dir=lora_dir,
        lora_rank=cfg.model.lora.r if lora_dir is not None else None,
        weight_transfer=weight_transfer,
        env=env,
        reproducible=cfg.reproducible,
    )


def run_layout(cfg: Config) -> GpuLayout:
    """The run's GPUs by side (`gpu_layout` of its gpu, train.processes and servers)."""
    return gpu_layout(cfg.gpu, cfg.train.processes, cfg.generation.servers)


def server_gpu(layout: GpuLayout, member: int) -> int:
    """The GPU of server `member` of the fleet: the server GPUs in turn."""
    return layout.server[member % len(layout.server)]


def weight_route_from_config(cfg: Config, cuda_available: bool, member: int = 0) -> RouteChoice:
    """The weight route of server `member` (grail/inference/weights/route.py):
    `generation.weight_transfer` among the routes its backend takes (`weight_routes`), given
    where that server and the trainer are: on the same device when both are on CPU, or on one
    CUDA index (the trainer's rank 0)."""
    layout = run_layout(cfg)
    return resolve_route(
        cfg.generation.weight_transfer,
        BACKEND_CLASSES[cfg.generation.backend].weight_routes,
        backend=cfg.generation.backend,
        # what the GPUs are, whichever keys said so: shared when the lists overlap
        strategy="single" if layout.shared else "multi",
        same_device=not cuda_available or server_gpu(layout, member) == layout.trainer[0],
        lora=cfg.model.lora.enabled,
        weight_sync=cfg.generation.weight_sync,
    )


def server_and_syncer_from_config(
    cfg: Config,
    model_dir: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
    *,
    cuda_available: bool | None = None,
    lora_dir: str | os.PathLike[str] | None = None,
    member: int = 0,
) -> tuple[ServerManager, WeightSyncer]:
    """The server of `server_manager_from_config` and the `WeightSyncer` that gives it the
    trainer's weights, through the run's route, chosen once here: the server is started for it
    (vLLM's nccl) and the syncer sends through it, disk as the fallback."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    route = weight_route_from_config(cfg, cuda_available, member)
    server = server_manager_from_config(
        cfg,
        model_dir,
        run_dir,
        cuda_available=cuda_available,
        lora_dir=lora_dir,
        weight_transfer=route.name,
        member=member,
    )
    return server, WeightSyncer.for_server(server, route, cfg.generation.weight_sync)


def external_server_and_syncer(
    cfg: Config,
    url: str,
    model_dir: str | os.PathLike[str],
    run_dir: str | os.PathLike[str],
) -> tuple[ServerManager, WeightSyncer]:
    """The server the user runs at `url` (`generation.urls`, grail/inference/external.py), of
    kind `generation.backend`, and its syncer: weights from disk (`model_dir`, which the server
    must read), in place."""
    server = external_server(
        cfg.generation.backend,
        url,
        model_dir,
        model=cfg.generation.url_model,
        log_dir=Path(run_dir) / "logs",
        request_timeout_s=cfg.generation.request_timeout_s,
    )
    route = RouteChoice("disk", "a server grail did not start reads the weights from disk")
    return server, WeightSyncer.for_server(server, route, WeightSyncMode.in_place)
