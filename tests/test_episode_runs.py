"""Episodes through everything else a run does (issue 41, point 8): `env=copy_turns` end to end,
with evaluation, pipelining, a study's shared iteration-0 rollouts, a fleet, SIGKILL and resume,
dynamic sampling, LoRA and two trainer processes.

Each grail-train costs seconds of start-up, so the runs are few and combine checks, and the
`runs` fixture starts the independent ones at once:

    sync        the reference: 4 iterations, evaluation, a study that stores iteration 0
    pipelined   train.pipeline=true and another train.lr, on a fleet of two servers, reuse off:
                generates every batch; its batch 0 is the sync run's
    resumed     the same as `pipelined` on one server, reusing the study's iteration 0 (the sync
                run's: the key leaves train.* out), SIGKILLed after its checkpoint iter_001 and
                resumed: every record must still be `pipelined`'s (the fleet, the stored batch
                and the resume change no number)
    dynamic     data.dynamic_sampling=true with LoRA, 2 iterations
    two         train.processes=2, 1 iteration: iteration 0 as the sync run's

Fast tests without a server: a study's store loads tool episodes (their prompts hold the tools'
schemas), data.rewards score episodes, and a fleet keeps an episode's turns on one server, also
when that server is set aside mid-episode (the episode goes on, on another).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.grail_process import alive, finish, servers_of, train_process, wait_for
from helpers.rank_runs import COMPARED, TWO, start_grail_train
from helpers.rank_runs import finish as finish_ranks

from grail.core.config import Config, DataConfig
from grail.core.records import read_metrics, validate_metrics
from grail.envs import make_env
from grail.envs.base import Problem
from grail.envs.episodes import Step
from grail.envs.rewards.plugins import RewardFunctions
from grail.inference.completions import Completion, SamplingParams
from grail.inference.errors import ServerDiedError
from grail.models.loading import load_tokenizer
from grail.rollouts.batch import GeneratedBatch
from grail.rollouts.episodes import EpisodeLimits, turn_seed
from grail.rollouts.fleet_client import FleetClient
from grail.rollouts.generation import RolloutGenerator, render_prompt_ids
from grail.rollouts.seeds import request_seed
from grail.rollouts.server import iteration_seeds
from grail.rollouts.shared import SharedRollouts

# Two turns of copy_turns in SMALL's 4 problems x 4 episodes. The untrained tiny model seldom
# says the digit: with seed 23 two of iteration 0's groups have rewards that differ, so the
# policy-gradient term (over the sampled tokens only) is not zero, as it is for most seeds.
# One server thread: a fleet's servers then compute as the lone server does.
EPISODES = ["env=copy_turns", "data.env_kwargs.turns=2", "seed=23", "generation.server_threads=1"]
TURNS, EPISODES_PER_BATCH, MAX_NEW_TOKENS = 2, 16, 2
PIPELINED = ["train.iterations=4", "train.pipeline=true", "train.lr=1e-2"]
LORA = ["model.lora.enabled=true", "model.lora.r=4", "train.kl_coef=0.02"]

# Keys that differ between two runs of one config or say where the samples came from (which
# server, the store), not results.
VOLATILE = {"timings", "tokens_per_s", "eval_s", "weight_sync", "fleet", "rollouts_reused"}


def _stable(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in VOLATILE}


def _flat(record: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in record.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _train(run_dir: Path, iteration: int) -> dict[str, Any]:
    return read_metrics(run_dir / "metrics" / f"train_iter_{iteration:03d}.json")


@dataclass
class Runs:
    root: Path
    study: Path
    out: dict[str, str]  # each run's console output (`resumed`: both parts)
    two_code: int

    def dir(self, name: str) -> Path:
        return self.root / name

    def completed(self, name: str) -> Path:
        run_dir = self.dir(name)
        assert (run_dir / "summary.json").exists(), f"{name}:\n{self.out[name][-3000:]}"
        return run_dir


def _killed_and_resumed(run_dir: Path, *overrides: str) -> str:
    """Start a run, SIGKILL it (no cleanup runs in the trainer) once its checkpoint iter_001 is
    committed, wait for its orphaned server to die, resume it to the end: the output of both."""
    killed = train_process(run_dir, *overrides)
    wait_for(
        lambda: (run_dir / "checkpoints" / "iter_001").exists() or killed.poll() is not None,
        300,
        "checkpoint iter_001",
    )
    server_pids = servers_of(run_dir)
    killed.kill()
    first_part, _ = killed.communicate()
    assert server_pids, f"the run should have a server process:\n{first_part[-3000:]}"
    wait_for(lambda: not any(alive(p) for p in server_pids), 30, "the orphaned server to die")
    return first_part + finish(train_process(run_dir, *overrides, "resume=true"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("episodes")
    study = root / "study"
    in_study = f"study_dir={study}"
    started: list[subprocess.Popen[str]] = []  # killed if the fixture fails half-way
    sessions: list[subprocess.Popen[str]] = []  # those with their own session (the ranks')
    try:
        sync = train_process(root / "sync", *EPISODES, "train.iterations=4", in_study)
        started.append(sync)
        pipelined = train_process(
            root / "pipelined",
            *EPISODES,
            *PIPELINED,
            in_study,
            "data.reuse_initial_rollouts=false",
            "generation.servers=2",
        )
        started.append(pipelined)
        dynamic = train_process(
            root / "dynamic",
            *EPISODES,
            *LORA,
            "train.iterations=2",
            "eval.enabled=false",
            "data.dynamic_sampling=true",
        )
        started.append(dynamic)
        two = start_grail_train(
            root / "two", *EPISODES, "train.iterations=1", "eval.enabled=false", *TWO
        )
        started.append(two)
        sessions.append(two)

        # The resumed run reuses what the sync run stores: it starts once the file is there.
        # One server, as the sync run had: `generation.servers` is part of the store's key.
        wait_for(
            lambda: any((study / "rollouts").glob("*.json")) or sync.poll() is not None,
            300,
            "the sync run's stored iteration 0",
        )
        try:
            resumed = _killed_and_resumed(root / "resumed", *EPISODES, *PIPELINED, in_study)
        except (Exception, pytest.fail.Exception) as exc:  # its test says so; the others go on
            resumed = f"the killed and resumed run failed: {exc}"

        out = {"resumed": resumed}
        for name, proc in (("sync", sync), ("pipelined", pipelined), ("dynamic", dynamic)):
            out[name] = finish(proc)
        two_code, out["two"] = finish_ranks(two, 300)
    finally:
        for proc in started:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    if proc in sessions:
                        os.killpg(proc.pid, signal.SIGKILL)
                    else:
                        proc.kill()
                proc.communicate()
    return Runs(root, study, out, two_code)


def test_an_episode_run_writes_valid_records_and_evaluates(runs: Runs) -> None:
    run_dir = runs.completed("sync")
    metrics = run_dir / "metrics"
    assert sorted(p.name for p in metrics.iterdir()) == [
        "eval_baseline.json",
        "eval_iter_001.json",
        "eval_iter_003.json",
        *[f"train_iter_{i:03d}.json" for i in range(4)],
    ]
    for path in metrics.iterdir():
        schema = "eval" if path.name.startswith("eval") else "train_iteration"
        validate_metrics(read_metrics(path), schema)
    validate_metrics(read_metrics(run_dir / "summary.json"), "summary")

    for i in range(4):
        record = _train(run_dir, i)
        episodes = record["episodes"]
        assert episodes["turns_mean"] == TURNS and episodes["turns_max"] == TURNS
        # Each turn samples at most max_new_tokens; the environment's turns are context.
        assert 0 < episodes["sampled_tokens"] <= EPISODES_PER_BATCH * TURNS * MAX_NEW_TOKENS
        assert episodes["sampled_tokens"] < record["tokens"]["completion"]
        # The trainer's loss covers the sampled tokens and nothing else.
        assert record["num_tokens"] == episodes["sampled_tokens"]
        assert episodes["tool_calls"] == episodes["tool_errors"] == 0
        assert record["timings"]["env_s"] >= 0  # the environment's time, among the timings
        # The behaviour log-probs the server gave are the trainer's, token for token.
        assert record["logprob_mismatch"] < 1e-5
    first = _train(run_dir, 0)
    # (loss_pg itself is ~0 at ratio 1: a group's advantages sum to zero.)
    assert first["reward_std"] > 0 and first["zero_variance_group_frac"] < 1, "seed 23's signal"

    for name in ("eval_baseline.json", "eval_iter_001.json", "eval_iter_003.json"):
        evaluation = read_metrics(metrics / name)
        assert evaluation["environment"] == "copy_turns"
        assert (evaluation["num_tasks"], evaluation["replicates"]) == (8, 2)
        for block in ("pass@k", "mean@k", "best@k"):
            assert set(evaluation[block]) == {"1", "2"}, (name, block)
            assert 0.0 <= evaluation[block]["1"] <= evaluation[block]["2"] <= 1.0, (name, block)


def test_a_pipelined_episode_run_starts_from_the_sync_runs_batch(runs: Runs) -> None:
    pipelined, sync = runs.completed("pipelined"), runs.completed("sync")
    records = [_train(pipelined, i) for i in range(4)]
    for record in records:
        validate_metrics(record, "train_iteration")
    assert [r["policy"]["version"] for r in records] == [0, 0, 1, 2]
    assert [r["policy"]["staleness"] for r in records] == [0, 1, 1, 1]
    assert all(r["timings"]["overlap_s"] > 0 for r in records[:3])
    # Batch 0: the same episodes and rewards exactly, the trainer's numbers within float
    # rounding (a pipelined trainer has half the cores); the learning rate is another.
    ignored = {"policy", "lr"}
    got = _flat({k: v for k, v in _stable(records[0]).items() if k not in ignored})
    want = _flat({k: v for k, v in _stable(_train(sync, 0)).items() if k not in ignored})
    assert got.keys() == want.keys()
    exact = ["reward_mean", "reward_std", "success_rate", "zero_variance_group_frac"]
    exact += [k for k in want if k.split(".")[0] in ("episodes", "tokens", "completion_length")]
    assert {k: got[k] for k in exact} == {k: want[k] for k in exact}
    numbers = {k for k, v in want.items() if isinstance(v, float)}
    assert {k: got[k] for k in numbers} == pytest.approx(
        {k: want[k] for k in numbers}, rel=1e-5, abs=1e-7
    )
    assert {k: v for k, v in got.items() if k not in numbers} == {
        k: v for k, v in want.items() if k not in numbers
    }


def test_a_fleet_reused_episodes_and_a_resume_change_no_record(runs: Runs) -> None:
    """`pipelined` generated every batch on two servers; `resumed`, on one, loaded iteration 0
    from the study, was SIGKILLed after checkpoint iter_001 (its prefetched episode batch in it)
    and resumed: every record is the same."""
    resumed, pipelined = runs.completed("resumed"), runs.completed("pipelined")
    out = runs.out["resumed"]
    assert "resuming after iteration" in out, out[-3000:]
    # The stored prompt ids are render_prompt_ids' (no tools): the store was used, not refused.
    assert "ignoring stored rollouts" not in out, out[-3000:]
    (stored,) = (runs.study / "rollouts").glob("*.json")
    assert _train(resumed, 0)["rollouts_reused"]["key"] == stored.stem
    assert "rollouts_reused" not in _train(runs.dir("sync"), 0)
    for i in range(4):
        record = _train(resumed, i)
        validate_metrics(record, "train_iteration")
        assert _stable(record) == _stable(_train(pipelined, i)), f"train_iter_{i:03d}"
    for name in ("eval_iter_001.json", "eval_iter_003.json"):
        assert _stable(read_metrics(resumed / "metrics" / name)) == _stable(
            read_metrics(pipelined / "metrics" / name)
        ), name
    fleet = [_train(pipelined, i) for i in range(4)]
    for record in fleet:
        assert "rollouts_reused" not in record
        assert sum(s["tokens"] for s in record["fleet"]) == record["episodes"]["sampled_tokens"]
    assert all(sum(r["fleet"][s]["requests"] for r in fleet) > 0 for s in (0, 1))
    assert sorted(p.name for p in (pipelined / "logs").iterdir()) == ["server-0", "server-1"]


def test_dynamic_sampling_with_lora_trains_on_informative_episodes(runs: Runs) -> None:
    run_dir = runs.completed("dynamic")
    for i in range(2):
        record = _train(run_dir, i)
        validate_metrics(record, "train_iteration")
        resampling = record["dynamic_sampling"]
        assert resampling["generated_groups"] == (
            resampling["kept_groups"] + resampling["dropped_groups"]
        )
        assert resampling["extra_rounds"] <= 3  # data.max_resample_rounds
        assert record["episodes"]["turns_mean"] == TURNS
        # The server samples with the trainer's adapter; context tokens carry no log-prob.
        assert record["logprob_mismatch"] < 1e-5 and record["kl"] is not None
    first = _train(run_dir, 0)
    # Iteration 0's first round is the sync run's, which has informative groups: the batch
    # holds informative groups only.
    assert first["dynamic_sampling"]["kept_groups"] >= 1
    assert first["zero_variance_group_frac"] == 0.0 and first["reward_std"] > 0
    summary = read_metrics(run_dir / "summary.json")
    assert summary["status"] == "completed" and summary["iterations"] == 2


def test_two_trainer_processes_train_episodes_as_one_does(runs: Runs) -> None:
    assert runs.two_code == 0, runs.out["two"][-3000:]
    two, one = runs.completed("two"), runs.completed("sync")
    assert "2 trainer process(es)" in runs.out["two"]
    first_one, first_two = _train(one, 0), _train(two, 0)
    for key in (*COMPARED, "num_tokens"):
        a, b = first_one[key], first_two[key]
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-6), (key, a, b)
    assert first_two["trainer_processes"] == 2
    assert _stable(first_two)["episodes"] == _stable(first_one)["episodes"]
    summary = read_metrics(two / "summary.json")
    assert summary["status"] == "completed" and summary["trainer_processes"] == 2


# ---- without a server -----------------------------------------------------------------------


class Answering:
    """A completion client without a server: every turn answers "7" and stops; it keeps the
    seed of each prompt it was sent, and which of `servers` it stands for."""

    def __init__(self, tokenizer: Any, seen: dict[int, int] | None = None, server: int = 0):
        self.ids = [int(t) for t in tokenizer("7", add_special_tokens=False)["input_ids"]]
        self.seen = {} if seen is None else seen
        self.server = server
        self.timeout = 60.0

    def prompts_per_request(self, n: int) -> int:
        return 64

    async def complete(
        self, prompt_ids: Sequence[int], n: int, sampling: SamplingParams, seed: int
    ) -> list[Completion]:
        (completions,) = await self.complete_many([prompt_ids], n, sampling, [seed])
        return completions

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Any = None,
        spans: Any = None,
    ) -> list[list[Completion]]:
        await asyncio.sleep(0.001 * (1 + self.server))  # answers take time: the balancer measures
        for seed in seeds:
            self.seen[seed] = self.server
        one = Completion(list(self.ids), [-0.5] * len(self.ids), "stop", "7")
        return [[one for _ in range(n)] for _ in prompts]

    async def aclose(self) -> None:
        return None


def lookup(key: str) -> str:
    """The value of a key.

    Args:
        key: the key to look up
    """
    return "7"


class WithTool:
    """One answer per episode, with a tool on offer: the smallest episode whose prompt holds a
    tool's schema."""

    name = "with_tool"
    components: tuple[str, ...] = ("said_7",)

    def reset(self, seed: int) -> Any:
        problem = Problem(seed, [{"role": "user", "content": f"Look up {seed % 10}."}], "7")

        class Episode:
            tools = [lookup]

            def __init__(self) -> None:
                self.problem = problem

            def step(self, text: str) -> Step:
                said = float("7" in text)
                return Step(reward=said, done=True, success=bool(said), components={"said_7": said})

        return Episode()


def _generator(client: Any, tokenizer: Any, env: Any = None, **kwargs: Any) -> RolloutGenerator:
    return RolloutGenerator(
        env or make_env("copy_turns", turns=TURNS),
        tokenizer,
        client,
        SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0),
        episodes=EpisodeLimits(max_turns=4, max_tokens=4096, step_timeout_s=10.0),
        **kwargs,
    )


def test_a_stored_batch_of_tool_episodes_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """An episode with tools starts with their schemas in the prompt (the chat template writes
    them), so a stored group's prompt ids are checked against that rendering, not the plain
    messages' (the store refused every tool batch, and the run generated it again)."""
    tokenizer = load_tokenizer(str(tiny_model_dir))
    data = DataConfig(environment="with_tool", problems_per_iteration=2, rollouts_per_problem=2)
    cfg, env = Config(data=data), WithTool()
    seeds = iteration_seeds(cfg.data, 0)
    batch = asyncio.run(_generator(Answering(tokenizer), tokenizer, env).generate(seeds, 2))
    generated = GeneratedBatch(batch, 0, 1.0, 0.0, 1.0)
    plain = render_prompt_ids(tokenizer, batch.groups[0].problem)
    assert len(batch.groups[0].prompt_ids) > len(plain)  # the tool's schema is in the prompt
    store = SharedRollouts(cfg.data, tmp_path, {"test": True})
    assert store.get(lambda: generated, env, tokenizer, seeds) is generated

    def never() -> GeneratedBatch:
        raise AssertionError("the stored batch should have been loaded, not generated")

    loaded = SharedRollouts(cfg.data, tmp_path, {"test": True}).get(never, env, tokenizer, seeds)
    assert loaded.reused is not None and loaded.batch.groups == batch.groups


def test_extra_rewards_score_episodes(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    extra = RewardFunctions.from_specs([{"fn": "reward_plugins:length_bonus", "weight": 1.0}])
    plain = asyncio.run(_generator(Answering(tokenizer), tokenizer).generate([3, 4], 2))
    scored = asyncio.run(
        _generator(Answering(tokenizer), tokenizer, extra_rewards=extra).generate([3, 4], 2)
    )
    for a, b in zip(plain.samples, scored.samples, strict=True):
        assert b.components["length_bonus"] > 0 and b.reward > a.reward


def test_a_fleet_keeps_an_episodes_turns_on_one_server(tiny_model_dir: Path) -> None:
    tokenizer = load_tokenizer(str(tiny_model_dir))
    seen: dict[int, int] = {}
    clients = [Answering(tokenizer, seen, server) for server in (0, 1)]
    fleet = FleetClient(clients, window=2)  # type: ignore[arg-type]
    batch = asyncio.run(_generator(fleet, tokenizer).generate(list(range(8)), 4))
    assert all(s.episode is not None and s.episode.turns == TURNS for s in batch.samples)
    firsts = [seed for seed in seen if turn_seed(seed, 1) in seen]
    assert len(firsts) == 8 * 4
    assert set(seen.values()) == {0, 1}  # both served
    moved = [s for s in firsts if seen[s] != seen[turn_seed(s, 1)]]
    assert not moved, f"{len(moved)} of {len(firsts)} episodes changed server between turns"


class Dying(Answering):
    """An `Answering` server that answers episodes' first turns (`firsts`: their seeds), then
    dies at the first later turn it is sent, and fails every request from then on."""

    def __init__(self, tokenizer: Any, seen: dict[int, int], server: int, firsts: set[int]):
        super().__init__(tokenizer, seen, server)
        self.firsts, self.dead = firsts, False

    async def complete_many(
        self,
        prompts: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seeds: Sequence[int],
        on_done: Any = None,
        spans: Any = None,
    ) -> list[list[Completion]]:
        self.dead = self.dead or any(seed not in self.firsts for seed in seeds)
        if self.dead:
            raise ServerDiedError("the server died")
        return await super().complete_many(prompts, n, sampling, seeds, on_done)


def test_an_episode_whose_server_is_set_aside_finishes_on_another(tiny_model_dir: Path) -> None:
    # Server 1 draws first turns, then dies at the second turn of its episodes: it is set aside,
    # and those episodes go on on server 0 (re-pinned there: their third turns follow).
    tokenizer = load_tokenizer(str(tiny_model_dir))
    seen: dict[int, int] = {}
    firsts = {request_seed(0, 0, problem) + i for problem in range(8) for i in range(4)}
    aside: list[int] = []
    dying = Dying(tokenizer, seen, 1, firsts)
    fleet = FleetClient(
        [Answering(tokenizer, seen, 0), dying],  # type: ignore[list-item]
        window=2,
        on_set_aside=aside.append,
    )
    generator = _generator(fleet, tokenizer, make_env("copy_turns", turns=3))

    async def episodes() -> Any:
        return await asyncio.wait_for(generator.generate(list(range(8)), 4), 30)

    batch = asyncio.run(episodes())
    assert all(s.episode is not None and s.episode.turns == 3 for s in batch.samples)
    assert dying.dead and aside == [1] and set(seen) >= firsts  # a second turn reached it
    moved = [seed for seed in firsts if seen[seed] == 1]
    assert moved, "server 1 drew no first turn"
    assert all(seen[turn_seed(seed, t)] == 0 for seed in moved for t in (1, 2))
    assert fleet.server_records()[1]["failures"] >= 1
