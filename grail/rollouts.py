"""Rollout generation: problem seeds in, scored groups with advantages out.

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

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from grail.algo.grpo import ScaleRewards, compute_advantages
from grail.envs.base import Environment, Problem
from grail.envs.rewards import RewardFunctions, score_completions

if TYPE_CHECKING:
    from grail.inference.client import Completion, CompletionClient, SamplingParams


@dataclass
class Sample:
    """One completion of a group, as the server produced it and the environment scored it."""

    completion_ids: list[int]
    behaviour_logprobs: list[float]
    finish_reason: str
    text: str
    reward: float
    components: dict[str, float]
    success: bool
    advantage: float = 0.0

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


@dataclass
class Group:
    """All replicates of one problem: the unit GRPO normalises rewards over."""

    problem: Problem
    prompt_ids: list[int]
    samples: list[Sample]

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


@dataclass
class RolloutBatch:
    groups: list[Group]
    advantage_stats: dict[str, float] = field(default_factory=dict)

    @property
    def samples(self) -> list[Sample]:
        return [s for g in self.groups for s in g.samples]


def request_seed(base_seed: int, round_index: int, problem_seed: int) -> int:
    """A stable 31-bit sampling seed for one request (same on every machine and Python run)."""
    digest = hashlib.blake2b(
        f"{base_seed}:{round_index}:{problem_seed}".encode(), digest_size=8
    ).digest()
    # Leave head-room below 2**31 so that seed + replicate index stays a valid 32-bit seed.
    return int.from_bytes(digest, "little") % (2**31 - 2**16)


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
        env: Environment,
        tokenizer: Any,
        client: CompletionClient,
        sampling: SamplingParams,
        *,
        base_seed: int = 0,
        scale_rewards: ScaleRewards = "group",
        advantage_clip_percentile: float | None = None,
        extra_rewards: RewardFunctions | None = None,
    ) -> None:
        self.env = env
        self.tokenizer = tokenizer
        self.client = client
        self.sampling = sampling
        self.base_seed = base_seed
        self.scale_rewards: ScaleRewards = scale_rewards
        self.advantage_clip_percentile = advantage_clip_percentile
        self.extra_rewards = extra_rewards

    def generate(
        self,
        problem_seeds: Sequence[int],
        replicas: int,
        *,
        round_index: int = 0,
        on_group_done: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """Generate, score and compute advantages for `replicas` samples of each problem seed."""
        return asyncio.run(
            self.agenerate(
                problem_seeds, replicas, round_index=round_index, on_group_done=on_group_done
            )
        )

    async def agenerate(
        self,
        problem_seeds: Sequence[int],
        replicas: int,
        *,
        round_index: int = 0,
        on_group_done: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        problems = [self.env.problem(int(seed)) for seed in problem_seeds]
        prompt_ids = [render_prompt_ids(self.tokenizer, p) for p in problems]

        async def one(problem: Problem, ids: list[int]) -> list[Completion]:
            seed = request_seed(self.base_seed, round_index, problem.seed)
            completions = await self.client.complete(ids, replicas, self.sampling, seed)
            if on_group_done is not None:
                on_group_done()
            return completions

        # gather keeps the input order: groups line up with problem_seeds whatever finishes first.
        # One session: the requests share keep-alive connections, closed before we return.
        async with self.client.session():
            results = await asyncio.gather(
                *(one(p, ids) for p, ids in zip(problems, prompt_ids, strict=True))
            )

        groups = []
        for problem, ids, completions in zip(problems, prompt_ids, results, strict=True):
            scores = score_completions(
                self.env,
                [problem] * len(completions),
                [c.text for c in completions],
                self.extra_rewards,
            )
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

        stats: dict[str, float] = {}
        if replicas > 1:  # a single sample has no group baseline (evaluation at pass@1)
            rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
            advantages, stats = compute_advantages(
                rewards, self.scale_rewards, clip_percentile=self.advantage_clip_percentile
            )
            for group, row in zip(groups, advantages.tolist(), strict=True):
                for sample, advantage in zip(group.samples, row, strict=True):
                    sample.advantage = float(advantage)
        return RolloutBatch(groups=groups, advantage_stats=stats)
