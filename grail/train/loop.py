"""The iteration loop: generate → train → sync weights → evaluate → checkpoint, one JSON per step.

Everything a run writes lives in its run directory (Hydra's `outputs/DATE/TIME` or
`multirun/DATE/TIME/N`):

    metrics/train_iter_XXX.json   one per iteration (schema: grail/schemas/train_iteration)
    metrics/eval_baseline.json    before any training;  metrics/eval_iter_XXX.json every interval
    checkpoints/iter_XXX/         save_pretrained dir + tokenizer + trainer_state.pt (newest k kept)
    weights/                      what the inference server loads (initial weights, then each sync)
    logs/                         the inference server's log
    summary.json                  written at the end

Order inside an iteration, chosen so a run killed at any moment resumes cleanly: the checkpoint is
staged first, the iteration's metrics file is written, and only then the checkpoint is committed
(renamed into place). A resumed run restarts after the newest committed checkpoint, and reruns
(deterministically, rewriting the same files) any iteration whose checkpoint never committed.
"""

from __future__ import annotations

import inspect
import logging
import math
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from grail.algo.grpo import GRPOLossConfig
from grail.config import Config, cpu_threads, validate
from grail.envs import ENVIRONMENTS, Environment, make_env
from grail.envs.rewards import RewardFunctions
from grail.inference.backends import server_manager_from_config
from grail.inference.client import CompletionClient, SamplingParams
from grail.inference.servers import call_with_recovery
from grail.models.loading import load_model, load_tokenizer
from grail.models.tiny import ensure_tiny_model
from grail.rollouts import RolloutBatch, RolloutGenerator
from grail.runs import run_summary
from grail.train.checkpoint import (
    commit_checkpoint,
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    set_rng_state,
    stage_checkpoint,
)
from grail.train.evaluate import eval_metrics
from grail.train.loggers import MetricLoggers
from grail.train.metrics import SCHEMA_VERSION, write_metrics
from grail.train.pipeline import (
    CancellableRunner,
    GeneratedBatch,
    Prefetch,
    overlap_s,
    timed_generation,
)
from grail.train.update import UpdateSettings, policy_update

log = logging.getLogger("grail.train")

EVAL_ROUND = -1  # eval samples use the same seeds every time, so evals differ only by weights


def resolve_model(model_id: str) -> str:
    """'tiny' is the offline tiny model (built once, cached); anything else goes to transformers."""
    return str(ensure_tiny_model()) if model_id == "tiny" else model_id


def iteration_seeds(cfg: Config, iteration: int) -> list[int]:
    """The training problem seeds of an iteration, wrapping around the training pool."""
    per_iter, pool = cfg.data.problems_per_iteration, cfg.data.num_train_seeds
    start = iteration * per_iter
    return [cfg.data.train_seed_start + (start + i) % pool for i in range(per_iter)]


def make_envs(cfg: Config) -> tuple[Environment, Environment]:
    """The training environment and the evaluation one: a dataset task with splits (gsm8k)
    evaluates on its test split; procedural tasks evaluate on held-out seeds of the same task."""
    name, kwargs = cfg.data.environment, dict(cfg.data.env_kwargs)
    train_env = make_env(name, **kwargs)
    if "split" in inspect.signature(ENVIRONMENTS[name]).parameters:
        return train_env, make_env(name, **{**kwargs, "split": "test"})
    return train_env, train_env


def eval_seeds(cfg: Config) -> list[int]:
    return list(range(cfg.eval.id_seed_start, cfg.eval.id_seed_start + cfg.eval.num_ids))


def lr_multiplier(step: int, warmup_steps: int) -> float:
    """Linear warmup that starts at lr / (warmup + 1), not at 0 (a zero-lr step is wasted)."""
    return min(1.0, (step + 1) / (warmup_steps + 1))


def batch_metrics(batch: RolloutBatch) -> dict[str, Any]:
    samples = batch.samples
    rewards = [s.reward for s in samples]
    lengths = [len(s.completion_ids) for s in samples]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "success_rate": sum(s.success for s in samples) / len(samples),
        "truncated_frac": sum(s.truncated for s in samples) / len(samples),
        "zero_variance_group_frac": batch.advantage_stats["zero_variance_group_frac"],
        "completion_length": {
            "mean": statistics.fmean(lengths),
            "min": min(lengths),
            "max": max(lengths),
        },
        "tokens": {
            "prompt": sum(len(g.prompt_ids) * len(g.samples) for g in batch.groups),
            "completion": sum(lengths),
        },
    }


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


class Display:
    """rich progress bars on a terminal; plain log lines otherwise (CI, files, pipes)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not console.is_terminal,
            transient=True,
        )

    def task(self, description: str, total: int) -> Any:
        task_id = self.progress.add_task(description, total=total)
        return lambda: self.progress.advance(task_id)

    def done(self, description: str) -> None:
        for task in list(self.progress.tasks):
            self.progress.remove_task(task.id)
        self.console.log(description) if self.console.is_terminal else log.info(description)


def run(cfg: Config, run_dir: Path) -> dict[str, Any]:
    """Train according to `cfg`, writing everything into `run_dir`; returns the summary."""
    validate(cfg)
    run_dir = run_dir.absolute()
    # Opened before any model loads: a logging backend that is not installed fails at once.
    config = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    with MetricLoggers.from_config(cfg.logging, run_dir, config) as loggers:  # type: ignore[arg-type]
        return run_with_loggers(cfg, run_dir, loggers)


def run_with_loggers(cfg: Config, run_dir: Path, loggers: MetricLoggers) -> dict[str, Any]:
    """The body of `run`: the JSON files in `run_dir/metrics` and `loggers` get every record."""
    metrics_dir, checkpoints_dir = run_dir / "metrics", run_dir / "checkpoints"
    metrics_dir.mkdir(parents=True, exist_ok=True)
    t_run = time.perf_counter()
    # Built first: GRPOLossConfig checks its own combinations before any model loads.
    settings = UpdateSettings(
        loss=GRPOLossConfig(
            loss_type=cfg.train.loss_type,  # type: ignore[arg-type]
            importance_sampling_level=cfg.train.importance_sampling_level,  # type: ignore[arg-type]
            epsilon=cfg.train.epsilon,
            epsilon_high=cfg.train.epsilon_high,
            kl_coef=cfg.train.kl_coef,
            kl_estimator=cfg.train.kl_estimator,  # type: ignore[arg-type]
            is_ratio_max=cfg.train.is_ratio_max,
            logratio_clamp=cfg.train.logratio_clamp,
            entropy_coef=cfg.train.entropy_coef,
            tis_cap=cfg.train.tis_cap,
            max_completion_length=cfg.generation.max_new_tokens,
        ),
        temperature=cfg.generation.temperature,
        batch_size=cfg.train.batch_size,
        grad_accum_steps=cfg.train.grad_accum_steps,
        grad_clip=cfg.train.grad_clip,
    )

    env, eval_env = make_envs(cfg)
    extra_rewards = RewardFunctions.from_specs(list(cfg.data.rewards))

    torch.manual_seed(cfg.seed)
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(cfg.gpu.training_gpu)
    else:
        torch.set_num_threads(cpu_threads(cfg)[0])
    accelerator = Accelerator(cpu=not on_cuda, mixed_precision="bf16" if on_cuda else "no")
    torch.use_deterministic_algorithms(not on_cuda, warn_only=True)

    # --- where to start: a fresh model, or the newest complete checkpoint -----------------------
    resume_from = latest_checkpoint(checkpoints_dir) if cfg.resume else None
    stale = sorted(metrics_dir.glob("*.json"))
    if resume_from is None and stale:
        if not cfg.resume:
            raise FileExistsError(
                f"{run_dir} already holds the metrics of a run ({len(stale)} files in "
                f"{metrics_dir}); rerun with resume=true to continue it, or use a new "
                "hydra.run.dir"
            )
        log.warning("resume=true but no complete checkpoint in %s: starting over", checkpoints_dir)
        for path in [*stale, run_dir / "summary.json"]:
            path.unlink(missing_ok=True)
    init_id = str(resume_from.path) if resume_from else resolve_model(cfg.model.train_id)
    tokenizer = load_tokenizer(init_id)
    model = load_model(init_id, dtype="float32", device=accelerator.device)
    if cfg.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    ref_model = None
    if cfg.train.kl_coef > 0:
        ref_model = load_model(
            resolve_model(cfg.model.ref_id or cfg.model.train_id),
            dtype="float32",
            device=accelerator.device,
        )
        ref_model.eval().requires_grad_(False)

    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.train.lr,
        betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
        weight_decay=cfg.train.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg.train.warmup_steps)
    )
    start_iteration = 0
    resumed_rollouts: GeneratedBatch | None = None
    if resume_from is not None:
        state = load_trainer_state(resume_from.path)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        start_iteration = state["iteration"] + 1
        if cfg.train.pipeline:
            resumed_rollouts = state.get("pending_rollouts")
        log.info("resuming after iteration %d from %s", state["iteration"], resume_from.path)
    model, optimizer = accelerator.prepare(model, optimizer)

    # The server starts from exactly the trainer's weights, saved where later syncs go.
    weights_dir = run_dir / "weights"
    accelerator.unwrap_model(model).save_pretrained(weights_dir, safe_serialization=True)
    tokenizer.save_pretrained(weights_dir)

    sampling = SamplingParams(
        max_tokens=cfg.generation.max_new_tokens,
        temperature=cfg.generation.temperature,
        top_p=cfg.generation.top_p,
        top_k=cfg.generation.top_k,
    )
    console = Console()
    display = Display(console)

    # Entering starts the server and waits until it is ready.
    with server_manager_from_config(cfg, weights_dir, run_dir) as server, display.progress:
        client = CompletionClient(
            server.base_url,
            server.model_name,
            timeout=cfg.generation.request_timeout_s,
            max_concurrency=cfg.generation.max_concurrency,
            liveness_check=server.check_alive,
            backend=server.kind,
        )

        def generate(
            gen: RolloutGenerator,
            seeds: list[int],
            replicas: int,
            runner: CancellableRunner | None = None,
            **kw: Any,
        ) -> RolloutBatch:
            # A server that dies mid-batch is restarted from the newest weights and the batch
            # (fixed seeds, so safe to repeat) runs again, a bounded number of times. A background
            # generation runs on `runner`'s event loop so that the main thread can cancel it.
            def attempt() -> RolloutBatch:
                if runner is None:
                    return gen.generate(seeds, replicas, **kw)
                return runner.run(gen.agenerate(seeds, replicas, **kw))

            return call_with_recovery(server, attempt, max_restarts=cfg.generation.max_restarts)

        generator, eval_generator = (
            RolloutGenerator(
                e,
                tokenizer,
                client,
                sampling,
                base_seed=cfg.seed,
                scale_rewards=cfg.train.scale_rewards,  # type: ignore[arg-type]
                extra_rewards=extra_rewards,
            )
            for e in (env, eval_env)
        )

        def training_rollouts(
            iteration: int, policy_version: int, runner: CancellableRunner | None = None
        ) -> GeneratedBatch:
            seeds = iteration_seeds(cfg, iteration)
            tick = display.task(f"iter {iteration:03d} generate", len(seeds))
            return timed_generation(
                lambda: generate(
                    generator,
                    seeds,
                    cfg.data.rollouts_per_problem,
                    runner,
                    round_index=iteration,
                    on_group_done=tick,
                ),
                policy_version,
            )

        def evaluate(iteration: int, name: str) -> float:
            t0 = time.perf_counter()
            seeds = eval_seeds(cfg)
            tick = display.task(f"eval {name}", len(seeds))
            batch = generate(
                eval_generator,
                seeds,
                cfg.eval.replicates,
                round_index=EVAL_ROUND,
                on_group_done=tick,
            )
            record = {
                "schema_version": SCHEMA_VERSION,
                "iteration": iteration,
                "environment": cfg.data.environment,
                **eval_metrics(batch, cfg.eval.report_ks),
                "eval_s": time.perf_counter() - t0,
            }
            write_metrics(metrics_dir / f"eval_{name}.json", record, "eval")
            loggers.log("eval", record, step=iteration + 1)  # the baseline (-1) at step 0
            display.done(
                f"eval {name}: success {record['success_rate']:.3f} "
                f"reward {record['reward_mean']:.3f}"
            )
            return record["eval_s"]

        if cfg.eval.enabled and not (resume_from and (metrics_dir / "eval_baseline.json").exists()):
            evaluate(-1, "baseline")

        # The trainer holds policy version `iteration` (updates applied so far) while it trains
        # iteration `iteration`. With train.pipeline, `pending` is the next iteration's rollouts:
        # generating (a Prefetch) while this iteration trains, then ready (a GeneratedBatch).
        pending: Prefetch | GeneratedBatch | None = resumed_rollouts
        staged: Path | None = None  # a checkpoint written but not yet committed
        try:
            for iteration in range(start_iteration, cfg.train.iterations):
                t_iter = time.perf_counter()
                timings: dict[str, float] = {"overlap_s": 0.0}

                t0 = time.perf_counter()
                if pending is None:  # synchronous mode, or the first batch of a pipelined run
                    rollouts = training_rollouts(iteration, policy_version=iteration)
                else:
                    rollouts = pending if isinstance(pending, GeneratedBatch) else pending.result()
                    pending = None
                timings["generation_wait_s"] = time.perf_counter() - t0
                timings["generation_s"] = rollouts.generation_s
                batch = rollouts.batch

                if cfg.train.pipeline and iteration + 1 < cfg.train.iterations:
                    pending = Prefetch(
                        lambda runner, i=iteration: training_rollouts(i + 1, i, runner)
                    )

                tick = display.task(
                    f"iter {iteration:03d} train",
                    math.ceil(len(batch.samples) / cfg.train.batch_size),
                )
                lr = scheduler.get_last_lr()[0]
                t_train = time.perf_counter()
                train = policy_update(
                    model,
                    ref_model,
                    optimizer,
                    scheduler,
                    batch,
                    settings,
                    pad_token_id=tokenizer.pad_token_id,
                    device=accelerator.device,
                    backward=accelerator.backward,
                    clip_grad_norm=lambda c: accelerator.clip_grad_norm_(model.parameters(), c),
                    on_microbatch_done=tick,
                )
                timings["train_s"] = time.perf_counter() - t_train

                if isinstance(pending, Prefetch):
                    # The server's weights must not change under a running batch: wait for it.
                    t0 = time.perf_counter()
                    pending = pending.result()
                    timings["generation_wait_s"] += time.perf_counter() - t0
                    timings["overlap_s"] = overlap_s(
                        (pending.started, pending.finished),
                        (t_train, t_train + timings["train_s"]),
                    )

                t0 = time.perf_counter()
                accelerator.unwrap_model(model).save_pretrained(
                    weights_dir, safe_serialization=True
                )
                sync = server.sync_weights(
                    weights_dir,
                    cfg.generation.weight_sync,  # type: ignore[arg-type]
                    weight_version=f"iter_{iteration:03d}",
                )
                timings["weight_sync_s"] = time.perf_counter() - t0

                last = iteration == cfg.train.iterations - 1
                timings["eval_s"] = 0.0
                if cfg.eval.enabled and ((iteration + 1) % cfg.eval.interval == 0 or last):
                    timings["eval_s"] = evaluate(iteration, f"iter_{iteration:03d}")

                t0 = time.perf_counter()
                if (iteration + 1) % cfg.checkpoint.save_interval == 0 or last:
                    staged = stage_checkpoint(
                        checkpoints_dir,
                        iteration,
                        accelerator.unwrap_model(model),
                        tokenizer,
                        {
                            "optimizer": optimizer.state_dict(),
                            "scheduler": scheduler.state_dict(),
                            "config": OmegaConf.to_yaml(OmegaConf.structured(cfg)),
                            # Already generated with the pre-update weights: a resumed pipelined
                            # run trains on exactly what the uninterrupted one would have.
                            "pending_rollouts": pending,
                        },
                    )
                timings["checkpoint_s"] = time.perf_counter() - t0

                rollout = batch_metrics(batch)
                timings["iteration_s"] = time.perf_counter() - t_iter
                record = {
                    "schema_version": SCHEMA_VERSION,
                    "iteration": iteration,
                    **rollout,
                    **{k: v for k, v in train.items() if k != "grad_norm"},
                    "grad_norm": _finite_or_none(train["grad_norm"]),
                    "kl": train.get("kl"),  # None without a reference model (kl_coef = 0)
                    "lr": lr,
                    "tokens_per_s": rollout["tokens"]["completion"] / rollouts.generation_s,
                    "weight_sync": {"mode": sync.mode_used, "fell_back": sync.fell_back},
                    "policy": {
                        "version": rollouts.policy_version,
                        "staleness": iteration - rollouts.policy_version,
                        "pipelined": cfg.train.pipeline,
                    },
                    "timings": timings,
                }
                write_metrics(
                    metrics_dir / f"train_iter_{iteration:03d}.json", record, "train_iteration"
                )
                loggers.log("train", record, step=iteration + 1)
                if staged is not None:
                    commit_checkpoint(staged)
                    staged = None
                    prune_checkpoints(checkpoints_dir, cfg.checkpoint.keep_last_k)
                display.done(
                    f"iter {iteration:03d}: reward {record['reward_mean']:.3f} "
                    f"success {record['success_rate']:.3f} loss {record['loss_total']:.4f} "
                    f"({timings['iteration_s']:.1f}s)"
                )
        finally:
            # Stop a background generation before the server shuts down under it (Ctrl-C, error).
            if isinstance(pending, Prefetch):
                pending.cancel()
            if staged is not None:  # interrupted between staging and commit: not a checkpoint
                shutil.rmtree(staged, ignore_errors=True)

    summary = write_summary(cfg, run_dir, time.perf_counter() - t_run)
    print_summary(console, summary)
    return summary


def write_summary(cfg: Config, run_dir: Path, wall_s: float) -> dict[str, Any]:
    summary = run_summary(
        run_dir,
        "completed",
        wall_s,
        environment=cfg.data.environment,
        config=OmegaConf.to_container(OmegaConf.structured(cfg)),  # type: ignore[arg-type]
    )
    write_metrics(run_dir / "summary.json", summary, "summary")
    return summary


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title="grail run summary")
    table.add_column("eval")
    table.add_column("iteration", justify="right")
    table.add_column("success", justify="right")
    table.add_column("reward", justify="right")
    for name in ("baseline_eval", "final_eval", "best_eval"):
        record = summary[name]
        if record is not None:
            table.add_row(
                name.removesuffix("_eval"),
                str(record["iteration"]),
                f"{record['success_rate']:.3f}",
                f"{record['reward_mean']:.3f}",
            )
    console.print(table)
    console.print(
        f"{summary['iterations']} iterations, {summary['tokens']['completion']} completion tokens, "
        f"{summary['wall_time_s']:.1f}s wall"
    )
