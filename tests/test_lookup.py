"""grail/envs/lookup.py: a tool task whose answer only the tool knows. The environment through
`reset`/`step` and the turn loop's ToolBox, scripted policies through the real turn loop
(grail/rollouts/episodes.py) with a fake completion client, the job's token budget against the
tiny tokenizer, and one real episode on the built-in server."""

from __future__ import annotations

import asyncio
import json
import re
import string
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.scripted import Policy, ScriptedPolicy
from omegaconf import OmegaConf

from grail.envs import make_env
from grail.envs.base import Problem
from grail.envs.copy_digits import CopyDigitsEnv
from grail.envs.episodes import EpisodeEnvironment, Step
from grail.envs.lookup import NO_SUCH_KEY, LookupEnv
from grail.envs.tools import ToolBox, ToolTurn
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.client import CompletionClient
from grail.inference.completions import SamplingParams
from grail.models.loading import load_model, load_tokenizer
from grail.rollouts.batch import Sample
from grail.rollouts.chat import ChatRenderer
from grail.rollouts.episodes import EpisodeLimits
from grail.rollouts.generation import RolloutGenerator

REPO = Path(__file__).resolve().parents[1]


def _call(key: str, name: str = "lookup") -> str:
    """A call as Qwen2.5's template renders it (the shortest form of one)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


def _answer(box: ToolBox, text: str) -> ToolTurn:
    turn = asyncio.run(box.answer(text, 5.0))
    assert turn is not None
    return turn


# ---------------------------------------------------------------------------------------------
# The environment, directly


def test_an_episode_is_deterministic_in_its_seed_and_its_prompt_holds_no_digit() -> None:
    env = LookupEnv()
    assert isinstance(env, EpisodeEnvironment) and make_env("lookup").name == "lookup"
    tables = set()
    for seed in range(50):
        a, b = env.reset(seed), env.reset(seed)
        assert a.problem == b.problem and a.table == b.table and a.key == b.key
        assert len(a.table) == 4 and a.key in a.table and a.problem.answer == a.table[a.key]
        assert all(k in string.ascii_lowercase and v in "0123456789" for k, v in a.table.items())
        (message,) = a.problem.prompt_messages
        assert f'key "{a.key}"' in message["content"]
        assert not any(c.isdigit() for c in message["content"])  # the answer is not in the prompt
        tables.add(tuple(a.table.items()))
    assert len(tables) == 50  # the seed, not a constant, makes the table
    assert len(LookupEnv(keys=26).reset(0).table) == 26
    for bad in (0, 27, 1.5, True):
        with pytest.raises(ValueError, match="keys must be an integer from 1 to 26"):
            LookupEnv(keys=bad)  # type: ignore[arg-type]


def test_no_answer_without_the_tool_beats_a_uniform_digit() -> None:
    """The value is a uniform digit whatever the key: the best constant answer succeeds on ~10%
    of the seeds, and no key predicts its value."""
    env = LookupEnv()
    episodes = [env.reset(seed) for seed in range(5000)]
    by_digit = Counter(e.problem.answer for e in episodes)
    assert max(by_digit.values()) / len(episodes) < 0.12
    for letter in "aq":  # nor does a key name tell its value
        values = Counter(e.problem.answer for e in episodes if e.key == letter)
        assert max(values.values()) / sum(values.values()) < 0.2


def test_calling_the_tool_then_answering_its_value_scores_one() -> None:
    episode = LookupEnv().reset(7)
    box = ToolBox(episode.tools)
    assert box.names == ["lookup"]
    turn = _answer(box, _call(episode.key))
    assert turn.messages == [{"role": "tool", "content": episode.table[episode.key]}]
    assert (turn.calls, turn.errors) == (1, 0)
    step = episode.step(episode.table[episode.key])
    assert step == Step(
        reward=1.0,
        done=True,
        success=True,
        components={"correct": 1.0, "found": 1.0, "brevity": 1.0, "looked_up": 1.0},
    )


def test_answering_without_the_tool_is_scored_as_copy_digits_against_the_value() -> None:
    copy = CopyDigitsEnv()
    for seed in range(20):
        value = LookupEnv().reset(seed).problem.answer
        wrong = str((int(value) + 1) % 10)
        for text in (value, wrong, f"{value} is it", "", f"{value}<|im_end|>"):
            episode = LookupEnv().reset(seed)  # a fresh episode: nothing looked up
            step = episode.step(text)
            expected = copy.score(Problem(seed, [], value), text)
            assert step.done and step.reward == expected.reward
            assert step.success == expected.success
            assert step.components == {**expected.components, "looked_up": 0.0}


def test_a_wrong_key_gets_another_value_or_no_such_key_and_is_not_looked_up() -> None:
    episode = LookupEnv(keys=26).reset(3)
    box = ToolBox(episode.tools)
    other = next(k for k in episode.table if k != episode.key)
    turn = _answer(box, _call(other) + _call("Q") + _call(f" {episode.key}"))
    # Another key of the table gives its value; a key not in it (exact match: " q" is not "q")
    # gives NO_SUCH_KEY.
    assert [m["content"] for m in turn.messages] == [episode.table[other], NO_SUCH_KEY, NO_SUCH_KEY]
    assert (turn.calls, turn.errors) == (3, 0)  # well-formed calls, not the policy's errors
    assert episode.step(episode.table[episode.key]).components["looked_up"] == 0.0


@pytest.mark.parametrize(
    ("text", "says", "calls"),
    [  # calls: well-formed calls of a known tool, even when their arguments do not fit
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}\n</tool_call>', "not valid", 0),
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}', "unclosed", 0),
        (_call("a", name="search"), "unknown tool 'search'", 0),
        ('<tool_call>\n{"name": "lookup", "arguments": {"key": 7}}\n</tool_call>', "string", 1),
        ('<tool_call>\n{"name": "lookup", "arguments": {"value": "a"}}\n</tool_call>', "value", 1),
    ],
)
def test_a_malformed_call_or_unknown_tool_is_a_tool_error_and_the_episode_goes_on(
    text: str, says: str, calls: int
) -> None:
    episode = LookupEnv().reset(11)
    turn = _answer(ToolBox(episode.tools), text)
    (message,) = turn.messages
    assert message["role"] == "tool" and message["content"].startswith("error: ")
    assert says in message["content"]
    assert (turn.calls, turn.errors) == (calls, 1)
    # The environment never saw the turn: the episode still takes a call and its answer.
    assert _answer(ToolBox(episode.tools), _call(episode.key)).messages[0]["content"] == (
        episode.problem.answer
    )
    assert episode.step(episode.problem.answer).success


# ---------------------------------------------------------------------------------------------
# Scripted policies through the turn loop


def _asked(conversation: str) -> str:
    """The key the user asked for (the last question in the conversation)."""
    return re.findall(r'value of key "(.)"', conversation)[-1]


def _responses(conversation: str) -> list[str]:
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", conversation, re.S)


def _turns(conversation: str) -> int:
    """Assistant turns so far (the generation prompt opens one more)."""
    return conversation.count("<|im_start|>assistant") - 1


def _episodes(tokenizer: Any, policy: Policy, max_turns: int, seeds: Sequence[int]) -> list[Sample]:
    generator = RolloutGenerator(
        LookupEnv(),
        tokenizer,
        ScriptedPolicy(tokenizer, policy),
        SamplingParams(max_tokens=64),
        episodes=EpisodeLimits(max_turns=max_turns, max_tokens=1024, step_timeout_s=10.0),
    )
    return asyncio.run(generator.generate(list(seeds), 1)).samples


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def test_a_policy_that_calls_the_tool_then_answers_its_result_succeeds(tokenizer: Any) -> None:
    def policy(conversation: str) -> str:
        responses = _responses(conversation)
        return responses[-1] if responses else _call(_asked(conversation))

    samples = _episodes(tokenizer, policy, max_turns=2, seeds=range(10))
    for seed, sample in zip(range(10), samples, strict=True):
        assert sample.reward == 1.0 and sample.success
        assert sample.components["looked_up"] == 1.0
        assert sample.episode is not None
        assert (sample.episode.turns, sample.episode.tool_calls, sample.episode.tool_errors) == (
            2,
            1,
            0,
        )
        assert not sample.episode.truncated
        # The tool's answer is the context between the two sampled turns, never trained on.
        mask = sample.sampled_mask
        assert mask is not None
        context = [i for i, m in zip(sample.completion_ids, mask, strict=True) if m == 0]
        value = LookupEnv().reset(seed).problem.answer
        assert tokenizer.decode(context) == (
            f"\n<|im_start|>user\n<tool_response>\n{value}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )


def test_a_policy_that_guesses_gets_copy_digits_score_in_one_turn(tokenizer: Any) -> None:
    samples = _episodes(tokenizer, lambda conversation: "7", max_turns=2, seeds=range(40))
    copy = CopyDigitsEnv()
    for seed, sample in zip(range(40), samples, strict=True):
        value = LookupEnv().reset(seed).problem.answer
        assert sample.reward == copy.score(Problem(seed, [], value), "7").reward
        assert sample.episode is not None and sample.episode.turns == 1
        assert sample.episode.tool_calls == 0 and sample.components["looked_up"] == 0.0
    assert 0 < sum(s.success for s in samples) < 10  # right only where the value is 7


def test_a_malformed_call_is_a_tool_error_and_the_next_turns_still_count(tokenizer: Any) -> None:
    def policy(conversation: str) -> str:
        turn = _turns(conversation)
        if turn == 0:
            return '<tool_call>\n{"name": "lookup", "arguments": "a"}\n</tool_call>'
        if turn == 1:
            assert _responses(conversation)[-1].startswith("error: ")  # the model is told why
            return _call(_asked(conversation))
        return _responses(conversation)[-1]

    for sample in _episodes(tokenizer, policy, max_turns=3, seeds=range(5)):
        assert sample.success and sample.reward == 1.0
        assert sample.episode is not None
        assert (sample.episode.turns, sample.episode.tool_calls, sample.episode.tool_errors) == (
            3,
            1,
            1,
        )
    # With two turns the same policy never answers: truncated, reward 0.
    for sample in _episodes(tokenizer, policy, max_turns=2, seeds=range(3)):
        assert sample.episode is not None and sample.episode.truncated
        assert sample.reward == 0.0 and not sample.success


# ---------------------------------------------------------------------------------------------
# The job's budget and a real episode


def test_the_jobs_turn_budget_fits_the_shortest_call_of_every_key(tokenizer: Any) -> None:
    """conf/env/lookup.yaml's max_new_tokens holds the shortest call and <|im_end|>, for every
    key, as the tiny tokenizer encodes it, and its two turns are a call and an answer."""
    conf = OmegaConf.load(REPO / "conf" / "env" / "lookup.yaml")
    lengths = {
        len(tokenizer(_call(key), add_special_tokens=False)["input_ids"]) + 1
        for key in string.ascii_lowercase
    }
    assert lengths == {conf.generation.max_new_tokens} == {52}
    assert conf.data.max_turns == 2
    # A key is one token, the same in the question and in a call: copying it is token for token.
    for key in string.ascii_lowercase:
        token = tokenizer.convert_tokens_to_ids(key)
        question = LookupEnv().reset(0).problem.prompt_messages[0]["content"]
        question = re.sub(r'key "."', f'key "{key}"', question)
        assert token in tokenizer(question, add_special_tokens=False)["input_ids"]
        assert token in tokenizer(_call(key), add_special_tokens=False)["input_ids"]


def test_a_real_episode_shows_the_tool_to_the_model_and_completes(
    tiny_server: BuiltinServer,
) -> None:
    tokenizer = load_tokenizer(str(tiny_server.model_path))
    client = CompletionClient(tiny_server.base_url, tiny_server.model_name, timeout=60)
    generator = RolloutGenerator(
        LookupEnv(),
        tokenizer,
        client,
        SamplingParams(max_tokens=52, temperature=1.0),
        episodes=EpisodeLimits(max_turns=2, max_tokens=1024, step_timeout_s=10.0),
    )
    batch = asyncio.run(generator.generate([5], 4))
    (group,) = batch.groups
    prompt = str(tokenizer.decode(group.prompt_ids))
    schema = json.dumps(ToolBox(LookupEnv().reset(5).tools).schemas[0])
    assert f"<tools>\n{schema}\n</tools>" in prompt  # the tool as transformers describes it
    assert "<tool_call></tool_call>" in prompt
    key = LookupEnv().reset(5).key
    assert prompt.endswith(
        f'What is the value of key "{key}"? Use the lookup tool.<|im_end|>\n<|im_start|>assistant\n'
    )
    for sample in group.samples:
        assert sample.episode is not None and 1 <= sample.episode.turns <= 2
        assert sample.sampled_mask is not None
        assert len(sample.sampled_mask) == len(sample.completion_ids)
        assert sum(sample.sampled_mask) >= 1
        assert 0.0 <= sample.reward <= 1.0
        assert set(sample.components) == set(LookupEnv.components)


# ---------------------------------------------------------------------------------------------
# The documented warm start (examples/lookup_warm_start.py)


@pytest.fixture(scope="module")
def warm_start() -> Any:
    sys.path.insert(0, str(REPO / "examples"))
    try:
        import lookup_warm_start  # examples/ is not a package
    finally:
        sys.path.remove(str(REPO / "examples"))
    return lookup_warm_start


def test_the_warm_starts_examples_are_the_episodes_the_turn_loop_makes(
    tokenizer: Any, warm_start: Any
) -> None:
    """Token for token, with the loss on exactly the sampled turns: the supervised examples are
    what a policy that calls with the asked key and then answers a digit samples in a run."""
    renderer = ChatRenderer(tokenizer)
    for digit in "07":

        def policy(conversation: str, digit: str = digit) -> str:
            return digit if _responses(conversation) else _call(_asked(conversation))

        seeds = range(2_000_000, 2_000_006)
        samples = _episodes(tokenizer, policy, max_turns=2, seeds=seeds)
        for seed, sample in zip(seeds, samples, strict=True):
            episode = LookupEnv().reset(seed)
            prompt = tokenizer.apply_chat_template(
                episode.problem.prompt_messages,
                tools=ToolBox(episode.tools).schemas,
                add_generation_prompt=True,
                tokenize=False,
            )
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            ids, mask = warm_start.example(LookupEnv(), renderer, seed, digit)
            assert ids == prompt_ids + sample.completion_ids
            assert mask == [0] * len(prompt_ids) + sample.sampled_mask
            first = sample.sampled_mask.index(0)  # the call: the first sampled turn
            ids, mask = warm_start.example(LookupEnv(), renderer, seed, None)
            assert (ids, mask) == (
                prompt_ids + sample.completion_ids[:first],
                [0] * len(prompt_ids) + [1] * first,
            )
            assert sample.success == (digit == episode.problem.answer)


def test_the_warm_starts_repeats_are_copy_digits_episodes_answered(
    tokenizer: Any, warm_start: Any
) -> None:
    renderer = ChatRenderer(tokenizer)
    schemas = ToolBox(LookupEnv().reset(0).tools).schemas
    for seed, digits, tools in ((3, 1, None), (4, 3, None), (5, 2, schemas)):
        problem = CopyDigitsEnv(digits).problem(seed)
        assert len(problem.answer) == digits
        prompt = tokenizer.apply_chat_template(
            problem.prompt_messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        assert prompt.startswith("<|im_start|>system\n# Tools") == (tools is not None)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reply = tokenizer(problem.answer + "<|im_end|>", add_special_tokens=False)["input_ids"]
        ids, mask = warm_start.repeat_example(renderer, seed, digits, tools)
        assert (ids, mask) == (prompt_ids + reply, [0] * len(prompt_ids) + [1] * len(reply))


def test_the_warm_starts_shared_prefix_loss_is_the_full_forwards(
    tiny_model_dir: Path, tokenizer: Any, warm_start: Any
) -> None:
    """Running the rows' common prefix once gives the loss and gradients of running every row
    whole, and a batch with no common prefix (or a loss inside it) takes the plain path."""
    import torch

    renderer, env = ChatRenderer(tokenizer), LookupEnv()
    model = load_model(str(tiny_model_dir))

    def full(batch: Any) -> Any:
        ids, attention, loss_mask = batch
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="none"
        )
        return (nll * loss_mask[:, 1:].reshape(-1)).sum() / loss_mask[:, 1:].sum()

    def loss_and_grads(loss_fn: Any) -> tuple[float, list[Any]]:
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    lookups = [warm_start.example(env, renderer, s, "7") for s in range(3)]
    lookups.append(warm_start.example(env, renderer, 3, None))
    repeats = [warm_start.repeat_example(renderer, s, d, None) for s, d in ((0, 1), (1, 3))]
    lookup_batch = warm_start.batch(lookups, tokenizer.pad_token_id)
    assert warm_start.shared_prefix(*lookup_batch[:2]) > 400  # the tools' description and more
    # Identical rows with a loss at their second token: no prefix to share without a loss in it.
    lossy = [([5, 6, 7, 8], [0, 1, 1, 1])] * 2
    for parts in ([lookups, repeats], [repeats], [lossy]):
        batches = [warm_start.batch(part, tokenizer.pad_token_id) for part in parts]
        want, want_grads = loss_and_grads(lambda b=batches: sum(map(full, b)) / len(b))
        got, got_grads = loss_and_grads(lambda b=batches: warm_start.sft_loss(model, *b))
        assert got == pytest.approx(want, rel=1e-5)
        for g, w in zip(got_grads, want_grads, strict=True):
            assert torch.allclose(g, w, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("answer", ["random", "value", "none"])
def test_the_warm_start_writes_a_model_grail_loads(
    tiny_model_dir: Path, tmp_path: Path, warm_start: Any, answer: str
) -> None:
    out = tmp_path / "warm"
    small = ["--steps", "2", "--batch", "2", "--answer", answer, "--repeats", "1"]
    warm_start.main(["--out", str(out), "--base", str(tiny_model_dir), *small])
    model = load_model(str(out))
    assert model.config.vocab_size == len(load_tokenizer(str(out)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    manifest = json.loads((out / "grail_manifest.json").read_text())
    assert manifest["warm_start"]["steps"] == 2 and manifest["warm_start"]["answer"] == answer
    with pytest.raises(SystemExit):  # never over an existing model
        warm_start.main(["--out", str(out), "--base", str(tiny_model_dir)])


def test_the_warm_start_can_stop_part_way_through_its_schedule(
    tiny_model_dir: Path, tmp_path: Path, warm_start: Any
) -> None:
    small = ["--base", str(tiny_model_dir), "--batch", "2", "--repeats", "1"]
    warm_start.main(["--out", str(tmp_path / "two"), "--steps", "2", *small])
    warm_start.main(["--out", str(tmp_path / "part"), "--steps", "4", "--stop-after", "2", *small])
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("two", "part")]
    assert weights[0] != weights[1]  # the second step's learning rate is the longer schedule's
    manifest = json.loads((tmp_path / "part" / "grail_manifest.json").read_text())
    assert manifest["warm_start"]["stop_after"] == 2
    with pytest.raises(SystemExit):
        warm_start.main(["--out", str(tmp_path / "x"), "--steps", "4", "--stop-after", "5", *small])
