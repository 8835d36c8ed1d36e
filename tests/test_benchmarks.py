"""The pure helpers of the benchmark scripts (benchmarks/*.py): what their printed numbers and
verdicts are computed from. Nothing here is timed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from grail.core.placement import available_cores, split_cores

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The scripts import their shared module as `common` (their own folder is on sys.path when run).
sys.path.insert(0, str(BENCHMARKS))

import common  # noqa: E402
import scaling  # noqa: E402
import weight_sync  # noqa: E402

# --------------------------------------------------------------------------- weight_sync


def test_engine_update_seconds_reads_the_servers_line_for_that_version() -> None:
    log = (
        "2026-01-01 INFO grail.serve: weights updated: loaded 26 tensors from /w in 0.12 s; "
        "weight_version=tiny-1\n"
        "2026-01-01 INFO grail.serve: weights updated: loaded 26 tensors from /w in 0.50 s; "
        "weight_version=tiny-2\n"
        "2026-01-01 INFO grail.serve: weights updated: loaded 26 tensors from /w in 0.07 s; "
        "weight_version=tiny-1\n"
    )
    assert weight_sync.engine_update_seconds(log, "tiny-2") == 0.50
    assert weight_sync.engine_update_seconds(log, "tiny-1") == 0.07  # the latest such update
    assert weight_sync.engine_update_seconds(log, "tiny-3") is None
    assert weight_sync.engine_update_seconds("", "tiny-1") is None


def test_sync_ratio_is_the_ratio_of_medians() -> None:
    assert weight_sync.sync_ratio([0.1, 0.3, 0.2], [10.0, 30.0, 20.0]) == pytest.approx(0.01)
    with pytest.raises(ValueError, match="both modes"):
        weight_sync.sync_ratio([], [1.0])
    with pytest.raises(ValueError, match="positive"):
        weight_sync.sync_ratio([1.0], [0.0])


def test_compare_logprobs_accepts_only_the_new_weights() -> None:
    old = torch.log_softmax(torch.tensor([1.0, 2.0, 3.0, 0.5]), dim=-1)
    new = torch.log_softmax(torch.tensor([1.0, 2.5, 3.0, 0.5]), dim=-1)
    served_new = {2: float(new[2]), 1: float(new[1])}
    served_old = {2: float(old[2]), 1: float(old[1])}
    ok = weight_sync.compare_logprobs(served_new, new, old, tol=1e-4)
    assert ok["ok"] and ok["off_new"] == 0.0 and ok["off_old"] > 0.1
    stale = weight_sync.compare_logprobs(served_old, new, old, tol=1e-4)
    assert not stale["ok"]  # the server kept the old weights
    # Numbers that are neither (a broken load): too far from the new weights.
    garbage = {2: float(new[2]) + 0.01, 1: float(new[1])}
    assert not weight_sync.compare_logprobs(garbage, new, old, tol=1e-4)["ok"]
    with pytest.raises(ValueError, match="no log-probabilities"):
        weight_sync.compare_logprobs({}, new, old, tol=1e-4)


def test_perturb_moves_every_parameter_by_its_scale_deterministically() -> None:
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))

    a, b, c = model(), model(), model()
    before = [p.detach().clone() for p in a.parameters()]
    weight_sync.perturb_(a, seed=1, scale=0.05)
    weight_sync.perturb_(b, seed=1, scale=0.05)
    weight_sync.perturb_(c, seed=2, scale=0.05)
    for pa, pb, pc, p0 in zip(a.parameters(), b.parameters(), c.parameters(), before, strict=True):
        assert torch.equal(pa, pb)
        assert not torch.equal(pa, pc)
        delta = (pa - p0).pow(2).mean().sqrt()
        rms = max(p0.pow(2).mean().sqrt(), 0.02)  # all-zero tensors (the biases) use the floor
        assert 0.03 * rms < delta < 0.07 * rms  # ~ scale x rms


# --------------------------------------------------------------------------- scaling


def test_plan_points_shares_the_x1_run_between_series() -> None:
    points = scaling.plan_points(16, 8, 8, [4, 1, 2])
    assert [(p.series, p.factor, p.rollouts, p.max_new_tokens) for p in points] == [
        ("rollouts", 1, 128, 8),
        ("rollouts", 2, 256, 8),
        ("rollouts", 4, 512, 8),
        ("length", 2, 128, 16),
        ("length", 4, 128, 32),
    ]
    length = scaling.series_points(points, "length")
    assert [(p.series, p.factor) for p in length] == [
        ("rollouts", 1),
        ("length", 2),
        ("length", 4),
    ]
    for bad in ([2, 4], [1, 1, 2], [0, 1]):
        with pytest.raises(ValueError, match="factors"):
            scaling.plan_points(16, 8, 8, bad)
    with pytest.raises(ValueError, match="rollouts_per_problem"):
        scaling.plan_points(16, 1, 8, [1, 2])


def test_overrides_fix_the_micro_batch_and_compose_into_a_valid_config() -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from grail.core.validate import validate
    from grail.train.cli import CONF_DIR

    point = scaling.Point("rollouts", 4, 40, 8, 8)  # 320 rollouts
    args = scaling.overrides(point, iterations=3, batch_size=32)
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="offline_grpo", overrides=args))
    validate(cfg)  # type: ignore[arg-type]
    assert cfg.data.problems_per_iteration * cfg.data.rollouts_per_problem == 320  # type: ignore[attr-defined]
    assert cfg.train.batch_size == 32 and cfg.train.grad_accum_steps == 10  # type: ignore[attr-defined]
    assert cfg.eval.enabled is False and cfg.checkpoint.save_interval == 3  # type: ignore[attr-defined]
    assert cfg.data.environment == "copy_digits"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="batch_size"):
        scaling.overrides(point, iterations=3, batch_size=0)


def _record(iteration: int, iteration_s: float, **timings: float) -> dict:
    return {
        "iteration": iteration,
        "timings": {
            "iteration_s": iteration_s,
            "generation_s": 1.0,
            "train_s": 0.5,
            "weight_sync_s": 0.1,
            **timings,
        },
        "tokens": {"completion": 100 * (iteration + 1)},
        "completion_length": {"mean": 8.0},
    }


def test_iteration_timings_drop_warmup_and_subtract_eval_and_checkpoint() -> None:
    records = [
        _record(3, 2.5, checkpoint_s=1.0, eval_s=0.5),  # last: checkpoint and eval
        _record(0, 9.0),  # warm-up, slow
        _record(2, 1.1),
        _record(1, 1.2, eval_s=0.0, checkpoint_s=0.0),
    ]
    per = scaling.iteration_timings(records, warmup=1)
    assert per["core_s"] == pytest.approx([1.2, 1.1, 1.0])  # iteration order, warm-up gone
    assert per["completion_tokens"] == [200.0, 300.0, 400.0]
    with pytest.raises(ValueError, match="no iterations left"):
        scaling.iteration_timings(records, warmup=4)


def _run(core: list[float], peak: float, start: float) -> dict:
    n = len(core)
    return {
        "per_iteration": {
            "core_s": core,
            "generation_s": [0.5] * n,
            "train_s": [0.4] * n,
            "weight_sync_s": [0.1] * n,
            "completion_tokens": [64.0] * n,
            "completion_length": [8.0] * n,
        },
        "trainer_peak_rss_mb": peak,
        "trainer_rss_start_mb": start,
        "server_peak_rss_mb": 700.0,
        "wall_s": 20.0,
    }


def test_combine_runs_pools_iterations_and_keeps_the_highest_peak() -> None:
    combined = scaling.combine_runs([_run([1.0, 1.2, 5.0], 800, 760), _run([1.1, 0.9], 820, 750)])
    assert combined["iterations_timed"] == 5
    assert combined["core_s"] == pytest.approx(1.1)  # median of the pooled five, not of medians
    assert combined["trainer_peak_rss_mb"] == 820
    assert combined["trainer_added_mb"] == 70  # from the run that peaked
    assert combined["completion_length_mean"] == 8.0 and combined["wall_s"] == [20.0, 20.0]
    with pytest.raises(ValueError, match="no runs"):
        scaling.combine_runs([])


def test_scaling_exponent_recovers_a_power_law() -> None:
    work = [128, 256, 512]
    assert scaling.scaling_exponent(work, [0.5 * w for w in work]) == pytest.approx(1.0)
    assert scaling.scaling_exponent(work, [3.0 + 0 * w for w in work]) == pytest.approx(0.0)
    assert scaling.scaling_exponent(work, [1e-4 * w**2 for w in work]) == pytest.approx(2.0)
    # Fixed cost + linear part: between 0 and 1 (sub-linear).
    assert 0 < scaling.scaling_exponent(work, [2.0 + 0.01 * w for w in work]) < 1
    with pytest.raises(ValueError, match="two different"):
        scaling.scaling_exponent([4, 4], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        scaling.scaling_exponent([1, 2], [0.0, 1.0])


def test_relative_growth() -> None:
    assert scaling.relative_growth([500.0, 505.0, 550.0]) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        scaling.relative_growth([0.0, 1.0])


def test_server_peak_rss_reads_the_server_before_it_stops(tiny_model_dir: Path) -> None:
    from grail.inference.backends.builtin import BuiltinServer

    server = BuiltinServer(
        tiny_model_dir, "policy", log_dir=tiny_model_dir.parent / "logs", threads=1
    )
    with common.ServerPeakRss() as peak, server:
        first = server.pid
        server.restart(tiny_model_dir)  # stops the first server, starts a second
        second = server.pid
    assert peak.pids == [first, second] and first != second
    assert 100 < peak.peak_mb < 10_000  # a process that loaded torch and the model
    server.stop()  # outside the block: not recorded
    assert peak.pids == [first, second]


# --------------------------------------------------------------------------- vs_trl
# Only the pure parts: CI does not install the `trl` group, and nothing here imports trl.

import vs_trl  # noqa: E402


def _compose_ours(overrides: list[str]):  # type: ignore[no-untyped-def]
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from grail.core.validate import validate
    from grail.train.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="offline_grpo", overrides=overrides))
    validate(cfg)  # type: ignore[arg-type]
    return cfg


@pytest.mark.parametrize("arm", ["sync", "pipelined"])
def test_vs_trl_both_sides_are_configured_alike(arm: str) -> None:
    """The harness's config and TRL's arguments say the same thing, key by key: a change to one
    side that the other does not follow fails here, not silently in the published ratio."""
    w = vs_trl.Workload(
        problems=6,
        group_size=4,
        max_new_tokens=5,
        iterations=3,
        micro_batch=8,
        lr=3e-3,
        loss_type="bnpo",
        threads=3,
    )
    cfg = _compose_ours(vs_trl.ours_overrides(w, arm, "tiny"))
    trl = vs_trl.trl_config_kwargs(w, "/tmp/x")
    # one optimizer step per iteration, of equal micro-batches
    assert cfg.data.problems_per_iteration * cfg.data.rollouts_per_problem == 24
    assert cfg.train.batch_size == trl["per_device_train_batch_size"] == 8
    assert cfg.train.grad_accum_steps == trl["gradient_accumulation_steps"] == 3
    assert trl["steps_per_generation"] == 3 and trl["num_iterations"] == 1
    assert trl["max_steps"] == cfg.train.iterations == 3
    assert cfg.train.pipeline is (arm == "pipelined")
    # sampling
    assert cfg.data.rollouts_per_problem == trl["num_generations"] == 4
    assert cfg.generation.max_new_tokens == trl["max_completion_length"] == 5
    assert cfg.generation.temperature == trl["temperature"] == 1.0
    assert cfg.generation.top_p == trl["top_p"] == 1.0
    assert cfg.generation.top_k == -1 and trl["top_k"] == 0  # both: off
    # objective and optimiser
    assert cfg.train.loss_type == trl["loss_type"] == "bnpo"
    assert cfg.train.epsilon == trl["epsilon"] and cfg.train.epsilon_high is trl["epsilon_high"]
    assert cfg.train.kl_coef == trl["beta"] == 0.0
    assert cfg.train.is_correction == "none" and not trl.get("use_vllm", False)
    assert cfg.train.scale_rewards == trl["scale_rewards"] == "group"
    assert cfg.train.lr == trl["learning_rate"] == 3e-3
    assert (cfg.train.adam_beta1, cfg.train.adam_beta2) == (trl["adam_beta1"], trl["adam_beta2"])
    assert cfg.train.weight_decay == trl["weight_decay"] == 0.0
    assert cfg.train.grad_clip == trl["max_grad_norm"]
    assert cfg.train.warmup_steps == trl["warmup_steps"] == 0
    # nothing else in the timed iterations; threads as grail-train picks them on 3 cores
    assert cfg.eval.enabled is False and trl["eval_strategy"] == "no"
    assert cfg.checkpoint.save_interval > cfg.train.iterations and trl["save_strategy"] == "no"
    trainer = 3 if arm == "sync" else 1
    assert (cfg.train.threads, cfg.generation.server_threads) == (trainer, 1)


def test_vs_trl_measures_the_default_jobs_iteration_by_default() -> None:
    cfg = _compose_ours([])  # what `uv run grail-train` runs
    w = vs_trl.Workload()
    assert (w.problems, w.group_size) == (
        cfg.data.problems_per_iteration,
        cfg.data.rollouts_per_problem,
    )
    assert w.max_new_tokens == cfg.generation.max_new_tokens
    assert (w.micro_batch, w.grad_accum_steps) == (cfg.train.batch_size, cfg.train.grad_accum_steps)
    assert (w.lr, w.loss_type, w.adam_beta2) == (
        cfg.train.lr,
        cfg.train.loss_type,
        cfg.train.adam_beta2,
    )


def test_vs_trl_dataset_is_the_harness_seeds_in_order() -> None:
    from grail.envs import make_env
    from grail.rollouts.server import iteration_seeds

    w = vs_trl.Workload(problems=5, group_size=2, iterations=3, micro_batch=5)
    rows = vs_trl.trl_rows(w)
    cfg = _compose_ours(vs_trl.ours_overrides(w, "sync", "tiny"))
    expected = [s for i in range(3) for s in iteration_seeds(cfg.data, i)]
    assert [r["seed"] for r in rows] == expected and len(set(expected)) == 15
    env = make_env("copy_digits")
    assert rows[7]["prompt"] == env.problem(expected[7]).prompt_messages
    # TRL's batch i (each prompt repeated group_size times, any order) must be iteration i.
    per_iter = vs_trl.train_seeds(w)
    seen = [[s for s in reversed(seeds) for _ in range(2)] for seeds in per_iter]
    vs_trl.check_same_problems(seen, per_iter, 2)
    seen[1][0] = per_iter[2][0]
    with pytest.raises(RuntimeError, match="iteration 1"):
        vs_trl.check_same_problems(seen, per_iter, 2)


def test_vs_trl_prompts_render_to_the_same_token_ids(tiny_model_dir: Path) -> None:
    """TRL renders a batch of conversations with apply_chat_template(return_dict=True); the
    harness one problem at a time. Both must give the ids the model is trained on."""
    from grail.envs import make_env
    from grail.models.loading import load_tokenizer
    from grail.rollouts.generation import render_prompt_ids

    tokenizer = load_tokenizer(str(tiny_model_dir))
    env = make_env("copy_digits")
    problems = [env.problem(s) for s in (0, 1, 2)]
    batched = tokenizer.apply_chat_template(
        conversation=[p.prompt_messages for p in problems],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    assert [list(ids) for ids in batched] == [render_prompt_ids(tokenizer, p) for p in problems]


def test_vs_trl_reward_is_the_environments() -> None:
    from grail.envs import make_env

    env = make_env("copy_digits")
    reward = vs_trl.make_reward(env)
    answer = env.problem(3).answer
    conversational = [
        [{"role": "assistant", "content": answer}],
        [{"role": "assistant", "content": "x"}],
    ]
    assert reward(completions=conversational, seed=[3, 3], prompts=None) == [1.0, 0.0]
    assert reward(completions=[answer + "7"], seed=[3]) == [
        env.score(env.problem(3), answer + "7").reward
    ]
    with pytest.raises(TypeError, match="completion format"):
        vs_trl.completion_text(42)


def test_vs_trl_alternates_arms_and_counts_steady_iterations_only() -> None:
    assert vs_trl.schedule(["sync", "pipelined", "trl"], 2) == [
        (0, "sync"),
        (0, "pipelined"),
        (0, "trl"),
        (1, "sync"),
        (1, "pipelined"),
        (1, "trl"),
    ]
    its = [
        {
            "step_s": s,
            "wall_s": None if i == 0 else s,
            "completion_tokens": 10,
            "reward_mean": 0.0,
            "parts": {},
        }
        for i, s in enumerate([9.0, 1.0, 2.0, 0.1])
    ]
    run = {"iterations": its, "peak_rss": {"total_mb": 100.0}, "threads": {}, "process_s": 5.0}
    summary = vs_trl.summarize([run, run], warmup=1)
    # first (warm-up) and last (no prefetch in pipelined mode) iterations are not counted
    assert summary["iteration_s"]["n"] == 4 and summary["iteration_s"]["median"] == 1.5
    assert summary["completion_tok_per_s"]["max"] == 10.0


def test_vs_trl_rejects_unequal_workloads_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--micro-batch"):
        vs_trl.Workload(problems=16, group_size=8, micro_batch=48).check()
    with pytest.raises(ValueError, match="--group-size"):
        vs_trl.Workload(group_size=1, micro_batch=16).check()
    with pytest.raises(ValueError, match="arm"):
        vs_trl.ours_overrides(vs_trl.Workload(), "trl", "tiny")


def test_vs_trl_gives_ours_the_threads_grail_train_picks_by_default() -> None:
    assert vs_trl.ours_threads("sync", 5) == (5, 2) and vs_trl.ours_threads("pipelined", 5) == (
        2,
        2,
    )
    assert vs_trl.ours_threads("sync", 1) == vs_trl.ours_threads("pipelined", 1) == (1, 1)
    cores = available_cores()
    assert vs_trl.ours_threads("sync", cores) == split_cores(cores, pipelined=False)
    assert vs_trl.ours_threads("pipelined", cores) == split_cores(cores, pipelined=True)
    # The arm process runs ours' trainer; TRL gets all the cores, or half
    assert vs_trl.arm_threads("sync", 5) == 5 and vs_trl.arm_threads("pipelined", 5) == 2
    assert vs_trl.arm_threads("trl", 5) == 5 and vs_trl.arm_threads("trl_half", 5) == 2


# --------------------------------------------------------------------------- train_step_gpu
# Its pure parts, the layout counts checked against the forward passes an update really runs,
# and a CPU run of the whole script on the tiny shape.

import json  # noqa: E402

import train_step_gpu  # noqa: E402


def test_train_step_completion_lengths_are_seeded_and_spread_around_the_mean() -> None:
    def draw(seed: int, spread: str) -> list[int]:
        return train_step_gpu.completion_lengths(
            4000, 50, spread, torch.Generator().manual_seed(seed)
        )

    lengths = draw(0, "uniform")
    assert lengths == draw(0, "uniform") and lengths != draw(1, "uniform")
    assert min(lengths) == 1 and max(lengths) == 99 == train_step_gpu.max_completion_len(
        50, "uniform"
    )
    assert sum(lengths) / len(lengths) == pytest.approx(50, abs=1.5)
    assert draw(0, "none") == [50] * 4000 and train_step_gpu.max_completion_len(50, "none") == 50
    assert train_step_gpu.completion_lengths(3, 1, "uniform", torch.Generator()) == [1, 1, 1]
    with pytest.raises(ValueError, match="spread"):
        draw(0, "normal")


def test_train_step_flops_count_the_output_layer_on_completion_positions() -> None:
    # 2 samples: (prompt 3, completion 2) and (3, 5); N_body 100, head 10, L 2, d 4.
    flops, every = train_step_gpu.model_flops([(3, 2), (3, 5)], 100, 10, 2, 4)
    body = 6 * 100 * (5 + 8) + 12 * 2 * 4 * (5**2 + 8**2)
    assert flops == body + 6 * 10 * (2 + 5)
    assert every == body + 6 * 10 * (5 + 8)
    # The Qwen2.5-0.5B shape as the script builds it: 494.0 M parameters, 136.1 M of them the
    # tied embedding / output layer.
    assert train_step_gpu.SHAPES["qwen2.5-0.5b"] == {
        "hidden_size": 896,
        "num_layers": 24,
        "num_heads": 14,
        "num_kv_heads": 2,
        "intermediate_size": 4864,
    }


@pytest.mark.parametrize("mode", ["shared", "full", "packed"])
def test_train_step_layout_counts_the_slots_the_update_runs(
    tiny_model_dir: Path, mode: str
) -> None:
    """padded_layout / packed_layout against the transformer body's inputs in a real update:
    shared prompts (padded), every row in full (gradient checkpointing), packed pieces."""
    from grail.algo.grpo import GRPOLossConfig
    from grail.models.loading import load_model
    from grail.train.microbatch import microbatches
    from grail.train.packing import decoder_and_head
    from grail.train.update import UpdateSettings, policy_update

    torch.manual_seed(0)
    model = load_model(str(tiny_model_dir))
    if mode == "full":
        model.gradient_checkpointing_enable()
    gen = torch.Generator().manual_seed(0)
    lengths = train_step_gpu.completion_lengths(9, 4, "uniform", gen)
    batch = train_step_gpu.synthetic_batch(3, 3, 5, lengths, 512, gen)
    batch.groups[1].prompt_ids = batch.groups[1].prompt_ids[:2]  # prompts of unequal length
    budget = 20 if mode == "packed" else 0
    calls: list[tuple[int, int]] = []  # (slots, real tokens) per body forward

    def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        tokens = ids.numel() if mask is None else int(mask[:, -ids.shape[1] :].sum())
        calls.append((ids.numel(), tokens))

    decoder_and_head(model)[0].register_forward_pre_hook(record, with_kwargs=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    settings = UpdateSettings(GRPOLossConfig(), 1.0, 4, 3, 1.0, micro_batch_tokens=budget)
    policy_update(
        model,
        None,
        optimizer,
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
        batch,
        settings,
        pad_token_id=0,
        device=torch.device("cpu"),
        backward=lambda loss: loss.backward(),
        clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c),
    )
    mbs = microbatches(batch, 4)
    layout = (
        train_step_gpu.packed_layout(mbs, budget)
        if budget
        else train_step_gpu.padded_layout(mbs, shared=mode == "shared")
    )
    assert (layout.slots, layout.tokens) == tuple(map(sum, zip(*calls, strict=True)))
    assert (layout.passes, layout.largest) == (len(calls), max(s for s, _ in calls))
    assert layout.padding_frac == 0 if budget else layout.padding_frac > 0.1


def test_train_step_runs_on_cpu_and_prints_every_field(capsys: pytest.CaptureFixture[str]) -> None:
    # One thread: two spin-wait on each other on a busy 2-core machine (seconds, not 0.1 s).
    common_args = "--device cpu --shape tiny --vocab-size 300 --groups 2 --group-size 3 --threads 1"
    common_args += " --prompt-len 8 --completion-len 6 --warmup 0 --steps 1 --batch-size 4 --json"
    runs = {}
    threads = torch.get_num_threads()
    try:
        for tokens in (0, 24):
            argv = [*common_args.split(), "--micro-batch-tokens", str(tokens)]
            assert train_step_gpu.main(argv) == 0
            runs[tokens] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        # The same fields as text, one line each
        assert train_step_gpu.main([*common_args.split()[:-1], "--peak-tflops", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    padded, packed = runs[0], runs[24]
    assert padded["layout"] == "padded" and packed["layout"] == "packed"
    assert padded["padding_frac"] > 0 and packed["padding_frac"] == 0
    assert packed["largest_forward_tokens"] <= 24 < packed["forward_passes_per_update"] * 24
    for r in (padded, packed):
        assert r["vocab_size"] == 300 and r["head_params"] == 300 * 64 and r["tied_embeddings"]
        assert r["tokens_per_update"] == pytest.approx(6 * (8 + r["completion_len_mean"]))
        assert r["tokens_per_s"] > 0 and r["model_tflops"] > 0 and r["grad_accum_steps"] == 2
        assert r["mfu"] is None  # no peak known on CPU
    for name in ("device", "model", "batch", "layout", "padding", "throughput", "MFU"):
        assert any(line.startswith(f"{name} ") for line in out.splitlines()), name
    assert "n/a" not in out


# --------------------------------------------------------------------------- fleet_sim

import fleet_sim  # noqa: E402

from grail.rollouts.balance import Balancer  # noqa: E402


def test_fleet_sim_step_time_is_the_line_through_the_measured_points() -> None:
    for sequences, seconds in fleet_sim.MEASURED:
        assert fleet_sim.step_s(sequences) == pytest.approx(seconds)
    assert fleet_sim.step_s(64, speed=0.5) == pytest.approx(2 * 3.66e-3)


def test_fleet_sim_one_server_decodes_a_batch_step_by_step() -> None:
    # Two sequences of 3 and 5 tokens on one server with room for both: 3 steps of 2
    # sequences, then 2 steps of 1.
    result = fleet_sim.run_iteration(Balancer(1, 1), [1.0], [[3, 5]], max_batch=4, cost=8.0)
    assert result.seconds == pytest.approx(3 * fleet_sim.step_s(2) + 2 * fleet_sim.step_s(1))
    assert (result.answered, result.tokens, result.rollouts) == ([0], 8, 2)
    # A batch of one: the 5-token sequence waits for the 3-token one.
    result = fleet_sim.run_iteration(Balancer(1, 1), [1.0], [[3, 5]], max_batch=1, cost=8.0)
    assert result.seconds == pytest.approx(8 * fleet_sim.step_s(1))


def test_fleet_sim_meets_the_utilisation_target_with_one_server_at_half_speed() -> None:
    # Issue 30's target, >= 90% of the ideal (every server at a full batch, no tail), holds
    # once an iteration is long against its tail: 512 groups of 16 per server.
    window = fleet_sim.default_window(256, 16)
    slow = fleet_sim.SCENARIOS[1]
    outcome, _ = fleet_sim.simulate(8, slow, window=window, groups_per_server=512, iterations=2)
    assert outcome.utilisation >= 0.9
    # With 8 groups per server the iteration is its tail (~35% even with equal servers), and
    # what the balancer owes is to lose no more than the slow server's capacity.
    equal, _ = fleet_sim.simulate(8, fleet_sim.SCENARIOS[0], window=window)
    half, _ = fleet_sim.simulate(8, slow, window=window)
    assert half.rollouts_per_s / (equal.rollouts_per_s * 7.5 / 8) >= 0.9
    assert half.slow_share is not None and half.slow_share < 0.5  # it got fewer groups


def test_fleet_sim_a_server_that_was_slow_rejoins_once_probed() -> None:
    # Server 0 runs at a third of the speed in the first iteration only: measured slow, it gets
    # nothing in the second, is probed at the start of the third (a long batch: the probe fits)
    # and, measured fast again, takes its share, as in an equal fleet.
    window = fleet_sim.default_window(256, 16)
    (recovers,) = [s for s in fleet_sim.SCENARIOS if s.recovers]
    _, results = fleet_sim.simulate(8, recovers, window=window, groups_per_server=256, iterations=4)
    assert results[1].server_groups[0] == 0
    assert results[-1].server_groups[0] > 0.8 * 256
    equal, _ = fleet_sim.simulate(
        8, fleet_sim.SCENARIOS[0], window=window, groups_per_server=256, iterations=4
    )
    assert results[-1].seconds <= 1.05 * equal.iteration_s


def test_fleet_sim_failure_loses_no_group_and_counts_none_twice() -> None:
    window = fleet_sim.default_window(256, 16)
    equal, _ = fleet_sim.simulate(8, fleet_sim.SCENARIOS[0], window=window)
    balancers: list[Balancer] = []

    def factory(servers: int, w: int) -> Balancer:
        balancers.append(Balancer(servers, w))
        return balancers[-1]

    (fails,) = [s for s in fleet_sim.SCENARIOS if s.fails]
    outcome, results = fleet_sim.simulate(
        8, fails, window=window, fail_at=equal.iteration_s / 2, balancer_factory=factory
    )
    last = results[-1]
    assert last.resent > 0 and outcome.resent == last.resent
    assert sorted(last.answered) == list(range(8 * 8))  # every group once
    assert last.server_groups[0] < 8  # the dead server answered only what it finished first
    loads = balancers[0].loads
    assert loads[0].failures == last.resent
    assert sum(load.requests for load in loads) == 3 * 8 * 8  # answers, not attempts
    assert all(load.in_flight == 0 for load in loads)
    assert outcome.iteration_s > equal.iteration_s
    with pytest.raises(ValueError, match="needs fail_at"):
        fleet_sim.simulate(8, fails, window=window)


def test_fleet_sim_without_a_usable_server_says_so() -> None:
    balancer = Balancer(1, 2)
    with pytest.raises(RuntimeError, match="2 groups were never answered"):
        fleet_sim.run_iteration(balancer, [1.0], [[5], [5]], max_batch=4, cost=5.0, fail=(0, 0.001))


# --------------------------------------------------------------------------- every script runs
# Each script in benchmarks/ runs its smallest configuration here, in this process where it can
# (no interpreter and torch to start again), so a change elsewhere that breaks a script fails
# here and not months later, when someone wants its numbers (benchmarks/vs_trl.py imported
# `preflight` from a module that no longer had it). Numbers are not checked: a script that ran
# to its end and wrote its results passes. GPU-only scripts have their command lines checked on
# CPU and skip the GPU part, naming it.

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable  # noqa: E402

from helpers import forked  # noqa: E402
from helpers.run_dirs import make_run  # noqa: E402

# The smallest grail-train run that evaluates (seeds.py and service.py read its final eval).
RUN = "data.problems_per_iteration=2 data.rollouts_per_problem=2 eval.num_ids=2 eval.replicates=1"
RUN += " eval.report_ks=[1]"
NO_CUDA = "needs a CUDA device; torch sees none"


# `subprocess` as the scripts see it here: its Popen forks a `python -m grail.train.cli` worker
# (common.run_worker's, service.py's trainer) from this pytest worker's runner, as the suite's
# own grail-train runs are (tests/helpers/forked.py: the same arguments, environment, session
# and exit status), instead of a new interpreter importing torch again (~5 CPU-s a worker;
# study.py and under_load.py start two). Any other command (a script re-running itself as its
# worker, the hogs) is subprocess.Popen's own.
_FORKING = types.ModuleType("subprocess")
_FORKING.__dict__.update(vars(subprocess))
_FORKING.Popen = forked.popen  # type: ignore[attr-defined]


def _main(script: str, args: str, *more: str | Path) -> int | None:
    """`script`'s main(ARGS) in this process (`args` split on spaces, then `more`): what it
    returned, or its SystemExit's code."""
    module = importlib.import_module(script.removesuffix(".py"))
    try:
        return module.main([*args.split(), *map(str, more)])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1


def _results(path: Path) -> dict:
    assert path.is_file(), f"{path} not written"
    return json.loads(path.read_text())


class _Parsed(Exception):
    """Raised in place of a script's work once its command line parsed."""


def _parses(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """`script`'s parser accepts `argv` (an unknown or misspelt flag exits 2); nothing runs."""
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *args: object) -> None:
        parse(self, *args)  # type: ignore[arg-type]
        raise _Parsed

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
        with pytest.raises(_Parsed):
            _main(script, "", *argv)


def smoke_attention_gpu(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = "--tokens 256 --min-len 16 --max-len 64 --reps 1"
    _parses("attention_gpu.py", small.split(), monkeypatch)
    if not torch.cuda.is_available():
        pytest.skip(f"attention_gpu.py times CUDA kernels: {NO_CUDA}")
    assert _main("attention_gpu.py", small) == 0


def smoke_train_step_gpu(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = "--shape tiny --vocab-size 300 --groups 2 --group-size 2 --prompt-len 8"
    small += " --completion-len 6 --warmup 0 --steps 1 --json --device cuda"
    _parses("train_step_gpu.py", small.split(), monkeypatch)
    if not torch.cuda.is_available():  # its CPU run: test_train_step_runs_on_cpu_and_prints_...
        pytest.skip(f"train_step_gpu.py's GPU run {NO_CUDA}")
    assert _main("train_step_gpu.py", small) == 0


def _check_code(code: str) -> None:
    """A `python -c` program compiles, and the names it imports exist."""
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module:
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"{node.module} has no {missing}"


def smoke_gpu_session(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every stage's command, as DRY_RUN=1 prints it, still parses: the benchmarks' flags, the
    grail-train overrides (composed), the test files, a `python -c` program's imports. The
    stages themselves take minutes on a GPU: run it by hand there (docs/gpu.md)."""
    from hydra import compose, initialize_config_dir

    from grail.train.cli import CONF_DIR

    script = BENCHMARKS / "gpu_session.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    stages = script.read_text().split("# stages:")[1].splitlines()[0].split()
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp)}
    result = subprocess.run(
        ["bash", str(script), *stages], capture_output=True, text=True, timeout=60, env=env,
        cwd=BENCHMARKS.parent,
    )  # fmt: skip
    assert result.returncode == 0 and "unknown stage" not in result.stdout, result.stdout
    printed = result.stdout.split("######## summary")[0].splitlines()
    commands = {line.split(" (dry run):", 1)[1] for line in printed if " (dry run): python" in line}
    assert len(commands) > 10, result.stdout
    for command in sorted(commands):
        argv = shlex.split(command)[1:]  # after the python that runs it
        if argv[0].startswith("benchmarks/"):
            _parses(Path(argv[0]).name, argv[1:], monkeypatch)
        elif argv[:2] == ["-m", "pytest"]:
            files = [a for a in argv if a.startswith("tests/")]
            assert files and all((BENCHMARKS.parent / f).is_file() for f in files), command
        elif argv[:2] == ["-m", "grail.train.cli"]:
            with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
                compose(config_name="offline_grpo", overrides=argv[2:])
        elif argv[0] == "-c":
            _check_code(argv[1])
        else:
            raise AssertionError(f"a stage runs what this test cannot check: {command}")


def smoke_client_overhead(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    assert _main("client_overhead.py", "--batches 1 --warmup 0 --prompts 2 --out", out) == 0
    assert _results(out)["prompts"] == 2


def smoke_engine_decode(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    assert _main("engine_decode.py", "--shapes 1x2x3 --prompt-len 4 --no-warmup --out", out) == 0
    assert [r["mode"] for r in _results(out)["results"]] == ["eager", "graph"]


def smoke_episodes(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    small = "--problems 2 --episodes 2 --turns 2 --turn-tokens 2 --batches 1 --out"
    assert _main("episodes.py", small, out) == 0
    assert _results(out)["sampled_tokens_per_batch"] == 2 * 2 * 2 * 2


def smoke_fleet_sim(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    small = "--servers 2 --groups-per-server 2 --group-size 2 --max-len 8 --max-batch 4"
    _main("fleet_sim.py", f"{small} --iterations 2 --out", out)
    assert len(_results(out)["outcomes"]) == len(fleet_sim.SCENARIOS)


def smoke_iteration_times(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = make_run(tmp / "run", ["seed=0"], iterations=3, done=3, completed=True)
    assert _main("iteration_times.py", "", run) == 0


def smoke_lora(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    _main("lora.py", "--model tiny --smoke --threads 1 --out", out)
    results = _results(out)
    assert list(results["sync"]) == ["adapter"] and list(results["memory"]) == ["lora"]


def smoke_scaling(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"  # one point (x1): one real run, no exponent to fit
    small = "--problems 2 --rollouts-per-problem 2 --max-new-tokens 2 --factors 1 --batch-size 4"
    assert _main("scaling.py", f"{small} --iterations 2 --warmup 1 --out", out) == 0
    assert list(_results(out)["points"]) == ["rollouts x1"]


def smoke_seeds(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    assert _main("seeds.py", f"--seeds 1 train.iterations=1 {RUN} --out", out) == 0
    assert [r["seed"] for r in _results(out)["runs"]] == [0]


def smoke_service(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    monkeypatch.setattr(importlib.import_module("service"), "subprocess", _FORKING)
    _main("service.py", f"--workers 2 --timeout 300 train.iterations=1 {RUN} --out", out)
    assert _results(out)["groups"] >= 1


def smoke_study(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"  # one setting on the 2 seeds statistics need, without and with pruning
    small = f"--lrs 5e-3 --kl-coefs 0 --seeds 2 train.iterations=1 {RUN}"
    assert _main("study.py", f"{small} --out", out) == 0
    assert [s["runs"] for s in _results(out)["studies"]] == [2, 2]


def smoke_suite_cpu(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    inner = ["--", "tests/test_codec.py", "-n", "0", "-q", "-p", "no:cacheprovider"]
    assert _main("suite_cpu.py", "--top 2 --out", out, *inner) == 0
    results = _results(out)
    assert results["tests"] > 0 and results["pytest_exit_code"] == 0
    assert list(results["files"]) == ["tests/test_codec.py"] and results["cpu_s"] > 0


def smoke_tinker_overhead(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    _main("tinker_overhead.py", "--rounds 1 --warmup 0 --shapes call --out", out)
    assert list(_results(out)["shapes"]) == ["call"]


def smoke_tinker_wire(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    _main("tinker_wire.py", "--repeats 1 --out", out)
    assert len(_results(out)["cases"]) == 3


def smoke_under_load(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    small = f"--hogs 1 --rounds 1 --iterations 2 --warmup 0 {RUN}"
    assert _main("under_load.py", f"{small} --out", out) == 0
    assert _results(out)["idle"]["n"] == 1


def smoke_vs_trl(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arms = "sync,trl"
    try:
        import trl  # noqa: F401
    except ImportError:  # the `trl` dependency group left out: ours alone
        arms = "sync"
    out = tmp / "r.json"
    small = "--problems 2 --group-size 2 --max-new-tokens 2 --micro-batch 4 --threads 1"
    run = f"--arms {arms} --repetitions 1 --iterations 3 --warmup 1 {small} --out"
    assert _main("vs_trl.py", run, out) == 0
    assert _results(out)["arms"] == arms.split(",")


def smoke_weight_sync(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp / "r.json"
    code = _main("weight_sync.py", "--models tiny --reps 1 --warmup 0 --threads 1 --out", out)
    assert code in (0, 1)  # 1: the in-place/restart target missed, a number, not a failure
    assert "tiny" in _results(out)["models"]


SMOKE: dict[str, Callable[[Path, pytest.MonkeyPatch], None]] = {
    "attention_gpu.py": smoke_attention_gpu,
    "client_overhead.py": smoke_client_overhead,
    "engine_decode.py": smoke_engine_decode,
    "episodes.py": smoke_episodes,
    "fleet_sim.py": smoke_fleet_sim,
    "gpu_session.sh": smoke_gpu_session,
    "iteration_times.py": smoke_iteration_times,
    "lora.py": smoke_lora,
    "scaling.py": smoke_scaling,
    "seeds.py": smoke_seeds,
    "service.py": smoke_service,
    "study.py": smoke_study,
    "suite_cpu.py": smoke_suite_cpu,
    "tinker_overhead.py": smoke_tinker_overhead,
    "tinker_wire.py": smoke_tinker_wire,
    "train_step_gpu.py": smoke_train_step_gpu,
    "under_load.py": smoke_under_load,
    "vs_trl.py": smoke_vs_trl,
    "weight_sync.py": smoke_weight_sync,
}
# Run in full elsewhere (not again here), or not a script.
ELSEWHERE = {
    "memory_plan.py": "tests/test_memory_plan.py::test_the_script_prints_a_table_and_json",
    "common.py": "the scripts' shared module, imported by every smoke run above",
}


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_every_benchmark_runs_its_smallest_configuration(
    script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = torch.get_num_threads()  # several scripts set this process's
    monkeypatch.setattr(common, "subprocess", _FORKING)  # run_worker's workers
    try:
        SMOKE[script](tmp_path, monkeypatch)
    finally:
        torch.set_num_threads(threads)


def test_every_file_in_benchmarks_is_run_by_a_test() -> None:
    """A new script joins SMOKE (or says where it runs), or this fails."""
    files = {p.name for p in BENCHMARKS.iterdir() if p.is_file()}
    assert files == set(SMOKE) | set(ELSEWHERE), files ^ (set(SMOKE) | set(ELSEWHERE))
