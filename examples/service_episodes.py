"""An agent loop for the trainer as a service: multi-turn episodes of one of grail's episode
environments (copy_turns by default: digits to copy one per turn), every turn sampled through the
service's /v1/turns, each episode pushed whole to /v1/groups with the mask of the tokens the
policy sampled (Atropos' shape), where the service checks every sampled span against the turns it
sampled (service.check_spans).

    uv run grail-train mode=service                       # terminal 1: the trainer, waiting
    uv run python examples/service_episodes.py --endpoint outputs/DATE/TIME/service/endpoint.json

The loop here is grail's own (`grail.rollouts.episodes.EpisodeRunner`: token-exact turns, the
chat template's suffix for the environment's messages as context, budgets, tool calls) over a
client whose every request is a POST /v1/turns, so the sampling settings and seeds are the
run's. Yours may be any loop that keeps the token ids it was given and appends the environment's
messages as tokens: per turn, POST /v1/turns {"prompt": the episode's token ids so far}; per
group, POST /v1/groups with each episode's token ids after the prompt, its sampled_mask (1 for
the turns' tokens, 0 for the environment's), the turns' logprobs (anything finite at the 0s), its
reward, and the oldest policy_version its turns came with. --tokenizer: the run's model (default:
grail's tiny model, the default job's).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from transformers import AutoTokenizer

from grail.envs import make_env
from grail.inference.completions import Completion, SamplingParams
from grail.models.tiny import resolve_model
from grail.rollouts.batch import Group
from grail.rollouts.episodes import EpisodeLimits, EpisodeRunner
from grail.service.endpoint import add_endpoint_arguments, endpoint_from_arguments


class Finished(Exception):
    """The run has taken all its batches (503), or the service is gone."""


class TurnsClient:
    """What EpisodeRunner asks of an inference client (`grail.inference.client.Completer`),
    answered by the service's /v1/turns: one request per prompt. The runner's sampling settings
    and seeds are not sent; the service samples with the run's. Keeps the policy versions that
    sampled each turn."""

    def __init__(self, service: httpx.AsyncClient) -> None:
        self.service = service
        self.versions: list[int] = []

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        try:
            answer = await self.service.post("/v1/turns", json={"prompt": list(prompt_ids), "n": n})
        except httpx.TransportError:
            raise Finished from None
        if answer.status_code == 503:
            raise Finished
        body = answer.raise_for_status().json()
        self.versions.append(int(body["policy_version"]))
        return [
            Completion(c["token_ids"], c["logprobs"], c["finish_reason"], c["text"])
            for c in body["choices"]
        ]

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Callable[[int], None] | None = None,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,  # for a prefix cache: unused
    ) -> list[list[Completion]]:
        return list(
            await asyncio.gather(
                *(self.complete(p, n, sampling, s) for p, s in zip(prompts, seeds, strict=True))
            )
        )

    async def aclose(self) -> None:
        pass


def to_pushed(group: Group, version: int) -> dict[str, Any]:
    """A group of episodes as /v1/groups takes it."""
    return {
        "prompt_ids": group.prompt_ids,
        "policy_version": version,
        "completions": [
            {
                "token_ids": s.completion_ids,
                "logprobs": s.behaviour_logprobs,  # 0.0 at the environment's tokens
                "sampled_mask": s.sampled_mask,
                "reward": s.reward,
                "success": s.success,
                "finish_reason": "length" if s.finish_reason == "length" else "stop",
                "text": s.text,
            }
            for s in group.samples
        ],
    }


async def run(args: argparse.Namespace, url: str, api_key: str) -> tuple[int, int, int]:
    """Push groups of episodes until the run is over or --groups are accepted: (groups
    accepted, episodes in them, groups too stale)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    # A turns request waits while the trainer syncs weights: allow for a sync by restart.
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300) as service:
        info = (await service.get("/v1/info")).raise_for_status().json()
        group_size = int(info["rollouts_per_problem"])
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
        client = TurnsClient(service)
        runner = EpisodeRunner(
            make_env(args.env),  # type: ignore[arg-type]
            tokenizer,
            client,
            SamplingParams(max_tokens=int(info["sampling"]["max_tokens"])),
            EpisodeLimits(args.max_turns, args.max_tokens, step_timeout_s=60.0),
        )
        accepted = episodes = stale = 0
        seed = args.seed_start
        while args.groups is None or accepted < args.groups:
            status = (await service.get("/v1/status")).raise_for_status().json()
            if status["finished"]:
                break
            if status["queued_groups"] >= int(info["problems_per_iteration"]):
                await asyncio.sleep(0.1)  # the next batch is there: more would wait
                continue
            client.versions.clear()
            try:
                (group,) = await runner.generate_groups([seed], group_size)
            except Finished:
                break
            seed += 1
            # The oldest version that sampled any of the group's turns.
            pushed = await service.post(
                "/v1/groups", json={"groups": [to_pushed(group, min(client.versions))]}
            )
            if pushed.status_code == 503:
                break
            if pushed.status_code == 409:  # too old by now (service.max_staleness)
                stale += 1
                continue
            if pushed.status_code != 200:
                raise RuntimeError(f"POST /v1/groups: {pushed.status_code} {pushed.text[:500]}")
            accepted += 1
            episodes += group_size
        return accepted, episodes, stale


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_endpoint_arguments(parser)
    parser.add_argument("--env", default="copy_turns", help="an episode environment of grail's")
    parser.add_argument("--tokenizer", default="tiny", help="the run's model (path or hub id)")
    parser.add_argument("--max-turns", type=int, default=8)
    parser.add_argument(
        "--max-tokens", type=int, default=1024, help="an episode's, prompt included"
    )
    parser.add_argument("--groups", type=int, help="stop after this many (default: the run's end)")
    parser.add_argument("--seed-start", type=int, default=0, help="first problem seed")
    args = parser.parse_args(argv)
    url, api_key = endpoint_from_arguments(parser, args)
    t0 = time.perf_counter()
    accepted, episodes, stale = asyncio.run(run(args, url, api_key))
    seconds = time.perf_counter() - t0
    print(
        f"{accepted} groups accepted ({episodes} episodes, {stale} groups too stale) in "
        f"{seconds:.1f} s"
    )


if __name__ == "__main__":
    main()
