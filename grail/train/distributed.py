"""`train.processes=N`: the trainer as N ranks under torch's elastic launcher, rank 0 driving.

Where Hydra's process ends and the ranks begin: grail-train's own (Hydra) process composes and
checks the config, claims the run directory (its lock) and then calls `launch`, which runs
`rank_main` in N fresh processes through `torch.distributed.launcher.api.elastic_launch` (the
launcher behind `torchrun`: a standalone c10d rendezvous on 127.0.0.1, no restarts, a short monitor
interval), passing each the resolved `Config`, the run directory and the resume plan. The Hydra
process stays the elastic agent: it holds the run's lock for the ranks (rank 0 writes under it,
`held_for_the_ranks`), watches them, and turns how they ended into one line. So the config is
composed once, Hydra's run directory and logging stay where they are, and a rank is a plain
function of its arguments.

Rank 0 runs the loop of grail/train/loop.py unchanged (rollouts from the server, evaluation,
metrics, checkpoints, weight sync, display) with a `ShardedTrainer`, which tells the other ranks
what to do through a few typed commands (`broadcast_object_list` from rank 0): `Start` (build the
trainer, resuming from a checkpoint or not), `Update` (the same `Trainer.update` on the same batch),
`Gather` (the full weights, for a sync or a checkpoint), `Save` (their share of the optimizer
state) and `Stop`. The other ranks run `follow`, which does what each command says.

Faults. The agent watches the ranks: when one fails (raises, or is killed) it stops the others
(SIGTERM, which rank 0 turns into an interrupt that stops the inference server) and raises
`ChildFailedError`, which `launch` turns into a `RankFailed` naming the rank and its cause. A rank
that only saw its peers go away (a collective that failed because the other side died) waits
`LOST_GRACE_S` before it exits with `LOST_EXIT`, so that the agent sees the rank that failed
first and names it rather than its bystander. Every collective has the process group's timeout
(`train.collective_timeout_s`), so a rank that hangs fails the run instead of stopping it forever.
Ctrl-C or SIGTERM to grail-train reach the agent, which passes them to every rank and waits for
them; `launch` then raises the interrupt as a single run's, which prints the resume command.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import time
import traceback
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
from grail.core.placement import cpu_threads, gpu_placement
from grail.core.records import follow_umask, held_for_the_ranks
from grail.core.reproducible import check_torch_honours
from grail.inference.weights.policy import PolicyWeights
from grail.models.lora import base_weights
from grail.rollouts.batch import RolloutBatch
from grail.train.checkpoint import CheckpointRef, stage_checkpoint
from grail.train.fsdp import full_state_dict, shard_model
from grail.train.resume import Resume
from grail.train.trainer import Trainer, silence_library_progress_bars

log = logging.getLogger("grail.train")

OPTIMIZER_DIR = "optimizer"  # inside a checkpoint: the optimizer's shards (DCP)
LOST_EXIT = 75  # a rank that ended because its peers went away (not the cause of a failure)
LOST_GRACE_S = 3.0  # how long such a rank waits, so that the agent names the rank that failed
MONITOR_INTERVAL_S = 0.2  # how often the agent checks its ranks
# How long the agent waits for the ranks to end after a signal, before it kills them.
STOP_TIMEOUT_S = 30


class RankFailed(UserError, RuntimeError):
    """A rank of a multi-process run failed: the message names it and why."""


class PeersLost(RuntimeError):
    """A collective failed because another rank went away (or timed out waiting for it)."""


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
    world, local_rank = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    timeout = timedelta(seconds=cfg.train.collective_timeout_s)
    if torch.cuda.is_available():
        device = torch.device("cuda", gpu_placement(cfg.gpu)[1] + local_rank)
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
        torch.set_num_threads(max(1, threads // world))  # the ranks share the trainer's cores
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


# ---- the ranks' processes ---------------------------------------------------------------------

_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _log_to(rank: int, log_file: str | None) -> None:
    """Rank 0 logs as grail-train's process does (the console and the run's log file); the other
    ranks their warnings, prefixed with their rank."""
    root = logging.getLogger()
    root.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    fmt = _LOG_FORMAT if rank == 0 else f"[rank {rank}]{_LOG_FORMAT}"
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    if log_file is not None:
        handlers.append(logging.FileHandler(log_file))
    for handler in handlers:
        handler.setFormatter(logging.Formatter(fmt))
        root.addHandler(handler)
    for noisy in ("httpx", "httpx2", "openai"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def rank_main(cfg: Config, run_dir: str, resume: Resume | None, log_file: str | None) -> None:
    """One rank (what `launch` starts N of). Rank 0 reports a known error as grail-train does
    (one line) and exits with its code; an interrupt (the agent's SIGTERM included) exits quietly
    with 130 or 143, `launch` says what happened. A rank whose peers went away exits
    `LOST_EXIT` after `LOST_GRACE_S`."""
    from grail.train.cli import interrupt_exit_code, interrupt_on_sigterm, report_run_error

    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    rank = int(os.environ["RANK"])
    _log_to(rank, log_file)
    try:
        setup_rank(cfg)
        if rank == 0:
            from grail.train.loop import run

            with held_for_the_ranks(Path(run_dir)):
                run(cfg, Path(run_dir), resume)
            send(Stop())
        else:
            follow(cfg)
    except PeersLost as exc:
        log.debug("rank %d: %s", rank, exc)
        time.sleep(LOST_GRACE_S)
        sys.exit(LOST_EXIT)
    except KeyboardInterrupt as exc:
        sys.exit(interrupt_exit_code(exc))
    except Exception as exc:
        if rank != 0:
            raise  # the agent records it (error file): `launch` names the rank and the error
        code = report_run_error(exc, Path(run_dir))
        if code is None:  # not a known user error: its traceback, as a single run shows it
            traceback.print_exc()
            code = 1
        sys.exit(code)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(cfg: Config, run_dir: Path, resume: Resume | None, log_file: str | None) -> None:
    """Run `cfg` as `train.processes` ranks (see the module docstring); returns when every rank
    has ended. A rank that failed: `RankFailed` naming it and why, or the exit code rank 0
    reported its own error with (`SystemExit`); an interrupt: `KeyboardInterrupt`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from grail.train.cli import Terminated

    # Their INFO lines, and the failure tables with a rank's traceback, which `raise_failure`
    # puts in the run's log file: the console gets one line.
    # torch's modules set their loggers' levels themselves: each one, not only the parents.
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*prefixes, *logging.Logger.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.train.processes,
        run_id=f"grail-{os.getpid()}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # standalone: the agent hosts the store on a free port
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
    )
    try:
        elastic_launch(config, rank_main)(cfg, str(run_dir), resume, log_file)
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Terminated(int(exc.sigval)) from None
    except ChildFailedError as exc:
        raise_failure(exc)


def raise_failure(exc: Any) -> None:
    """What ended a run whose rank failed (`ChildFailedError.failures`: rank -> ProcessFailure)."""
    from grail.train.cli import Terminated

    failures = {f.local_rank: f for f in exc.failures.values()}
    causes = {r: f for r, f in failures.items() if f.exitcode != LOST_EXIT}
    if not causes:
        raise RankFailed(
            f"the {len(failures)} trainer rank(s) that ended lost contact with the others "
            "(a rank died or a collective timed out, train.collective_timeout_s); see the log"
        )
    rank = min((r for r in causes if r != 0), default=0)
    failure = causes[rank]
    code = failure.exitcode
    if rank == 0 and code > 0:
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):
            raise Terminated(code - 128)  # someone signalled rank 0 itself
        sys.exit(code)  # rank 0 reported its own error
    _details_to_log_file(rank, failure)
    if code < 0:
        cause = f"killed by {signal.Signals(-code).name}"
    else:
        cause = _error_message(failure) or f"exit code {code}"
    raise RankFailed(f"trainer rank {rank} (pid {failure.pid}) failed: {cause}")


def _error_message(failure: Any) -> str:
    """The exception a rank raised, as `Type: message` on one line (from the agent's record)."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line for line in str(message or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _details_to_log_file(rank: int, failure: Any) -> None:
    """The failed rank's traceback (as the agent recorded it) into the run's log file only."""
    from grail.train.cli import log_files

    text = failure.message if isinstance(failure.message, str) else str(failure.message)
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, "trainer rank %d: %s", (rank, text), None
    )
    for handler in log_files():
        handler.handle(record)
