"""Episodes in flight: the turn loop between an episode environment and the inference server.

One episode is one token sequence, built turn by turn without ever re-tokenizing what the policy
sampled:

    prompt ids                     the first messages, rendered by the chat template
    + sampled ids (turn 1)         the server's ids and behaviour log-probs, as they came
    + glue                         what the template writes after an assistant turn that the
                                   policy did not sample (Qwen: "\\n" after <|im_end|>; the whole
                                   <|im_end|>\\n when the turn was cut at max_new_tokens)
    + the environment's turn       rendered as a suffix: the conversation rendered with and
                                   without the new messages (generation prompt included), the
                                   difference appended, with a check that the one really is a
                                   prefix of the other (a template that re-renders earlier turns,
                                   as reasoning templates that drop old <think> blocks do, is
                                   refused: it cannot be continued token-exactly)
    + sampled ids (turn 2) ...

`sampled_mask` marks the sampled ids; everything else is context (attended to, never trained on,
behaviour log-prob 0.0). The Sample's `completion_ids` is everything after the prompt; its `text`
is the last answer (what extra reward functions score: data.rewards).

Seeds. Episode i of problem p in round r samples turn 0 with `request_seed(base, r, p) + i`, the
seed the single-turn path gives replicate i, and turn t with a stable hash of those; the built-in
server's batches are batch-invariant, so an episode's tokens do not depend on which others were
in flight, and the same config and seed give the same episodes.

Concurrency. Every episode of the batch runs as its own task: a turn is sent the moment its
environment has answered (no barrier per turn across the batch), and the client caps the
requests in flight. A plain `step` runs in a daemon thread under `data.env_step_timeout_s`. An
environment's `max_episodes` caps the episodes in flight (each waits for a slot before its reset).

A fleet. The balancer picks the server of an episode's first turn, and its later turns go to the
server that answered the one before (`TurnBatcher`), which holds the episode's tokens so far in
its prefix cache; one set aside passes its episodes to the balancer's choice, where they stay.
A turn's seed does not depend on its server.

The built-in server's prefix cache (generation.prefix_cache, opt-in). A later turn's prompt is
the episode so far; sent with the spans of it the policy sampled, the built-in server computes it
in the units its cache holds (grail/inference/builtin/prefix_cache.py) and continues from the
sequence that sampled the turn before instead of prefilling the whole episode again: the same
numbers on a hit or a miss, but not those of the prompt sent as one chunk (float rounding).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from grail.core.errors import UserError, first_line
from grail.core.threads import DaemonWorkers
from grail.envs.base import Problem
from grail.envs.episodes import Episode, EpisodeEnvironment, Step, check_step, tools_of
from grail.envs.tools import ToolBox, ToolTimeout, ToolTurn
from grail.inference.completions import Completion, SamplingParams
from grail.rollouts.batch import EpisodeStats, Group, Sample
from grail.rollouts.chat import ChatRenderer
from grail.rollouts.fleet_client import FleetClient
from grail.rollouts.seeds import request_seed, stable_hash

if TYPE_CHECKING:
    from grail.inference.client import Completer

log = logging.getLogger(__name__)

# Sampling seeds stay below 2**31 with head-room, as `request_seed`'s do.
_SEED_RANGE = 2**31 - 2**16


class EnvironmentFailed(UserError):
    """An environment raised, hung or returned junk: the run stops naming it and the seed."""


@dataclass(frozen=True)
class EpisodeLimits:
    """The budgets of one episode (data.max_turns, data.max_episode_tokens, generation's
    max_new_tokens per turn) and the environment's deadline per step."""

    max_turns: int
    max_tokens: int  # prompt + every turn, sampled and context
    step_timeout_s: float


@dataclass
class _Turn:
    prompt: list[int]
    seed: int
    # The prompt's sampled tokens (the episode's earlier turns); None: not sent (no prefix cache)
    spans: list[tuple[int, int]] | None
    done: asyncio.Future[tuple[Completion, int | None]]


class TurnBatcher:
    """Turns of many episodes, sent in shared requests as they become ready.

    One request per turn would cost an HTTP round trip and a server-side parse per turn: 1024
    episodes of 3 turns took ~50 s an iteration that way, against ~0.3 s for the same tokens in
    single-turn groups (which send 16 prompts x n=16 per request). So a turn joins a queue, and
    at most `in_flight` requests run at once, each taking every queued turn of the same sampling
    settings (up to the client's request size): while requests are out, the turns that get
    ready meanwhile gather for the next. No turn waits for another episode's turn; the built-in
    server is batch-invariant, so a turn's tokens do not depend on what it was sent with.

    With a fleet (`FleetClient`) a turn may name the server to send it to: the one that answered
    its episode's earlier turns holds their tokens in its prefix cache (vLLM, SGLang). Turns
    then share a request only with turns of the same settings bound for the same server, and
    `in_flight` is per server (unbound turns, an episode's first, count as one more): a fleet of
    eight would otherwise have at most four servers busy."""

    def __init__(self, client: Completer, in_flight: int = 4, most: int = 256) -> None:
        self.client, self.in_flight, self.most = client, in_flight, most
        self._fleet = client if isinstance(client, FleetClient) else None
        self._queue: dict[tuple[SamplingParams, int | None], list[_Turn]] = {}
        self._running: dict[asyncio.Task[None], int | None] = {}  # each request's server
        self._kick_scheduled = False

    def new_batch(self, episodes: int, sampling: SamplingParams) -> None:
        """A batch of `episodes` episodes starts. A fleet's balancer counts it as one batch of
        their first turns (`FleetClient.new_batch`), not one batch per request of turns."""
        if self._fleet is not None:
            self._fleet.new_batch(episodes, 1, sampling)

    async def complete(
        self,
        prompt: list[int],
        sampling: SamplingParams,
        seed: int,
        server: int | None = None,
        spans: list[tuple[int, int]] | None = None,
    ) -> tuple[Completion, int | None]:
        """A turn's completion, sent to fleet server `server` (None: where the client routes
        it), and the server that answered it (None from a client of one server). `spans`: the
        [start, end) positions of the prompt's tokens the policy sampled (the episode's turns so
        far), with which the built-in server continues them from its prefix cache."""
        done: asyncio.Future[tuple[Completion, int | None]]
        done = asyncio.get_running_loop().create_future()
        server = server if self._fleet is not None else None
        turn = _Turn(prompt, seed, None if spans is None else list(spans), done)
        self._queue.setdefault((sampling, server), []).append(turn)
        if not self._kick_scheduled:  # turns that get ready in this pass of the loop go together
            self._kick_scheduled = True
            asyncio.get_running_loop().call_soon(self._kick)
        return await done

    def _kick(self) -> None:
        self._kick_scheduled = False
        for key in list(self._queue):
            server = key[1]
            while key in self._queue and self._busy(server) < self.in_flight:
                waiting = self._queue[key]
                batch, rest = waiting[: self.most], waiting[self.most :]
                if rest:
                    self._queue[key] = rest
                else:
                    del self._queue[key]
                batch = [t for t in batch if not t.done.cancelled()]
                if batch:
                    task = asyncio.ensure_future(self._send(key, batch))
                    self._running[task] = server
                    task.add_done_callback(self._finished)

    def _busy(self, server: int | None) -> int:
        return sum(1 for s in self._running.values() if s == server)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.pop(task, None)
        self._kick()

    async def _send(self, key: tuple[SamplingParams, int | None], batch: list[_Turn]) -> None:
        sampling, server = key
        prompts, seeds = [t.prompt for t in batch], [t.seed for t in batch]
        # Only with generation.prefix_cache: a client of the Completer protocol written before
        # spans existed keeps working without it.
        spans = None
        if any(t.spans is not None for t in batch):
            spans = [t.spans or [] for t in batch]
        answered: Sequence[int | None]
        try:
            if self._fleet is None:
                results = await (
                    self.client.complete_many(prompts, 1, sampling, seeds)
                    if spans is None
                    else self.client.complete_many(prompts, 1, sampling, seeds, spans=spans)
                )
                answered = [None] * len(batch)
            else:
                results, answered = await self._fleet.complete_on(
                    prompts, 1, sampling, seeds, server, spans=spans
                )
        except BaseException as exc:
            for turn in batch:
                if not turn.done.done():
                    turn.done.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for turn, (completion,), where in zip(batch, results, answered, strict=True):
            if not turn.done.done():
                turn.done.set_result((completion, where))

    async def aclose(self) -> None:
        """Cancel the requests still out (a failed or cancelled batch of episodes); the batcher
        takes the next batch's turns afterwards."""
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for waiting in self._queue.values():
            for turn in waiting:
                turn.done.cancel()
        self._queue.clear()


def turn_seed(first: int, turn: int) -> int:
    """The sampling seed of an episode's turn `turn` (0: `first`, its replicate's seed)."""
    return first if turn == 0 else stable_hash(f"{first}:{turn}") % _SEED_RANGE


class EpisodeRunner:
    """Runs the episodes of problem seeds against the server and returns them as `Group`s."""

    def __init__(
        self,
        env: EpisodeEnvironment,
        tokenizer: Any,
        client: Completer,
        sampling: SamplingParams,
        limits: EpisodeLimits,
        *,
        base_seed: int = 0,
        prefix_cache: bool = False,
    ) -> None:
        self.env, self.client, self.sampling, self.limits = env, client, sampling, limits
        self.prefix_cache = prefix_cache  # send turns with their sampled spans
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer(tokenizer)
        self.base_seed = base_seed
        self._turns = TurnBatcher(client)
        # The environment's plain (not async) calls run here, off the event loop.
        self._workers = DaemonWorkers("grail-environment")

    async def generate_groups(
        self,
        problem_seeds: Sequence[int],
        replicas: int,
        *,
        round_index: int = 0,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Group]:
        """`replicas` episodes of each problem seed, as groups in the order of the seeds;
        `on_progress(1)` as each problem's episodes are all done."""
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        self._turns.new_batch(len(problem_seeds) * replicas, self.sampling)
        most = getattr(self.env, "max_episodes", None)
        slots = asyncio.Semaphore(most) if most else contextlib.nullcontext()

        async def one(seed: int, first_seed: int) -> tuple[Problem, list[int], Sample]:
            async with slots:
                return await self.episode(seed, first_seed)

        async def group(seed: int) -> Group:
            first = request_seed(self.base_seed, round_index, seed)
            runs = await asyncio.gather(*(one(seed, first + i) for i in range(replicas)))
            if on_progress is not None:
                on_progress(1)
            (problem, prompt), samples = runs[0][:2], [sample for _, _, sample in runs]
            return Group(problem=problem, prompt_ids=prompt, samples=samples)

        tasks = [asyncio.ensure_future(group(int(s))) for s in problem_seeds]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            await self._turns.aclose()

    async def episode(self, seed: int, first_seed: int) -> tuple[Problem, list[int], Sample]:
        """One episode of problem `seed`, its turn 0 sampled with `first_seed`; the episode
        closed at the end (its `close()`, if it has one), however it ends."""
        episode = await self._call(self.env.reset, seed, seed=seed, turn=0)
        try:
            return await self._turns_of(episode, seed, first_seed)
        finally:
            close = getattr(episode, "close", None)
            if close is not None:
                try:
                    await self._call(close, seed=seed, turn=0)
                except EnvironmentFailed as exc:
                    log.warning("closing an episode failed: %s", exc)

    async def _turns_of(
        self, episode: Episode, seed: int, first_seed: int
    ) -> tuple[Problem, list[int], Sample]:
        limits = self.limits
        toolbox = _toolbox(episode)
        schemas = toolbox.schemas if toolbox is not None else None
        problem = episode.problem
        messages: list[Mapping[str, Any]] = list(problem.prompt_messages)
        prompt = self.renderer.render(messages, schemas, generation_prompt=True)
        if len(prompt) >= limits.max_tokens:
            raise EnvironmentFailed(
                f"environment {self.env.name!r} at seed {seed}: its first messages take "
                f"{len(prompt)} tokens, which leaves no room to answer within "
                f"{limits.max_tokens} (data.max_episode_tokens)"
            )

        ids: list[int] = []
        spans: list[tuple[int, int]] = []  # the sampled turns, as positions in prompt + ids
        mask: list[int] = []
        logprobs: list[float] = []
        reward, success = 0.0, False
        components = dict.fromkeys(self.env.components, 0.0)
        turns = tool_calls = tool_errors = 0
        env_s = 0.0
        finish, done, answer = "stop", False, ""
        server: int | None = None  # a fleet's: the one holding this episode's turns so far
        while not done:
            room = limits.max_tokens - len(prompt) - len(ids)
            if turns == limits.max_turns or room < 1:
                break
            sampling = replace(self.sampling, max_tokens=min(self.sampling.max_tokens, room))
            turn, server = await self._turns.complete(
                prompt + ids,
                sampling,
                turn_seed(first_seed, turns),
                server,
                spans if self.prefix_cache else None,
            )
            turns += 1
            if turn.token_ids:
                start = len(prompt) + len(ids)
                spans.append((start, start + len(turn.token_ids)))
            ids += turn.token_ids
            mask += [1] * len(turn.token_ids)
            logprobs += turn.logprobs
            finish, answer = turn.finish_reason, turn.text
            messages.append({"role": "assistant", "content": turn.text})

            started = time.perf_counter()
            new: Sequence[Mapping[str, Any]]
            answered = await self._tools(toolbox, turn.text, seed, turns)
            if answered is not None:
                new = answered.messages
                tool_calls += answered.calls
                tool_errors += answered.errors
            else:
                step = await self._step(episode, turn.text, seed, turns)
                reward += step.reward
                for key, value in step.components.items():
                    components[key] = components.get(key, 0.0) + float(value)
                done, success, new = step.done, step.success, step.messages
            env_s += time.perf_counter() - started
            if done:
                break
            context = self.renderer.glue(turn.token_ids) + self.renderer.suffix(
                messages, new, schemas
            )
            if len(prompt) + len(ids) + len(context) >= limits.max_tokens:
                break  # no room left to answer the environment's turn
            ids += context
            mask += [0] * len(context)
            logprobs += [0.0] * len(context)
            messages += new

        stats = EpisodeStats(
            turns=turns,
            truncated=not done or finish == "length",
            tool_calls=tool_calls,
            tool_errors=tool_errors,
            env_s=env_s,
        )
        sample = Sample(
            completion_ids=ids,
            behaviour_logprobs=logprobs,
            finish_reason=finish,
            text=answer,  # the last answer: what extra reward functions score
            reward=reward,
            components=components,
            success=success and done,
            sampled_mask=mask,
            episode=stats,
        )
        return problem, prompt, sample

    async def _step(self, episode: Episode, text: str, seed: int, turn: int) -> Step:
        result = await self._call(episode.step, text, seed=seed, turn=turn)
        try:
            return check_step(result, f"environment {self.env.name!r} at seed {seed}")
        except ValueError as exc:
            raise EnvironmentFailed(f"{exc} (turn {turn})") from exc

    async def _tools(
        self, toolbox: ToolBox | None, text: str, seed: int, turn: int
    ) -> ToolTurn | None:
        if toolbox is None:
            return None
        try:
            return await toolbox.answer(text, self.limits.step_timeout_s)
        except ToolTimeout as exc:
            raise EnvironmentFailed(
                f"environment {self.env.name!r} at seed {seed} (turn {turn}): {exc}"
            ) from exc

    async def _call(self, fn: Callable[..., Any], *args: Any, seed: int, turn: int) -> Any:
        """`fn(*args)` (awaited if it is a coroutine), under the step deadline; a failure is an
        EnvironmentFailed naming the environment, the seed and the turn."""
        what = f"environment {self.env.name!r} at seed {seed} (turn {turn})"
        timeout = self.limits.step_timeout_s
        try:
            # asyncio.timeout, not wait_for: wait_for wraps the call in a task of its own, and
            # its tasks were the client's largest cost after rendering (5,120 calls a batch).
            if inspect.iscoroutinefunction(fn):
                async with asyncio.timeout(timeout):
                    result = await fn(*args)
            else:
                async with asyncio.timeout(timeout):
                    result = await self._workers.run(fn, *args)
                if isinstance(result, Awaitable):  # a plain method that returned a coroutine
                    async with asyncio.timeout(timeout):
                        result = await result
        except TimeoutError:
            raise EnvironmentFailed(
                f"{what} did not answer within data.env_step_timeout_s={timeout:g} s"
            ) from None
        except UserError:
            raise
        except Exception as exc:
            raise EnvironmentFailed(f"{what} raised {first_line(exc)}") from exc
        return result


def _toolbox(episode: Episode) -> ToolBox | None:
    tools = tools_of(episode)
    return ToolBox(tools) if tools else None
