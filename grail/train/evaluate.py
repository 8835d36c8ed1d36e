"""Evaluation on held-out seeds: unbiased pass@k, mean@k and best@k from n replicates per task.

With n samples of a task, c of them successful and rewards sorted ascending r_(1) <= ... <= r_(n),
the unbiased estimators (Chen et al. 2021 for pass@k; the same combinatorics for best@k) are

    pass@k = 1 - C(n - c, k) / C(n, k)          chance that k samples drawn without replacement
                                                 contain at least one success
    best@k = sum_i r_(i) * C(i - 1, k - 1) / C(n, k)
                                                 expected best reward among k samples (r_(i) is the
                                                 maximum of C(i - 1, k - 1) of the C(n, k) subsets)
    mean@k = mean_i r_i                          expected mean reward of k samples (any k)

and each is averaged over tasks.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb

from grail.rollouts.batch import RolloutBatch


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def best_at_k(rewards: Sequence[float], k: int) -> float:
    n = len(rewards)
    if not 1 <= k <= n:
        raise ValueError(f"best@k needs 1 <= k <= n, got n={n} k={k}")
    ordered = sorted(rewards)
    return sum(r * comb(i, k - 1) for i, r in enumerate(ordered)) / comb(n, k)


def eval_metrics(batch: RolloutBatch, ks: Sequence[int]) -> dict[str, object]:
    """Aggregate an evaluation batch (one group per held-out task) into the eval record fields."""
    groups = batch.groups
    if not groups:
        raise ValueError("evaluation produced no groups")
    n = len(groups[0].samples)
    samples = batch.samples
    record: dict[str, object] = {
        "num_tasks": len(groups),
        "replicates": n,
        "success_rate": sum(s.success for s in samples) / len(samples),
        "reward_mean": sum(s.reward for s in samples) / len(samples),
        "truncated_frac": sum(s.truncated for s in samples) / len(samples),
        "pass@k": {},
        "mean@k": {},
        "best@k": {},
    }
    for k in ks:
        passes = [pass_at_k(n, sum(s.success for s in g.samples), k) for g in groups]
        bests = [best_at_k(g.rewards, k) for g in groups]
        means = [sum(g.rewards) / n for g in groups]
        record["pass@k"][str(k)] = sum(passes) / len(groups)  # type: ignore[index]
        record["best@k"][str(k)] = sum(bests) / len(groups)  # type: ignore[index]
        record["mean@k"][str(k)] = sum(means) / len(groups)  # type: ignore[index]
    return record
