"""TRL's environment classes under grail (`env=trl`, grail/envs/trl_environment.py): `reset`
gets the row, its string joins the prompt, public methods are the tools, `get_reward` the reward,
through the real turn loop with scripted policies; and what is refused."""

from __future__ import annotations

import asyncio
import json
import re
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import trl_classes
from helpers.docs_examples import install_example
from helpers.scripted import Policy, ScriptedPolicy

from grail.core.errors import ConfigError
from grail.envs import make_env
from grail.envs.episodes import is_episodic
from grail.inference.completions import SamplingParams
from grail.models.loading import load_tokenizer
from grail.rollouts.batch import RolloutBatch, Sample
from grail.rollouts.episodes import EpisodeLimits
from grail.rollouts.generation import RolloutGenerator


def _rows(tmp_path: Path, targets: Sequence[int]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Reach {t}.", "target": str(t), "level": i}) + "\n"
            for i, t in enumerate(targets)
        )
    )
    return path


@pytest.fixture
def rows(tmp_path: Path) -> Path:
    _rows(tmp_path, [2, 3, 5, 1, 4, 6])
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "Reach 9.", "target": "9"}) + "\n")
    return tmp_path / "rows.jsonl"


def _make(rows: Path, cls: str = "Counter", **kwargs: Any) -> Any:
    return make_env(
        "trl",
        environment_factory=f"helpers.trl_classes:{cls}",
        path=str(rows),
        test_path=str(rows.with_name("test.jsonl")),
        **kwargs,
    )


def _call(step: int, name: str = "increment") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"step": {step}}}}}\n</tool_call>'


def _batch(env: Any, policy: Policy, seeds: Sequence[int], tokenizer: Any) -> RolloutBatch:
    generator = RolloutGenerator(
        env,
        tokenizer,
        ScriptedPolicy(tokenizer, policy),
        SamplingParams(max_tokens=64),
        episodes=EpisodeLimits(max_turns=4, max_tokens=2048, step_timeout_s=10.0),
    )
    return asyncio.run(generator.generate(list(seeds), 1))


def _episodes(env: Any, policy: Policy, seeds: Sequence[int], tokenizer: Any) -> list[Sample]:
    return _batch(env, policy, seeds, tokenizer).samples


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _target(conversation: str) -> int:
    return int(re.findall(r"Reach (\d+)\.", conversation)[0])


def _counter(conversation: str) -> int:
    responses = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", conversation, re.S)
    return int(responses[-1]) if responses else 0


@pytest.mark.parametrize("cls", ["Counter", "AsyncCounter"])
def test_a_policy_that_uses_the_tool_to_reach_the_target_gets_the_environments_reward(
    rows: Path, tokenizer: Any, cls: str
) -> None:
    env = _make(rows, cls)
    assert is_episodic(env)

    def policy(conversation: str) -> str:
        left = _target(conversation) - _counter(conversation)
        return _call(min(left, 3)) if left else "done"

    trl_classes.RESETS.clear()
    samples = _episodes(env, policy, range(6), tokenizer)
    for sample in samples:
        assert sample.reward == 1.0 and sample.success and sample.components == {"env_reward": 1.0}
        assert sample.episode is not None and sample.episode.tool_errors == 0
        assert sample.episode.tool_calls >= 1
    # reset got each row's fields, the prompt as the row holds it
    assert {r["prompt"] for r in trl_classes.RESETS} == {f"Reach {t}." for t in (2, 3, 5, 1, 4, 6)}
    assert all(set(r) == {"target", "prompt", "level"} for r in trl_classes.RESETS)


def test_resets_string_is_appended_to_the_prompt_and_methods_are_the_tools(rows: Path) -> None:
    env = _make(rows)
    episode = env.reset(0)
    assert episode.problem.prompt_messages[-1]["content"].endswith(". The counter is at 0.")
    assert [t.__name__ for t in episode.tools] == ["increment"]
    assert episode.tools[0](1) == "1"  # results as TRL writes them: str(result)
    assert episode.step("done").reward == 0.0  # row 0's target is 2
    again = env.reset(0)  # a new instance per episode: its counter starts at 0
    assert again.tools[0](2) == "2" and again.step("done").reward == 1.0
    silent = _make(rows, "Silent").reset(0)
    assert silent.problem.prompt_messages[-1]["content"] == "Reach 2."
    assert silent.tools == [] and silent.step("x").reward == 0.0


def test_a_policy_that_answers_without_the_tool_earns_nothing(rows: Path, tokenizer: Any) -> None:
    samples = _episodes(_make(rows), lambda conversation: "5", range(6), tokenizer)
    assert [s.reward for s in samples] == [0.0] * 6
    assert all(s.episode is not None and s.episode.turns == 1 for s in samples)


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("", "environment_factory must name the class"),
        ("helpers.trl_classes", "not a 'package.module:attribute' spec"),
        ("helpers.no_such_module:Env", "module 'helpers.no_such_module' not found"),
        ("helpers.trl_classes:NoReset", "is not a class with reset"),
    ],
)
def test_a_class_that_is_not_an_environment_is_refused_naming_it(
    rows: Path, factory: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        make_env("trl", environment_factory=factory, path=str(rows))


def test_ids_and_mask_are_those_trls_own_code_builds(rows: Path, tokenizer: Any) -> None:
    """One scripted episode (a tool call, its result, the answer) under grail, against the ids
    and tool mask TRL's GRPOTrainer builds for it: its prompt (`_tokenize_prompts`: the chat
    template with the instance's methods as tools, reset's string appended), the sampled turns
    as sampled, and between them the tool message's ids from TRL's own `_get_tool_suffix_ids`,
    masked 0 (`_tool_call_loop`)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    env = _make(rows)

    def policy(conversation: str) -> str:
        return _call(2) if _counter(conversation) == 0 else "done"

    (group,) = _batch(env, policy, [0], tokenizer).groups
    (sample,) = group.samples
    assert sample.reward == 1.0 and sample.sampled_mask is not None

    # TRL's side, from the same row: reset's string on the last user message, methods as tools.
    instance = trl_classes.Counter()
    prompt = [{"role": "user", "content": "Reach 2." + instance.reset(target="2")}]
    trl_prompt = tokenizer.apply_chat_template(
        conversation=[prompt],
        tools=[instance.increment],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"][0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    first = tokenizer(_call(2), add_special_tokens=False)["input_ids"] + [end]
    answer = tokenizer("done", add_special_tokens=False)["input_ids"] + [end]
    trainer = types.SimpleNamespace(
        processing_class=tokenizer,
        _tokenizer=tokenizer,
        chat_template=None,
        chat_template_kwargs={},
        _is_vlm=False,
    )
    tool_message = {"role": "tool", "name": "increment", "content": str(instance.increment(2))}
    suffix = GRPOTrainer._get_tool_suffix_ids(trainer, [tool_message])  # type: ignore[arg-type]

    assert "<tool_response>\n2\n</tool_response>" in tokenizer.decode(suffix)
    assert "increment" in tokenizer.decode(trl_prompt)  # the tool described
    assert group.prompt_ids == list(trl_prompt)
    assert sample.completion_ids == first + suffix + answer
    assert sample.sampled_mask == [1] * len(first) + [0] * len(suffix) + [1] * len(answer)


def test_the_docs_example_runs_as_written(
    rows: Path, tokenizer: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_example(
        "environments.md",
        "## TRL environment classes (`env=trl`)",
        "my_envs",
        tmp_path,
        monkeypatch,
    )
    env = make_env(
        "trl",
        environment_factory="my_envs:Counter",
        path=str(rows),
        test_path=str(rows.with_name("test.jsonl")),
    )

    def policy(conversation: str) -> str:
        left = _target(conversation) - _counter(conversation)
        return _call(min(left, 3)) if left else "done"

    assert [s.reward for s in _episodes(env, policy, range(6), tokenizer)] == [1.0] * 6


def test_a_run_trains_on_a_trl_environment_class(rows: Path, tmp_path: Path) -> None:
    """docs/environments.md's TRL example, shorter: grail-train with env=trl on the tiny model."""
    from helpers.short_runs import one_iteration

    records = one_iteration(
        tmp_path / "run",
        "env=trl",
        "data.env_kwargs.environment_factory=helpers.trl_classes:Counter",
        f"data.env_kwargs.path={rows}",
        f"data.env_kwargs.test_path={rows.with_name('test.jsonl')}",
        "data.max_turns=2",
        "generation.max_new_tokens=8",
    )
    assert all("reward_mean" in r and r["episodes"]["turns_mean"] >= 1 for r in records)
