"""examples/service_environment.py against a real `grail-train mode=service`: an environment that
samples its groups through /v1/turns, scores them itself and pushes them (/v1/groups), each
token checked against what the service sampled (service.check_spans, the default)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.run_dirs import REPO, TINY_RUN
from helpers.service_run import ServiceRun

from grail.core.records import read_json, train_metrics_path

ITERATIONS = 3
PROBLEMS = 4  # data.problems_per_iteration in TINY_RUN


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[ServiceRun]:
    # max_staleness=0: every group trained was sampled by the very weights that train on it (a
    # group labelled with the version before a sync is refused or dropped), so the trainer's
    # log-probabilities of its tokens must equal the behaviour ones the environment sent.
    args = [
        *TINY_RUN,
        f"train.iterations={ITERATIONS}",
        "eval.enabled=false",
        "service.max_staleness=0",
    ]
    started = ServiceRun(tmp_path / "run", *args)
    try:
        yield started
    finally:
        started.stop()  # kills it (and its inference server) if the test left it running


@pytest.mark.timeout(120)
def test_an_environment_that_samples_itself_trains_the_policy(trainer: ServiceRun) -> None:
    """Every group the trainer takes is one the environment pushed, and the behaviour
    log-probabilities it sent (the inference server's, as /v1/turns returned them) are the trained
    policy's: the trainer's own log-probabilities of those tokens agree with them."""
    trainer.connect(timeout_s=60).close()
    # Iteration 0's groups: multi-turn episodes of an agent loop (grail's, over /v1/turns), each
    # pushed with the mask of its sampled tokens; then single-turn groups until the run ends.
    episodes = subprocess.run(
        [
            sys.executable,
            "examples/service_episodes.py",
            "--endpoint",
            str(trainer.endpoint),
            "--groups",
            str(PROBLEMS),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert episodes.returncode == 0, episodes.stdout + episodes.stderr + trainer.output()
    assert f"{PROBLEMS} groups accepted" in episodes.stdout, episodes.stdout
    env = subprocess.run(
        [sys.executable, "examples/service_environment.py", "--endpoint", str(trainer.endpoint)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert env.returncode == 0, env.stdout + env.stderr + trainer.output()
    assert "groups accepted" in env.stdout, env.stdout
    assert trainer.process.wait(30) == 0, trainer.output()
    for iteration in range(ITERATIONS):
        record = read_json(train_metrics_path(trainer.run_dir, iteration))
        assert record is not None, trainer.output()
        if iteration == 0:  # the episodes: several turns, the environment's tokens between
            episodes = record["episodes"]
            assert episodes["turns_mean"] > 1, episodes
            assert episodes["sampled_tokens"] < record["tokens"]["completion"], record["tokens"]
        groups = record["service"]["groups"]
        assert len(groups) == PROBLEMS
        assert {g["source"] for g in groups} == {"groups"}
        assert record["policy"]["staleness"] == 0  # service.max_staleness=0
        # The same weights, the same tokens: only float round-off apart (~1e-7 on CPU; a group
        # sampled one version earlier shows ~0.1 to 0.2 on this tiny model).
        assert record["logprob_mismatch"] is not None and record["logprob_mismatch"] < 1e-3, (
            iteration,
            record["logprob_mismatch"],
        )
