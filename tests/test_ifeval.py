"""The IFEval environment (grail/envs/ifeval.py, `env=ifeval`) over rows written here in
google/IFEval's shape: its problems, TorchRL's reward on followed and unfollowed responses, the
graded <answer> block, the Hub path (google/IFEval held out by prompt), and rows refused by name."""

from __future__ import annotations

import csv
import inspect
import json
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from grail.core.errors import UserError
from grail.envs import instructions
from grail.envs.base import Problem
from grail.envs.dataset import DatasetError
from grail.envs.ifeval import COMPONENTS, SYSTEM_PROMPT, IFEvalEnv, blocks
from grail.envs.instructions import LanguageDetectionUnavailableError

REPO = Path(__file__).resolve().parents[1]
# google/IFEval's kwargs carry every instruction's keys, null where unused
ALL_KEYS = sorted({a for spec in instructions.INSTRUCTIONS.values() for a in spec.arguments})


def _kwargs(**given: Any) -> dict[str, Any]:
    return {key: given.get(key) for key in ALL_KEYS}


def _row(key: int, prompt: str, *instructions_: tuple[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        "key": key,
        "prompt": prompt,
        "instruction_id_list": [i for i, _ in instructions_],
        "kwargs": [_kwargs(**k) for _, k in instructions_],
    }


NO_COMMA = ("punctuation:no_comma", {})
END_BYE = ("startend:end_checker", {"end_phrase": "Bye."})
TRAIN = [
    _row(1000, "Describe tea without commas; end with 'Bye.'", NO_COMMA, END_BYE),
    _row(1001, "End your note with 'Bye.'", END_BYE),
    _row(1002, "Give a title in <<>>.", ("detectable_format:title", {})),
    _row(1003, "Two bullets.", ("detectable_format:number_bullet_lists", {"num_bullets": 2})),
]
TEST = [
    _row(2000, "Write about rain in JSON.", ("detectable_format:json_format", {})),
    _row(2001, "Quote it all.", ("startend:quotation", {})),
]


def _write(tmp_path: Path, rows: list[dict[str, Any]], name: str = "train") -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _env(tmp_path: Path, rows: list[dict[str, Any]] = TRAIN, **kwargs: Any) -> IFEvalEnv:
    return IFEvalEnv(
        path=str(_write(tmp_path, rows)), test_path=str(_write(tmp_path, TEST, "test")), **kwargs
    )


@pytest.fixture
def without_langdetect(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    instructions._language_detector.cache_clear()
    monkeypatch.setitem(sys.modules, "langdetect", None)  # `import langdetect` raises
    yield
    instructions._language_detector.cache_clear()


def test_a_problem_is_an_ifeval_row(tmp_path: Path) -> None:
    env = _env(tmp_path)
    assert len(env) == 4 and env.name == "ifeval" and env.components == COMPONENTS
    problem = env.problem(4)  # seeds wrap around the rows
    assert problem.prompt_messages == [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": TRAIN[0]["prompt"]},
    ]
    assert problem.answer == ""
    assert problem.meta == {
        "row": 0,
        "split": "train",
        "key": 1000,
        "instruction_id_list": TRAIN[0]["instruction_id_list"],
        "kwargs": TRAIN[0]["kwargs"],
    }
    test = _env(tmp_path, split="test", system_prompt="")
    assert test.problem(1).prompt_messages == [{"role": "user", "content": "Quote it all."}]


@pytest.mark.parametrize(
    ("completion", "components", "reward"),
    [
        # everything followed, with one think and one answer block: TorchRL's maximum
        ("<think>plan</think>\n<answer>\nTea is warm and calm. Bye.\n</answer>",
         (1, 1, 1, 1, 1, 1), 1.15),
        # the comma breaks one instruction of two, strictly and loosely
        ("<think>plan</think><answer>Tea, warm. Bye.</answer>", (0, 0.5, 0, 0.5, 1, 1), 0.35),
        # the stars break the ending strictly only; no think block
        ("<answer>\nTea is warm\n**Bye.**\n</answer>", (0, 0.5, 1, 1, 1, 0), 0.55),
        # no answer block: the graded response is empty and follows nothing
        ("<think>x</think> Tea is warm. Bye.", (0, 0, 0, 0, 0, 1), 0.05),
        # two answer blocks: the first is graded, and no format reward
        ("<answer>Tea. Bye.</answer><answer>Tea, Bye</answer>", (1, 1, 1, 1, 0, 0), 1.0),
    ],
)  # fmt: skip
def test_the_reward_is_torchrls(
    tmp_path: Path, completion: str, components: tuple[float, ...], reward: float
) -> None:
    env = _env(tmp_path)
    score = env.score(env.problem(0), completion)
    assert tuple(score.components) == COMPONENTS
    assert tuple(score.components.values()) == pytest.approx(components)
    assert score.reward == pytest.approx(reward)
    assert score.success is (components[0] == 1)


def test_the_whole_completion_is_graded_without_answer_block(tmp_path: Path) -> None:
    env = _env(tmp_path, answer_block=False)
    problem = env.problem(1)
    followed = env.score(problem, "Tea is warm. Bye.")
    assert followed.success and followed.reward == pytest.approx(1.0)
    tagged = env.score(problem, "<answer>Tea. Bye.</answer>")  # the tag is after "Bye."
    assert not tagged.success and tagged.components["answer_format"] == 1.0


def test_weights_scale_the_components_and_are_checked(tmp_path: Path) -> None:
    env = _env(
        tmp_path,
        all_followed_weight=1.0,
        instructions_followed_weight=0.0,
        all_followed_loose_weight=0.0,
        instructions_followed_loose_weight=0.0,
        answer_format_weight=0.0,
        think_format_weight=0.0,
    )
    assert env.score(env.problem(1), "<answer>Bye.</answer>").reward == 1.0
    assert env.score(env.problem(1), "<think>t</think><answer>Hi</answer>").reward == 0.0
    with pytest.raises(ValueError, match="think_format_weight must be >= 0"):
        _env(tmp_path, think_format_weight=-0.1)
    with pytest.raises(ValueError, match="answer_block must be true or false"):
        _env(tmp_path, answer_block="yes")


def test_blocks_are_found_as_torchrls_findall_finds_them() -> None:
    texts = [
        "",
        "<answer>a</answer>",
        "<answer>a</answer> <answer>b</answer>",
        "<answer><answer>inner</answer></answer>",
        "<answer>unclosed <answer>x</answer>",
        "</answer><answer>\nmulti\nline\n</answer><answer>",
    ]
    for text in texts:
        assert blocks(text, "answer") == re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    # linear: many unclosed opening tags do not stall it
    assert blocks("<answer>" * 200_000, "answer") == []


def test_a_problem_of_another_environment_is_refused(tmp_path: Path) -> None:
    env = _env(tmp_path)
    with pytest.raises(ValueError, match="not made by the ifeval environment"):
        env.score(Problem(seed=0, prompt_messages=[], answer=""), "text")


def test_a_csv_file_holds_the_lists_as_json(tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(TRAIN[0]))
        writer.writeheader()
        for row in TRAIN:
            writer.writerow(
                {k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()}
            )
    env = IFEvalEnv(path=str(path), test_path=str(_write(tmp_path, TEST, "test")))
    assert env.score(env.problem(0), "<answer>Tea is calm. Bye.</answer>").success


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"instruction_id_list": None}, r"missing field\(s\) \['instruction_id_list'\]"),
        ({"kwargs": None}, r"missing field\(s\) \['kwargs'\]"),
        ({"instruction_id_list": ["punctuation:no_coma"]},
         r"row 1 \(key 1001\): unknown IFEval instruction id 'punctuation:no_coma' "
         r"\(did you mean 'punctuation:no_comma'\?\)"),
        ({"kwargs": [_kwargs(end_phrase="Bye.", num_words=3)]},
         r"row 1 \(key 1001\): instruction 'startend:end_checker' does not take argument\(s\) "
         r"\['num_words'\]"),
        ({"kwargs": [_kwargs()]},
         r"'startend:end_checker' needs argument\(s\) \['end_phrase'\]"),
        ({"kwargs": []}, r"'kwargs' must be a list of 1 dict\(s\), one per instruction"),
        ({"instruction_id_list": []}, "must be a non-empty list of instruction ids"),
        ({"instruction_id_list": "punctuation:no_comma"},
         "'instruction_id_list' is text but not JSON"),
        ({"kwargs": ["end_phrase"]}, "the kwargs of 'startend:end_checker' must be a dict"),
    ],
)  # fmt: skip
def test_bad_rows_are_refused_naming_the_row(
    tmp_path: Path, change: dict[str, Any], message: str
) -> None:
    row = {**TRAIN[1], **change}
    rows = [TRAIN[0], {k: v for k, v in row.items() if v is not None}, *TRAIN[2:]]
    with pytest.raises(DatasetError, match=message) as info:
        _env(tmp_path, rows)
    assert "train.jsonl row 1" in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, UserError)


@pytest.mark.usefixtures("without_langdetect")
def test_language_rows_without_langdetect_are_refused_at_construction(tmp_path: Path) -> None:
    rows = [
        *TRAIN,
        _row(1004, "Answer in French.", ("language:response_language", {"language": "fr"})),
    ]
    with pytest.raises(LanguageDetectionUnavailableError, match="uv sync --extra ifeval"):
        _env(tmp_path, rows)
    _env(tmp_path)  # rows without one need nothing


def test_language_rows_are_graded_with_langdetect(tmp_path: Path) -> None:
    pytest.importorskip("langdetect")
    rows = [_row(1004, "Answer in French.", ("language:response_language", {"language": "fr"}))]
    env = _env(tmp_path, [*rows, *TRAIN])
    french = "<answer>Le thé est une boisson chaude que nous aimons beaucoup.</answer>"
    assert env.score(env.problem(0), french).success
    assert not env.score(env.problem(0), "<answer>Tea is a warm drink we love.</answer>").success


def _hub(monkeypatch: pytest.MonkeyPatch, rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    calls: list[tuple[Any, ...]] = []

    def load_dataset(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
        calls.append((name, config, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_google_ifeval_from_the_hub_is_held_out_by_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [*TRAIN, *TEST, *(_row(3000 + i, f"Say hi {i}.", NO_COMMA) for i in range(14))]
    calls = _hub(monkeypatch, rows)
    train, test = IFEvalEnv(), IFEvalEnv(split="test")
    # google/IFEval has one split: both sides read it and hold out 10% of its prompts
    assert calls == [("google/IFEval", None, "train")] * 2
    assert (len(train), len(test)) == (18, 2)
    prompts = [{r.prompt for r in env.records} for env in (train, test)]
    assert not prompts[0] & prompts[1]
    assert prompts[0] | prompts[1] == {r["prompt"] for r in rows}
    # a copy with its own test split uses it whole
    other = IFEvalEnv(hub="someone/ifeval", hub_test_split="validation", split="test")
    assert calls[-1] == ("someone/ifeval", None, "validation") and len(other) == len(rows)


def test_a_bad_hub_row_is_named_by_its_split(monkeypatch: pytest.MonkeyPatch) -> None:
    _hub(monkeypatch, [*TRAIN, {**TEST[0], "instruction_id_list": ["nope"]}])
    with pytest.raises(DatasetError, match=r"google/IFEval\[dev\] row 4 \(key 2000\): unknown"):
        IFEvalEnv(split="test", hub_test_split="dev")


def test_the_config_declares_exactly_the_constructors_arguments() -> None:
    """conf/env/ifeval.yaml, as tests/test_envs.py checks every registered environment's."""
    data = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "env" / "ifeval.yaml"))
    assert isinstance(data, dict) and data["data"]["environment"] == "ifeval"
    declared = data["data"]["env_kwargs"]
    arguments = {p.name: p.default for p in inspect.signature(IFEvalEnv).parameters.values()}
    assert list(declared) == list(arguments)
    for key, default in arguments.items():
        assert declared[key] == default and type(declared[key]) is type(default), key
