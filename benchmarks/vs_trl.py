"""The same GRPO workload run by this harness (sync and pipelined) and by TRL's GRPOTrainer.

    uv run --group trl python benchmarks/vs_trl.py                    # ~3 min on 2 idle cores
    uv run --group trl python benchmarks/vs_trl.py --repetitions 5 --arms sync,trl,trl_half

TRL lives in the optional dependency group `trl` (pyproject.toml), so a plain `uv sync` does not
install it. Without it, `--arms sync,pipelined` still runs.

What runs. Each repetition runs every arm once, in order (sync, pipelined, trl, trl_half, sync,
...), each arm in its own fresh Python process, so that peak memory and thread settings are per
arm and no arm warms another's caches; alternating spreads drift in the machine's load over all
arms.

    sync       `grail.train.loop.run` with train.pipeline=false: generate → train → sync weights
    pipelined  the same with train.pipeline=true (generation of iteration i+1 overlaps the
               training of iteration i, one step off-policy)
    trl        `trl.GRPOTrainer.train()` on the same model, prompts and hyper-parameters, with
               all T threads
    trl_half   the same with floor(T/2) threads (see Threads)

How the workloads were made equal (TRL's name in brackets where it differs):
- Model: the directory `grail.models.tiny.ensure_tiny_model()` returns, loaded in float32 by both
  [model_init_kwargs={"dtype": "float32"}, bf16=False, fp16=False], no gradient checkpointing
  [gradient_checkpointing=False; TRL defaults to True], on CPU [use_cpu=True;
  CUDA_VISIBLE_DEVICES is emptied for every arm].
- Prompts: iteration i trains on exactly the problem seeds
  `grail.rollouts.server.iteration_seeds(cfg.data, i)` of the copy_digits task. TRL's dataset
  holds those seeds' `prompt_messages` in that order (iteration 0's problems, then iteration
  1's, ...) with shuffling off [shuffle_dataset=False], so TRL's generation batch i holds the
  same problems as our iteration i; the TRL arm fails unless its reward function saw exactly
  those seeds, each G times, in step i. Both render the messages with the tokenizer's chat
  template and add_generation_prompt=True.
- Reward: the environment's own `score(problem(seed), completion).reward` in both; TRL gets it
  as its one reward function (the seed is a dataset column passed to the function).
- Sampling: G completions per prompt [num_generations]; at most `--max-new-tokens` tokens
  [max_completion_length]; both stop at the tokenizer's / model's EOS ids (<|im_end|>) or at the
  length limit, and both count the EOS token as a completion token; temperature 1, top_p 1,
  top-k off [top_k=0], no repetition penalty, no min_p.
- Objective: the same loss_type (default dapo), epsilon 0.2 (epsilon_high = epsilon), token-level
  importance sampling, rewards scaled by the group std [scale_rewards="group"], beta = 0 (no
  reference model in either), no entropy bonus, truncated completions not masked, no
  importance-sampling correction (TRL applies it only when vLLM generates).
- Optimisation: exactly one AdamW step per iteration in both. Ours: train.batch_size = M (the
  micro-batch) and train.grad_accum_steps = P·G / M. TRL: per_device_train_batch_size = M,
  gradient_accumulation_steps = P·G / M, steps_per_generation = that too (TRL's default) and
  num_iterations = 1, so one generation batch of P·G completions is exactly one optimizer step
  and TRL computes no separate "old" log-prob pass (neither does ours: with one step the old
  policy is the current one, detached). Same lr, constant schedule, no warmup
  [lr_scheduler_type="constant"], betas, eps 1e-8, weight decay 0, grad-norm clip 1.0
  [optim="adamw_torch"]; iterations [max_steps].
- What differs is method, not work: ours' forward pass runs each distinct prompt of a
  micro-batch once and its completions on the prompt's key/value cache (grail/train/update.py;
  same log-probs and gradients as the full pass, tests/test_update.py), where TRL runs every
  prompt + completion in full. Ours generates on a separate server process, TRL with
  `model.generate` on the training model.
- Threads: both get the same T cores (default: this process's CPU affinity). Ours runs with
  the threads `grail-train` picks by default on T cores: in sync mode the trainer has all T
  torch threads (generation and training take turns) and the inference server floor(T/2)
  (OMP/MKL threads), or T for a model of 1M body parameters or more (`--model small`); in
  pipelined mode, where they compute at once, floor(T/2) each. TRL runs in
  one process with torch.set_num_threads(T). The counts each arm actually ran with are in the
  JSON and printed. Why `trl_half` too: on a machine where other processes run, a process whose
  OpenMP threads outnumber the free cores waits at every parallel region's barrier for a thread
  that has lost its core. Measured on the shared 2-core machine these numbers come from (load
  average ~3 from other jobs), TRL's median iteration was 1.5-1.6 s with 2 threads and
  0.18-0.29 s with 1. So `trl` alone would flatter ours whenever the machine is not idle;
  compare with the faster of the two TRL arms, on an idle machine.
- Nothing else inside the timed iterations: no evaluation (eval.enabled=false;
  eval_strategy="no"), no logging (TRL: report_to="none", logging_strategy="no", no tqdm),
  no checkpoints (ours: checkpoint.save_interval beyond the run, TRL: save_strategy="no").
  What remains: ours always checkpoints in its last iteration, which is not counted (below);
  ours also runs its per-iteration weight sync (save safetensors, server reloads in place),
  which is part of what a harness with a separate inference server costs and is counted. Ours'
  built-in server runs batch-invariant decoding on CPU (its default), TRL `model.generate` on
  the training model.

What is measured, per iteration. The first `--warmup` (default 1) iterations of every run are
not counted: they carry one-off costs (lazy initialisation, first-touch allocation and, in
pipelined mode, a first generation that nothing overlaps). Nor is the last: in pipelined mode it
starts no generation (nothing is left to prefetch), so it is cheaper than a steady-state one, and
ours checkpoints in it; it is dropped for every arm alike.
- iteration seconds. Ours: metrics/train_iter_XXX.json `timings.iteration_s` (minus
  `checkpoint_s` and `eval_s`, which are 0 in every counted iteration). TRL: a
  TrainerCallback's on_step_begin → on_step_end, which includes generation, because TRL
  generates inside the step (in `_prepare_inputs` of the first micro-batch).
- wall seconds: end of iteration i-1 to end of iteration i (ours: the metrics files'
  modification times; TRL: consecutive on_step_end), so it also counts anything between
  iterations (TRL's log/save checks, the dataloader) — a cross-check on the first number.
- completion tokens per second: completion tokens of the iteration / iteration seconds.
- what dominates: ours' timings (generation_s, train_s, weight_sync_s); for TRL the time in
  `_generate_single_turn` (model.generate), the rest of `_generate_and_score_completions`
  (decode, reward, padding, advantages) and the remainder of the step (forward, backward, step).
- peak RSS of the arm, in MiB: the arm process's own VmHWM read just before it exits, plus, for
  ours, the inference server's VmHWM read just before the harness stops it (`ServerPeakRss`).
  TRL runs in one process. The sum of two per-process peaks bounds from above what both held
  at the same moment.

Ratios are ours / TRL of the median iteration seconds (below 1: ours is faster). Results go to
benchmarks/results/vs_trl.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, get_args

from common import (
    ServerPeakRss,
    core_iteration_s,
    peak_rss_mb,
    print_table,
    run_worker,
    spread,
    write_results,
)

from grail.core.choices import LossType
from grail.core.placement import decode_scales, split_cores

ARMS = ("sync", "pipelined", "trl", "trl_half")
OURS_ARMS = ("sync", "pipelined")
TRL_ARMS = ("trl", "trl_half")
ENVIRONMENT = "copy_digits"
# `--model small`: the shape the thread counts of grail.core.placement.split_cores were measured on.
SMALL_MODEL: dict[str, Any] = {
    "hidden_size": 384,
    "num_layers": 6,
    "num_heads": 6,
    "num_kv_heads": 2,
}


@dataclass(frozen=True)
class Workload:
    """Everything both sides are configured from; one instance is passed to every arm. The
    defaults are one iteration of the default job (conf/env/copy_digits.yaml) without its entropy
    bonus (neither side gets one). docs/benchmarks.md's numbers were measured when the default
    job allowed 4 new tokens: `--max-new-tokens 4` reproduces that workload."""

    problems: int = 64
    group_size: int = 16
    max_new_tokens: int = 2
    iterations: int = 6
    micro_batch: int = 256
    lr: float = 5e-3
    loss_type: str = "dapo"
    epsilon: float = 0.2
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    grad_clip: float = 1.0
    threads: int = 2
    seed: int = 0
    model: str = "tiny"  # "tiny" (grail.models.tiny), else a model directory (`--model small`)
    server_threads: int = 0  # ours' generation.server_threads; 0: what grail-train picks

    def model_dir(self) -> str:
        from grail.models.tiny import ensure_tiny_model

        return str(ensure_tiny_model()) if self.model == "tiny" else self.model

    @property
    def samples(self) -> int:
        return self.problems * self.group_size

    @property
    def grad_accum_steps(self) -> int:
        """Micro-batches per iteration, all accumulated into the iteration's one optimizer step."""
        return self.samples // self.micro_batch

    def check(self) -> None:
        """Reject workloads the two sides cannot run identically, naming the flag."""
        for flag, value in (
            ("--problems", self.problems),
            ("--iterations", self.iterations),
            ("--max-new-tokens", self.max_new_tokens),
            ("--micro-batch", self.micro_batch),
            ("--threads", self.threads),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.group_size < 2:
            raise ValueError(
                f"--group-size must be >= 2 (GRPO needs a group), got {self.group_size}"
            )
        if self.samples % self.micro_batch:
            raise ValueError(
                f"--micro-batch {self.micro_batch} must divide problems x group size = "
                f"{self.samples}, so that both sides make one optimizer step of equal micro-batches"
            )


def ours_threads(arm: str, total: int, model_dir: str | None = None) -> tuple[int, int]:
    """(trainer, server) torch threads for ours on `total` cores: what `grail-train` picks by
    default on a machine with that many (`grail.core.placement.split_cores`: the trainer all of
    them in sync mode, where generation and training take turns, half in pipelined mode; the
    server half, or all of them in sync mode for a model large enough to gain)."""
    if total < 1:
        raise ValueError(f"threads must be >= 1, got {total}")
    if arm not in OURS_ARMS:
        raise ValueError(f"arm {arm!r} is not one of ours: {', '.join(OURS_ARMS)}")
    return split_cores(total, pipelined=arm == "pipelined", server_scales=decode_scales(model_dir))


def arm_threads(arm: str, total: int) -> int:
    """Torch (and OMP/MKL) threads of the arm's own process: ours' trainer (see `ours_threads`),
    `trl` all of `total`, `trl_half` half of it."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {', '.join(ARMS)}")
    if arm in OURS_ARMS:
        return ours_threads(arm, total)[0]
    return total if arm == "trl" else max(1, total // 2)


def ours_overrides(w: Workload, arm: str, model_dir: str) -> list[str]:
    """Hydra overrides of conf/offline_grpo.yaml that make `grail.train.loop.run` do `w`."""
    trainer_threads, server_threads = ours_threads(arm, w.threads, model_dir)
    server_threads = w.server_threads or server_threads
    return [
        f"env={ENVIRONMENT}",
        f"seed={w.seed}",
        f"model.train_id={model_dir}",
        f"data.problems_per_iteration={w.problems}",
        f"data.rollouts_per_problem={w.group_size}",
        f"generation.max_new_tokens={w.max_new_tokens}",
        "generation.temperature=1.0",
        "generation.top_p=1.0",
        "generation.top_k=-1",
        f"generation.server_threads={server_threads}",
        f"train.iterations={w.iterations}",
        f"train.lr={w.lr}",
        f"train.loss_type={w.loss_type}",
        "train.importance_sampling_level=token",
        f"train.epsilon={w.epsilon}",
        "train.epsilon_high=null",
        "train.kl_coef=0.0",
        "train.entropy_coef=0.0",
        "train.scale_rewards=group",
        "train.is_correction=none",  # TRL corrects only with vLLM generating (use_vllm)
        f"train.batch_size={w.micro_batch}",
        f"train.grad_accum_steps={w.grad_accum_steps}",
        "train.warmup_steps=0",
        f"train.grad_clip={w.grad_clip}",
        "train.weight_decay=0.0",
        f"train.adam_beta1={w.adam_beta1}",
        f"train.adam_beta2={w.adam_beta2}",
        f"train.threads={trainer_threads}",
        f"train.pipeline={'true' if arm == 'pipelined' else 'false'}",
        "eval.enabled=false",
        f"checkpoint.save_interval={w.iterations + 1}",
        "checkpoint.keep_last_k=1",
    ]


def trl_config_kwargs(w: Workload, output_dir: str) -> dict[str, Any]:
    """`trl.GRPOConfig` arguments that make `GRPOTrainer.train()` do `w` (see the docstring)."""
    return {
        "output_dir": output_dir,
        "seed": w.seed,
        "use_cpu": True,
        "bf16": False,
        "fp16": False,
        "gradient_checkpointing": False,
        "model_init_kwargs": {"dtype": "float32"},
        # data and sampling
        "shuffle_dataset": False,
        "num_generations": w.group_size,
        "max_completion_length": w.max_new_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "use_vllm": False,
        "mask_truncated_completions": False,
        # objective
        "loss_type": w.loss_type,
        "importance_sampling_level": "token",
        "epsilon": w.epsilon,
        "epsilon_high": None,
        "beta": 0.0,
        "scale_rewards": "group",
        "num_iterations": 1,
        # one optimizer step per generation batch of problems x group size completions
        "per_device_train_batch_size": w.micro_batch,
        "gradient_accumulation_steps": w.grad_accum_steps,
        "steps_per_generation": w.grad_accum_steps,
        "max_steps": w.iterations,
        "learning_rate": w.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch",
        "adam_beta1": w.adam_beta1,
        "adam_beta2": w.adam_beta2,
        "adam_epsilon": 1e-8,
        "weight_decay": 0.0,
        "max_grad_norm": w.grad_clip,
        # nothing but training inside the steps
        "eval_strategy": "no",
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": "none",
        "log_completions": False,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
    }


def train_seeds(w: Workload) -> list[list[int]]:
    """The problem seeds of every iteration, exactly as the harness picks them."""
    from grail.rollouts.server import iteration_seeds

    cfg = _compose(ours_overrides(w, "sync", "tiny"))
    return [iteration_seeds(cfg.data, i) for i in range(w.iterations)]


def trl_rows(w: Workload) -> list[dict[str, Any]]:
    """TRL's training dataset: one row per problem, iteration by iteration, in the harness's order.
    `prompt` (chat messages) is what TRL renders with the chat template; `seed` is passed to the
    reward function."""
    from grail.envs import make_env

    env = make_env(ENVIRONMENT)
    return [
        {"prompt": env.problem(seed).prompt_messages, "seed": seed}
        for seeds in train_seeds(w)
        for seed in seeds
    ]


def completion_text(completion: Any) -> str:
    """TRL hands a conversational completion as [{"role": "assistant", "content": text}]."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[0], dict):
        return "".join(str(m.get("content", "")) for m in completion)
    raise TypeError(f"unexpected completion format: {completion!r:.200}")


def make_reward(env: Any) -> Callable[..., list[float]]:
    """The environment's reward in TRL's reward-function signature."""

    def env_reward(completions: list[Any], seed: list[int], **_: Any) -> list[float]:
        return [
            env.score(env.problem(int(s)), completion_text(c)).reward
            for c, s in zip(completions, seed, strict=True)
        ]

    env_reward.__name__ = f"{env.name}_reward"
    return env_reward


def check_same_problems(seen: list[list[int]], expected: list[list[int]], group_size: int) -> None:
    """Fail unless generation batch i held exactly iteration i's problems, each `group_size`
    times (the order inside a batch does not matter: advantages are per group)."""
    for i, (got, want) in enumerate(zip(seen, expected, strict=True)):
        if sorted(got) != sorted(s for s in want for _ in range(group_size)):
            raise RuntimeError(
                f"iteration {i}: TRL scored seeds {sorted(set(got))} (x{len(got)}), expected "
                f"{sorted(want)} x{group_size}: the workloads differ"
            )


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from grail.train.cli import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return OmegaConf.to_object(compose("offline_grpo", overrides=overrides))


# ---------------------------------------------------------------------------------------------
# Arm workers: each runs in its own process and writes one JSON.
# ---------------------------------------------------------------------------------------------


def run_ours(w: Workload, arm: str) -> dict[str, Any]:
    import torch

    from grail.train.launch import preflight, train

    cfg = _compose(ours_overrides(w, arm, w.model_dir()))
    preflight(cfg)
    with tempfile.TemporaryDirectory(prefix=f"vs_trl-{arm}-") as tmp, ServerPeakRss() as server:
        run_dir = Path(tmp)
        train(cfg, run_dir)  # as grail-train runs it: reproducible=true pins the kernels first
        iterations = []
        previous_end: float | None = None
        for i in range(w.iterations):
            path = run_dir / "metrics" / f"train_iter_{i:03d}.json"
            record = json.loads(path.read_text())
            t = record["timings"]
            step_s = core_iteration_s(t)
            excluded = t["iteration_s"] - step_s  # evaluation and checkpoint
            end = path.stat().st_mtime_ns / 1e9
            iterations.append(
                {
                    "iteration": i,
                    "step_s": step_s,
                    "wall_s": None if previous_end is None else end - previous_end - excluded,
                    "completion_tokens": record["tokens"]["completion"],
                    "reward_mean": record["reward_mean"],
                    "parts": {
                        k: t[k]
                        for k in sorted(t)
                        if k not in ("iteration_s", "checkpoint_s", "eval_s")
                    },
                }
            )
            previous_end = end
    if server.peak_mb == 0.0:
        raise RuntimeError("the inference server's peak RSS was not recorded")
    return {
        "iterations": iterations,
        "threads": {
            "trainer_torch": torch.get_num_threads(),
            "server": cfg.generation.server_threads,
        },
        "server_peak_rss_mb": server.peak_mb,
    }


def run_trl(w: Workload, threads: int) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from grail.envs import make_env

    torch.set_num_threads(threads)
    env = make_env(ENVIRONMENT)
    dataset = Dataset.from_list(trl_rows(w))
    reward = make_reward(env)
    rewards: list[list[float]] = []
    seeds_seen: list[list[int]] = []

    def recorded_reward(*args: Any, **kwargs: Any) -> list[float]:
        values = reward(*args, **kwargs)
        rewards.append(values)
        seeds_seen.append([int(s) for s in kwargs["seed"]])
        return values

    recorded_reward.__name__ = reward.__name__

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer with timers around generation; nothing else changed."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.generate_s: list[float] = []
            self.generate_and_score_s: list[float] = []
            self.completion_tokens: list[int] = []

        def _generate_single_turn(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
            self.generate_s.append(time.perf_counter() - t0)
            self.completion_tokens.append(sum(len(c) for c in completion_ids))
            return completion_ids, logprobs

        def _generate_and_score_completions(self, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*args, **kwargs)
            self.generate_and_score_s.append(time.perf_counter() - t0)
            return out

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.begin: list[float] = []
            self.end: list[float] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.begin.append(time.perf_counter())

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.end.append(time.perf_counter())

    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="vs_trl-trl-") as tmp:
        trainer = TimedGRPOTrainer(
            model=w.model_dir(),
            reward_funcs=recorded_reward,
            args=trl.GRPOConfig(**trl_config_kwargs(w, tmp)),
            train_dataset=dataset,
            callbacks=[timer],
        )
        trainer.train()
    gen, gen_score = trainer.generate_s, trainer.generate_and_score_s
    counts = (len(timer.begin), len(timer.end), len(gen), len(gen_score), len(rewards))
    if set(counts) != {w.iterations}:
        raise RuntimeError(
            f"TRL made {counts} (steps begun, ended, generations, generate+score, reward calls), "
            f"expected {w.iterations} of each: one generation per optimizer step"
        )
    check_same_problems(seeds_seen, train_seeds(w), w.group_size)
    iterations = []
    for i in range(w.iterations):
        step = timer.end[i] - timer.begin[i]
        iterations.append(
            {
                "iteration": i,
                "step_s": step,
                "wall_s": None if i == 0 else timer.end[i] - timer.end[i - 1],
                "completion_tokens": trainer.completion_tokens[i],
                "reward_mean": statistics.fmean(rewards[i]),
                "parts": {
                    "generate_s": gen[i],
                    "score_and_prepare_s": gen_score[i] - gen[i],
                    "train_s": step - gen_score[i],
                },
            }
        )
    return {
        "iterations": iterations,
        "threads": {"torch": torch.get_num_threads()},
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__},
    }


def worker(arm: str, w: Workload, out: Path) -> None:
    from grail.train.reporting import interrupt_on_sigterm

    signal.signal(signal.SIGTERM, interrupt_on_sigterm)
    t0 = time.perf_counter()
    result = run_trl(w, arm_threads(arm, w.threads)) if arm in TRL_ARMS else run_ours(w, arm)
    result["process_s"] = time.perf_counter() - t0
    own = peak_rss_mb()
    server = result.pop("server_peak_rss_mb", 0.0)
    result["peak_rss"] = {"process_mb": own, "server_mb": server, "total_mb": own + server}
    out.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------
# The driver: alternate arms over repetitions, each in a fresh process.
# ---------------------------------------------------------------------------------------------


def schedule(arms: Sequence[str], repetitions: int) -> list[tuple[int, str]]:
    """(repetition, arm) in run order: every arm once per repetition, A B C A B C ..."""
    return [(rep, arm) for rep in range(repetitions) for arm in arms]


def steady(iterations: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """The iterations that are counted: all but the first `warmup` and the last.

    The last is dropped for every arm because in pipelined mode it starts no generation (there is
    no next iteration to prefetch), which makes it cheaper than a steady-state iteration."""
    return iterations[warmup : len(iterations) - 1]


def measured(runs: list[dict[str, Any]], warmup: int, key: str) -> list[float]:
    """`key` of every counted iteration (see `steady`) of each run, pooled over runs."""
    return [it[key] for r in runs for it in steady(r["iterations"], warmup) if it[key] is not None]


def summarize(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    steps = measured(runs, warmup, "step_s")
    tok_s = [
        it["completion_tokens"] / it["step_s"]
        for r in runs
        for it in steady(r["iterations"], warmup)
    ]
    parts: dict[str, list[float]] = {}
    for r in runs:
        for it in steady(r["iterations"], warmup):
            for k, v in it["parts"].items():
                parts.setdefault(k, []).append(v)
    rss = [r["peak_rss"]["total_mb"] for r in runs]
    return {
        "iteration_s": spread(steps),
        "wall_s": spread(measured(runs, warmup, "wall_s")),
        "completion_tok_per_s": spread(tok_s),
        "parts_median_s": {k: statistics.median(v) for k, v in parts.items()},
        "peak_rss_mb": {"median": statistics.median(rss), "max": max(rss)},
        "per_run_median_iteration_s": [
            statistics.median(it["step_s"] for it in steady(r["iterations"], warmup)) for r in runs
        ],
        "reward_mean": statistics.fmean(
            it["reward_mean"] for r in runs for it in steady(r["iterations"], warmup)
        ),
        "threads": runs[0]["threads"],
        "process_s_median": statistics.median(r["process_s"] for r in runs),
    }


def run_arm(arm: str, w: Workload, timeout_s: float, log_dir: Path) -> dict[str, Any]:
    """One arm in a fresh process (own session, so a timeout kills its server too)."""
    out = log_dir / f"{arm}-{time.monotonic_ns()}.json"
    log = out.with_suffix(".log")
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONUNBUFFERED": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Ours' server gets its OMP/MKL threads from the harness, the arm process these.
        "OMP_NUM_THREADS": str(arm_threads(arm, w.threads)),
        "MKL_NUM_THREADS": str(arm_threads(arm, w.threads)),
    }
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        arm,
        "--workload",
        json.dumps(asdict(w)),
        "--out",
        str(out),
    ]
    run_worker(cmd, env, log, timeout_s, f"arm {arm} (--arm-timeout {timeout_s:g} s)")
    if not out.exists():
        raise RuntimeError(f"arm {arm} wrote no results; last output:\n{log.read_text()[-4000:]}")
    return json.loads(out.read_text())


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = Workload()
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {ARMS}")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--iterations", type=int, default=d.iterations, help="per run")
    p.add_argument("--warmup", type=int, default=1, help="iterations of each run not counted")
    p.add_argument("--problems", type=int, default=d.problems, help="problems per iteration")
    p.add_argument("--group-size", type=int, default=d.group_size, help="completions per problem")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="samples")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--loss-type", default=d.loss_type, choices=get_args(LossType))
    p.add_argument("--threads", type=int, default=cores, help="total cores for each arm")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--model",
        default=d.model,
        help="tiny (the default job's model), small (a random Qwen2 of hidden 384 and 6 layers, "
        "built into a temporary directory: a CPU workload larger than the default) or a directory",
    )
    p.add_argument(
        "--server-threads", type=int, default=0, help="ours' server threads (0: grail's default)"
    )
    p.add_argument("--arm-timeout", type=float, default=900.0, help="seconds per arm run")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default: results/)")
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--workload", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, Workload(**json.loads(args.workload)), args.out)
        return 0

    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise SystemExit(f"--arms: unknown {unknown or 'empty'}; choose from {', '.join(ARMS)}")
    w = Workload(
        problems=args.problems,
        group_size=args.group_size,
        max_new_tokens=args.max_new_tokens,
        iterations=args.iterations,
        micro_batch=args.micro_batch,
        lr=args.lr,
        loss_type=args.loss_type,
        threads=args.threads,
        seed=args.seed,
        model=args.model,
        server_threads=args.server_threads,
    )
    try:
        w.check()
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not 0 <= args.warmup <= w.iterations - 2:
        raise SystemExit(
            f"--warmup must be in [0, --iterations - 2 = {w.iterations - 2}] (the first --warmup "
            f"and the last iteration of each run are not counted), got {args.warmup}"
        )
    if args.repetitions < 1:
        raise SystemExit(f"--repetitions must be >= 1, got {args.repetitions}")
    if any(a in TRL_ARMS for a in arms):
        try:
            import trl  # noqa: F401
        except ImportError:
            raise SystemExit(
                "TRL is not installed: run `uv run --group trl python benchmarks/vs_trl.py`, "
                "or leave it out with --arms sync,pipelined"
            ) from None

    from grail.models.tiny import build_random_qwen2, ensure_tiny_model

    ensure_tiny_model()  # built once here, not inside the first arm's timing
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        if w.model == "small":
            w = replace(w, model=str(build_random_qwen2(Path(tmp) / "small", **SMALL_MODEL)))
        for rep, arm in schedule(arms, args.repetitions):
            t0 = time.perf_counter()
            result = run_arm(arm, w, args.arm_timeout, Path(tmp))
            runs[arm].append(result)
            steps = [it["step_s"] for it in steady(result["iterations"], args.warmup)]
            print(
                f"rep {rep + 1}/{args.repetitions} {arm:9s}: median iteration "
                f"{statistics.median(steps):.3f}s ({time.perf_counter() - t0:.0f}s process, "
                f"peak RSS {result['peak_rss']['total_mb']:.0f} MiB)",
                flush=True,
            )

    summary = {arm: summarize(r, args.warmup) for arm, r in runs.items()}
    n = summary[arms[0]]["iteration_s"]["n"]
    print_table(
        f"vs_trl: seconds per iteration, {n} per arm ({args.repetitions} runs x "
        f"{w.iterations - args.warmup - 1}: of {w.iterations}, the first {args.warmup} and the "
        "last are not counted)",
        ["arm", "median s", "min", "max", "IQR", "wall s", "tok/s", "RSS MiB"],
        [
            (
                arm,
                s["iteration_s"]["median"],
                s["iteration_s"]["min"],
                s["iteration_s"]["max"],
                s["iteration_s"]["iqr"],
                s["wall_s"]["median"],
                f"{s['completion_tok_per_s']['median']:.0f}",
                f"{s['peak_rss_mb']['median']:.0f}",
            )
            for arm, s in summary.items()
        ],
    )
    print_table(
        "where the time goes: median seconds per iteration; threads; whole process",
        ["arm", "parts", "threads", "process s"],
        [
            (
                arm,
                "\n".join(f"{k} {v:.3f}" for k, v in s["parts_median_s"].items()),
                "\n".join(f"{k} {v}" for k, v in s["threads"].items()),
                s["process_s_median"],
            )
            for arm, s in summary.items()
        ],
    )
    ratios: dict[str, dict[str, float]] = {}
    for ours in (a for a in arms if a in OURS_ARMS):
        for theirs in (a for a in arms if a in TRL_ARMS):
            o, t = summary[ours], summary[theirs]
            ratios[f"{ours}/{theirs}"] = {
                "iteration_s": o["iteration_s"]["median"] / t["iteration_s"]["median"],
                "wall_s": o["wall_s"]["median"] / t["wall_s"]["median"],
                "peak_rss": o["peak_rss_mb"]["median"] / t["peak_rss_mb"]["median"],
            }
    if ratios:
        print_table(
            "ratios ours / TRL of the medians (< 1: ours faster / smaller)",
            ["arms", "iteration s", "wall s", "peak RSS"],
            [(k, v["iteration_s"], v["wall_s"], v["peak_rss"]) for k, v in ratios.items()],
        )
    write_results(
        "vs_trl",
        {
            "command": " ".join(
                ["benchmarks/vs_trl.py", *(argv if argv is not None else sys.argv[1:])]
            ),
            "workload": asdict(w),
            "arms": arms,
            "repetitions": args.repetitions,
            "warmup_iterations": args.warmup,
            "versions": next((runs[a][0]["versions"] for a in arms if a in TRL_ARMS), None),
            "summary": summary,
            "ratios": ratios,
            "runs": runs,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
