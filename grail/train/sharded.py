"""The trainer of a multi-process run (`train.processes=N`, launched by grail/train/distributed.py):
`ShardedTrainer`, its model sharded over the ranks (grail/train/fsdp.py), and the few typed
commands rank 0 gives the other ranks through `broadcast_object_list`: `Start` (build the trainer,
resuming from a checkpoint or not), `Update` (the same `Trainer.update` on the same batch),
`Gather` (the full weights, for a sync or a checkpoint), `Save` (each rank's share of the optimizer
state, torch.distributed.checkpoint) and `Stop`. On rank 0 each method that needs the other ranks
first sends them its command; the other ranks run `follow`, which calls the same methods.

A collective that fails because a peer went away (gloo's closed connection, NCCL's error, the
process group's timeout, `train.collective_timeout_s`) raises `PeersLost`.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from grail.core.config import Config
from grail.core.disk import writing
from grail.core.errors import UserError
from grail.core.placement import cpu_threads, trainer_devices
from grail.core.records import follow_umask
from grail.core.reproducible import check_torch_honours
from grail.inference.weights.policy import PolicyWeights
from grail.models.lora import base_weights
from grail.rollouts.batch import RolloutBatch
from grail.train.checkpoint import CheckpointRef, stage_checkpoint
from grail.train.fsdp import full_state_dict, shard_model
from grail.train.trainer import Trainer, silence_library_progress_bars

log = logging.getLogger("grail.train")

OPTIMIZER_DIR = "optimizer"  # inside a checkpoint: the optimizer's shards (DCP)


class PeersLost(RuntimeError):
    """A collective failed because another rank went away (or timed out waiting for it)."""

    @property
    def timed_out(self) -> bool:
        """The process group's timeout ended the wait (a peer hung), not a closed connection."""
        text = str(self).lower()
        return "timed out" in text or "timeout" in text


# ---- the commands rank 0 gives the other ranks -----------------------------------------------


@dataclass(frozen=True)
class Start:
    resume_from: CheckpointRef | None


@dataclass(frozen=True)
class Update:
    batch: RolloutBatch


@dataclass(frozen=True)
class Gather:
    pass


@dataclass(frozen=True)
class Save:
    directory: str  # where the optimizer's shards go


@dataclass(frozen=True)
class Stop:
    pass


Command = Start | Update | Gather | Save | Stop


@contextlib.contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a collective's failure (a peer that died: gloo's closed connection, NCCL's error, the
    process group's timeout) into `PeersLost`."""
    try:
        yield
    except (dist.DistError, RuntimeError) as exc:
        if isinstance(exc, dist.DistError) or "gloo" in str(exc) or "Connection" in str(exc):
            raise PeersLost(f"{what}: {exc}") from exc
        raise


def send(command: Command) -> None:
    """Rank 0: give every other rank `command`."""
    with collective(f"sending {type(command).__name__} to the other ranks"):
        dist.broadcast_object_list([command], src=0)


def receive() -> Command:
    """A rank > 0: the next command from rank 0 (waits up to the process group's timeout)."""
    box: list[Any] = [None]
    with collective("waiting for rank 0's next command"):
        dist.broadcast_object_list(box, src=0)
    return box[0]


# ---- one rank's torch ------------------------------------------------------------------------


class RankAccelerator:
    """What `Trainer` uses of accelerate's `Accelerator`, for a rank of a sharded run: FSDP does
    what accelerate would (mixed precision is the shards' policy, grail/train/fsdp.py), and an
    `Accelerator` built under torchrun's environment would set up data parallelism of its own."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def clip_grad_norm_(self, parameters: Any, max_norm: float) -> torch.Tensor:
        # DTensor gradients: the norm is over the whole model, reduced across the ranks.
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)

    def autocast(self) -> AbstractContextManager[Any]:
        return nullcontext()

    def unwrap_model(self, model: Any) -> Any:
        return model

    def prepare(self, *objects: Any) -> tuple[Any, ...]:
        return objects


def setup_rank(cfg: Config) -> RankAccelerator:
    """This rank's device (LOCAL_RANK-th training GPU, or the CPU with its share of the trainer's
    threads), seed and process group (NCCL or gloo, with the collective timeout)."""
    silence_library_progress_bars()
    torch.manual_seed(cfg.seed)
    # This node's ranks share its devices and cores (one node: every rank of the run).
    local_world, local_rank = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    if torch.cuda.is_available():
        device = torch.device(
            "cuda",
            trainer_devices(
                cfg.gpu, local_world, torch.cuda.device_count(), cfg.generation.servers
            )[local_rank],
        )
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        device = torch.device("cpu")
        threads = cpu_threads(
            cfg.train.threads,
            cfg.generation.server_threads,
            pipelined=cfg.train.pipeline,
            reproducible=cfg.reproducible,
        )[0]
        torch.set_num_threads(max(1, threads // local_world))  # the ranks share the trainer's cores
        if cfg.reproducible:
            check_torch_honours()
        dist.init_process_group("gloo", timeout=timeout)
    torch.use_deterministic_algorithms(device.type != "cuda", warn_only=True)
    return RankAccelerator(device)


# ---- the trainer of a sharded run ------------------------------------------------------------


class GatheredModel:
    """The trained model with its full weights gathered from the shards (rank 0): what a weight
    sync (`PolicyWeights`) and a checkpoint save, as `save_pretrained` directories."""

    def __init__(self, model: Any, state: dict[str, torch.Tensor]) -> None:
        self.model, self.state = model, state

    def save_pretrained(self, save_directory: Path, **kwargs: Any) -> None:
        kwargs.setdefault("state_dict", self.state)
        self.model.save_pretrained(save_directory, **kwargs)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return (torch.nn.Parameter(t, requires_grad=False) for t in self.state.values())


class ShardedTrainer(Trainer):
    """A `Trainer` whose model (and reference model) is sharded over the ranks. On rank 0 (the
    driver) each method that needs the other ranks first sends them its command; on the others
    `follow` calls the same methods."""

    def __init__(self, cfg: Config, resume_from: CheckpointRef | None) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        accelerator = RankAccelerator(
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        super().__init__(cfg, accelerator, resume_from)

    @property
    def driver(self) -> bool:
        return self.rank == 0

    def _command(self, command: Command) -> None:
        if self.driver:
            send(command)

    def _shard(self, model: Any) -> Any:
        return shard_model(model, self.accelerator.device)

    def _load_optimizer(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        checkpoint: Path,
    ) -> None:
        shards = checkpoint / OPTIMIZER_DIR
        if not shards.is_dir():
            raise UserError(
                f"{checkpoint} was written by a 1-process run (its optimizer state is in "
                "trainer_state.pt, not sharded): resume it with train.processes=1"
            )
        with collective("loading the optimizer's shards"):
            loaded = {"optimizer": get_optimizer_state_dict(model, optimizer)}
            dcp.load(loaded, checkpoint_id=shards)  # reshards when the rank count changed
            set_optimizer_state_dict(model, optimizer, loaded["optimizer"])

    def update(
        self, batch: RolloutBatch, on_progress: Callable[[int], None] | None = None
    ) -> dict[str, float | bool | None]:
        self._command(Update(batch))
        with collective("the policy update"):
            return super().update(batch, on_progress)

    def gather(self) -> dict[str, torch.Tensor]:
        """The full weights on rank 0 ({} on the others)."""
        self._command(Gather())
        with collective("gathering the weights"):
            return full_state_dict(self.model)

    def save_optimizer(self, directory: Path) -> None:
        """Every rank writes its shard of the optimizer's state into `directory`."""
        self._command(Save(str(directory)))
        with collective("saving the optimizer's shards"):
            state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}
            dcp.save(state, checkpoint_id=directory)

    @property
    def weights(self) -> PolicyWeights:
        """Gathered now (a collective), held on rank 0's CPU until the sync is done."""
        return PolicyWeights(GatheredModel(self.model, self.gather()), lora=self.lora)

    def save_weights(self, directory: Path) -> None:
        self.weights.save(directory)

    def save_server_model(self, directory: Path) -> None:
        state = self.gather()
        with writing(directory):
            if self.lora:
                prefix = "base_model.model."  # the PeftModel's names of its base's weights
                base = {k.removeprefix(prefix): v for k, v in state.items()}
                self.model.get_base_model().save_pretrained(
                    directory, state_dict=base_weights(base)
                )
            else:
                self.model.save_pretrained(directory, state_dict=state, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
        follow_umask(directory)

    def stage_checkpoint(
        self, checkpoints_dir: Path, iteration: int, source_state: dict[str, Any]
    ) -> Path:
        """The HF directory from the gathered weights (rank 0), the optimizer's state as shards
        every rank writes (`OPTIMIZER_DIR`), then the manifest over both."""
        model = GatheredModel(self.model, self.gather())
        return stage_checkpoint(
            checkpoints_dir,
            iteration,
            model,
            self.tokenizer,
            {
                "scheduler": self.scheduler.state_dict(),
                "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
                "kl_coef": None if self.kl_control is None else self.kl_control.value,
                "trainer_processes": self.world,
            },
            source_state,
            write_more=lambda tmp: self.save_optimizer(tmp / OPTIMIZER_DIR),
        )


def driver_trainer(cfg: Config, resume_from: CheckpointRef | None) -> ShardedTrainer:
    """Rank 0's trainer: the other ranks build theirs at the same time (`Start`)."""
    send(Start(resume_from))
    return ShardedTrainer(cfg, resume_from)


def follow(cfg: Config) -> None:
    """A rank > 0: build the trainer when rank 0 does, then do what rank 0 says until `Stop`."""
    command = receive()
    if isinstance(command, Stop):  # rank 0 had nothing to train (a finished run)
        return
    assert isinstance(command, Start), command
    trainer = ShardedTrainer(cfg, command.resume_from)
    while not isinstance(command := receive(), Stop):
        if isinstance(command, Update):
            trainer.update(command.batch)
        elif isinstance(command, Gather):
            trainer.gather()
        elif isinstance(command, Save):
            trainer.save_optimizer(Path(command.directory))
        else:
            raise RuntimeError(f"rank {trainer.rank}: unexpected command {command!r}")
