"""SAT and GSM8K environments and the registry: determinism, satisfiability, grading, loading."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import types
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from grail.core.errors import ConfigError, UserError
from grail.envs import ENVIRONMENTS, Environment, Problem, env_arguments, make_env
from grail.envs.gsm8k import (
    GSM8KDataError,
    GSM8KEnv,
    HubUnavailableError,
    extract_answer,
    format_number,
    load_records,
    parse_number,
)
from grail.envs.rewards.builtins import correctness, strict_format
from grail.envs.sat import SATEnv, clauses_satisfied
from grail.envs.tags import last_block

FIXTURE = Path(__file__).parent / "fixtures" / "gsm8k_sample.jsonl"
REPO = Path(__file__).resolve().parents[1]


# --- helpers ---------------------------------------------------------------------------------


def dpll(clauses: list[list[int]], assignment: dict[int, bool] | None = None) -> dict | None:
    """A satisfying partial assignment, or None: unit propagation + branching, no heuristics."""
    assignment = dict(assignment or {})
    while True:
        simplified: list[list[int]] = []
        unit = None
        for clause in clauses:
            if any(assignment.get(abs(lit)) == (lit > 0) for lit in clause):
                continue
            free = [lit for lit in clause if abs(lit) not in assignment]
            if not free:
                return None
            if len(free) == 1:
                unit = free[0]
            simplified.append(free)
        if not simplified:
            return assignment
        if unit is None:
            break
        assignment[abs(unit)] = unit > 0
    var = abs(simplified[0][0])
    for value in (True, False):
        result = dpll(simplified, {**assignment, var: value})
        if result is not None:
            return result
    return None


def all_assignments(n: int) -> list[str]:
    return ["".join(bits) for bits in itertools.product("01", repeat=n)]


def solution(bits: str) -> str:
    return f"<reasoning>try</reasoning>\n<SOLUTION>{bits}</SOLUTION>"


# --- registry --------------------------------------------------------------------------------


def test_registry_builds_known_envs_and_lists_them_on_unknown_name() -> None:
    assert {"sat", "gsm8k", "copy_digits"} <= set(ENVIRONMENTS)
    env = make_env("sat", difficulty=1.0)
    assert isinstance(env, Environment) and env.name == "sat"
    assert isinstance(make_env("gsm8k", path=str(FIXTURE)), Environment)
    for name, factory in ENVIRONMENTS.items():
        assert factory.name == name  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"unknown environment 'sta' .*; known: .*gsm8k.*sat"):
        make_env("sta")
    with pytest.raises(
        ConfigError,
        match=r"environment 'sat' has no argument 'difficuly' \(data.env_kwargs.difficuly\) "
        r"\(did you mean 'difficulty'\?\); it accepts difficulty, num_vars",
    ):
        make_env("sat", difficuly=0.5)
    # a value the environment refuses is a configuration error naming the environment
    with pytest.raises(ConfigError, match=r"environment 'sat' \(data.env_kwargs\): difficulty"):
        make_env("sat", difficulty=2.0)


def test_each_env_config_declares_exactly_its_constructor_arguments() -> None:
    """conf/env/NAME.yaml lists the environment's keyword arguments with the constructor's
    defaults, so that `data.env_kwargs.KEY=VALUE` (no `+`) works for each of them."""
    declared = {}
    for path in sorted((REPO / "conf" / "env").glob("*.yaml")):
        data = OmegaConf.to_container(OmegaConf.load(path))["data"]  # type: ignore[index]
        assert path.stem == data["environment"], path
        declared[data["environment"]] = data["env_kwargs"]
    assert sorted(declared) == sorted(ENVIRONMENTS)
    for name, kwargs in declared.items():
        arguments = env_arguments(name)
        assert list(kwargs) == list(arguments), name  # same keys, in the signature's order
        for key, default in arguments.items():
            assert kwargs[key] == default and type(kwargs[key]) is type(default), (name, key)


def test_env_components_are_the_keys_of_its_scores() -> None:
    envs = [make_env("copy_digits"), make_env("sat"), make_env("gsm8k", path=str(FIXTURE))]
    for env in envs:
        problem = env.problem(0)
        for completion in ("", problem.answer, f"<answer>{problem.answer}</answer>"):
            assert tuple(env.score(problem, completion).components) == env.components


def test_missing_data_file_is_a_user_error() -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl") as info:
        make_env("gsm8k", path="/nonexistent/nope.jsonl")
    assert isinstance(info.value, UserError)


# --- determinism -----------------------------------------------------------------------------

_DUMP = """
import json, sys
from grail.envs import make_env
sat = [make_env("sat", difficulty=d) for d in (0.0, 0.5, 1.0)]
gsm = make_env("gsm8k", path=sys.argv[1])
out = [[e.problem(s).__dict__ for s in range(25)] for e in sat]
out.append([gsm.problem(s).__dict__ for s in range(25)])
print(json.dumps(out, sort_keys=True))
"""


def _dump_in_subprocess(hashseed: str) -> str:
    env = {**os.environ, "PYTHONHASHSEED": hashseed}
    result = subprocess.run(
        [sys.executable, "-c", _DUMP, str(FIXTURE)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return result.stdout


def test_problems_are_identical_across_processes_and_hash_seeds() -> None:
    a = _dump_in_subprocess("0")
    b = _dump_in_subprocess("4242")
    assert a == b
    sat = make_env("sat", difficulty=0.5)
    here = json.loads(a)
    assert here[1][7] == sat.problem(7).__dict__
    assert here[3][3] == make_env("gsm8k", path=str(FIXTURE)).problem(3).__dict__


def test_sat_uses_no_global_random_state() -> None:
    env = SATEnv(difficulty=0.5)
    random.seed(1)
    first = env.problem(11)
    state = random.getstate()
    random.seed(999)
    second = env.problem(11)
    assert first == second
    random.setstate(state)
    env.problem(12)
    assert random.getstate() == state


# --- SAT -------------------------------------------------------------------------------------


def test_sat_difficulty_sets_sizes_and_explicit_sizes_override() -> None:
    easy, hard = SATEnv(difficulty=0.0), SATEnv(difficulty=1.0)
    assert (easy.num_vars, easy.num_clauses) == (4, 12)
    assert (hard.num_vars, hard.num_clauses) == (16, 69)
    p = SATEnv(num_vars=7, num_clauses=20).problem(0)
    assert p.meta["num_vars"] == 7 and len(p.meta["clauses"]) == 20
    assert len(p.answer) == 7
    assert "x7" in p.prompt_messages[-1]["content"]
    assert [m["role"] for m in p.prompt_messages] == ["system", "user"]


@pytest.mark.parametrize("difficulty", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_sat_instances_are_satisfiable_and_well_formed(difficulty: float) -> None:
    env = SATEnv(difficulty=difficulty)
    for seed in range(40):
        p = env.problem(seed)
        clauses = p.meta["clauses"]
        n = p.meta["num_vars"]
        assert len(clauses) == env.num_clauses
        assert len({tuple(c) for c in clauses}) == len(clauses)
        for clause in clauses:
            assert len({abs(lit) for lit in clause}) == 3
            assert all(1 <= abs(lit) <= n for lit in clause)
        # Independent of the planted bits: a solver must find some satisfying assignment.
        found = dpll(clauses)
        assert found is not None, f"seed {seed} unsatisfiable"
        bits = "".join("1" if found.get(v, False) else "0" for v in range(1, n + 1))
        assert clauses_satisfied(clauses, bits) == len(clauses)
        assert clauses_satisfied(clauses, p.answer) == len(clauses)


def test_sat_small_instances_brute_force_agrees_with_planted() -> None:
    env = SATEnv(num_vars=6, num_clauses=30)
    for seed in range(30):
        p = env.problem(seed)
        sats = [b for b in all_assignments(6) if clauses_satisfied(p.meta["clauses"], b) == 30]
        assert p.answer in sats


def test_sat_any_satisfying_assignment_succeeds_not_only_the_planted_one() -> None:
    env = SATEnv(difficulty=0.0)
    others = 0
    for seed in range(20):
        p = env.problem(seed)
        assert env.score(p, solution(p.answer)) == env.score(p, solution(p.answer))
        assert env.score(p, solution(p.answer)).reward == pytest.approx(1.0)
        for bits in all_assignments(p.meta["num_vars"]):
            if bits != p.answer and clauses_satisfied(p.meta["clauses"], bits) == 12:
                s = env.score(p, solution(bits))
                assert s.success and s.reward == pytest.approx(1.0)
                assert s.components == {"format": 1.0, "satisfied": 1.0, "solved": 1.0}
                others += 1
    assert others > 0  # otherwise this test checked nothing


def test_sat_wrong_and_malformed_answers_score_lower_with_named_components() -> None:
    env = SATEnv(difficulty=0.0)
    p = env.problem(3)
    clauses, n = p.meta["clauses"], p.meta["num_vars"]
    best = env.score(p, solution(p.answer))
    wrong = next(b for b in all_assignments(n) if clauses_satisfied(clauses, b) < len(clauses))
    frac = clauses_satisfied(clauses, wrong) / len(clauses)

    s = env.score(p, solution(wrong))
    assert s.components == {"format": 1.0, "satisfied": frac, "solved": 0.0}
    assert s.reward == pytest.approx(0.1 + 0.4 * frac) and not s.success

    cases = {
        p.answer: {"format": 0.0, "satisfied": 0.0, "solved": 0.0},  # no tags
        f"<SOLUTION>{p.answer}0</SOLUTION>": {"format": 0.5, "satisfied": 0.0, "solved": 0.0},
        f"<SOLUTION>{p.answer[:-1]}x</SOLUTION>": {"format": 0.5, "satisfied": 0.0, "solved": 0.0},
        f"<solution>{p.answer}</solution>": {"format": 0.0, "satisfied": 0.0, "solved": 0.0},
        "": {"format": 0.0, "satisfied": 0.0, "solved": 0.0},
    }
    for completion, components in cases.items():
        s = env.score(p, completion)
        assert s.components == components, completion
        assert s.reward < best.reward and not s.success
    assert env.score(p, f"<SOLUTION>{p.answer}0</SOLUTION>").reward == pytest.approx(0.05)

    # Whitespace inside the block is ignored; the last block is the answer.
    spaced = "<SOLUTION> " + " ".join(p.answer) + "\n</SOLUTION>"
    assert env.score(p, spaced).success
    assert env.score(p, f"format: <SOLUTION>{wrong}</SOLUTION> ... {solution(p.answer)}").success
    assert not env.score(p, f"{solution(p.answer)} no wait {solution(wrong)}").success


def test_sat_rejects_bad_configuration_and_seeds() -> None:
    with pytest.raises(ValueError, match="difficulty"):
        SATEnv(difficulty=1.5)
    with pytest.raises(ValueError, match="num_vars must be an integer >= clause_size"):
        SATEnv(num_vars=2)
    with pytest.raises(ValueError, match="more than the 28 distinct clauses"):
        SATEnv(num_vars=4, num_clauses=29)
    with pytest.raises(ValueError, match="format_weight"):
        SATEnv(format_weight=float("inf"))
    with pytest.raises(ValueError, match="non-negative"):
        SATEnv().problem(-1)
    with pytest.raises(TypeError, match="seed must be an integer"):
        SATEnv().problem("3")  # type: ignore[arg-type]
    assert len(SATEnv(num_vars=4, num_clauses=28).problem(0).meta["clauses"]) == 28


def test_sat_score_rejects_a_foreign_problem() -> None:
    gsm = make_env("gsm8k", path=str(FIXTURE))
    with pytest.raises(ValueError, match="not made by the sat environment"):
        SATEnv().score(gsm.problem(0), "<SOLUTION>0</SOLUTION>")


# --- GSM8K: loading and splits ---------------------------------------------------------------


def test_gsm8k_jsonl_holdout_is_a_deterministic_disjoint_partition() -> None:
    records = load_records(FIXTURE)
    assert len(records) == 16
    train = GSM8KEnv(path=FIXTURE, split="train", holdout_fraction=0.25)
    test = GSM8KEnv(path=FIXTURE, split="test", holdout_fraction=0.25)
    assert len(test) == 4 and len(train) == 12
    train_q = {r.prompt for r in train.records}
    test_q = {r.prompt for r in test.records}
    assert not train_q & test_q
    assert train_q | test_q == {r.prompt for r in records}
    assert [r.index for r in train.records] == sorted(r.index for r in train.records)
    # Depends on question text, not file order.
    again = GSM8KEnv(path=FIXTURE, split="test", holdout_fraction=0.25)
    assert [r.prompt for r in again.records] == [r.prompt for r in test.records]


def test_gsm8k_holdout_is_independent_of_file_order(tmp_path: Path) -> None:
    lines = FIXTURE.read_text().splitlines()
    shuffled = tmp_path / "shuffled.jsonl"
    shuffled.write_text("\n".join(reversed(lines)) + "\n")
    a = {r.prompt for r in GSM8KEnv(path=FIXTURE, split="test").records}
    b = {r.prompt for r in GSM8KEnv(path=shuffled, split="test").records}
    assert a == b and len(a) == 2  # round(0.1 * 16)


def test_gsm8k_duplicate_questions_stay_on_one_side(tmp_path: Path) -> None:
    lines = FIXTURE.read_text().splitlines()
    dup = tmp_path / "dup.jsonl"
    dup.write_text("\n".join(lines + lines) + "\n")
    train = GSM8KEnv(path=dup, split="train", holdout_fraction=0.2)
    test = GSM8KEnv(path=dup, split="test", holdout_fraction=0.2)
    assert not {r.prompt for r in train.records} & {r.prompt for r in test.records}
    assert len(train) + len(test) == 32


def test_gsm8k_parquet_matches_jsonl(tmp_path: Path) -> None:
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    assert load_records(path) == load_records(FIXTURE)
    a, b = GSM8KEnv(path=path), GSM8KEnv(path=FIXTURE)
    assert [a.problem(s) for s in range(20)] == [b.problem(s) for s in range(20)]

    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "q", "solution": "#### 1"}]), bad)
    with pytest.raises(GSM8KDataError, match=r"missing field\(s\) \['answer'\]"):
        load_records(bad)


def test_gsm8k_separate_test_file(tmp_path: Path) -> None:
    lines = FIXTURE.read_text().splitlines()
    (tmp_path / "train.jsonl").write_text("\n".join(lines[:10]) + "\n")
    (tmp_path / "test.jsonl").write_text("\n".join(lines[10:]) + "\n")
    train = GSM8KEnv(path=tmp_path / "train.jsonl", test_path=tmp_path / "test.jsonl")
    test = GSM8KEnv(path=tmp_path / "train.jsonl", test_path=tmp_path / "test.jsonl", split="test")
    assert (len(train), len(test)) == (10, 6)
    with pytest.raises(ValueError, match="test_path was given without path"):
        GSM8KEnv(test_path=tmp_path / "test.jsonl")


def test_gsm8k_problem_picks_seed_mod_len_with_canonical_answer() -> None:
    env = GSM8KEnv(path=FIXTURE, holdout_fraction=0.25)
    n = len(env)
    for seed in (0, 5, n, n + 5, 10 * n + 3):
        p = env.problem(seed)
        rec = env.records[seed % n]
        assert p.seed == seed
        assert p.prompt_messages[-1] == {"role": "user", "content": rec.prompt}
        assert p.prompt_messages[0]["role"] == "system"
        assert "<answer>" in p.prompt_messages[0]["content"]
        assert p.answer == rec.answer
        assert p.meta == {"index": rec.index, "split": "train", "solution": rec.fields["answer"]}
    answers = {r.answer for r in load_records(FIXTURE)}
    assert {"1250", "13.5", "-2"} <= answers  # "#### 1,250" normalised
    assert GSM8KEnv(path=FIXTURE, system_prompt="").problem(0).prompt_messages[0]["role"] == "user"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"question": "q", "answer": "#### 3"}\nnot json\n', r"bad\.jsonl:2: invalid JSON"),
        ('{"question": "q"}\n', r"bad\.jsonl:1: missing field\(s\) \['answer'\]"),
        ('{"question": "q", "answer": "three"}\n', r"does not end with '#### <answer>'"),
        ('{"question": 3, "answer": "#### 3"}\n', "'question' must be a string"),
        ("[1, 2]\n", "expected an object"),
        ("\n\n", "no records"),
    ],
)
def test_gsm8k_bad_jsonl_names_file_and_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(GSM8KDataError, match=message):
        load_records(path)


def test_gsm8k_bad_paths_and_options(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        GSM8KEnv(path=tmp_path / "nope.jsonl")
    csv = tmp_path / "data.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(GSM8KDataError, match="data.csv: no records"):
        GSM8KEnv(path=csv)
    tsv = tmp_path / "data.tsv"
    tsv.write_text("question\tanswer\n")
    with pytest.raises(GSM8KDataError, match="unknown file type '.tsv'"):
        GSM8KEnv(path=tsv)
    with pytest.raises(ValueError, match="split must be 'train' or 'test'"):
        GSM8KEnv(path=FIXTURE, split="validation")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="holdout_fraction must be in"):
        GSM8KEnv(path=FIXTURE, holdout_fraction=1.0)


# --- GSM8K: hub ------------------------------------------------------------------------------


def test_gsm8k_hub_without_datasets_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(HubUnavailableError, match=r"`datasets` package.*path=.*hub extra"):
        GSM8KEnv()


def test_gsm8k_hub_download_failure_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    def load_dataset(*args: object, **kwargs: object) -> object:
        raise ConnectionError("no route to host")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(HubUnavailableError, match=r"ConnectionError: no route to host.*path="):
        GSM8KEnv(split="test")


def test_gsm8k_hub_uses_the_datasets_split(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    rows = [json.loads(line) for line in FIXTURE.read_text().splitlines()]

    def load_dataset(*args: object, **kwargs: object) -> list[dict]:
        calls.append((args, kwargs))
        return rows[:3] if kwargs.get("split") == "test" else rows[3:]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    test = GSM8KEnv(split="test")
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]
    assert [r.prompt for r in test.records] == [r["question"] for r in rows[:3]]
    assert len(GSM8KEnv(split="train")) == 13


# --- GSM8K: answers --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("18", Fraction(18)),
        ("18.00", Fraction(18)),
        ("1,000", Fraction(1000)),
        ("1,000,000.5", Fraction(2000001, 2)),
        ("-3", Fraction(-3)),
        ("-3.0", Fraction(-3)),
        ("+4", Fraction(4)),
        ("$5", Fraction(5)),
        ("-$5.50", Fraction(-11, 2)),
        (" 7. ", Fraction(7)),
        ("50%", Fraction(50)),
        ("1e3", Fraction(1000)),
        ("2.5E-1", Fraction(1, 4)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-6 / 4", Fraction(-3, 2)),
        ("0.1", Fraction(1, 10)),  # exact: not the float 0.1000000000000000055...
        ("1,00", None),  # not a thousands grouping
        ("1e999", None),  # exponent beyond the cap
        ("1" * 101, None),  # more digits than any real answer: no huge integers
        ("1" * 5000 + "/3", None),
        ("1e" + "9" * 5000, None),
        ("5/0", None),
        ("eighteen", None),
        ("18 apples", None),
        ("", None),
    ],
)
def test_parse_number(text: str, value: Fraction | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("completion", "value"),
    [
        ("<reasoning>\n3*6=18\n</reasoning>\n<answer>\n18\n</answer>", Fraction(18)),
        ("I think 12. <answer>$1,250.00</answer> (was 7)", Fraction(1250)),  # tag beats last num
        ("<answer>about 40 apples</answer>", Fraction(40)),
        ("<answer>none</answer> but 5", None),  # a tag without a number does not fall through
        ("<answer>1</answer><answer>2</answer>", Fraction(2)),
        ("so 4+5=9\n#### 9\nextra 3", Fraction(9)),  # #### beats the last number
        ("The total is 1,234 dollars.", Fraction(1234)),
        ("x = -3", Fraction(-3)),
        ("pages 5-7", Fraction(7)),  # hyphen, not a sign
        ("variables x1 and x2 sum to 10", Fraction(10)),
        ("It costs $3.25.", Fraction(13, 4)),
        ("we get 1e3 grams", Fraction(1000)),
        ("half is 3/4 of the way", Fraction(4)),  # free text: no fractions (dates look alike)
        ("no numbers here", None),
    ],
)
def test_extract_answer(completion: str, value: Fraction | None) -> None:
    assert extract_answer(completion) == value


def test_format_number_is_canonical() -> None:
    assert [format_number(Fraction(x)) for x in ("18", "-2", "13.5", "1/3", "1e3", "-0.125")] == [
        "18",
        "-2",
        "13.5",
        "1/3",
        "1000",
        "-0.125",
    ]
    for text in ("18", "-2", "13.5", "1/3"):
        assert format_number(parse_number(text)) == text  # type: ignore[arg-type]


def test_gsm8k_scores_numbers_exactly_with_named_components() -> None:
    env = GSM8KEnv(path=FIXTURE, holdout_fraction=0.25)
    p = next(env.problem(s) for s in range(len(env)) if env.problem(s).answer == "13.5")
    right = "<reasoning>\n3+6+4.5\n</reasoning>\n<answer>\n13.50\n</answer>"
    s = env.score(p, right)
    assert s.components == {"correct": 1.0, "format": 1.0}
    assert s.reward == pytest.approx(1.1) and s.success
    s = env.score(p, "The answer is 13.5")
    assert s.components == {"correct": 1.0, "format": 0.0} and s.reward == pytest.approx(1.0)
    s = env.score(p, "<answer>13</answer>")
    assert s.components == {"correct": 0.0, "format": 1.0} and not s.success
    s = env.score(p, "I don't know")
    assert s.reward == 0.0 and not s.success
    neg = Problem(seed=0, prompt_messages=[], answer="-2")
    assert env.score(neg, "<answer>-2.0</answer>").success
    assert not env.score(neg, "<answer>2</answer>").success


# --- tags and degenerate completions ---------------------------------------------------------


def test_last_block_takes_the_last_closed_block() -> None:
    assert last_block("<a>1</a> then <a>2</a>", "a") == "2"
    assert last_block("<a>1<a>2</a>", "a") == "2"  # innermost opening before the last close
    assert last_block("<a>1</a> <a>unclosed", "a") == "1"
    assert last_block("</a> <a>", "a") is None
    assert last_block("<a></a>", "a") == ""
    assert last_block("<A>x</A>", "a") is None
    assert last_block("<A>x</a>", "a", ignore_case=True) == "x"


@pytest.mark.timeout(10)  # the quadratic regex this replaced took > 30 s on the first input
def test_degenerate_completions_are_graded_quickly() -> None:
    sat = SATEnv()
    p = sat.problem(0)
    gsm = GSM8KEnv(path=FIXTURE)
    q = gsm.problem(0)
    countdown = make_env("countdown")
    c = countdown.problem(0)
    junk = [
        "<SOLUTION>" * 20000,
        "<answer>" * 20000,
        "</answer><answer>" * 10000,
        "1," * 50000,
        "9" * 50000,
        "<answer>" + "7" * 5000 + "/3</answer>",
        "#### 1e" + "9" * 5000,
        "<reasoning>\n" + "ab " * 20000,
    ]
    for text in junk:
        assert not sat.score(p, text).success
        assert not gsm.score(q, text).success
        assert not countdown.score(c, text).success
        assert strict_format([""], [text]) == [0.0]
        assert correctness([""], [text], answers=["1"]) == [0.0]


# --------------------------------------------------------------------------- countdown


def test_countdown_instances_are_solvable_deterministic_and_in_range() -> None:
    env = make_env("countdown")
    for seed in range(300):
        problem = env.problem(seed)
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        assert len(numbers) == 4 and all(1 <= n <= 100 for n in numbers)
        assert 1 <= target <= 100
        # The planted expression uses every number once and reaches the target.
        assert env.score(problem, f"<answer>{problem.answer}</answer>").success, problem
    assert make_env("countdown").problem(7) == env.problem(7)
    three = make_env("countdown", num_numbers=3, max_number=9, min_target=10, max_target=50)
    for seed in range(50):
        problem = three.problem(seed)
        assert len(problem.meta["numbers"]) == 3 and 10 <= problem.meta["target"] <= 50


@pytest.mark.parametrize(
    ("answer", "fmt", "numbers", "solved"),
    [
        ("<answer>(3 + 5) * 2 - 6</answer>", 1.0, 1.0, 1.0),
        ("<answer>2 * (5 + 3) - 6 = 10</answer>", 1.0, 1.0, 1.0),  # text after "=" ignored
        ("<answer>6 / 2 + 3 + 5 - 1</answer>", 1.0, 0.0, 0.0),  # 1 is not given
        ("<answer>(3 + 5) * 2</answer>", 1.0, 0.0, 0.0),  # 6 unused: all are required
        ("<answer>3 + 5 + 2 + 6</answer>", 1.0, 1.0, 0.0),  # the numbers, not the target
        ("<answer>(3 + 5) * 2 - 6 - 6</answer>", 1.0, 0.0, 0.0),  # 6 twice
        ("<answer>3 / (5 - 5) + 2 + 6</answer>", 0.5, 0.0, 0.0),  # division by zero
        ("<answer>-3 + 5 * 2 + 6</answer>", 0.5, 0.0, 0.0),  # unary minus
        ("<answer>2 ** 3 + 5 - 6</answer>", 0.5, 0.0, 0.0),  # powers
        ("<answer>__import__('os')</answer>", 0.5, 0.0, 0.0),  # names, calls
        ("<answer>3.0 + 5 + 2 + 6</answer>", 0.5, 0.0, 0.0),  # only integers
        ("<answer>10</answer>", 1.0, 0.0, 0.0),
        ("(3 + 5) * 2 - 6", 0.0, 0.0, 0.0),  # no tags
        ("<answer>" + "(" * 300 + "3" + ")" * 300 + "</answer>", 0.5, 0.0, 0.0),  # too long
    ],
)
def test_countdown_grades_expressions_exactly_without_eval(
    answer: str, fmt: float, numbers: float, solved: float
) -> None:
    env = make_env("countdown")
    problem = Problem(1, [], "(3 + 5) * 2 - 6", {"numbers": [3, 5, 2, 6], "target": 10})
    score = env.score(problem, answer)
    assert score.components == {"format": fmt, "numbers": numbers, "solved": solved}
    assert score.success == (solved == 1.0)
    assert score.reward == pytest.approx(0.1 * fmt + 0.9 * solved)
    # At most once instead of exactly once: a subset of the numbers is enough.
    subset = make_env("countdown", use_all_numbers=False).score(problem, "<answer>5 + 5</answer>")
    assert subset.components["numbers"] == 0.0  # 5 twice
    fewer = make_env("countdown", use_all_numbers=False).score(problem, "<answer>5 * 2</answer>")
    assert fewer.success


def test_countdown_rejects_bad_configuration_naming_the_key() -> None:
    for kwargs, match in (
        ({"num_numbers": 1}, "num_numbers must be an integer >= 2"),
        ({"min_number": 5, "max_number": 4}, "min_number=5 is above max_number=4"),
        ({"min_target": 9, "max_target": 3}, "min_target=9 is above max_target=3"),
        ({"solved_weight": -1}, "solved_weight must be >= 0"),
        ({"use_all_numbers": "yes"}, "use_all_numbers must be true or false"),
    ):
        with pytest.raises(ConfigError, match=match):
            make_env("countdown", **kwargs)
    impossible = make_env("countdown", num_numbers=2, max_number=1, min_target=50)
    with pytest.raises(ValueError, match="no target in \\[50, 100\\] found for seed 0"):
        impossible.problem(0)
