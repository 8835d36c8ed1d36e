"""Rollouts: problem seeds in, scored groups out (rewards only: the trainer computes the
advantages, grail/train/trainer.py).

One request per problem asks the server for `replicas` samples (`n`). The prompt travels as token
ids rendered with the tokenizer's chat template, and the completion ids and behaviour
log-probabilities the server returns are kept exactly as they came: they are what the trainer
scores, so nothing is ever re-tokenized.

Seeds: the request for problem seed p in round r gets the sampling seed `request_seed(base, r, p)`;
the server gives sample i the seed `request_seed + i` (vLLM's rule, which our built-in server
follows), so every replicate has its own deterministic seed and a fixed config reproduces the same
groups.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from grail.core.threads import in_daemon_thread
from grail.envs.base import Environment, Problem, Score
from grail.envs.episodes import EpisodeEnvironment, is_episodic
from grail.envs.rewards.plugins import RewardFunctions, score_completions, with_extra_rewards
from grail.inference.completions import SamplingParams
from grail.rollouts.batch import Group, Resampling, RolloutBatch, Sample, informative
from grail.rollouts.episodes import EpisodeLimits, EpisodeRunner
from grail.rollouts.seeds import request_seed
from grail.rollouts.verifiers import VerifiersRunner

if TYPE_CHECKING:
    from grail.core.config import GenerationConfig
    from grail.inference.client import Completer


async def fill_informative(
    first: list[Group],
    wanted: int,
    generate_more: Callable[[int, int], Awaitable[list[Group]]],
    max_extra_rounds: int,
) -> tuple[list[Group], Resampling]:
    """DAPO's dynamic sampling: keep the groups of `first` whose rewards differ and generate more
    problems, `generate_more(round, count)` for rounds 1, 2, ... at most `max_extra_rounds`,
    until `wanted` informative groups are in hand; the first `wanted` of them, in the order they
    came. Each round asks for the shortfall divided by the informative fraction seen so far
    (at most `wanted` problems), so a task where half the groups are informative closes the gap
    in about one round. When the rounds run out, the batch holds the informative groups found
    (fewer than `wanted`); when there is none at all, the first round's groups (an update on
    them changes nothing and is skipped as such)."""
    kept = [g for g in first if informative(g)]
    generated, rounds = len(first), 0
    while len(kept) < wanted and rounds < max_extra_rounds:
        rounds += 1
        rate = max(len(kept) / generated, 1.0 / wanted)
        count = min(wanted, math.ceil((wanted - len(kept)) / rate))
        more = await generate_more(rounds, count)
        generated += len(more)
        kept += [g for g in more if informative(g)]
    groups = kept[:wanted] if kept else first
    return groups, Resampling(rounds, generated, generated - len(groups), len(groups))


def sampling_params(gen: GenerationConfig) -> SamplingParams:
    """The rollout sampling of a run: `generation.max_new_tokens` (as max_tokens),
    `temperature`, `top_p` and `top_k`."""
    return SamplingParams(
        max_tokens=gen.max_new_tokens, temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k
    )


def render_prompt_ids(tokenizer: Any, problem: Problem) -> list[int]:
    """Chat-template the problem's messages into the token ids sent to the server."""
    ids = tokenizer.apply_chat_template(
        problem.prompt_messages, add_generation_prompt=True, tokenize=True
    )
    # transformers 5 returns a BatchEncoding-like mapping for tokenize=True; 4.x a plain list.
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


class RolloutGenerator:
    """Turns problem seeds into scored `Group`s through an OpenAI-compatible server."""

    def __init__(
        self,
        env: Environment | EpisodeEnvironment,
        tokenizer: Any,
        client: Completer,
        sampling: SamplingParams,
        *,
        base_seed: int = 0,
        extra_rewards: RewardFunctions | None = None,
        episodes: EpisodeLimits | None = None,
        prefix_cache: bool = False,
    ) -> None:
        """`env` is a single-turn environment, or an episode one (grail/envs/episodes.py) whose
        episodes run within the budgets of `episodes` (grail/rollouts/episodes.py), their turns
        sent with their sampled spans when `prefix_cache` (generation.prefix_cache)."""
        self.env = env
        self.tokenizer = tokenizer
        self.client = client
        self.sampling = sampling
        self.base_seed = base_seed
        self.extra_rewards = extra_rewards
        self.episodes: EpisodeRunner | VerifiersRunner | None = None
        samples_itself = getattr(env, "samples_itself", False)  # verifiers: its own agent loop
        if samples_itself or is_episodic(env):
            if episodes is None:
                raise ValueError(f"environment {env.name!r} runs episodes: give their limits")
            self.episodes = (
                VerifiersRunner(env, tokenizer, client, sampling, episodes, base_seed=base_seed)  # type: ignore[arg-type]
                if samples_itself
                else EpisodeRunner(
                    env,  # type: ignore[arg-type]
                    tokenizer,
                    client,
                    sampling,
                    episodes,
                    base_seed=base_seed,
                    prefix_cache=prefix_cache,
                )
            )

    async def generate(
        self,
        problem_seeds: Sequence[int],
        replicas: int,
        *,
        round_index: int = 0,
        on_progress: Callable[[int], None] | None = None,
    ) -> RolloutBatch:
        """Generate and score `replicas` samples of each problem seed; `on_progress(k)` is told as
        k more problems are done. Groups keep the order of `problem_seeds`."""
        groups = await self.generate_groups(
            problem_seeds, replicas, round_index=round_index, on_progress=on_progress
        )
        return RolloutBatch(groups)

    def _score_episodes(self, groups: list[Group]) -> None:
        """Add the extra rewards to every episode's, each called once on the batch with the
        episodes' last answers as the completions (as TRL's reward functions get them)."""
        samples = [s for g in groups for s in g.samples]
        scores = with_extra_rewards(
            self.env.name,
            [g.problem for g in groups for _ in g.samples],
            [s.text for s in samples],
            [Score(s.reward, s.components, s.success) for s in samples],
            self.extra_rewards,
        )
        for sample, score in zip(samples, scores, strict=True):
            sample.reward, sample.components = score.reward, dict(score.components)

    async def generate_groups(
        self,
        problem_seeds: Sequence[int],
        replicas: int,
        *,
        round_index: int = 0,
        on_progress: Callable[[int], None] | None = None,
    ) -> list[Group]:
        """`generate`'s scored groups, not yet a batch (dynamic sampling adds more rounds)."""
        if self.episodes is not None:
            groups = await self.episodes.generate_groups(
                problem_seeds, replicas, round_index=round_index, on_progress=on_progress
            )
            if self.extra_rewards is not None and len(self.extra_rewards) > 0:
                await in_daemon_thread(self._score_episodes, groups, name="grail-scoring")
            return groups
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        env: Environment = self.env  # type: ignore[assignment]  # single-turn from here on
        problems = [env.problem(int(seed)) for seed in problem_seeds]
        prompt_ids = [render_prompt_ids(self.tokenizer, p) for p in problems]

        seeds = [request_seed(self.base_seed, round_index, p.seed) for p in problems]
        results = await self.client.complete_many(
            prompt_ids, replicas, self.sampling, seeds, on_done=on_progress
        )

        # One scoring call for the whole batch, every group's samples in order: extra rewards see
        # the batch as TRL gives it to a reward function (once per batch), and a remote scorer
        # gets one request (or its chunks) instead of one per problem. It runs in a worker thread
        # so that a slow scorer does not block the event loop other generations run on: a daemon
        # thread, not asyncio.to_thread's pool, whose threads the interpreter waits for at exit,
        # so that a plugin stuck there cannot keep a stopped run alive (grail/core/threads.py).
        flat_problems = [p for p, cs in zip(problems, results, strict=True) for _ in cs]
        flat_texts = [c.text for cs in results for c in cs]
        all_scores = (
            await in_daemon_thread(
                score_completions,
                env,
                flat_problems,
                flat_texts,
                self.extra_rewards,
                name="grail-scoring",
            )
            if flat_texts
            else []
        )

        groups = []
        start = 0
        for problem, ids, completions in zip(problems, prompt_ids, results, strict=True):
            scores = all_scores[start : start + len(completions)]
            start += len(completions)
            samples = [
                Sample(
                    completion_ids=c.token_ids,
                    behaviour_logprobs=c.logprobs,
                    finish_reason=c.finish_reason,
                    text=c.text,
                    reward=s.reward,
                    components=dict(s.components),
                    success=s.success,
                )
                for c, s in zip(completions, scores, strict=True)
            ]
            groups.append(Group(problem=problem, prompt_ids=ids, samples=samples))
        return groups
