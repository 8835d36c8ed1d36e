"""verifiers tasksets under grail (`env=verifiers`): a taskset and an in-process harness written as
prime-rl users write them (tests/verifiers_digits.py), run by verifiers' own rollout code against
grail's gateway (grail/rollouts/verifiers.py): its token ids, mask and log-probs become samples,
seeds reach every call, and a short run trains on it with the built-in server. verifiers cannot
be installed beside openenv, vllm or sglang: .ci/run runs this file in a second environment."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "verifiers.v1",
    reason="verifiers is not installed: uv sync --group dev --group verifiers (.ci/run does)",
)

from helpers.docs_examples import install_example  # noqa: E402
from helpers.scripted import ScriptedPolicy  # noqa: E402

from grail.core.errors import ConfigError  # noqa: E402
from grail.envs import make_env  # noqa: E402
from grail.inference.completions import Completion, SamplingParams  # noqa: E402
from grail.models.loading import load_tokenizer  # noqa: E402
from grail.rollouts.batch import Group  # noqa: E402
from grail.rollouts.episodes import EpisodeLimits, turn_seed  # noqa: E402
from grail.rollouts.generation import RolloutGenerator, render_prompt_ids  # noqa: E402
from grail.rollouts.seeds import request_seed  # noqa: E402

TASKSET = "verifiers_digits"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _policy(conversation: str) -> str:
    """Repeat the digits; reverse them when asked, but only right for an even first digit."""
    digits = re.findall(r"Repeat: (\d+)", conversation)[0]
    if "reversed" not in conversation:
        return digits
    return digits[::-1] if int(digits[0]) % 2 == 0 else digits


class Recording(ScriptedPolicy):
    """The scripted policy, recording each call's prompt and seed."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer, _policy)
        self.seeds: list[int] = []

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        self.seeds.append(seed)
        return await super().complete(prompt_ids, n, sampling, seed)


def _groups(
    env: Any, client: Any, tokenizer: Any, seeds: Sequence[int], replicas: int
) -> list[Group]:
    generator = RolloutGenerator(
        env,
        tokenizer,
        client,
        SamplingParams(max_tokens=16),
        base_seed=7,
        episodes=EpisodeLimits(max_turns=4, max_tokens=512, step_timeout_s=30.0),
    )
    return list(asyncio.run(generator.generate(list(seeds), replicas)).groups)


def test_episodes_are_verifiers_traces_of_the_policys_turns(tokenizer: Any) -> None:
    env = make_env("verifiers", taskset=TASKSET)
    client = Recording(tokenizer)
    groups = _groups(env, client, tokenizer, range(4), 2)
    for seed, group in enumerate(groups):
        digits = env.task(seed).data.digits
        assert group.problem.prompt_messages == [{"role": "user", "content": f"Repeat: {digits}"}]
        # the prompt verifiers rendered is grail's rendering of the problem (rollout reuse)
        assert group.prompt_ids == render_prompt_ids(tokenizer, group.problem)
        want = 1.0 if int(digits[0]) % 2 == 0 else 0.5
        for sample in group.samples:
            assert sample.reward == want and sample.components == {"env_reward": want}
            assert sample.success == (want == 1.0)
            assert sample.episode is not None and sample.episode.turns == 2
            # the sampled tokens are the policy's two replies, the follow-up is context
            sampled = [
                t for t, m in zip(sample.completion_ids, sample.sampled_mask, strict=True) if m
            ]
            assert tokenizer.decode(sampled).count("<|im_end|>") == 2
            context = [
                t for t, m in zip(sample.completion_ids, sample.sampled_mask, strict=True) if not m
            ]
            assert "reversed" in tokenizer.decode(context)
            assert len(sample.behaviour_logprobs) == len(sample.completion_ids)
    # every call's seed: the replicate's, then turn_seed of it for the second call
    firsts = [request_seed(7, 0, p) + i for p in range(4) for i in range(2)]
    assert sorted(client.seeds) == sorted(firsts + [turn_seed(s, 1) for s in firsts])


def test_the_same_seeds_give_the_same_groups(tokenizer: Any) -> None:
    env = make_env("verifiers", taskset=TASKSET)
    once, again = (
        _groups(env, ScriptedPolicy(tokenizer, _policy), tokenizer, [3, 5], 2) for _ in range(2)
    )
    assert [[s.completion_ids for s in g.samples] for g in once] == [
        [s.completion_ids for s in g.samples] for g in again
    ]


def test_train_and_test_tasks_do_not_overlap() -> None:
    train = make_env("verifiers", taskset=TASKSET)
    test = make_env("verifiers", taskset=TASKSET, split="test")
    train_ids = {t.data.id for t in train.tasks}
    test_ids = {t.data.id for t in test.tasks}
    assert train_ids and test_ids and not train_ids & test_ids
    assert len(train_ids | test_ids) == 12


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "taskset must name the taskset's module"),
        ({"taskset": "no_such_taskset_module"}, "verifiers could not load taskset"),
        ({"taskset": TASKSET, "harness_args": {"x": 1}}, "harness_args without harness"),
        ({"taskset": TASKSET, "max_concurrent": 0}, "max_concurrent must be an integer >= 1"),
    ],
)
def test_what_verifiers_cannot_load_is_refused_naming_it(
    kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_env("verifiers", **kwargs)


def test_the_docs_example_runs_as_written(
    tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_example(
        "environments.md", "## verifiers (`env=verifiers`)", "my_tasks", tmp_path, monkeypatch
    )
    env = make_env("verifiers", taskset="my_tasks", holdout_fraction=0.25)
    groups = _groups(env, ScriptedPolicy(tokenizer, _policy), tokenizer, range(3), 2)
    assert [s.reward for g in groups for s in g.samples] == [1.0] * 6  # the first reply is right


def test_a_run_trains_on_a_verifiers_taskset(tmp_path: Path) -> None:
    """docs/environments.md's verifiers example, shorter: the tiny model on the built-in server."""
    from helpers.short_runs import one_iteration

    records = one_iteration(
        tmp_path / "run",
        "env=verifiers",
        f"data.env_kwargs.taskset={TASKSET}",
        "generation.max_new_tokens=4",
    )
    assert records[0]["episodes"]["turns_mean"] == 2.0  # the harness's two calls, each episode
