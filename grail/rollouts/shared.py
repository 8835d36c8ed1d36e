"""Iteration 0's rollouts, generated once per study and shared by its runs.

Every run of a study (`study_dir`: a sweep's directory, or one the user names) that starts from the
same weights, with the same task, seed and generation settings, generates exactly the same
iteration-0 batch: the server holds the initial weights and every request carries a seed derived
from (`seed`, round, problem seed) (grail/rollouts/seeds.py `request_seed`). Runs that differ
only in `train.*` (learning rate, KL coefficient, loss, pipelining) therefore share it: the first
run that needs it generates and stores it under `<study_dir>/rollouts/<key>.json`, later ones load
it.

The key is a sha256 over everything that determines that batch and nothing else (`identity`):
- the files the server starts from (`weights/`: weights, model config, tokenizer, chat template),
  hashed byte for byte, so any change in the initial weights (model, LoRA, dtype, init) counts;
- `seed`, every `data.*` key but `reuse_initial_rollouts` (environment, env_kwargs, rewards,
  problem and group counts, the seed pool, dynamic sampling);
- the generation settings that reach the server's sampling (every `generation.*` key but those
  that only say how long to wait, how often to retry and how later weights are synced), and the
  server as started: backend, device kind, dtype, CPU threads (CPU kernels split reductions
  differently by thread count), extra arguments;
- torch and transformers versions, the CPU architecture, and `FORMAT`.
Advantages depend on `train.scale_rewards`, so they are not stored: the loading run's trainer
computes them, as for any batch.

The file is plain JSON in the form of grail/rollouts/codec.py (never a pickle): per group the
problem seed, the prompt token ids and every sample as the server returned and the environment
scored it, floats exact to the bit. Problems are rebuilt with `env.problem(seed)` and their
rendered prompt ids must match the stored ones. A file that cannot be read or does not match
is ignored with a warning and generated again. Writes are atomic (temporary file, then rename); a
lock file beside it makes parallel runs of a study wait for the one generating instead of
generating the same batch at once (the OS drops the lock of a process that dies).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grail.core.records import atomic_write_text
from grail.envs.base import Problem
from grail.envs.episodes import is_episodic, opening, problem_maker
from grail.rollouts import codec
from grail.rollouts.batch import GeneratedBatch, Group, Resampling, Reused, RolloutBatch
from grail.rollouts.chat import ChatRenderer
from grail.rollouts.generation import render_prompt_ids

if TYPE_CHECKING:
    from grail.core.config import DataConfig
    from grail.envs.episodes import AnyEnvironment
    from grail.inference.process import ServerManager
    from grail.rollouts.settings import RolloutSettings

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what a file holds, or what the key covers, changes
ROLLOUTS_DIR = "rollouts"  # under the study directory
_HASH_CHUNK = 1 << 20

# Keys outside the batch: how long to wait for the server, how often to restart it, and how new
# weights reach it (iteration 0 is generated before any sync). `server_threads` stands in the key
# as the thread count the server was actually started with.
_IGNORED_GENERATION_KEYS = frozenset(
    {"request_timeout_s", "start_timeout_s", "max_restarts", "weight_sync", "server_threads"}
)
_IGNORED_DATA_KEYS = frozenset({"reuse_initial_rollouts"})


class Unusable(Exception):
    """A stored batch that cannot be used; the message says why."""


def weights_digest(directory: Path) -> str:
    """sha256 over every file under `directory` (relative name, size, bytes), in name order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(directory).as_posix()}\0{path.stat().st_size}\0".encode())
        with path.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def identity(settings: RolloutSettings, weights: str, server: ServerManager) -> dict[str, Any]:
    """What iteration 0's batch depends on (see the module docstring); `weights`: the
    `weights_digest` of the directory the server starts from."""
    import torch
    import transformers

    generation = {
        k: v for k, v in asdict(settings.generation).items() if k not in _IGNORED_GENERATION_KEYS
    }
    return {
        "format": FORMAT,
        "seed": settings.seed,
        "weights": weights,
        "data": {k: v for k, v in asdict(settings.data).items() if k not in _IGNORED_DATA_KEYS},
        "generation": generation,
        "server": {
            "backend": server.kind,
            "device": server.device.split(":")[0],  # which GPU a sweep job got does not count
            "dtype": server.dtype,
            "threads": server.threads,
            "extra_args": list(server.extra_args),
        },
        "software": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": platform.machine(),
        },
    }


def rollout_key(ident: dict[str, Any]) -> str:
    canonical = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _prompt_ids(env: AnyEnvironment, tokenizer: Any, problem: Problem) -> list[int]:
    """The ids generation sent first for `problem`: an episode's are rendered with the schemas
    of the tools it offers (grail/rollouts/episodes.py), which the chat template writes too."""
    if not is_episodic(env):
        return render_prompt_ids(tokenizer, problem)
    from grail.envs.tools import ToolBox

    tools = opening(env, problem.seed)[1]  # type: ignore[arg-type]
    schemas = ToolBox(tools).schemas if tools else None
    return ChatRenderer(tokenizer).render(problem.prompt_messages, schemas, generation_prompt=True)


class SharedRollouts:
    """Iteration 0's batch in a study's store: loaded when a run of the study stored it under
    this run's key, else generated (by `get`'s callback) and stored."""

    def __init__(self, data: DataConfig, study_dir: Path, ident: dict[str, Any]) -> None:
        self.data = data
        self.identity = ident
        self.key = rollout_key(ident)
        self.path = study_dir / ROLLOUTS_DIR / f"{self.key}.json"

    @classmethod
    def for_run(
        cls, settings: RolloutSettings, weights_dir: Path, server: ServerManager
    ) -> SharedRollouts | None:
        """The store of this run's study, or None when `study_dir` is unset or
        `data.reuse_initial_rollouts` is off. Call before the server starts: `weights_dir` must
        hold what it starts from."""
        if settings.study_dir is None or not settings.data.reuse_initial_rollouts:
            return None
        t0 = time.perf_counter()
        ident = identity(settings, weights_digest(weights_dir), server)
        shared = cls(settings.data, Path(settings.study_dir), ident)
        log.debug("iteration-0 rollout key %s (%.2f s)", shared.key, time.perf_counter() - t0)
        return shared

    def get(
        self,
        generate: Callable[[], GeneratedBatch],
        env: AnyEnvironment,
        tokenizer: Any,
        expected_seeds: list[int],
    ) -> GeneratedBatch:
        """The stored batch if there is a usable one, else `generate()`, stored for the next run.
        `expected_seeds`: iteration 0's problem seeds (without dynamic sampling, the batch's)."""
        t0 = time.perf_counter()
        with self._lock():
            batch = self.load(env, tokenizer, expected_seeds, t0)
            if batch is not None:
                return batch
            batch = generate()
            self.save(batch)
            return batch

    def load(
        self, env: AnyEnvironment, tokenizer: Any, expected_seeds: list[int], t0: float
    ) -> GeneratedBatch | None:
        """The stored batch (None when there is none, or a warning says why it is unusable); its
        `generation_s` is the time since `t0`."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("ignoring stored rollouts %s (%s); generating them again", self.path, exc)
            return None
        try:
            stored = json.loads(text)
            groups, resampling, generation_s = self._decode(stored, env, tokenizer, expected_seeds)
        # Whatever a damaged file makes fail (the JSON, a field, env.problem of a bad seed): a
        # store is a cache, and the run can always generate the batch instead.
        except Exception as exc:
            log.warning("ignoring stored rollouts %s (%s); generating them again", self.path, exc)
            return None
        finished = time.perf_counter()
        log.info("iteration 0: rollouts reused from %s", self.path)
        return GeneratedBatch(
            RolloutBatch(groups),
            policy_version=0,
            generation_s=finished - t0,
            started=t0,
            finished=finished,
            resampling=resampling,
            reused=Reused(self.key, generation_s),
        )

    def save(self, generated: GeneratedBatch) -> None:
        """Store `generated` for the study's other runs; a failure only warns (the run goes on)."""
        data = {
            "format": FORMAT,
            "key": self.key,
            "identity": self.identity,  # what the key covers, for a reader wondering why a miss
            "generation_s": generated.generation_s,
            "resampling": None if generated.resampling is None else asdict(generated.resampling),
            **codec.batch_to_json(generated.batch),
        }
        try:
            # allow_nan: a -inf log-probability must read back as -inf, not fail the write.
            atomic_write_text(self.path, json.dumps(data, separators=(",", ":"), default=str))
        except (OSError, TypeError, ValueError) as exc:
            log.warning("could not store iteration 0's rollouts in %s: %s", self.path, exc)

    def _decode(
        self, stored: Any, env: AnyEnvironment, tokenizer: Any, expected_seeds: list[int]
    ) -> tuple[list[Group], Resampling | None, float]:
        data = self.data
        if not isinstance(stored, dict):
            raise Unusable("not a JSON object")
        if stored.get("format") != FORMAT or stored.get("key") != self.key:
            raise Unusable(f"format {stored.get('format')!r} or key differs from this run's")
        resampling = None
        if data.dynamic_sampling:
            resampling = codec.resampling_from_json(stored.get("resampling"))
        groups_data = stored.get("groups")
        if not isinstance(groups_data, list) or not groups_data:
            raise Unusable("no 'groups'")
        if resampling is not None and resampling.kept_groups != len(groups_data):
            raise Unusable(
                f"{len(groups_data)} groups, but 'resampling' kept {resampling.kept_groups}"
            )
        seeds = [g.get("seed") if isinstance(g, dict) else None for g in groups_data]
        if not data.dynamic_sampling and seeds != expected_seeds:
            raise Unusable(f"problem seeds {seeds[:4]}... are not iteration 0's")
        groups = [self._group(g, env, tokenizer, i) for i, g in enumerate(groups_data)]
        generation_s = stored.get("generation_s")
        if not codec.is_number(generation_s) or generation_s < 0:
            raise Unusable(f"bad 'generation_s' {generation_s!r}")
        return groups, resampling, float(generation_s)

    def _group(self, stored: dict[str, Any], env: AnyEnvironment, tokenizer: Any, i: int) -> Group:
        group = codec.group_from_json(stored, problem_maker(env), f"groups[{i}]")
        if group.prompt_ids != _prompt_ids(env, tokenizer, group.problem):
            raise Unusable(f"groups[{i}].prompt_ids differ from problem {group.problem.seed}'s")
        if len(group.samples) != self.data.rollouts_per_problem:
            raise Unusable(f"groups[{i}].samples is not {self.data.rollouts_per_problem} samples")
        return group

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        """Hold `<key>.lock` (flock) for the block: a run of the study that finds another one
        generating this batch waits for it and loads it. Where the file system refuses locks, or
        the store cannot be created, runs go on without (at worst each generates it)."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            log.warning("rollout store %s unavailable (%s)", self.path.parent, exc)
            yield
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                log.info("iteration 0: waiting for another run of the study to store its rollouts")
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as exc:
                log.debug("no lock on %s (%s): going on without", self.path, exc)
            yield
        finally:
            os.close(fd)  # releases the lock
