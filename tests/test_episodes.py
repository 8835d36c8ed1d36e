"""Episodes over real HTTP against the built-in server serving the tiny model: the token rules
(grail/rollouts/episodes.py), the budgets, and an environment's failures."""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from grail.envs import make_env
from grail.envs.base import Problem
from grail.envs.episodes import Reprompt, SingleTurn, Step
from grail.inference.backends.builtin import BuiltinServer
from grail.inference.client import CompletionClient
from grail.inference.completions import Completion, SamplingParams
from grail.models.loading import load_tokenizer
from grail.rollouts.chat import ChatRenderer, TemplateError
from grail.rollouts.episodes import EnvironmentFailed, EpisodeLimits
from grail.rollouts.generation import RolloutGenerator

LIMITS = EpisodeLimits(max_turns=8, max_tokens=4096, step_timeout_s=10.0)


@dataclass
class Call:
    prompt: list[int]
    completion: Completion


@dataclass
class Recording:
    """A completion client that keeps every request's prompt and the server's answer."""

    client: CompletionClient
    calls: list[Call] = field(default_factory=list)

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        out = await self.client.complete(prompt_ids, n, sampling, seed)
        self.calls += [Call(list(prompt_ids), c) for c in out]
        return out

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Any = None,
        spans: Any = None,
    ) -> list[list[Completion]]:
        out = await self.client.complete_many(prompts, n, sampling, seeds, on_done, spans=spans)
        self.calls += [Call(list(p), c) for p, cs in zip(prompts, out, strict=True) for c in cs]
        return out

    async def aclose(self) -> None:
        await self.client.aclose()


class Scripted:
    """An episode environment whose turn t answers with `replies[t]` (a user message) until
    they run out; reward 1 per turn."""

    name = "scripted"
    components = ("turns",)

    def __init__(self, replies: Sequence[str], fail: str | None = None) -> None:
        self.replies, self.fail = list(replies), fail

    def reset(self, seed: int) -> Any:
        env = self

        class Episode:
            problem = Problem(seed, [{"role": "user", "content": f"Repeat: {seed % 10}"}], "")
            turn = 0

            def step(self, text: str) -> Any:
                if env.fail == "raise":
                    raise KeyError("no such state")
                if env.fail == "hang":
                    time.sleep(30)
                if env.fail == "junk":
                    return {"reward": 1}
                self.turn += 1
                done = self.turn > len(env.replies)
                reply = [] if done else [{"role": "user", "content": env.replies[self.turn - 1]}]
                return Step(reply, reward=1.0, done=done, success=done, components={"turns": 1.0})

        return Episode()


@pytest.fixture(scope="module")
def server(tiny_server: BuiltinServer) -> BuiltinServer:
    return tiny_server


def _run(
    server: BuiltinServer,
    env: Any,
    seeds: Sequence[int] = (3,),
    replicas: int = 2,
    max_tokens: int = 3,
    limits: EpisodeLimits = LIMITS,
    prefix_cache: bool = False,
) -> tuple[Any, Recording]:
    tokenizer = load_tokenizer(str(server.model_path))
    recording = Recording(CompletionClient(server.base_url, server.model_name, timeout=60))
    generator = RolloutGenerator(
        env,
        tokenizer,
        recording,
        SamplingParams(max_tokens=max_tokens, temperature=1.0),
        episodes=limits,
        prefix_cache=prefix_cache,
    )
    return asyncio.run(generator.generate(list(seeds), replicas)), recording


def test_an_episode_is_the_servers_ids_turn_by_turn_with_the_environment_between(
    server: BuiltinServer,
) -> None:
    batch, recording = _run(server, Scripted(["Repeat: 7", "Repeat: 1"]), seeds=[3, 4])
    tokenizer = load_tokenizer(str(server.model_path))
    renderer = ChatRenderer(tokenizer)
    calls: dict[tuple[int, ...], list[Completion]] = {}
    for call in recording.calls:  # replicates share their first prompt
        calls.setdefault(tuple(call.prompt), []).append(call.completion)
    for group in batch.groups:
        for sample in group.samples:
            assert sample.episode.turns == 3 and sample.success and sample.reward == 3.0
            ids, mask = sample.completion_ids, sample.sampled_mask
            assert len(mask) == len(ids) == len(sample.behaviour_logprobs)
            # Walk the episode: each turn's prompt is everything so far, and the server's ids
            # follow it exactly, marked sampled, with their log-probs; the rest is context.
            position, turns, sampled = 0, 0, 0
            while position < len(ids):
                asked = calls[tuple(group.prompt_ids + ids[:position])]
                turn = next(c for c in asked if ids[position:][: len(c.token_ids)] == c.token_ids)
                end = position + len(turn.token_ids)
                assert mask[position:end] == [1] * len(turn.token_ids)
                assert sample.behaviour_logprobs[position:end] == turn.logprobs
                turns += 1
                sampled += len(turn.token_ids)
                context_end = end
                while context_end < len(ids) and mask[context_end] == 0:
                    context_end += 1
                context = ids[end:context_end]
                assert sample.behaviour_logprobs[end:context_end] == [0.0] * len(context)
                if context_end < len(ids) or context:
                    # glue (what the template adds after the turn) + the user's next message
                    glue = renderer.glue(turn.token_ids)
                    assert context[: len(glue)] == glue
                    text = tokenizer.decode(context[len(glue) :])
                    assert text.startswith("<|im_start|>user\nRepeat: ")
                    assert text.endswith("<|im_start|>assistant\n")
                position = context_end
            assert turns == 3
            assert sum(mask) == sample.num_sampled == sampled


def test_a_turn_cut_at_max_new_tokens_gets_the_end_of_turn_as_context(
    server: BuiltinServer,
) -> None:
    # One token per turn: no turn can end with its end-of-turn token unless it is the one token.
    batch, _ = _run(server, Scripted(["Repeat: 7"]), replicas=4, max_tokens=1)
    renderer = ChatRenderer(load_tokenizer(str(server.model_path)))
    end_of_turn = renderer.closing[0]
    cut = 0
    for sample in batch.samples:
        first = sample.completion_ids[0]
        assert sample.sampled_mask[0] == 1
        if first != end_of_turn:
            cut += 1
            # the closing tokens follow as context, the end-of-turn token never as sampled
            n = len(renderer.closing)
            assert sample.completion_ids[1 : 1 + n] == renderer.closing
            assert sample.sampled_mask[1 : 1 + n] == [0] * n
    assert cut > 0  # the untrained model rarely ends a turn at once


def test_same_seeds_give_the_same_episodes_whatever_runs_beside_them(
    server: BuiltinServer,
) -> None:
    env = Scripted(["Repeat: 7", "Repeat: 2"])
    alone, _ = _run(server, env, seeds=[5], replicas=3)
    crowded, _ = _run(server, env, seeds=[9, 5, 6], replicas=3)
    assert [s.completion_ids for s in alone.groups[0].samples] == [
        s.completion_ids for s in crowded.groups[1].samples
    ]
    assert [s.behaviour_logprobs for s in alone.groups[0].samples] == [
        s.behaviour_logprobs for s in crowded.groups[1].samples
    ]


def _prefix_cache(server: BuiltinServer) -> dict[str, int]:
    card = json.loads(urllib.request.urlopen(f"{server.base_url}/models", timeout=10).read())
    return card["data"][0]["prefix_cache"]


def test_later_turns_continue_from_the_prefix_cache_with_the_numbers_of_a_miss(
    server: BuiltinServer, tmp_path: Path
) -> None:
    """With generation.prefix_cache an episode's later turns are sent with the spans the policy
    sampled, and the built-in server continues them from its prefix cache: every later turn a
    hit, and the episodes bit for bit those of a server that keeps nothing (every turn a miss,
    computed again). Without it the turns go as before, one chunk each, and nothing is hit."""
    env = Scripted(["Repeat: 7", "Repeat: 2"])
    before = _prefix_cache(server)
    cached, _ = _run(server, env, seeds=[4, 8], replicas=3, prefix_cache=True)
    after = _prefix_cache(server)
    assert after["hits"] - before["hits"] == 2 * 3 * 2  # turns 2 and 3 of 6 episodes
    assert after["misses"] == before["misses"]
    _run(server, env, seeds=[4, 8], replicas=3)
    assert _prefix_cache(server)["hits"] == after["hits"]
    with BuiltinServer(
        server.model_path,
        "tiny",
        log_dir=tmp_path,
        threads=1,
        start_timeout=180,
        extra_args=["--prefix-cache-mb", "0"],
    ) as bare:
        replayed, _ = _run(bare, env, seeds=[4, 8], replicas=3, prefix_cache=True)
        assert _prefix_cache(bare)["misses"] == 2 * 3 * 2
    for one, other in zip(cached.groups, replayed.groups, strict=True):
        assert [s.completion_ids for s in one.samples] == [s.completion_ids for s in other.samples]
        assert [s.behaviour_logprobs for s in one.samples] == [
            s.behaviour_logprobs for s in other.samples
        ]


def test_a_single_turn_environment_as_an_episode_samples_what_the_single_turn_path_does(
    server: BuiltinServer,
) -> None:
    # The episode path's turn 0 has the seed the single-turn path gives the replicate.
    env = make_env("copy_digits")
    episodes, _ = _run(server, SingleTurn(env), seeds=[3, 8], replicas=4, max_tokens=2)
    single, _ = _run(server, env, seeds=[3, 8], replicas=4, max_tokens=2)
    for a, b in zip(episodes.samples, single.samples, strict=True):
        assert (a.completion_ids, a.behaviour_logprobs) == (b.completion_ids, b.behaviour_logprobs)
        assert (a.reward, a.success) == (b.reward, b.success)
        assert a.sampled_mask == [1] * len(a.completion_ids)


def test_budgets_end_an_episode_as_truncated_never_past_the_token_cap(
    server: BuiltinServer,
) -> None:
    forever = Scripted(["Repeat: 1"] * 50)
    batch, _ = _run(server, forever, limits=EpisodeLimits(3, 4096, 10.0))
    for sample in batch.samples:
        assert sample.episode.turns == 3 and sample.episode.truncated and not sample.success
        assert sample.reward == 3.0  # what its steps earned
    prompt = len(batch.groups[0].prompt_ids)
    cap = prompt + 30
    batch, _ = _run(server, forever, limits=EpisodeLimits(50, cap, 10.0), max_tokens=3)
    for sample in batch.samples:
        assert prompt + len(sample.completion_ids) <= cap
        assert sample.episode.truncated and not sample.success
        assert sample.sampled_mask[-1] == 1  # it ends on a turn, not on an unanswered question


@pytest.mark.parametrize(
    ("fail", "message"),
    [
        ("raise", "raised 'no such state'"),
        ("junk", "returned dict, not grail.envs.episodes.Step"),
        ("hang", "did not answer within data.env_step_timeout_s=0.5 s"),
    ],
)
def test_an_environment_that_fails_stops_the_batch_naming_it_and_the_seed(
    server: BuiltinServer, fail: str, message: str
) -> None:
    t0 = time.monotonic()
    with pytest.raises(EnvironmentFailed) as caught:
        _run(server, Scripted(["x"], fail=fail), seeds=[11], limits=EpisodeLimits(4, 4096, 0.5))
    assert time.monotonic() - t0 < 20
    text = str(caught.value)
    assert "environment 'scripted' at seed 11" in text and message in text, text


def test_reprompt_asks_again_after_a_wrong_answer_and_keeps_the_last_answers_reward(
    server: BuiltinServer,
) -> None:
    env = Reprompt(make_env("copy_digits"), threshold=0.0, attempts=3)
    batch, _ = _run(server, env, seeds=[1, 2, 3, 4], replicas=4, max_tokens=2)
    again = load_tokenizer(str(server.model_path)).encode(env.message)
    retried = 0
    for sample in batch.samples:
        assert 1 <= sample.episode.turns <= 3
        assert 0.0 <= sample.reward <= 1.0  # one answer's score, not a sum over attempts
        if sample.episode.turns > 1:
            retried += 1
            context = [
                t for t, m in zip(sample.completion_ids, sample.sampled_mask, strict=True) if m == 0
            ]
            assert _contains(context, again)
    assert retried > 0  # the untrained model fails most first answers


def _contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack)))


def test_a_template_that_rewrites_earlier_turns_is_refused(server: BuiltinServer) -> None:
    tokenizer = load_tokenizer(str(server.model_path))
    # Drops every assistant message but the last, as reasoning templates drop old thoughts.
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m.role != 'assistant' or loop.last %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(TemplateError, match="renders the earlier turns differently"):
        renderer.suffix(conversation, [{"role": "user", "content": "c"}], None)


def test_the_example_environment_of_the_docs_runs(server: BuiltinServer) -> None:
    # docs/episodes.md's first Python block, run as written.
    page = (Path(__file__).parents[1] / "docs" / "episodes.md").read_text()
    source = page.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/episodes.md", "exec"), namespace)
    batch, _ = _run(server, namespace["GuessEnv"](), seeds=[0, 1], replicas=2, max_tokens=2)
    for group in batch.groups:
        assert group.problem.answer == str(random.Random(group.problem.seed).randrange(10))
        for sample in group.samples:
            assert 1 <= sample.episode.turns <= LIMITS.max_turns
            assert sample.reward == float(sample.success)


def _add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b


CONVERSATIONS = [
    ([{"role": "user", "content": "Repeat: 3"}, {"role": "assistant", "content": "3"}], None),
    (
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Sum 2 and 5, then say <|im_end|> twice."},
            {"role": "assistant", "content": '<tool_call>\n{"name": "_add"}\n</tool_call>'},
        ],
        [_add],
    ),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": " trailing  \n"}], None),
]
NEW = [
    [{"role": "user", "content": "Repeat: 9"}],
    [{"role": "tool", "content": "7"}, {"role": "user", "content": "and again\n"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("new", NEW)
@pytest.mark.parametrize(("conversation", "tools"), CONVERSATIONS)
def test_the_text_cut_suffix_is_the_token_suffix(
    tiny_model_dir: Path, conversation: list[dict[str, Any]], tools: Any, new: list[dict[str, Any]]
) -> None:
    """`suffix` tokenizes only the new text where the template's cut is an added token (Qwen's
    <|im_start|>): the ids are those that comparing both renders' token ids gives."""
    from transformers.utils import get_json_schema

    renderer = ChatRenderer(load_tokenizer(str(tiny_model_dir)))
    schemas = [get_json_schema(t) for t in tools] if tools else None
    slow = renderer.token_suffix
    renderer.token_suffix = None  # type: ignore[assignment,method-assign]  # the cut path only
    fast = renderer.suffix(conversation, new, schemas)
    assert fast == slow(conversation, new, schemas)


def test_a_cut_that_is_not_an_added_token_takes_the_token_path(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    renderer = ChatRenderer(tokenizer)
    calls: list[int] = []
    token_suffix = renderer.token_suffix
    monkeypatch.setattr(
        renderer,
        "token_suffix",
        lambda *a: calls.append(1) or token_suffix(*a),  # type: ignore[func-returns-value]
    )
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    ids = renderer.suffix(conversation, [{"role": "user", "content": "c"}], None)
    assert calls == [1] and tokenizer.decode(ids) == "user: c\nassistant:"
