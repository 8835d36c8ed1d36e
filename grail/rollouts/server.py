"""The default `RolloutSource`: rollouts generated through an inference server.

`ServerRollouts` owns the server process (built-in, vLLM or SGLang), the completion client, the
training and evaluation generators, recovery from a server that dies, and prefetching. Every
request of the run goes through one event loop that lives in its own thread (`EventLoopThread`)
for the whole run, in synchronous and pipelined mode alike, so the client is bound to one loop.

Pipelined mode (`train.pipeline=true`) overlaps generation and training, one step off-policy:

    iteration i:   [ generate batch i+1 with weights v_i (server) ]
                   [ train on batch i  v_i -> v_{i+1}  (trainer)  ] wait, sync v_{i+1}, eval

Version v_k is the policy after k updates; the trainer holds v_i while it trains iteration i.
Batch i+1 is generated with v_i and trained at v_{i+1}, so its staleness is exactly 1 (batch 0,
generated before any training, has staleness 0). Staleness never exceeds 1 because
`sync_weights` waits for the running generation before the new weights are written: the server's
weights never change under a batch. The objective's importance-sampling correction
(`train.is_correction`, against the behaviour log-probabilities the server returned) corrects the
lag.
Rollouts are deterministic for a fixed seed whatever the timing: each prompt carries its own
sampling seed and the built-in server's batches are batch-invariant on CPU.

A server that dies mid-batch is restarted from the newest weights and the batch (fixed seeds, so
safe to repeat) runs again, at most `generation.max_restarts` times. Restarts always happen on the
caller's (main) thread: a background batch that failed that way is re-run when it is collected.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, TypeVar

from grail.core.records import iteration_name
from grail.envs.episodes import problem_maker
from grail.inference.client import Completer, CompletionClient
from grail.inference.process import ServerManager
from grail.inference.recovery import call_with_recovery
from grail.inference.weights.policy import Weights
from grail.inference.weights.syncer import WeightSyncer
from grail.rollouts import codec
from grail.rollouts.batch import GeneratedBatch, Group, RolloutBatch, WeightSync
from grail.rollouts.episodes import EpisodeLimits
from grail.rollouts.fleet import Fleet
from grail.rollouts.fleet_client import FleetClient
from grail.rollouts.generation import RolloutGenerator, fill_informative, sampling_params
from grail.rollouts.seeds import stable_hash
from grail.rollouts.sizing import request_size, window_for

if TYPE_CHECKING:
    from grail.core.config import DataConfig, EvalConfig, GenerationConfig
    from grail.envs.episodes import AnyEnvironment
    from grail.envs.rewards.plugins import RewardFunctions
    from grail.rollouts.settings import RolloutSettings
    from grail.rollouts.shared import SharedRollouts

log = logging.getLogger(__name__)

T = TypeVar("T")
# An episode's token cap when nothing names the context (data.max_episode_tokens,
# generation.max_model_len, the tokenizer's model_max_length).
DEFAULT_EPISODE_TOKENS = 4096
EVAL_ROUND = -1  # eval samples use the same seeds every time, so evals differ only by weights
_CANCEL_WAIT_S = 30.0  # how long close() waits for a cancelled generation to unwind

# Progress reporting: given a description and a total, returns `advance(k)`.
ProgressFactory = Callable[[str, int], Callable[[int], None]]


class GenerationCancelled(Exception):
    """A generation was cancelled because the run is stopping."""


class EventLoopThread:
    """One asyncio event loop running in a daemon thread until `close()`. Any thread can run a
    coroutine on it (`run`, blocking) or start one (`submit`, a concurrent Future)."""

    def __init__(self, name: str = "grail-generation") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the loop and wait for it; an interrupt (Ctrl-C) while waiting
        cancels it on the loop before it propagates."""
        return wait(self.submit(coroutine))

    def close(self, timeout_s: float = _CANCEL_WAIT_S) -> None:
        """Stop the loop (after cancelling what still runs on it) and join the thread."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        if self._thread.is_alive():
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                self.submit(cancel_all()).result(timeout_s)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()


def wait(future: concurrent.futures.Future[T]) -> T:
    """`future.result()`, cancelling the future when the wait is interrupted."""
    try:
        return future.result()
    except concurrent.futures.CancelledError:
        raise GenerationCancelled("generation cancelled") from None
    except BaseException:
        future.cancel()
        raise


@dataclass
class _Prefetch:
    """The next iteration's batch, generating in the background."""

    iteration: int
    policy_version: int
    future: concurrent.futures.Future[GeneratedBatch]


def iteration_seeds(data: DataConfig, iteration: int) -> list[int]:
    """The training problem seeds of an iteration, wrapping around the training pool."""
    per_iter, pool = data.problems_per_iteration, data.num_train_seeds
    start = iteration * per_iter
    return [data.train_seed_start + (start + i) % pool for i in range(per_iter)]


def resample_seeds(
    data: DataConfig, seed: int, iteration: int, round_number: int, count: int, used: set[int]
) -> list[int]:
    """`count` more training problem seeds for dynamic sampling's extra round `round_number` of
    `iteration`: drawn from the training pool by a hash of (seed, iteration, round, k), so a run
    and its resumption draw the same ones, skipping seeds in `used` (this iteration's so far,
    to which they are added) unless the pool is too small to avoid them."""
    start, pool = data.train_seed_start, data.num_train_seeds
    drawn: list[int] = []
    for k in range(count * 16 + 64):
        if len(drawn) == count:
            break
        problem = start + stable_hash(f"resample:{seed}:{iteration}:{round_number}:{k}") % pool
        if problem not in used or len(used) >= pool:
            used.add(problem)
            drawn.append(problem)
    return drawn


def completion_client(generation: GenerationConfig, server: ServerManager) -> CompletionClient:
    """A client of the run's inference server, with the run's timeouts and concurrency."""
    return CompletionClient(
        server.base_url,
        server.model_name,
        api_key=server.api_key,
        timeout=generation.request_timeout_s,
        max_concurrency=generation.max_concurrency,
        liveness_check=server.check_alive,
        backend=server.kind,  # type: ignore[arg-type]
    )


def fleet_client(settings: RolloutSettings, fleet: Fleet) -> FleetClient:
    """The client of a fleet: one `completion_client` per server; each server may hold about two
    of its batches of the run's training requests, at most its share of them (`window_for`)."""
    clients = [completion_client(settings.generation, server) for server in fleet.servers]
    n, problems = settings.data.rollouts_per_problem, settings.data.problems_per_iteration
    per_request = request_size(clients[0].prompts_per_request(n), problems, len(clients))
    requests = -(-problems // per_request)
    window = window_for(clients[0].max_batch_sequences, n, per_request, requests, len(clients))
    return fleet.connect(FleetClient(clients, window=window, on_set_aside=fleet.set_aside))


def fleet_delta(
    before: list[dict[str, Any]] | None, after: list[dict[str, Any]] | None
) -> list[dict[str, Any]] | None:
    """What each server of a fleet did between two `FleetClient.server_records()`."""
    if before is None or after is None:
        return None
    return [
        {key: (a[key] if key == "usable" else a[key] - b[key]) for key in a}
        for b, a in zip(before, after, strict=True)
    ]


def episode_limits(settings: RolloutSettings, tokenizer: Any) -> EpisodeLimits:
    """An episode's budgets (data.max_turns, data.max_episode_tokens; null: the server's context,
    generation.max_model_len, else the tokenizer's model_max_length) and its step deadline."""
    data = settings.data
    max_tokens = data.max_episode_tokens or settings.generation.max_model_len
    if max_tokens is None:
        # transformers sets a huge placeholder (~1e30) when a tokenizer names no length.
        max_tokens = int(getattr(tokenizer, "model_max_length", 0) or 0)
        if not 0 < max_tokens < 10**9:
            max_tokens = DEFAULT_EPISODE_TOKENS
    return EpisodeLimits(data.max_turns, max_tokens, data.env_step_timeout_s)


def eval_seeds(evaluation: EvalConfig) -> list[int]:
    return list(range(evaluation.id_seed_start, evaluation.id_seed_start + evaluation.num_ids))


def _no_progress(_description: str, _total: int) -> Callable[[int], None]:
    return lambda _k: None


class ServerRollouts:
    """A `RolloutSource` that generates through the inference server it owns.

    A context manager: entering starts the server and waits until it answers; leaving (also on
    Ctrl-C or an error) cancels a running generation, closes the client and stops the server.
    `syncer` gives the server the trainer's weights (whoever builds the server builds it:
    `grail.train.components.server_and_syncer_from_config`).
    """

    def __init__(
        self,
        settings: RolloutSettings,
        server: ServerManager,
        env: AnyEnvironment,
        eval_env: AnyEnvironment,
        tokenizer: Any,
        *,
        syncer: WeightSyncer,
        extra_rewards: RewardFunctions | None = None,
        progress: ProgressFactory = _no_progress,
        state: dict[str, Any] | None = None,
        shared: SharedRollouts | None = None,
        fleet: Fleet | None = None,
    ) -> None:
        """`state`: what a checkpoint kept of this source (`state()`), to resume from. `fleet`:
        several servers (`generation.servers`), `server` and `syncer` being its first."""
        self.settings = settings
        self.server = server
        self._fleet = fleet
        # How each sync hands over the weights: the run's route, disk as the fallback.
        self._syncer = syncer
        # Iteration 0's batch, shared by the runs of a study (grail/rollouts/shared.py).
        self._shared = shared
        self._env, self._eval_env = env, eval_env
        self._tokenizer = tokenizer
        self._extra_rewards = extra_rewards
        self._progress = progress
        self._sampling = sampling_params(settings.generation)
        # A batch generated before a checkpoint (pipelined), or one generating now.
        self._ready: GeneratedBatch | None = self._pending_from(state or {})
        self._prefetch: _Prefetch | None = None
        self._events: EventLoopThread | None = None
        self._client: Completer | None = None
        self._generator: RolloutGenerator | None = None
        self._eval_generator: RolloutGenerator | None = None

    # -- lifetime ---------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        try:
            self._events = EventLoopThread()
            if self._fleet is None:
                self.server.launch()
                self._client = completion_client(self.settings.generation, self.server)
            else:
                self._fleet.launch()
                self._client = fleet_client(self.settings, self._fleet)
            self._generator, self._eval_generator = (
                RolloutGenerator(
                    env,
                    self._tokenizer,
                    self._client,
                    self._sampling,
                    base_seed=self.settings.seed,
                    extra_rewards=self._extra_rewards,
                    episodes=episode_limits(self.settings, self._tokenizer),
                    prefix_cache=self.settings.generation.prefix_cache,
                )
                for env in (self._env, self._eval_env)
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        # A background generation stops before the server shuts down under it (Ctrl-C, error).
        if self._prefetch is not None:
            self._prefetch.future.cancel()
            self._prefetch = None
        if self._events is not None:
            if self._client is not None:
                with contextlib.suppress(Exception):
                    self._events.submit(self._client.aclose()).result(_CANCEL_WAIT_S)
            self._events.close()
            self._events = None
        self._client = None
        if self._fleet is None:
            self._syncer.close()
            self.server.stop()
        else:
            self._fleet.stop()

    # -- the RolloutSource interface ------------------------------------------------------------

    def next_batch(self, iteration: int, policy_version: int) -> GeneratedBatch:
        """Iteration `iteration`'s batch: generated now (sync mode, or the first batch of a
        pipelined run), or the one prefetched during the previous iteration. In pipelined mode
        the next iteration's batch starts generating before this returns."""
        if self._ready is not None:
            batch, self._ready = self._ready, None
        elif self._prefetch is not None:
            batch = self._collect()
        else:
            batch = self._generate_now(iteration, policy_version)
        if self.settings.pipeline and iteration + 1 < self.settings.iterations:
            self._start_prefetch(iteration + 1, policy_version)
        return batch

    def sync_weights(self, save: Weights, policy_version: int) -> WeightSync:
        """`save` is the trainer's `PolicyWeights` (the run's weight transfer route, disk as the
        fallback), or any callable that writes the weights into a directory (disk)."""
        t0 = time.perf_counter()
        prefetched = None
        if self._prefetch is not None:  # the server's weights must not change under a batch
            self._ready = self._collect()
            prefetched = (self._ready.started, self._ready.finished)
        t_sync = time.perf_counter()
        version = iteration_name(policy_version - 1)
        syncer = self._syncer if self._fleet is None else self._fleet
        result = syncer.sync(save, weight_version=version)
        return WeightSync(result, time.perf_counter() - t_sync, t_sync - t0, prefetched)

    def evaluate(self, on_progress: Callable[[int], None] | None = None) -> RolloutBatch:
        assert self._eval_generator is not None, "use ServerRollouts as a context manager"
        generator = self._eval_generator
        return self._with_recovery(
            lambda: generator.generate(
                eval_seeds(self.settings.eval),
                self.settings.eval.replicates,
                round_index=EVAL_ROUND,
                on_progress=on_progress,
            )
        )

    def state(self) -> dict[str, Any]:
        """The batch prefetched for the next iteration (pipelined; `sync_weights` collected it),
        which a resumed run trains on instead of generating it again; {} when there is none."""
        return {} if self._ready is None else {"pending": codec.to_json(self._ready)}

    def checkpointed(self, iteration: int) -> None:
        pass  # a checkpoint keeps the pending batch itself (`state`)

    def _pending_from(self, state: dict[str, Any]) -> GeneratedBatch | None:
        # Only a pipelined run trains on it: resumed without pipelining, a run generates each
        # batch with the weights it trains (the pending one was one update behind).
        pending = state.get("pending")
        if pending is None or not self.settings.pipeline:
            return None
        return codec.from_json(pending, problem_maker(self._env), "pending")

    # -- generation -------------------------------------------------------------------------------

    async def _training_batch(self, iteration: int, policy_version: int) -> GeneratedBatch:
        generator = self._generator
        assert generator is not None, "use ServerRollouts as a context manager"
        data = self.settings.data
        seeds = iteration_seeds(data, iteration)
        started = time.perf_counter()
        fleet_before = self._fleet_records()

        async def generate(problem_seeds: list[int], what: str) -> list[Group]:
            advance = self._progress(f"iter {iteration:03d} {what}", len(problem_seeds))
            return await generator.generate_groups(
                problem_seeds, data.rollouts_per_problem, round_index=iteration,
                on_progress=advance,
            )  # fmt: skip

        groups = await generate(seeds, "generate")
        resampling = None
        if data.dynamic_sampling:
            used = set(seeds)

            async def more(round_number: int, count: int) -> list[Group]:
                extra = resample_seeds(
                    data, self.settings.seed, iteration, round_number, count, used
                )
                return await generate(extra, f"resample {round_number}")

            groups, resampling = await fill_informative(
                groups, data.problems_per_iteration, more, data.max_resample_rounds
            )
        finished = time.perf_counter()
        return GeneratedBatch(
            RolloutBatch(groups),
            policy_version,
            finished - started,
            started,
            finished,
            resampling=resampling,
            fleet=fleet_delta(fleet_before, self._fleet_records()),
        )

    def _fleet_records(self) -> list[dict[str, Any]] | None:
        client = self._client
        return client.server_records() if isinstance(client, FleetClient) else None

    def another_client(self) -> Completer:
        """A client of this source's server(s) for another event loop (the service's): over a
        fleet it routes as the run's own client does, and a server either sets aside is set
        aside for both (`Fleet.connect`)."""
        if self._fleet is None:
            return completion_client(self.settings.generation, self.server)
        return fleet_client(self.settings, self._fleet)

    def _with_recovery(
        self,
        make: Callable[[], Coroutine[Any, Any, T]],
        first: concurrent.futures.Future[T] | None = None,
    ) -> T:
        """Run `make()` on the event loop (after collecting `first`, an attempt already
        running), restarting a server that died and running it again."""
        assert self._events is not None, "use ServerRollouts as a context manager"
        events = self._events
        attempts = [first] if first is not None else []

        def attempt() -> T:
            return wait(attempts.pop()) if attempts else events.run(make())

        if self._fleet is not None:
            return self._fleet.call_with_recovery(attempt, self.settings.generation.max_restarts)
        # The syncer's recovery writes the weights a fast route served before the restart.
        return call_with_recovery(
            self.server,
            attempt,
            max_restarts=self.settings.generation.max_restarts,
            recover=self._syncer.recover,
        )

    def _generate_now(self, iteration: int, policy_version: int) -> GeneratedBatch:
        def generate() -> GeneratedBatch:
            return self._with_recovery(lambda: self._training_batch(iteration, policy_version))

        # Only a fresh run's first batch: the one generated by the initial weights (policy 0).
        # Pipelined runs too: their batch 0 is generated here, before any prefetch, just the same.
        if self._shared is not None and iteration == 0 and policy_version == 0:
            seeds = iteration_seeds(self.settings.data, 0)
            return self._shared.get(generate, self._env, self._tokenizer, seeds)
        return generate()

    def _start_prefetch(self, iteration: int, policy_version: int) -> None:
        assert self._events is not None, "use ServerRollouts as a context manager"
        future = self._events.submit(self._training_batch(iteration, policy_version))
        self._prefetch = _Prefetch(iteration, policy_version, future)

    def _collect(self) -> GeneratedBatch:
        prefetch, self._prefetch = self._prefetch, None
        assert prefetch is not None
        return self._with_recovery(
            lambda: self._training_batch(prefetch.iteration, prefetch.policy_version),
            first=prefetch.future,
        )
