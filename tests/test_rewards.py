"""Built-in rewards, `module:function` plugins and their errors, and batch scoring."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from grail.core.errors import UserError
from grail.envs import CopyDigitsEnv, SATEnv
from grail.envs.rewards.base import RewardError, RewardTimeout
from grail.envs.rewards.builtins import correctness, keyword_match, strict_format
from grail.envs.rewards.plugins import (
    PLUGIN_TIMEOUT_S,
    RewardFunctions,
    load_reward_fn,
    score_completions,
)

TESTS_DIR = Path(__file__).parent
P = "reward_plugins"  # module in tests/, importable once TESTS_DIR is on sys.path


@pytest.fixture(autouse=True)
def _plugins_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS_DIR))


# --- built-ins -------------------------------------------------------------------------------


def test_correctness_uses_answer_block_else_whole_completion() -> None:
    completions = [
        "<reasoning>\nadd\n</reasoning>\n<answer>\n 42 \n</answer>",
        "  42\n",
        "<answer>41</answer> then <answer>42</answer>",  # last block counts
        "<answer>042</answer>",  # exact string match: no numeric normalisation
        "the answer is 42",
    ]
    got = correctness([""] * 5, completions, answers=["42", "42", "42", "42", " 42 "])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_correctness_without_answers_names_the_missing_kwarg() -> None:
    with pytest.raises(ValueError, match="answers"):
        correctness([""], ["x"], keywords=[["a"]])
    with pytest.raises(ValueError, match="2 entries for 1"):
        correctness([""], ["x"], answers=["a", "b"])


def test_keyword_match_is_case_insensitive_fraction() -> None:
    got = keyword_match(
        ["", "", ""],
        ["The PARIS summit in France", "nothing here", "berlin"],
        keywords=[["paris", "france", "rome", "Summit"], ["x"], "Berlin"],
    )
    assert got == [0.75, 0.0, 1.0]


def test_keyword_match_rejects_empty_keyword_list_with_index() -> None:
    with pytest.raises(ValueError, match="sample 1: empty keyword list"):
        keyword_match(["", ""], ["a", "b"], keywords=[["a"], []])


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>", 1.0),
        ("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>\n", 1.0),
        ("<reasoning>\nline one\nline two\n</reasoning>\n<answer>\n4\n</answer>", 1.0),
        ("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>\n\n", 0.0),  # two newlines
        ("<reasoning>\n2+2=4\n</reasoning>\n<answer>4</answer>", 0.0),  # no inner newlines
        ("<reasoning>2+2=4</reasoning>\n<answer>\n4\n</answer>", 0.0),
        ("Sure! <reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer>", 0.0),  # leading text
        ("<reasoning>\n2+2=4\n</reasoning>\n<answer>\n4\n</answer> done", 0.0),  # trailing text
        ("<reasoning>\n\n</reasoning>\n<answer>\n4\n</answer>", 0.0),  # empty reasoning
        ("<reasoning>\nx\n</reasoning>\n<answer>\n3\n</answer>\n<answer>\n4\n</answer>", 0.0),
        ("<answer>\n4\n</answer>", 0.0),
    ],
)
def test_strict_format_layout(completion: str, expected: float) -> None:
    assert strict_format([""], [completion]) == [expected]


# --- loading ---------------------------------------------------------------------------------


def test_builtins_and_plugins_load_by_spec() -> None:
    assert load_reward_fn("correctness") is correctness
    fn = load_reward_fn(f"{P}:length_bonus")
    assert fn([""], ["x" * 50]) == [0.5]
    assert load_reward_fn(f"{P}:Graders.constant")([""], ["a"]) == [0.5]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("corectness", "not a built-in .*correctness.*'package.module:function'"),
        (f"{P}:", "not a built-in"),
        ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
        (f"{P}:missing_fn", f"module '{P}' has no attribute 'missing_fn'"),
        (f"{P}:Graders.missing", "has no attribute 'Graders.missing'"),
        (f"{P}:NOT_CALLABLE", "'NOT_CALLABLE' is a float, not callable"),
        (f"{P}:no_kwargs", r"has no \*\*kwargs"),
        (f"{P}:one_positional", r"cannot take \(prompts, completions\)"),
    ],
)
def test_load_errors_name_the_spec(spec: str, message: str) -> None:
    with pytest.raises(RewardError, match=message) as info:
        load_reward_fn(spec)
    assert f"reward {spec!r}" in str(info.value)
    assert info.value.spec == spec
    assert info.value.index is None


def test_plugin_module_with_missing_dependency_names_the_dependency(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plugin_needs_dep.py").write_text("import not_installed_dep_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="needs 'not_installed_dep_xyz', which is missing"):
        load_reward_fn("plugin_needs_dep:fn")


def test_plugin_module_that_fails_to_import_reports_the_exception(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "plugin_broken.py").write_text("raise RuntimeError('bad config at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError, match="RuntimeError: bad config at import") as info:
        load_reward_fn("plugin_broken:fn")
    assert "'plugin_broken:fn'" in str(info.value)


# --- calling ---------------------------------------------------------------------------------

COMPLETIONS = ["a", "bb", "ccc", "dddd"]


def _call(spec: str, **kwargs: object) -> dict[str, list[float]]:
    rewards = RewardFunctions.from_specs([spec])
    return rewards([""] * len(COMPLETIONS), COMPLETIONS, **kwargs)


@pytest.mark.parametrize(
    ("name", "message", "index"),
    [
        ("returns_tuple", "returned tuple, expected a list", None),
        ("returns_one_short", "returned 3 values for 4 completions", None),
        ("nan_at_1", "value nan is not finite", 1),
        ("inf_at_2", "value -inf is not finite", 2),
        ("string_at_1", "value '1.0' is not a number", 1),
        ("none_at_0", "value None is not a number", 0),
        ("raises", "raised ZeroDivisionError: plugin bug", None),
    ],
)
def test_call_errors_name_plugin_and_sample(name: str, message: str, index: int | None) -> None:
    spec = f"{P}:{name}"
    with pytest.raises(RewardError, match=message) as info:
        _call(spec, answers=["1"] * 4)
    assert info.value.spec == spec
    assert info.value.index == index
    assert str(info.value).startswith(f"reward {spec!r}")
    if index is not None:
        assert f"(sample {index})" in str(info.value)


def test_numpy_result_is_rejected_with_a_hint() -> None:
    np = pytest.importorskip("numpy")

    def as_array(prompts: list[str], completions: list[str], **kwargs: object) -> object:
        return np.zeros(len(completions))

    from grail.envs.rewards.plugins import call_reward_fn

    with pytest.raises(RewardError, match=r"returned ndarray, expected a list \(convert with"):
        call_reward_fn("arr", as_array, [""], ["x"])


def test_missing_named_argument_is_reported_with_what_the_batch_has() -> None:
    with pytest.raises(RewardError, match=r"needs_foo'.*foo.*provides \['answers'\]"):
        _call(f"{P}:needs_foo", answers=["1"] * 4)


def test_builtin_errors_are_wrapped_with_the_spec() -> None:
    with pytest.raises(RewardError, match="reward 'keyword_match'.*sample 2: empty keyword list"):
        _call("keyword_match", keywords=[["a"], ["b"], [], ["d"]])


def test_one_plugin_mutating_kwargs_does_not_affect_the_next() -> None:
    rewards = RewardFunctions.from_specs([f"{P}:clears_answers", "correctness"])
    out = rewards(["", ""], ["1", "2"], answers=["1", "3"])
    assert out == {"clears_answers": [0.0, 0.0], "correctness": [1.0, 0.0]}


# --- collections -----------------------------------------------------------------------------


def test_from_specs_names_weights_and_validation() -> None:
    rewards = RewardFunctions.from_specs(
        [
            "strict_format",
            {"fn": "correctness", "weight": 2.0},
            {"fn": f"{P}:length_bonus", "weight": -0.5, "name": "len"},
            {"fn": f"{P}:Graders.constant"},
        ]
    )
    assert [(r.name, r.weight) for r in rewards] == [
        ("strict_format", 1.0),
        ("correctness", 2.0),
        ("len", -0.5),
        ("Graders.constant", 1.0),
    ]
    assert len(RewardFunctions.from_specs(None)) == 0
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['wieght'\]"):
        RewardFunctions.from_specs([{"fn": "correctness", "wieght": 1.0}])
    with pytest.raises(ValueError, match="weight must be finite"):
        RewardFunctions.from_specs([{"fn": "correctness", "weight": float("nan")}])
    with pytest.raises(ValueError, match="no 'fn' key"):
        RewardFunctions.from_specs([{"weight": 1.0}])
    with pytest.raises(ValueError, match=r"repeated: \['correctness'\]"):
        RewardFunctions.from_specs(["correctness", {"fn": "correctness", "weight": 2}])
    with pytest.raises(ValueError, match="must be a list"):
        RewardFunctions.from_specs("correctness")  # type: ignore[arg-type]
    with pytest.raises(RewardError, match="no_such_module_xyz"):
        RewardFunctions.from_specs([{"fn": "no_such_module_xyz:f", "weight": 1.0}])


# --- score_completions -----------------------------------------------------------------------


def test_score_completions_adds_weighted_extras_and_passes_meta() -> None:
    env = SATEnv(difficulty=0.0)
    problems = [env.problem(s) for s in range(3)]
    completions = [
        f"<SOLUTION>{problems[0].answer}</SOLUTION>",
        problems[1].answer,  # bare bits: correct for `correctness`, no format for the env
        f"<SOLUTION>{problems[2].answer}</SOLUTION>",
    ]
    extras = RewardFunctions.from_specs(
        [
            {"fn": f"{P}:num_vars_reward", "weight": 0.1},
            {"fn": f"{P}:prompt_mentions_clauses", "weight": 2.0},
            {"fn": "correctness", "weight": 0.5},
        ]
    )
    base = [env.score(p, c) for p, c in zip(problems, completions, strict=True)]
    scores = score_completions(env, problems, completions, extras)
    for b, s in zip(base, scores, strict=True):
        assert s.components["num_vars_reward"] == 4.0  # meta["num_vars"] arrived per sample
        assert s.components["prompt_mentions_clauses"] == 1.0  # last user message by default
        assert s.success == b.success
        for key, value in b.components.items():
            assert s.components[key] == value
    # correctness compares the stripped completion (no <answer> block) with the planted bits.
    correct = [s.components["correctness"] for s in scores]
    assert correct == [0.0, 1.0, 0.0]
    assert [b.success for b in base] == [True, False, True]
    for b, s, c in zip(base, scores, correct, strict=True):
        assert s.reward == pytest.approx(b.reward + 0.1 * 4.0 + 2.0 * 1.0 + 0.5 * c)


def test_score_completions_with_rendered_prompts_and_without_extras() -> None:
    env = SATEnv(difficulty=0.0)
    problems = [env.problem(s) for s in range(2)]
    completions = ["x", "y"]
    extras = RewardFunctions.from_specs([f"{P}:prompt_mentions_clauses"])
    scores = score_completions(env, problems, completions, extras, prompts=["<chat>", "<chat>"])
    assert [s.components["prompt_mentions_clauses"] for s in scores] == [0.0, 0.0]
    plain = score_completions(env, problems, completions)
    assert plain == [env.score(p, c) for p, c in zip(problems, completions, strict=True)]
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        score_completions(env, problems, ["x"])


def test_score_completions_rejects_a_name_that_shadows_an_env_component() -> None:
    env = SATEnv(difficulty=0.0)
    extras = RewardFunctions.from_specs([{"fn": f"{P}:length_bonus", "name": "format"}])
    with pytest.raises(RewardError, match="'format' is already a component of environment 'sat'"):
        score_completions(env, [env.problem(0)], ["x"], extras)


def test_a_name_taken_by_the_env_is_refused_before_scoring_with_how_to_rename() -> None:
    extras = RewardFunctions.from_specs([f"{P}:length_bonus", {"fn": "correctness"}])
    extras.check_names("copy_digits", CopyDigitsEnv.components)  # no clash
    clash = RewardFunctions.from_specs([{"fn": f"{P}:length_bonus", "name": "brevity"}])
    message = (
        r"reward 'reward_plugins:length_bonus': name 'brevity' is already a component of "
        r"environment 'copy_digits' \(correct, found, brevity\); give the reward another name "
        r"with `name:`"
    )
    with pytest.raises(RewardError, match=message):
        clash.check_names("copy_digits", CopyDigitsEnv.components)


def test_reward_errors_are_user_errors() -> None:
    with pytest.raises(UserError, match="PYTHONPATH"):  # says how to make the module importable
        RewardFunctions.from_specs(["no_such_module_xyz:f"])
    with pytest.raises(UserError, match="unknown key"):
        RewardFunctions.from_specs([{"fn": "correctness", "wieght": 1.0}])


def test_score_completions_reports_plugin_errors_by_sample() -> None:
    env = SATEnv(difficulty=0.0)
    problems = [env.problem(s) for s in range(3)]
    extras = RewardFunctions.from_specs([f"{P}:nan_at_1"])
    with pytest.raises(RewardError, match=r"reward 'reward_plugins:nan_at_1' \(sample 1\)"):
        score_completions(env, problems, ["a", "b", "c"], extras)


# --- deadlines -------------------------------------------------------------------------------


def test_a_plugin_past_its_timeout_fails_the_batch_naming_it_and_is_left_behind() -> None:
    import reward_plugins

    env = CopyDigitsEnv()
    problems = [env.problem(s) for s in range(2)]
    extras = RewardFunctions.from_specs([{"fn": f"{P}:waits_for_release", "timeout_s": 0.3}])
    t0 = time.monotonic()
    try:
        with pytest.raises(RewardTimeout) as info:
            score_completions(env, problems, ["1", "2"], extras)
        assert time.monotonic() - t0 < 3
        assert str(info.value) == (
            "reward 'reward_plugins:waits_for_release': did not return within timeout_s=0.3 s "
            "(it is left running); set a larger timeout_s on its data.rewards entry if it needs "
            "longer"
        )
        assert isinstance(info.value, UserError)  # grail-train prints it as one line
        # Still running, in a thread the interpreter does not wait for at exit.
        stuck = [t for t in threading.enumerate() if t.name == "grail-reward"]
        assert stuck and all(t.daemon for t in stuck)
    finally:
        reward_plugins.RELEASE.set()


def test_every_plugin_entry_has_a_deadline_and_a_url_entry_keeps_its_own() -> None:
    rewards = RewardFunctions.from_specs(
        ["correctness", {"fn": f"{P}:length_bonus", "timeout_s": 5}, "http://127.0.0.1:9/s"]
    )
    assert [r.timeout_s for r in rewards] == [PLUGIN_TIMEOUT_S, 5.0, None]
    assert PLUGIN_TIMEOUT_S == 60.0  # docs/rewards.md gives this default
    fast = RewardFunctions.from_specs([{"fn": "correctness", "timeout_s": 5}])
    assert fast(["", ""], ["1", "2"], answers=["1", "3"]) == {"correctness": [1.0, 0.0]}
