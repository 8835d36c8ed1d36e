"""OpenEnv environments under grail (`env=openenv`, grail/envs/open_env.py): an environment written
here as OpenEnv's template writes one, served on 127.0.0.1 by OpenEnv's own server code (in-process
by grail, or by the test as a user's server at a URL), run through the real turn loop with scripted
policies; what fails, fails naming the server; and what is refused."""

from __future__ import annotations

import asyncio
import random
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openenv = pytest.importorskip(
    "openenv", reason="openenv is not installed: uv sync --group openenv (.ci/run installs it)"
)

from fastapi import FastAPI  # noqa: E402
from helpers import openenv_classes  # noqa: E402
from helpers.docs_examples import install_example  # noqa: E402
from helpers.scripted import Policy, ScriptedPolicy  # noqa: E402
from openenv.core.env_server.http_server import create_app  # noqa: E402

from grail.core.errors import ConfigError  # noqa: E402
from grail.core.http_thread import ServerThread  # noqa: E402
from grail.envs import make_env  # noqa: E402
from grail.envs.episodes import problem_maker  # noqa: E402
from grail.inference.completions import SamplingParams  # noqa: E402
from grail.models.loading import load_tokenizer  # noqa: E402
from grail.rollouts.batch import Sample  # noqa: E402
from grail.rollouts.episodes import EnvironmentFailed, EpisodeLimits  # noqa: E402
from grail.rollouts.generation import RolloutGenerator  # noqa: E402

GUESS = "helpers.openenv_classes:Guess"
SEEDS = range(8)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


def _serve(app: Any) -> Iterator[str]:
    server = ServerThread(app, "127.0.0.1", 0, name="test-openenv", stop_timeout_s=10.0)
    try:
        yield server.start()
    finally:
        server.close()


@pytest.fixture
def one_session_server() -> Iterator[str]:
    """The Guess environment served as a user would serve it: OpenEnv's default of one session."""
    app = create_app(
        openenv_classes.Guess, openenv_classes.GuessAction, openenv_classes.GuessObservation
    )
    yield from _serve(app)


def _bisect(conversation: str) -> str:
    """Bisect 1..9 on the environment's "higher" / "lower" answers."""
    low, high = 1, 9
    for guess, hint in re.findall(
        r"assistant\n(\d+)<\|im_end\|>\n<\|im_start\|>user\n(\w+)", conversation
    ):
        if hint == "higher":
            low = int(guess) + 1
        else:
            high = int(guess) - 1
    return str((low + high) // 2)


def _found_within_three(seed: int) -> bool:
    secret, low, high = random.Random(seed).randint(1, 9), 1, 9
    for _ in range(3):
        guess = (low + high) // 2
        if guess == secret:
            return True
        low, high = (guess + 1, high) if guess < secret else (low, guess - 1)
    return False


def _episodes(env: Any, tokenizer: Any, policy: Policy = _bisect) -> list[Sample]:
    generator = RolloutGenerator(
        env,
        tokenizer,
        ScriptedPolicy(tokenizer, policy),
        SamplingParams(max_tokens=16),
        episodes=EpisodeLimits(max_turns=8, max_tokens=1024, step_timeout_s=10.0),
    )
    return asyncio.run(generator.generate(list(SEEDS), 1)).samples


def test_episodes_are_the_environments_game_seeded_by_the_problem_seed(tokenizer: Any) -> None:
    env = make_env("openenv", environment=GUESS, max_sessions=4)
    try:
        assert (env.action_field, env.observation_field) == ("guess", "prompt")
        samples = _episodes(env, tokenizer)
        problem = problem_maker(env)(5)  # as a stored group is rebuilt: reset, read, closed
    finally:
        env.close()
    wins = [_found_within_three(seed) for seed in SEEDS]
    assert 0 < sum(wins) < len(wins)  # both outcomes occur, so the rewards say something
    assert [s.reward for s in samples] == [float(w) for w in wins]
    assert [s.success for s in samples] == wins
    for sample in samples:
        assert sample.components == {"env_reward": sample.reward}
        assert sample.episode is not None and 1 <= sample.episode.turns <= 3
        assert not sample.episode.truncated  # the environment ended every game
    assert problem.seed == 5
    assert problem.prompt_messages == [{"role": "user", "content": "Guess a number from 1 to 9."}]


def test_a_servers_url_gives_the_same_episodes_one_session_at_a_time(
    one_session_server: str, tokenizer: Any
) -> None:
    here = make_env("openenv", environment=GUESS, max_sessions=8)
    try:
        served_here = _episodes(here, tokenizer)
    finally:
        here.close()
    there = _episodes(make_env("openenv", url=one_session_server), tokenizer)
    assert [s.completion_ids for s in there] == [s.completion_ids for s in served_here]
    assert [s.reward for s in there] == [s.reward for s in served_here]


def test_more_sessions_than_the_server_allows_fail_saying_so(
    one_session_server: str, tokenizer: Any
) -> None:
    env = make_env("openenv", url=one_session_server, max_sessions=8)
    with pytest.raises(EnvironmentFailed) as caught:
        _episodes(env, tokenizer)
    assert one_session_server in str(caught.value)
    assert "allows 1 sessions: set data.env_kwargs.max_sessions" in str(caught.value)


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        ("SlowGuess", {"message_timeout_s": 0.3}, "did not answer step within 0.3 s"),
        ("BrokenGuess", {}, "refused step: the board is on fire (EXECUTION_ERROR)"),
    ],
)
def test_a_server_that_hangs_or_fails_fails_the_episode_naming_it(
    tokenizer: Any, cls: str, kwargs: dict[str, Any], message: str
) -> None:
    env = make_env("openenv", environment=f"helpers.openenv_classes:{cls}", **kwargs)
    try:
        with pytest.raises(EnvironmentFailed) as caught:
            _episodes(env, tokenizer)
    finally:
        env.close()
    assert f"OpenEnv server {env.url}" in str(caught.value) and message in str(caught.value)
    assert "environment 'openenv' at seed" in str(caught.value)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def not_an_environment() -> Iterator[str]:
    app = FastAPI()

    @app.get("/schema")
    def schema() -> dict[str, str]:
        return {"openapi": "3.1"}

    yield from _serve(app)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "give exactly one of url"),
        ({"url": "http://127.0.0.1:1", "environment": GUESS}, "give exactly one of url"),
        ({"url": "ftp://127.0.0.1:1"}, "is not an http:// or https:// URL"),
        ({"url": "http://127.0.0.1:{free}"}, "no OpenEnv server answers at http://127.0.0.1:"),
        ({"url": "{not_env}"}, "answers but is not an OpenEnv environment: GET /schema"),
        ({"environment": "helpers.openenv_classes:NotAnEnvironment"}, "is not a subclass of"),
        ({"environment": "helpers.openenv_classes:Unannotated"}, "annotate its step as"),
        ({"environment": "helpers.openenv_classes:TwoFields"}, "has 2 string fields (guess, note)"),
        ({"environment": GUESS, "action_field": "move"}, "action_field 'move': the environment's"),
        ({"environment": GUESS, "observation_field": "x"}, "observation_field 'x': the environ"),
        ({"environment": GUESS, "max_sessions": 0}, "max_sessions must be an integer >= 1"),
        ({"environment": GUESS, "reset_kwargs": {"seed": 1}}, "must not set 'seed'"),
    ],
)
def test_what_is_not_an_openenv_environment_is_refused_naming_it(
    not_an_environment: str, kwargs: dict[str, Any], message: str
) -> None:
    filled = {
        k: v.format(free=_free_port(), not_env=not_an_environment) if isinstance(v, str) else v
        for k, v in kwargs.items()
    }
    with pytest.raises(ConfigError, match=re.escape(message)):
        make_env("openenv", **filled)


def test_a_named_action_field_takes_the_text(tokenizer: Any) -> None:
    env = make_env("openenv", environment="helpers.openenv_classes:TwoFields", action_field="guess")
    try:
        samples = _episodes(env, tokenizer)
    finally:
        env.close()
    assert [s.success for s in samples] == [_found_within_three(seed) for seed in SEEDS]


def test_the_docs_example_runs_as_written(
    tmp_path: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_example(
        "environments.md", "## OpenEnv (`env=openenv`)", "my_envs", tmp_path, monkeypatch
    )
    env = make_env("openenv", environment="my_envs:Guess", max_sessions=8)
    try:
        samples = _episodes(env, tokenizer)
    finally:
        env.close()
    assert [s.success for s in samples] == [_found_within_three(seed) for seed in SEEDS]


def test_a_run_trains_on_an_openenv_environment(tmp_path: Path) -> None:
    """docs/environments.md's OpenEnv example, shorter: env=openenv on the tiny model."""
    from helpers.short_runs import one_iteration

    records = one_iteration(
        tmp_path / "run",
        "env=openenv",
        f"data.env_kwargs.environment={GUESS}",
        "data.env_kwargs.max_sessions=8",
        "data.max_turns=3",
        "generation.max_new_tokens=4",
    )
    assert all("reward_mean" in r and r["episodes"]["turns_mean"] >= 1 for r in records)
