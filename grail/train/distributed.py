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
metrics, checkpoints, weight sync, display) with a `ShardedTrainer` (grail/train/sharded.py),
which tells the other ranks what to do through a few typed commands; the other ranks `follow`.

Faults. The agent watches the ranks: when one fails (raises, or is killed) it stops the others
(SIGTERM, which rank 0 turns into an interrupt that stops the inference server) and raises
`ChildFailedError`, which `launch` turns into a `RankFailed` naming the rank and its cause. A rank
that only saw its peers go away (a collective that failed because the other side died) waits
`LOST_GRACE_S` before it exits with `LOST_EXIT`, so that the agent sees the rank that failed
first and names it rather than its bystander. Every collective has the process group's timeout
(`train.collective_timeout_s`), so a rank that hangs fails the run instead of stopping it forever.
Ctrl-C or SIGTERM to grail-train reach the agent, which stops every rank with SIGTERM and waits
for them; `launch` then raises the interrupt as a single run's, which prints the resume command.
A rank prints nothing of an interrupt, whenever it comes (`_ranks_born_deaf`): it is born with
SIGINT blocked, so a Ctrl-C while it imports stays pending until `rank_main` takes it inside the
`try` that turns it into a quiet exit, and SIGTERM ends it silently until then; it takes one
interrupt only (a terminal's Ctrl-C reaches it, then the agent's SIGTERM).

Several nodes (`train.nodes`, grail/core/nodes.py): each node's grail-train is the agent of its
`train.processes` ranks, and the agents meet through torch's static rendezvous at node 0's
`train.rdzv_endpoint` (torchrun's `--nnodes --node-rank --master-addr --master-port`): node 0's
first rank is global rank 0, so node 0 claims the run directory, drives the loop, starts the server
and writes every record; the other nodes' ranks follow, and write only their shards of the
optimizer's state into the checkpoint being staged (so the run directory must be on a filesystem
every node sees). A node whose ranks lost node 0 (its run ended in an error, or it died) ends with
one line saying so, exit code 1; node 0 says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from grail.core.config import Config
from grail.core.errors import UserError
from grail.core.nodes import NodePlan, NodesDiffer, config_differences, shared_settings
from grail.core.placement import forks_its_servers, trainer_processes
from grail.core.records import held_for_the_ranks
from grail.train.resume import Resume

# grail.train.sharded (the ranks' trainer: LoRA, transformers, torch's distributed checkpoint) is
# imported inside the rank's functions: the agent, grail-train's own process, imports this module
# only to `launch`, and skipped ~3 s of imports on every start (`python -X importtime`).

log = logging.getLogger("grail.train")

LOST_EXIT = 75  # a rank that ended because its peers went away (not the cause of a failure)
TIMEOUT_EXIT = 74  # a rank that waited train.collective_timeout_s in a collective: a peer hung
LOST_GRACE_S = 3.0  # how long such a rank waits, so that the agent names the rank that failed
MONITOR_INTERVAL_S = 0.2  # how often the agent checks its ranks


class RankFailed(UserError, RuntimeError):
    """A rank of a multi-process run failed: the message names it and why."""


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


def _nodes_agree(cfg: Config) -> None:
    """The ranks of a run over several nodes compare their configs (grail/core/nodes.py) before
    anything else: each node's first rank raises `NodesDiffer` naming the keys that differ (rank
    0 reports it, the other nodes' agents in `raise_failure`), the others end as bystanders. The
    ranks of one node share the config their agent gave them."""
    from grail.train.sharded import PeersLost, collective

    world, local = int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_WORLD_SIZE"])
    if world == local:
        return
    gathered: list[Any] = [None] * world
    with collective("comparing the nodes' configs"):
        dist.all_gather_object(gathered, (int(os.environ["GROUP_RANK"]), shared_settings(cfg)))
    differences = config_differences(gathered)
    if differences is None:
        return
    if int(os.environ["LOCAL_RANK"]) == 0:
        raise NodesDiffer(differences)
    raise PeersLost("the nodes' configs differ: this node's first rank says how")


class _RankSignals:
    """A rank's SIGINT and SIGTERM handler. The first one is the interrupt that ends the rank
    quietly; later ones are ignored: a terminal's Ctrl-C reaches every rank and the agent then
    sends SIGTERM, which must not interrupt the first one's clean-up (rank 0 stopping the server;
    the agent kills a rank that has not ended 30 s on, torch's shutdown timeout). Once the rank
    is `ending`, a signal ends it at once: an interrupt in the interpreter's exit would be a
    traceback. (The handler stays installed throughout: Python reports a signal that arrives as
    its handler is swapped for SIG_IGN or SIG_DFL, "ignored due to race condition".)"""

    def __init__(self) -> None:
        self.interrupted = False
        self.ending = False

    def __call__(self, signum: int, _frame: object) -> None:
        from grail.train.reporting import Terminated

        if self.ending:
            os._exit(128 + signum)
        if self.interrupted:
            return
        self.interrupted = True
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)


def rank_main(cfg: Config, run_dir: str, resume: Resume | None, log_file: str | None) -> None:
    """One rank (what `launch` starts N of). Rank 0 reports a known error as grail-train does
    (one line) and exits with its code; an interrupt (the agent's SIGTERM included) exits quietly
    with 130 or 143, `launch` says what happened. A rank whose peers went away exits
    `LOST_EXIT` after `LOST_GRACE_S`.

    Signals before the `try`: SIGINT is blocked from the rank's birth (`_ranks_born_deaf`), so a
    Ctrl-C while the rank imports waits, pending, for the `try`; SIGTERM ends it at once and
    silently (its default action)."""
    from grail.train.reporting import interrupt_exit_code, report_run_error
    from grail.train.sharded import PeersLost, Stop, follow, send, setup_rank

    rank = int(os.environ["RANK"])
    _log_to(rank, log_file)
    # Rank 0 starts the servers: its zygote comes before torch.distributed starts threads.
    if rank == 0 and forks_its_servers(cfg.generation.backend, cfg.generation.urls):
        import grail.train.loop  # noqa: F401  (what the zygote's servers run, imported once)
        from grail.inference import zygote

        zygote.prepare()
    signals = _RankSignals()
    try:
        signal.signal(signal.SIGTERM, signals)
        signal.signal(signal.SIGINT, signals)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one comes here
        setup_rank(cfg)
        _nodes_agree(cfg)
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
        sys.exit(TIMEOUT_EXIT if exc.timed_out else LOST_EXIT)
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
        signals.ending = True
        if dist.is_initialized():
            dist.destroy_process_group()


# The signals torch's agent turns into its SignalException, passing the same signal on to the
# ranks (LaunchConfig.signals_to_handle, torch >= 2.9): not SIGINT (`_ranks_born_deaf`).
AGENT_SIGNALS = "SIGTERM,SIGHUP,SIGQUIT"


@contextlib.contextmanager
def _ranks_born_deaf() -> Iterator[None]:
    """While the agent runs: the ranks are born with SIGINT blocked, and the agent stops them
    with SIGTERM after a Ctrl-C. So a Ctrl-C is never a traceback in a rank, even one that is
    still importing (seconds: torch, transformers), and a rank that is importing ends at once.

    - A child is born with its parent thread's signal mask: SIGINT is blocked in this thread,
      which spawns the ranks (multiprocessing spawns its resource tracker so too), and
      `rank_main` unblocks it inside the `try` that turns it into a quiet exit.
    - This process still hears Ctrl-C: the kernel delivers it to a thread that does not block
      it, `helper`, and Python raises KeyboardInterrupt in the main thread.
    - torch's agent does not handle SIGINT (`AGENT_SIGNALS`): the KeyboardInterrupt leaves its
      run, which stops the ranks with SIGTERM. Its own handler would pass SIGINT on instead (as
      torch < 2.9 does), which a rank still importing keeps pending until its imports are done:
      as quiet, but up to torch's 30 s shutdown timeout slower."""
    from multiprocessing import resource_tracker

    # multiprocessing starts its resource tracker with the first spawn and then *unblocks* SIGINT
    # in the spawning thread (CPython's resource_tracker.ensure_running): started before the
    # block, it is not started again.
    resource_tracker.ensure_running()
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="grail-hears-sigint", daemon=True)
    helper.start()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        stop.set()


def launch(
    cfg: Config,
    run_dir: Path,
    resume: Resume | None,
    log_file: str | None,
    plan: NodePlan | None = None,
) -> None:
    """Run `cfg` as `train.processes` ranks on this node, `plan` placing it among the run's
    nodes (see the module docstring); returns when every rank has ended. A rank that failed:
    `RankFailed` naming it and why, or the exit code rank 0 reported its own error with
    (`SystemExit`); an interrupt: `KeyboardInterrupt`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from grail.train.reporting import Terminated

    # Their INFO lines, and the failure tables with a rank's traceback, which `raise_failure`
    # puts in the run's log file: the console gets one line.
    # torch's modules set their loggers' levels themselves: each one, not only the parents.
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*prefixes, *logging.Logger.manager.loggerDict]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    plan = plan or NodePlan.single()
    if plan.nodes == 1:
        rendezvous: dict[str, Any] = {
            "run_id": f"grail-{os.getpid()}",
            "rdzv_backend": "c10d",
            "rdzv_endpoint": "127.0.0.1:0",  # standalone: the agent hosts the store on a free port
        }
    else:
        # The node ranks the user (or SLURM) gave, node 0 hosting the store: torchrun's static
        # rendezvous. Joining waits for the other nodes at most the collective timeout.
        rendezvous = {
            "run_id": "grail",
            "rdzv_backend": "static",
            "rdzv_endpoint": plan.endpoint,
            "rdzv_configs": {
                "rank": plan.node_rank,
                "timeout": int(cfg.train.collective_timeout_s),
            },
        }
    fields = {field.name for field in dataclasses.fields(LaunchConfig)}
    signals: dict[str, Any] = (
        {"signals_to_handle": AGENT_SIGNALS} if "signals_to_handle" in fields else {}
    )
    config = LaunchConfig(
        min_nodes=plan.nodes,
        max_nodes=plan.nodes,
        nproc_per_node=trainer_processes(cfg.gpu, cfg.train.processes),
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
        **rendezvous,
        **signals,
    )
    try:
        with _ranks_born_deaf():
            elastic_launch(config, rank_main)(cfg, str(run_dir), resume, log_file)
    except SignalException as exc:
        if exc.sigval == signal.SIGINT:
            raise KeyboardInterrupt from None
        raise Terminated(int(exc.sigval)) from None
    except ChildFailedError as exc:
        raise_failure(exc, plan, cfg.train.collective_timeout_s)
    except (RendezvousError, dist.DistNetworkError, dist.DistStoreError) as exc:
        # Before any rank started: the nodes never met (node 0 not up, or a wrong endpoint).
        where = f"at {plan.endpoint} " if plan.endpoint else ""
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RankFailed(
            f"node {plan.node_rank} of {plan.nodes}: the trainer's nodes did not meet {where}"
            f"within train.collective_timeout_s={cfg.train.collective_timeout_s:g} s ({first}); "
            "start the same command on every node, train.node_rank=0 on the host of "
            "train.rdzv_endpoint"
        ) from exc


def raise_failure(
    exc: Any, plan: NodePlan | None = None, collective_timeout_s: float = 0.0
) -> None:
    """What ended a run whose rank failed (`ChildFailedError.failures`: global rank ->
    ProcessFailure, this node's ranks)."""
    from grail.train.reporting import Terminated

    plan = plan or NodePlan.single()
    failures: dict[int, Any] = dict(exc.failures)
    waited = sorted(r for r, f in failures.items() if f.exitcode == TIMEOUT_EXIT)
    if waited:  # the first sign of a hung rank: whoever waited for it, however the others ended
        _details_to_log_file(waited[0], failures[waited[0]])
        raise RankFailed(
            f"trainer rank {waited[0]} waited train.collective_timeout_s="
            f"{collective_timeout_s:g} s in a collective for a rank that never joined it: a rank "
            "hung (a deadlock, a stuck device or filesystem); raise train.collective_timeout_s "
            "if its work takes longer"
        )
    causes = {r: f for r, f in failures.items() if f.exitcode != LOST_EXIT}
    if not causes and not plan.drives:
        raise RankFailed(
            f"the trainer ranks on node {plan.node_rank} lost contact with the run: it ended on "
            "node 0 (an error there, Ctrl-C, or node 0 went away), which says why, or a "
            "collective timed out (train.collective_timeout_s); see node 0's output"
        )
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
    raised = _error_message(failure)
    if raised:  # the rank's exception: a signal after it (SIGABRT as gloo tore down) is not why
        cause = raised
    elif code < 0:
        cause = f"killed by {signal.Signals(-code).name}"
    else:
        cause = f"exit code {code}"
    differ = f"{NodesDiffer.__name__}: "
    if cause.startswith(differ):  # this node's first rank, as rank 0 reports it on node 0
        raise NodesDiffer(cause.removeprefix(differ))
    raise RankFailed(f"trainer rank {rank} (pid {failure.pid}) failed: {cause}")


def _error_message(failure: Any) -> str:
    """The exception a rank raised, as `Type: message` on one line, from torch's error file; ""
    where the rank wrote none (killed by a signal first: torch's `message` is then one it made
    up, from the signal or a pointer to its docs)."""
    data = getattr(failure, "error_file_data", None)
    # torch's placeholder for no error file is {"message": "<NONE>"} (errors._EMPTY_ERROR_DATA)
    if not isinstance(data, dict) or data.get("message") in (None, "", "<NONE>"):
        return ""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = [line for line in str(message or "").splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _details_to_log_file(rank: int, failure: Any) -> None:
    """The failed rank's traceback (as the agent recorded it) into the run's log file only."""
    from grail.train.reporting import log_files

    text = failure.message if isinstance(failure.message, str) else str(failure.message)
    record = log.makeRecord(
        log.name, logging.ERROR, __file__, 0, "trainer rank %d: %s", (rank, text), None
    )
    for handler in log_files():
        handler.handle(record)
