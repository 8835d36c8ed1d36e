"""pass@k / best@k / mean@k against brute-force enumeration of every k-subset."""

from __future__ import annotations

import itertools
import statistics

import pytest

from grail.envs.base import Problem
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train.evaluate import best_at_k, eval_metrics, pass_at_k


def _subsets(values: list[float], k: int) -> list[tuple[float, ...]]:
    return list(itertools.combinations(values, k))


@pytest.mark.parametrize("n,c", [(4, 0), (4, 1), (4, 3), (4, 4), (7, 2), (1, 1)])
def test_pass_at_k_is_the_chance_a_k_subset_contains_a_success(n: int, c: int) -> None:
    outcomes = [1.0] * c + [0.0] * (n - c)
    for k in range(1, n + 1):
        subsets = _subsets(outcomes, k)
        expected = sum(max(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(expected)


@pytest.mark.parametrize("rewards", [[0.1, 0.9, 0.5, 0.5], [1.0], [0.0, -1.0, 2.0, 0.3, 0.3]])
def test_best_at_k_is_the_expected_maximum_over_k_subsets(rewards: list[float]) -> None:
    for k in range(1, len(rewards) + 1):
        subsets = _subsets(rewards, k)
        expected = statistics.fmean(max(s) for s in subsets)
        assert best_at_k(rewards, k) == pytest.approx(expected)


def test_bad_k_is_rejected_with_the_values() -> None:
    with pytest.raises(ValueError, match="n=3"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="k=0"):
        best_at_k([1.0, 2.0], 0)


def _group(seed: int, rewards: list[float], successes: list[bool]) -> Group:
    problem = Problem(seed=seed, prompt_messages=[{"role": "user", "content": "x"}], answer="1")
    samples = [
        Sample([1, 2], [-0.5, -0.5], "stop", "1", r, {"r": r}, ok)
        for r, ok in zip(rewards, successes, strict=True)
    ]
    return Group(problem=problem, prompt_ids=[5, 6], samples=samples)


def test_eval_metrics_average_per_task_estimates() -> None:
    batch = RolloutBatch(
        groups=[
            _group(0, [1.0, 0.0, 0.0, 0.0], [True, False, False, False]),
            _group(1, [0.5, 0.5, 0.5, 0.5], [False] * 4),
        ]
    )
    record = eval_metrics(batch, [1, 4])
    assert record["num_tasks"] == 2 and record["replicates"] == 4
    assert record["success_rate"] == pytest.approx(1 / 8)
    assert record["pass@k"]["1"] == pytest.approx((0.25 + 0.0) / 2)
    assert record["pass@k"]["4"] == pytest.approx((1.0 + 0.0) / 2)
    assert record["best@k"]["4"] == pytest.approx((1.0 + 0.5) / 2)
    assert record["mean@k"]["1"] == pytest.approx((0.25 + 0.5) / 2)
