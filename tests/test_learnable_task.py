"""copy_digits, the default task: deterministic problems, prompt-dependent answers, shaping."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from grail.envs import make_env
from grail.envs.base import Environment, Problem
from grail.envs.copy_digits import DIGITS, CopyDigitsEnv


@pytest.fixture
def env() -> CopyDigitsEnv:
    return CopyDigitsEnv()


def test_is_an_environment_registered_by_name() -> None:
    env = make_env("copy_digits", num_digits=2)
    assert isinstance(env, Environment) and env.name == "copy_digits"
    assert len(env.problem(0).answer) == 2


def test_problems_are_deterministic_in_the_seed(env: CopyDigitsEnv) -> None:
    assert env.problem(123) == env.problem(123)
    assert CopyDigitsEnv().problem(123) == env.problem(123)
    # Pinned: a change here silently changes every run's training and evaluation seeds.
    assert [env.problem(s).answer for s in range(8)] == ["6", "2", "0", "3", "3", "9", "9", "5"]
    assert CopyDigitsEnv(num_digits=4).problem(7).answer == "5260"


def test_prompt_is_one_user_message_holding_the_answer(env: CopyDigitsEnv) -> None:
    problem = env.problem(5)
    assert problem.prompt_messages == [{"role": "user", "content": f"Repeat: {problem.answer}"}]
    assert problem.seed == 5 and problem.meta == {"num_digits": 1}


def test_the_answer_depends_on_the_seed(env: CopyDigitsEnv) -> None:
    counts = Counter(env.problem(s).answer for s in range(2000))
    assert set(counts) == set(DIGITS)
    # Uniform digits: each near 10% (binomial sd ~0.7%), so no digit is a good constant guess.
    assert all(0.07 < c / 2000 < 0.13 for c in counts.values()), counts


@pytest.mark.parametrize("num_digits", [1, 3])
def test_no_constant_completion_succeeds_often(num_digits: int) -> None:
    env = CopyDigitsEnv(num_digits=num_digits)
    problems = [env.problem(s) for s in range(2000)]
    constants = [d * num_digits for d in DIGITS] + ["", "Repeat", "0123456789"]
    if num_digits == 3:
        constants += ["123", "000", "999"]
    bound = 0.13 if num_digits == 1 else 0.01
    for constant in constants:
        rate = sum(env.score(p, constant).success for p in problems) / len(problems)
        assert rate <= bound, (constant, rate)


@pytest.mark.parametrize(
    "completion",
    ["{a}", "{a}\n", "  {a}  ", "\n{a}\n\n\n", "{a}<|im_end|>", "{a}<|im_end|>\nmore text"],
)
def test_the_answer_scores_success_and_the_maximum_reward(
    env: CopyDigitsEnv, completion: str
) -> None:
    problem = env.problem(11)
    score = env.score(problem, completion.format(a=problem.answer))
    assert score.success
    assert score.reward == 1.0
    assert score.components == {"correct": 1.0, "found": 1.0, "brevity": 1.0}


def _reward(env: CopyDigitsEnv, problem: Problem, completion: str) -> float:
    return env.score(problem, completion).reward


def test_reward_order_exact_then_shorter_with_answer_then_nothing(env: CopyDigitsEnv) -> None:
    problem = Problem(seed=0, prompt_messages=[], answer="7")
    exact = _reward(env, problem, "7")
    one_extra = _reward(env, problem, "7.")
    repeated = _reward(env, problem, "7777")
    hedged = _reward(env, problem, "0123456789")
    wrong_digit = _reward(env, problem, "3")
    garbage = _reward(env, problem, "xq#")
    empty = _reward(env, problem, "")
    assert exact == 1.0
    assert exact > one_extra > repeated > hedged > 0.0
    assert one_extra == pytest.approx(0.25)  # (0 + 1·1·½) / 2
    # Deliberately unrewarded: a wrong digit is worth no more than garbage (see module doc).
    assert wrong_digit == garbage == empty == 0.0
    assert not env.score(problem, "7.").success and not env.score(problem, "77").success


def test_multi_digit_answers_need_every_digit_in_order() -> None:
    env = CopyDigitsEnv(num_digits=3)
    problem = Problem(seed=0, prompt_messages=[], answer="123")
    assert env.score(problem, "123").success
    assert env.score(problem, "x123").components == {"correct": 0.0, "found": 1.0, "brevity": 0.75}
    for partial in ("12", "321", "1 2 3", "132"):
        assert env.score(problem, partial).reward == 0.0, partial


def test_components_and_reward_stay_in_unit_interval(env: CopyDigitsEnv) -> None:
    rng = random.Random(0)
    alphabet = DIGITS + "ab \n<|>"
    problem = env.problem(3)
    for _ in range(500):
        completion = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))
        score = env.score(problem, completion)
        assert 0.0 <= score.reward <= 1.0
        assert all(0.0 <= v <= 1.0 for v in score.components.values())
        assert score.success == (completion.split("<|im_end|>")[0].strip() == problem.answer)


def test_weights_change_the_mix() -> None:
    problem = Problem(seed=0, prompt_messages=[], answer="7")
    only_correct = CopyDigitsEnv(found_weight=0.0)
    assert only_correct.score(problem, "77").reward == 0.0
    assert only_correct.score(problem, "7").reward == 1.0
    heavy_found = CopyDigitsEnv(correct_weight=1.0, found_weight=3.0)
    assert heavy_found.score(problem, "77").reward == pytest.approx(3 * 0.5 / 4)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_digits": 0}, "num_digits"),
        ({"num_digits": True}, "num_digits"),
        ({"num_digits": 1.5}, "num_digits"),
        ({"correct_weight": 0.0}, "correct_weight"),
        ({"found_weight": -1.0}, "found_weight"),
        ({"found_weight": float("nan")}, "found_weight"),
        ({"found_weight": float("inf")}, "found_weight"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CopyDigitsEnv(**kwargs)  # type: ignore[arg-type]


def test_bad_seeds_are_named(env: CopyDigitsEnv) -> None:
    with pytest.raises(ValueError, match="non-negative"):
        env.problem(-1)
    with pytest.raises(TypeError, match="seed must be an integer"):
        env.problem("3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        env.problem(True)
