"""RolloutGenerator over real HTTP against the built-in server serving the tiny model."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from grail.core.config import Config, DataConfig
from grail.envs import make_env
from grail.envs.base import Problem
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.models.loading import load_tokenizer
from grail.models.tiny import ensure_tiny_model
from grail.rollouts.batch import Group, Resampling, Sample, informative
from grail.rollouts.generation import (
    RolloutGenerator,
    fill_informative,
    render_prompt_ids,
)
from grail.rollouts.seeds import request_seed
from grail.rollouts.server import resample_seeds
from grail.train.trainer import assign_advantages


@pytest.fixture(scope="module")
def server(tiny_server: BuiltinServer) -> BuiltinServer:
    """The session's built-in server on the tiny model (conftest.py)."""
    return tiny_server


def _generator(server: BuiltinServer, base_seed: int = 0) -> RolloutGenerator:
    tokenizer = load_tokenizer(str(server.model_path))
    client = CompletionClient(server.base_url, server.model_name, timeout=60)
    return RolloutGenerator(
        make_env("copy_digits"),
        tokenizer,
        client,
        SamplingParams(max_tokens=4, temperature=1.0),
        base_seed=base_seed,
    )


def test_groups_are_complete(server: BuiltinServer) -> None:
    generator = _generator(server)
    batch = asyncio.run(generator.generate([3, 1, 2], replicas=4, round_index=0))
    assert [g.problem.seed for g in batch.groups] == [3, 1, 2]  # input order kept
    tokenizer = generator.tokenizer
    for group in batch.groups:
        assert group.prompt_ids == render_prompt_ids(tokenizer, group.problem)
        assert len(group.samples) == 4
        for s in group.samples:
            assert 1 <= len(s.completion_ids) <= 4
            assert len(s.behaviour_logprobs) == len(s.completion_ids)
            assert all(lp <= 0 for lp in s.behaviour_logprobs)
            assert s.finish_reason in ("stop", "length")
            assert set(s.components) == {"correct", "found", "brevity"}
            assert s.advantage == 0.0  # rewards only: the trainer computes advantages
    stats = assign_advantages(batch.groups, "group")
    for group in batch.groups:
        # group-relative advantages: zero mean within each group
        assert sum(s.advantage for s in group.samples) == pytest.approx(0.0, abs=1e-5)
    assert 0.0 <= stats["zero_variance_group_frac"] <= 1.0


def test_same_seeds_give_the_same_groups(server: BuiltinServer) -> None:
    def snapshot(round_index: int, base_seed: int = 0) -> list[tuple]:
        generator = _generator(server, base_seed)
        batch = asyncio.run(generator.generate([5, 6], 3, round_index=round_index))
        return [
            (tuple(s.completion_ids), tuple(s.behaviour_logprobs), s.reward) for s in batch.samples
        ]

    first = snapshot(0)
    assert snapshot(0) == first
    assert snapshot(1) != first  # another iteration draws other samples of the same problems
    assert snapshot(0, base_seed=1) != first


def test_request_seeds_are_stable_and_leave_room_for_replicates() -> None:
    assert request_seed(0, 0, 5) == request_seed(0, 0, 5)
    assert len({request_seed(0, r, p) for r in range(20) for p in range(50)}) == 1000
    assert all(0 <= request_seed(b, 7, 9) < 2**31 - 2**16 for b in range(100))


def test_unreachable_server_is_a_clear_error(tmp_path: Path) -> None:
    from grail.inference.completions import GenerationError
    from grail.inference.os_process import free_port

    tokenizer = load_tokenizer(str(ensure_tiny_model()))
    client = CompletionClient(
        f"http://127.0.0.1:{free_port()}/v1",
        "policy",
        timeout=5,
        max_retries=1,
    )
    generator = RolloutGenerator(
        make_env("copy_digits"), tokenizer, client, SamplingParams(max_tokens=2)
    )
    with pytest.raises(GenerationError, match="127.0.0.1"):
        asyncio.run(generator.generate([0], 2))


def _group(seed: int, rewards: list[float]) -> Group:
    samples = [Sample([1], [0.0], "stop", "", r, {}, False) for r in rewards]
    return Group(Problem(seed, [], ""), [1], samples)


def test_dynamic_sampling_fills_the_batch_with_informative_groups() -> None:
    asked: list[tuple[int, int]] = []
    pool = iter(range(100, 200))

    async def more(round_number: int, count: int) -> list[Group]:
        asked.append((round_number, count))
        # every other new problem has signal
        return [_group(next(pool), [0.0, float(i % 2)]) for i in range(count)]

    first = [_group(i, [1.0, 1.0] if i % 4 else [0.0, 1.0]) for i in range(8)]  # 2 of 8 useful
    groups, r = asyncio.run(fill_informative(first, 8, more, max_extra_rounds=3))
    # 6 missing at a 1/4 hit rate: ask for 24, capped at the batch size 8 (4 useful); then
    # 2 missing at 6/16: ask for 6 (3 useful)
    assert asked == [(1, 8), (2, 6)]
    assert [g.problem.seed for g in groups[:2]] == [0, 4]  # the first round's, in order
    assert len(groups) == 8 and all(informative(g) for g in groups)
    assert r == Resampling(extra_rounds=2, generated_groups=22, dropped_groups=14, kept_groups=8)


def test_dynamic_sampling_stops_after_its_rounds() -> None:
    async def nothing_useful(round_number: int, count: int) -> list[Group]:
        return [_group(1000 + round_number, [0.5, 0.5]) for _ in range(count)]

    tied = [_group(i, [0.0, 0.0]) for i in range(4)]
    groups, r = asyncio.run(fill_informative(tied, 4, nothing_useful, max_extra_rounds=2))
    assert groups == tied  # nothing informative anywhere: the first round's (no update)
    assert (r.extra_rounds, r.generated_groups, r.kept_groups) == (2, 12, 4)

    some = [_group(0, [0.0, 1.0])] + tied[1:]
    groups, r = asyncio.run(fill_informative(some, 4, nothing_useful, max_extra_rounds=1))
    assert [g.problem.seed for g in groups] == [0] and r.kept_groups == 1  # fewer, all useful
    groups, r = asyncio.run(fill_informative(some, 4, nothing_useful, max_extra_rounds=0))
    assert len(groups) == 1 and r.extra_rounds == 0


def test_resampled_seeds_are_new_stable_and_from_the_training_pool() -> None:
    cfg = Config(
        data=DataConfig(environment="copy_digits", train_seed_start=50, num_train_seeds=40)
    )
    used = set(range(50, 60))
    data, seed = cfg.data, cfg.seed
    seeds = resample_seeds(data, seed, 3, 1, 12, used)
    assert len(seeds) == len(set(seeds)) == 12
    assert all(50 <= s < 90 and s not in range(50, 60) for s in seeds)
    assert used == set(range(50, 60)) | set(seeds)
    assert resample_seeds(data, seed, 3, 1, 12, set(range(50, 60))) == seeds  # stable
    assert resample_seeds(data, seed, 3, 2, 12, set(range(50, 60))) != seeds  # another round
    tiny = DataConfig(environment="copy_digits", num_train_seeds=3)
    assert len(resample_seeds(tiny, seed, 0, 1, 5, {0, 1, 2})) == 5  # a pool too small repeats
