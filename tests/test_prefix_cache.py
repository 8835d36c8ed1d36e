"""The built-in engine's prefix cache: a request that continues finished sequences gets, bit for
bit, the tokens and log-probabilities it gets when nothing is cached (grail/inference/builtin/
prefix_cache.py), so an episode's turns do not depend on what the server still holds."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from grail.inference.builtin.engine import Engine, SequenceOutput
from grail.inference.builtin.prefix_cache import PrefixCache, check_spans, units
from grail.inference.builtin.sampling import SamplingParams


def test_units_tile_the_prompt_as_the_engine_computed_it() -> None:
    # prompt [0, 5), a turn sampled [5, 9), context [9, 12), a turn [12, 14), context to 17
    assert units(17, [(5, 9), (12, 14)]) == [
        (0, 5),
        (5, 6),
        (6, 7),
        (7, 8),  # the decode steps fed the turn's tokens but its last
        (8, 12),  # which leads the next chunk
        (12, 13),
        (13, 17),
    ]
    assert units(4, []) == [(0, 4)]
    assert units(6, [(3, 4)]) == [(0, 3), (3, 6)]


@pytest.mark.parametrize(
    ("spans", "why"),
    [
        ([[0, 2]], "start < end"),
        ([[2, 2]], "start < end"),
        ([[2, 9]], "<= 8"),
        ([[2, 5], [4, 6]], "not overlapping"),
        ([[2, 5, 6]], "two integers"),
        ([[2.0, 5]], "two integers"),
    ],
)
def test_bad_spans_are_refused_naming_the_span(spans: list[list[int]], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_spans(spans, 8)


def test_the_cache_evicts_the_oldest_beyond_its_capacity_and_a_hit_takes_its_entry() -> None:
    cache = PrefixCache(capacity_tokens=10)
    cache.store((1, 2, 3, 4), ((2, 5),), [])
    cache.store((5, 6, 7, 8), ((2, 5),), [])
    assert cache.lookup((1, 2, 3, 4, 9, 9), ((2, 5),))[0] == 4
    # The continuation leaves a longer entry when it finishes: this one served its purpose.
    assert cache.lookup((1, 2, 3, 4, 9, 9), ((2, 5),)) == (0, None)
    assert len(cache) == 1
    cache.store((1, 2, 3, 4), ((2, 5),), [])
    cache.store((9, 9, 9, 9), ((2, 5),), [])  # 12 tokens: (5, 6, 7, 8), the oldest, goes
    assert cache.lookup((5, 6, 7, 8, 1), ((2, 5),)) == (0, None)
    # A prefix computed in other units is no hit: its keys and values would differ.
    assert cache.lookup((1, 2, 3, 4, 1), ((3, 5),)) == (0, None)
    assert cache.lookup((1, 2, 3, 4, 1), ((2, 5),))[0] == 4
    cache.clear()
    assert len(cache) == 0


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine(tiny_model_dir, max_batch_size=64)
    assert engine.prefix_cache is not None, "on by default with batch invariance (CPU)"
    engine.start()
    yield engine
    engine.stop()


def _outs(
    engine: Engine,
    prompts: list[list[int]],
    spans: list[list[tuple[int, int]]],
    seed: int,
    max_tokens: int = 5,
) -> list[SequenceOutput]:
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)
    seeds = [seed + 10 * p for p in range(len(prompts))]
    futures = engine.submit_many(prompts, params, seeds=seeds, spans=spans)
    return [f.result(timeout=120) for f in futures]


def _turns(
    engine: Engine, clear_between: bool, stop_on_eos: bool = False
) -> list[list[SequenceOutput]]:
    """Three turns of 12 episodes of random prompts and contexts, each turn's prompt the one
    before plus its sampled tokens plus new context, sent with its sampled spans."""
    rng = random.Random(7)
    vocab = engine.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    spans: list[list[tuple[int, int]]] = [[] for _ in prompts]
    every = []
    for turn in range(3):
        if clear_between:
            engine.clear_prefix_cache()
        outs = _outs(engine, prompts, spans, seed=100 * turn)
        every.append(outs)
        for p, out in enumerate(outs):
            start = len(prompts[p])
            spans[p].append((start, start + len(out.token_ids)))
            context = [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 9))]
            prompts[p] = prompts[p] + out.token_ids + context
    return every


def _same(a: list[list[SequenceOutput]], b: list[list[SequenceOutput]]) -> None:
    for turn, (x, y) in enumerate(zip(a, b, strict=True)):
        for p, (one, other) in enumerate(zip(x, y, strict=True)):
            assert one.token_ids == other.token_ids, f"turn {turn}, episode {p}"
            assert one.logprobs == other.logprobs, f"turn {turn}, episode {p}"


def test_a_turn_gets_the_same_numbers_from_the_cache_as_without_it(engine: Engine) -> None:
    cache = engine.prefix_cache
    assert cache is not None
    hits = cache.hits
    cached = _turns(engine, clear_between=False)
    assert cache.hits - hits == 24  # turns 2 and 3 of 12 episodes continued their turn before
    misses = cache.misses
    replayed = _turns(engine, clear_between=True)
    assert cache.misses - misses == 24
    _same(cached, replayed)


def test_requests_without_spans_leave_nothing_in_the_cache(engine: Engine) -> None:
    """A single-turn run's requests (no sampled_spans) cost the cache nothing."""
    engine.clear_prefix_cache()
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)
    futures = engine.submit_many([[5, 6, 7], [8, 9]], params, n=3, seed=1)
    [f.result(timeout=120) for f in futures]
    assert engine.prefix_cache is not None and len(engine.prefix_cache) == 0
    futures = engine.submit_many([[5, 6, 7], [8, 9]], params, n=3, seed=1, spans=[[], []])
    [f.result(timeout=120) for f in futures]
    # An episode's first turn: kept for the next (stored as the worker drops the finished rows,
    # just after it answers them).
    deadline = time.monotonic() + 30
    while len(engine.prefix_cache) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.prefix_cache) == 6


def test_a_weight_update_empties_the_cache(engine: Engine, tiny_model_dir: Path) -> None:
    _turns(engine, clear_between=False)
    assert engine.prefix_cache is not None and len(engine.prefix_cache) > 0
    engine.update_weights(tiny_model_dir)
    assert len(engine.prefix_cache) == 0


def test_without_cache_memory_continued_prompts_are_replayed_to_the_same_numbers(
    tiny_model_dir: Path, engine: Engine
) -> None:
    """With no memory for the cache (prefix_cache_mb=0) nothing is kept, and every continued
    prompt is computed again in its units: a server's numbers never depend on its cache."""
    bare = Engine(tiny_model_dir, max_batch_size=64, prefix_cache_mb=0)
    assert bare.prefix_cache is not None
    bare.start()
    try:
        _same(_turns(bare, clear_between=False), _turns(engine, clear_between=False))
        assert bare.prefix_cache.hits == 0 and len(bare.prefix_cache) == 0
    finally:
        bare.stop()
