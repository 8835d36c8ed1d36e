"""The default task: deterministic, prompt-dependent, graded in the order its docstring gives."""

from __future__ import annotations

import pytest

from grail.envs import make_env
from grail.envs.copy_digits import CopyDigitsEnv


def test_same_seed_same_problem_and_the_answer_is_in_the_prompt() -> None:
    env = CopyDigitsEnv()
    assert env.problem(7) == CopyDigitsEnv().problem(7)
    for seed in range(50):
        p = env.problem(seed)
        assert p.prompt_messages[-1]["content"].endswith(p.answer)
    assert len({env.problem(s).answer for s in range(200)}) == 10


def test_no_constant_completion_scores_well_on_held_out_seeds() -> None:
    env = make_env("copy_digits")
    seeds = range(1_000_000, 1_000_500)
    for constant in "0123456789":
        rate = sum(env.score(env.problem(s), constant).success for s in seeds) / len(seeds)
        assert rate < 0.15, (constant, rate)


def test_reward_order_exact_then_answer_plus_little_then_buried_then_nothing() -> None:
    env = CopyDigitsEnv()
    p = env.problem(3)
    other = next(d for d in "0123456789" if d != p.answer)
    exact = env.score(p, p.answer)
    near = env.score(p, p.answer + other)
    buried = env.score(p, other * 3 + p.answer)
    wrong = env.score(p, other)
    assert exact.success and exact.reward == pytest.approx(1.0)
    assert exact.components == {"correct": 1.0, "found": 1.0, "brevity": 1.0}
    assert exact.reward > near.reward > buried.reward > wrong.reward == 0.0
    assert not near.success and not buried.success
    # whitespace and whatever follows the end of the turn do not count
    assert env.score(p, f" {p.answer}\n<|im_end|>junk").success


def test_difficulty_knob_and_bad_arguments() -> None:
    p = CopyDigitsEnv(num_digits=3).problem(1)
    assert len(p.answer) == 3 and p.answer.isdigit()
    with pytest.raises(ValueError, match="num_digits"):
        CopyDigitsEnv(num_digits=0)
    with pytest.raises(ValueError, match="correct_weight"):
        CopyDigitsEnv(correct_weight=0)
