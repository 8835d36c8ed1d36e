"""Dataset tasks (grail/envs/dataset.py, `env=dataset`; `env=math`): files of every kind give the
same problems, prompts from a field or a template, each checker, splits that never share a
prompt, clear refusals, the Hub path, and a training run on a dataset written here."""

from __future__ import annotations

import csv
import json
import sys
import types
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grail.core.errors import ConfigError
from grail.envs import make_env
from grail.envs.answers import check
from grail.envs.dataset import DataFileNotFoundError, DatasetEnv, DatasetError

ROWS = [
    {"question": f"What is {a} + {b}?", "answer": str(a + b), "level": a % 3}
    for a, b in [(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (6, 1), (8, 8), (4, 0), (5, 5), (9, 3)]
]


def _write(tmp_path: Path, rows: list[dict[str, Any]], suffix: str, name: str = "data") -> Path:
    path = tmp_path / f"{name}{suffix}"
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return path


def _env(path: Path, **kwargs: Any) -> DatasetEnv:
    kwargs = {"prompt_field": "question", "checker": "number", **kwargs}
    return make_env("dataset", path=str(path), **kwargs)  # type: ignore[return-value]


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_every_file_kind_gives_the_same_problems(tmp_path: Path, suffix: str) -> None:
    jsonl = _env(_write(tmp_path, ROWS, ".jsonl"))
    other = _env(_write(tmp_path, ROWS, suffix))
    for seed in range(12):
        a, b = jsonl.problem(seed), other.problem(seed)
        assert a.prompt_messages == b.prompt_messages and a.answer == b.answer
        # CSV reads every field as text, as the file has it
        assert str(a.meta["level"]) == str(b.meta["level"])
    assert len(jsonl) == 9  # 10 rows, one held out


def test_a_problem_is_its_row_with_the_other_fields_as_meta(tmp_path: Path) -> None:
    rows = [{**r, "answers": "x", "completions": "y"} for r in ROWS]
    env = _env(_write(tmp_path, rows, ".jsonl"), system_prompt="Be brief.", holdout_fraction=0.5)
    n = len(env)
    for seed in (0, 3, n, 7 * n + 2):
        p = env.problem(seed)
        record = env.records[seed % n]
        assert p.prompt_messages == [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": record.prompt},
        ]
        # the row's fields, less the prompt and the reward functions' own argument names
        assert p.meta == {
            "row": record.index,
            "split": "train",
            "answer": p.answer,
            "level": record.fields["level"],
        }


def test_a_prompt_template_fills_in_fields_and_refuses_what_it_cannot(tmp_path: Path) -> None:
    path = _write(tmp_path, ROWS, ".jsonl")
    env = _env(path, prompt_template="Q: {question} (level {level})")
    assert env.problem(0).prompt_messages[-1]["content"] == (
        f"Q: {env.records[0].fields['question']} (level {env.records[0].fields['level']})"
    )
    with pytest.raises(DatasetError, match=r"missing field\(s\) \['topic'\]"):
        _env(path, prompt_template="{topic}: {question}")
    with pytest.raises(ConfigError, match=r"prompt_template may only name fields"):
        _env(path, prompt_template="{question.__class__}")


def test_splits_never_share_a_prompt(tmp_path: Path) -> None:
    path = _write(tmp_path, ROWS + ROWS[:3], ".jsonl")  # three prompts twice
    train, test = _env(path, holdout_fraction=0.3), _env(path, holdout_fraction=0.3, split="test")
    assert not {r.prompt for r in train.records} & {r.prompt for r in test.records}
    assert len(train) + len(test) == 13

    train_file = _write(tmp_path, ROWS[:6], ".jsonl", "train")
    test_file = _write(tmp_path, ROWS[4:], ".jsonl", "test")  # rows 4 and 5 in both
    with pytest.raises(DatasetError, match=r"2 prompt\(s\) are in both .*train.jsonl and .*test"):
        _env(train_file, test_path=str(test_file))
    test_file = _write(tmp_path, ROWS[6:], ".jsonl", "test")
    assert len(_env(train_file, test_path=str(test_file), split="test")) == 4


@pytest.mark.parametrize(
    ("checker", "reference", "right", "wrong"),
    [
        ("number", "0.5", ["<answer>1/2</answer>", "so it is 0.50"], ["<answer>2</answer>"]),
        ("exact", "Paris", ["<answer> Paris </answer>", "Paris"], ["<answer>paris</answer>"]),
        (
            "math",
            "so $x = \\boxed{\\frac{1}{2}}$",
            [
                "<answer>\\boxed{0.5}</answer>",
                "The answer is $1/2$.",
                "<answer>$\\frac{1}{2}$</answer>",
            ],
            ["<answer>\\boxed{2}</answer>", "I do not know"],
        ),
        ("none", "anything", [], ["anything", "<answer>anything</answer>"]),
    ],
)
def test_each_checker(
    tmp_path: Path, checker: str, reference: str, right: list[str], wrong: list[str]
) -> None:
    rows = [{"prompt": f"p{i}", "answer": reference} for i in range(4)]
    env = make_env("dataset", path=str(_write(tmp_path, rows, ".jsonl")), checker=checker)
    problem = env.problem(0)
    for text in right:
        assert env.score(problem, text).components["correct"] == 1.0, text
        assert env.score(problem, text).success
    for text in wrong:
        assert env.score(problem, text).components["correct"] == 0.0, text


def test_math_env_reads_matHs_fields_and_grades_equivalent_answers(tmp_path: Path) -> None:
    rows = [
        {"problem": "Halve 1.", "solution": "Half of one is $\\boxed{\\frac{1}{2}}$."},
        {"problem": "Square 3.", "solution": "$3^2 = \\boxed{9}$"},
        {"problem": "Root of 16?", "solution": "$\\sqrt{16} = \\boxed{4}$"},
    ]
    env = make_env("math", path=str(_write(tmp_path, rows, ".jsonl")), holdout_fraction=0.34)
    by_prompt = {env.problem(s).prompt_messages[-1]["content"]: env.problem(s) for s in range(2)}
    for prompt, problem in by_prompt.items():
        good = {"Halve 1.": "0.5", "Square 3.": "9", "Root of 16?": "4.0"}[prompt]
        score = env.score(problem, f"<answer>\\boxed{{{good}}}</answer>")
        assert score.components == {"correct": 1.0, "format": 1.0}
        assert env.score(problem, "<answer>\\boxed{7}</answer>").reward == pytest.approx(0.1)
    assert check("math", "\\frac{1}{2}", "x" * 100_000 + " 1/2")  # only the tail is read


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({}, ConfigError, "name the data: path .* or hub"),
        ({"path": "/nope/data.jsonl"}, DataFileNotFoundError, "data file not found: /nope"),
        ({"checker": "regex", "path": "x.jsonl"}, ConfigError, "checker must be one of number"),
        ({"path": "a.jsonl", "hub": "b/c"}, ConfigError, "path and hub are both set"),
    ],
)
def test_bad_settings_are_refused_in_one_line(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        make_env("dataset", **kwargs)


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        ([{"question": "q", "answer": "1"}], {}, r"data.jsonl:1: missing field\(s\) \['prompt'\]"),
        ([{"prompt": 3, "answer": "1"}], {}, r"data.jsonl:1: 'prompt' must be a string"),
        ([{"prompt": "q", "answer": "one"}], {"checker": "number"}, "number checker cannot read"),
        ([{"prompt": "q", "answer": "1"}], {"answer_after": "####"}, "does not end with '####"),
        ([{"prompt": "q", "answer": ["1"]}], {}, "'answer' must be a string or a number"),
    ],
)
def test_bad_rows_are_named(
    tmp_path: Path, rows: list[dict[str, Any]], kwargs: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path, rows * 2, ".jsonl")
    with pytest.raises(DatasetError, match=message):
        make_env("dataset", path=str(path), **kwargs)


def test_a_hub_dataset_goes_through_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def load_dataset(*args: object, **kwargs: object) -> list[dict[str, Any]]:
        calls.append((args, kwargs))
        return [{"prompt": f"{kwargs['split']} {i}", "answer": str(i)} for i in range(3)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    env = make_env("dataset", hub="someone/sums", hub_config="v2", hub_test_split="validation")
    test = make_env("dataset", hub="someone/sums", split="test", hub_test_split="validation")
    assert env.problem(1).prompt_messages[-1]["content"] == "train 1"
    assert test.problem(1).prompt_messages[-1]["content"] == "validation 1"
    assert calls[0] == (("someone/sums", "v2"), {"split": "train"})
    assert calls[1] == (("someone/sums", None), {"split": "validation"})


def test_a_run_trains_on_a_dataset_written_here(tmp_path: Path) -> None:
    """docs/environments.md's example, shorter: grail-train on a file of sums, evaluated on its
    held-out rows."""
    from helpers.short_runs import short_config, train_records

    from grail.train.loop import run

    rows = [{"question": f"{a} + 1 =", "answer": str(a + 1)} for a in range(40)]
    path = _write(tmp_path, rows, ".jsonl")
    cfg = short_config(
        "env=dataset",
        f"data.env_kwargs.path={path}",
        "data.env_kwargs.prompt_field=question",
        "data.env_kwargs.checker=number",
        "generation.max_new_tokens=8",
        "train.iterations=1",
        "data.problems_per_iteration=4",
        "eval.num_ids=8",
    )
    run(cfg, tmp_path / "run")
    records = train_records(tmp_path / "run")
    assert [r["iteration"] for r in records] == [0]
    evals = sorted((tmp_path / "run" / "metrics").glob("eval_iter_*.json"))
    assert evals, "the held-out rows were evaluated"
    assert all(0.0 <= r["success_rate"] <= 1.0 and "reward_mean" in r for r in records)


def test_a_conversational_prompt_is_taken_as_its_messages(tmp_path: Path) -> None:
    """TRL's dataset format: the prompt field a list of messages ending with the user's."""
    rows = [
        {"prompt": [{"role": "user", "content": f"Say {i}."}], "answer": str(i)} for i in range(6)
    ]
    rows[0]["prompt"].insert(0, {"role": "system", "content": "Terse."})
    held_out = _write(
        tmp_path, [{"prompt": [{"role": "user", "content": "?"}], "answer": "9"}], ".jsonl", "test"
    )
    path = _write(tmp_path, rows, ".jsonl")
    env = make_env("dataset", path=str(path), test_path=str(held_out), system_prompt="Hi.")
    assert env.problem(3).prompt_messages == [
        {"role": "system", "content": "Hi."},
        {"role": "user", "content": "Say 3."},
    ]
    # the row's own system message is kept, the configured one not added
    assert env.problem(0).prompt_messages == rows[0]["prompt"]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "chat.parquet")
    parquet = make_env(
        "dataset", path=str(tmp_path / "chat.parquet"), test_path=str(held_out), system_prompt="Hi."
    )
    assert [parquet.problem(s) for s in range(6)] == [env.problem(s) for s in range(6)]
    bad = [{"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}] * 2
    with pytest.raises(DatasetError, match="'prompt' must end with a user message"):
        make_env("dataset", path=str(_write(tmp_path, bad, ".jsonl", "bad")))
    bad = [{"prompt": [{"role": "user", "content": 3}], "answer": "1"}] * 2
    with pytest.raises(DatasetError, match=r"'prompt'\[0\] must be a message"):
        make_env("dataset", path=str(_write(tmp_path, bad, ".jsonl", "bad2")))
