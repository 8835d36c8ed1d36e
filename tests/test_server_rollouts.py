"""ServerRollouts, the default rollout source, in-process against the built-in server on the tiny
model: synchronous and pipelined batches, the weight-sync barrier, recovery from a killed server,
and a clean stop while a batch is generating."""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest

from grail.core.config import Config, DataConfig, EvalConfig, GenerationConfig, TrainConfig
from grail.envs import make_env
from grail.envs.rewards.plugins import RewardFunctions
from grail.models.loading import load_tokenizer
from grail.rollouts import codec
from grail.rollouts.batch import GeneratedBatch
from grail.rollouts.server import ServerRollouts, iteration_seeds
from grail.train.components import rollout_settings, server_and_syncer_from_config
from grail.train.trainer import assign_advantages


def _config(pipeline: bool = False, iterations: int = 3) -> Config:
    return Config(
        data=DataConfig(
            environment="copy_digits", problems_per_iteration=6, rollouts_per_problem=4
        ),
        generation=GenerationConfig(max_new_tokens=4, server_threads=1, max_restarts=1),
        train=TrainConfig(iterations=iterations, pipeline=pipeline),
        eval=EvalConfig(num_ids=5, replicates=3),
    )


def _source(
    cfg: Config, tiny_model_dir: Path, run_dir: Path, rewards: RewardFunctions | None = None
) -> ServerRollouts:
    weights = run_dir / "weights"
    shutil.copytree(tiny_model_dir, weights)
    env = make_env("copy_digits")
    server, syncer = server_and_syncer_from_config(cfg, weights, run_dir, cuda_available=False)
    return ServerRollouts(
        rollout_settings(cfg),
        server,
        env,
        env,
        load_tokenizer(str(weights)),
        syncer=syncer,
        extra_rewards=rewards,
    )


def _same_weights(directory: Path) -> None:
    """A weight 'update' that writes what is already there (so batches stay comparable)."""
    (directory / "model.safetensors").touch()


def _contents(batch: GeneratedBatch) -> list[tuple[int, list[list[int]], list[float]]]:
    return [
        (g.problem.seed, [s.completion_ids for s in g.samples], [s.reward for s in g.samples])
        for g in batch.batch.groups
    ]


@pytest.fixture(scope="module")
def sync_batches(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list:
    """Iterations 0 and 1 in synchronous mode (weights unchanged between them)."""
    cfg = _config()
    with _source(cfg, tiny_model_dir, tmp_path_factory.mktemp("sync")) as source:
        first = source.next_batch(0, policy_version=0)
        assert source.state() == {}  # nothing is generated ahead in sync mode
        source.sync_weights(_same_weights, policy_version=1)
        second = source.next_batch(1, policy_version=1)
        evaluation = source.evaluate()
    return [first, second, evaluation]


def test_sync_batches_are_the_iterations_problems_in_order(sync_batches: list) -> None:
    first, second, evaluation = sync_batches
    cfg = _config()
    assert [g.problem.seed for g in first.batch.groups] == iteration_seeds(cfg.data, 0)
    assert [g.problem.seed for g in second.batch.groups] == iteration_seeds(cfg.data, 1)
    assert (first.policy_version, second.policy_version) == (0, 1)
    for group in first.batch.groups:
        assert len(group.samples) == 4
        assert all(len(s.behaviour_logprobs) == len(s.completion_ids) for s in group.samples)
    assert first.generation_s > 0 and first.finished >= first.started
    assert [g.problem.seed for g in evaluation.groups] == list(range(1_000_000, 1_000_005))
    assert all(len(g.samples) == 3 for g in evaluation.groups)


def test_pipelined_source_generates_ahead_and_syncs_after_it(
    sync_batches: list, tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(pipeline=True)
    saved_at: list[float] = []

    def save(directory: Path) -> None:
        saved_at.append(time.perf_counter())
        _same_weights(directory)

    with _source(cfg, tiny_model_dir, tmp_path) as source:
        first = source.next_batch(0, policy_version=0)
        sync = source.sync_weights(save, policy_version=1)
        ahead = source.state()["pending"]  # what a checkpoint now keeps (JSON)
        assert ahead is not None and ahead["policy_version"] == 0  # generated with v0, stale by 1
        assert sync.prefetched == (ahead["started"], ahead["finished"])
        assert saved_at[0] >= ahead["finished"]  # weights written only after the batch finished
        second = source.next_batch(1, policy_version=1)
        assert codec.to_json(second) == ahead and source.state() == {}
        third = source.next_batch(2, policy_version=2)  # the last iteration: nothing ahead
        assert source._prefetch is None
    # Same seeds and the same weights: the same batches as synchronous mode.
    assert _contents(first) == _contents(sync_batches[0])
    assert _contents(second) == _contents(sync_batches[1])
    assert [g.problem.seed for g in third.batch.groups] == iteration_seeds(cfg.data, 2)


def test_a_killed_server_is_restarted_and_the_batch_repeated(
    sync_batches: list, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with _source(_config(), tiny_model_dir, tmp_path) as source:
        first_pid = source.server.pid
        assert first_pid is not None
        os.killpg(first_pid, signal.SIGKILL)
        batch = source.next_batch(0, policy_version=0)
        assert source.server.recoveries == 1 and source.server.pid != first_pid
    assert _contents(batch) == _contents(sync_batches[0])


def test_leaving_while_a_batch_generates_stops_it_and_the_server(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    cfg = _config(pipeline=True)
    source = _source(cfg, tiny_model_dir, tmp_path)
    with source:
        source.next_batch(0, policy_version=0)  # starts generating iteration 1 in the background
        prefetch = source._prefetch
        assert prefetch is not None
        pid = source.server.pid
    assert prefetch.future.done()  # cancelled or finished: nothing runs on
    assert not source.server.is_alive()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def test_dynamic_sampling_trains_on_groups_with_signal_only(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """DAPO's dynamic sampling: the batch keeps the first round's informative groups in order,
    then those of extra problems (new seeds, never the iteration's own), and says what it
    dropped. The untrained tiny model never copies the digit, so a reward for completions of
    even length (two samples tie about half the time) makes some groups informative."""
    cfg = _config()
    cfg.data.rollouts_per_problem = 2
    cfg.data.dynamic_sampling = True
    cfg.data.max_resample_rounds = 3
    rewards = RewardFunctions.from_specs(["reward_plugins:even_length"])
    with _source(cfg, tiny_model_dir, tmp_path, rewards) as source:
        batch = source.next_batch(0, policy_version=0)
    r = batch.resampling
    assert r is not None and r.dropped_groups > 0
    groups = batch.batch.groups
    assert all(max(g.rewards) != min(g.rewards) for g in groups)
    assert r.kept_groups == len(groups) <= cfg.data.problems_per_iteration
    assert r.generated_groups == r.kept_groups + r.dropped_groups
    assert assign_advantages(groups, "group")["zero_variance_group_frac"] == 0.0
    own = iteration_seeds(cfg.data, 0)
    seeds = [g.problem.seed for g in groups]
    first_round = [s for s in seeds if s in own]
    assert first_round == [s for s in own if s in first_round]  # in the iteration's order
    assert seeds[: len(first_round)] == first_round  # before any extra problem
    assert len(set(seeds)) == len(seeds)
    if r.extra_rounds == 0:
        assert len(groups) == cfg.data.problems_per_iteration
