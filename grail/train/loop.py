"""The training recipe: set up, then per iteration get rollouts → update → sync weights →
evaluate → checkpoint → record, one JSON file per iteration.

What a run writes, and where, is described in grail/core/records.py. A run holds its directory's
lock from start to end, so a second run into the same directory fails at once. Order inside an
iteration, chosen so a run killed at any moment resumes cleanly: the checkpoint is staged first,
the iteration's metrics file is written, and only then the checkpoint is committed (renamed into
place). A resumed run restarts after the newest intact checkpoint (grail/train/checkpoint.py), and
reruns (deterministically, rewriting the same files) any iteration whose checkpoint never
committed or is damaged.
"""

from __future__ import annotations

import logging
import math
import shutil
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf

from grail.core.config import Config
from grail.core.heap import frozen_heap
from grail.core.placement import trainer_ranks
from grail.core.records import (
    CHECKPOINTS_DIR,
    METRICS_DIR,
    PARTS,
    SCHEMA_VERSION,
    SUMMARY,
    RunPart,
    eval_metrics_path,
    iteration_name,
    read_json,
    read_pruned,
    run_lock,
    train_metrics_path,
    write_metrics,
    write_summary,
)
from grail.models.loading import check_model_source
from grail.models.lr_transfer import LrTransfer, lr_transfer
from grail.models.tiny import resolve_model
from grail.rollouts.batch import GeneratedBatch, RolloutBatch, RolloutSource, Sample, WeightSync
from grail.study.prune import open_trial
from grail.train.checkpoint import (
    CheckpointRef,
    commit_checkpoint,
    latest_checkpoint,
    prune_checkpoints,
)
from grail.train.components import build_run, open_loggers
from grail.train.display import Display
from grail.train.evaluate import eval_metrics
from grail.train.loggers import MetricLoggers
from grail.train.resume import Resume, refuse_a_fresh_start_over_a_run
from grail.train.trainer import Trainer

log = logging.getLogger("grail.train")


def run(cfg: Config, run_dir: Path, resume: Resume | None = None) -> dict[str, Any]:
    """Train according to `cfg`, writing everything into `run_dir`; returns the summary. Holds
    the directory's lock throughout; a run resumed after its last iteration only rewrites its
    summary. `cfg` has passed `grail.train.launch.preflight` (which validates it, once per run);
    `resume`: how a resume's command line changed the run's saved config (grail/train/resume.py).

    A run that fails once it holds its directory writes summary.json with the error; an interrupt
    (Ctrl-C, SIGTERM) leaves the run without a summary, for resume=true to continue."""
    run_dir = run_dir.absolute()
    t0 = time.perf_counter()
    with run_lock(run_dir):  # RunDirLocked when another run is writing there
        resume_from = resume_point(cfg, run_dir)
        try:
            if resume_from is not None and (
                resume_from.iteration + 1 >= cfg.train.iterations or pruned_by(run_dir, resume_from)
            ):
                return finished(cfg, run_dir, resume_from, resume)
            check_models(cfg, resume_from)
            if resume is not None:
                resume.record(run_dir)
            first_iteration = 0 if resume_from is None else resume_from.iteration + 1
            part = RunPart(run_dir, first_iteration, resume.part() if resume is not None else None)
            try:
                # Opened before any model loads: a missing logging backend fails at once.
                with open_loggers(cfg, run_dir) as loggers:
                    return train(cfg, run_dir, loggers, resume_from, part)
            except BaseException:
                try:
                    part.save()  # the wall time of a part that failed or was interrupted
                except OSError as exc:  # a full disk, say: the error that stopped the run matters
                    log.warning("the wall time of this part is not recorded: %s", exc)
                raise
        except Exception as exc:
            try:
                write_summary(
                    run_dir,
                    time.perf_counter() - t0,
                    error=exc,
                    environment=cfg.data.environment,
                    config=config_record(cfg),
                )
            except OSError as unwritten:  # a full disk, say: the error that stopped the run matters
                log.warning("summary.json not written: %s", unwritten)
            raise


def train(
    cfg: Config,
    run_dir: Path,
    loggers: MetricLoggers,
    resume_from: CheckpointRef | None,
    part: RunPart,
) -> dict[str, Any]:
    """Build the run's parts (grail/train/components.py), run the iterations, write the summary."""
    parts = build_run(cfg, run_dir, resume_from)
    with parts.display, parts.source, parts.extra_rewards, frozen_heap():
        recorder = Recorder(run_dir, cfg, loggers, parts.display, part)
        run_iterations(cfg, run_dir, parts.trainer, parts.source, recorder)

    part.save()  # its wall time in parts.json, then in the summary
    return summarize(cfg, run_dir, part.wall_time_s, parts.display, parts.trainer.lr_transfer)


def run_iterations(
    cfg: Config, run_dir: Path, trainer: Trainer, source: RolloutSource, recorder: Recorder
) -> None:
    """The loop. The trainer holds policy version `iteration` (updates applied so far) while it
    trains iteration `iteration`. A run the pruner stops (grail/study/prune.py) ends after the
    iteration whose evaluation decided it, with that iteration's checkpoint committed."""
    checkpoints_dir = run_dir / CHECKPOINTS_DIR
    if cfg.eval.enabled and not eval_metrics_path(run_dir, -1).exists():
        recorder.evaluate(source, -1)

    trial = open_trial(  # the pruner's (prune.pruner)
        cfg.prune,
        run_dir,
        trainer.start_iteration,
        study_dir=cfg.study_dir,
        seed=cfg.seed,
        iterations=cfg.train.iterations,
    )
    staged: Path | None = None  # a checkpoint written but not yet committed
    try:
        for iteration in range(trainer.start_iteration, cfg.train.iterations):
            t_iter = time.perf_counter()
            rollouts = source.next_batch(iteration, policy_version=iteration)
            generation_wait_s = time.perf_counter() - t_iter

            lr = trainer.lr
            t_train = time.perf_counter()
            batch = rollouts.batch
            micro_batches = math.ceil(len(batch.samples) / cfg.train.batch_size)
            advance = recorder.display.task(f"iter {iteration:03d} train", micro_batches)
            train_metrics = trainer.update(batch, advance)
            train_s = time.perf_counter() - t_train

            sync = source.sync_weights(trainer.weights, policy_version=iteration + 1)

            last = iteration == cfg.train.iterations - 1
            eval_s, pruned = 0.0, False
            if cfg.eval.enabled and ((iteration + 1) % cfg.eval.interval == 0 or last):
                eval_s = recorder.evaluate(source, iteration)
                # The last evaluation ends the run anyway: the trial gets it when it finishes.
                pruned = not last and trial.should_prune(iteration)

            t0 = time.perf_counter()
            if (iteration + 1) % cfg.checkpoint.save_interval == 0 or last or pruned:
                staged = trainer.stage_checkpoint(checkpoints_dir, iteration, source.state())
            checkpoint_s = time.perf_counter() - t0

            timings = {
                **environment_time(rollouts.batch),
                "generation_s": rollouts.generation_s,
                "generation_wait_s": generation_wait_s + sync.generation_wait_s,
                "overlap_s": overlap_s(sync.prefetched, (t_train, t_train + train_s)),
                "train_s": train_s,
                "weight_sync_s": sync.seconds,
                "eval_s": eval_s,
                "checkpoint_s": checkpoint_s,
                "iteration_s": time.perf_counter() - t_iter,
            }
            record = iteration_record(
                iteration, rollouts, train_metrics, sync, lr, timings, cfg.train.pipeline
            )
            record["trainer_processes"] = trainer_ranks(
                cfg.gpu, cfg.train.processes, cfg.train.nodes
            )
            recorder.train(record)
            if staged is not None:
                commit_checkpoint(staged)
                staged = None
                source.checkpointed(iteration)
                prune_checkpoints(checkpoints_dir, cfg.checkpoint.keep_last_k)
            recorder.display.done(
                f"iter {iteration:03d}: reward {record['reward_mean']:.3f} "
                f"success {record['success_rate']:.3f} loss {record['loss_total']:.4f} "
                f"({timings['iteration_s']:.1f}s){fleet_text(record.get('fleet'))}"
            )
            if pruned:
                break
    except Exception:
        trial.fail()  # an interrupt (Ctrl-C, SIGTERM) leaves it running, for resume=true
        raise
    finally:
        if staged is not None:  # interrupted between staging and commit: not a checkpoint
            shutil.rmtree(staged, ignore_errors=True)
    trial.finish()


def fleet_text(fleet: list[dict[str, Any]] | None) -> str:
    """The fleet's part of an iteration's line: requests per server, and the servers that failed
    or were set aside (a record's `fleet`); empty for one server."""
    if not fleet:
        return ""
    text = f" servers {'/'.join(str(s['requests']) for s in fleet)} requests"
    failed = [str(i) for i, s in enumerate(fleet) if s["failures"]]
    aside = [str(i) for i, s in enumerate(fleet) if not s["usable"]]
    if failed:
        text += f", failures on {','.join(failed)}"
    if aside:
        text += f", {','.join(aside)} set aside"
    return text


# ---- setup ----------------------------------------------------------------------------------


def resume_point(cfg: Config, run_dir: Path) -> CheckpointRef | None:
    """Where to start: the newest intact checkpoint with `resume=true`, else None (fresh).
    A fresh start refuses a directory that already holds a run's metrics, unless resume=true
    found no checkpoint there, in which case the old files are cleared. A fresh start records
    its parts anew."""
    metrics_dir = run_dir / METRICS_DIR
    metrics_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        refuse_a_fresh_start_over_a_run(run_dir)
    resume_from = latest_checkpoint(run_dir / CHECKPOINTS_DIR) if cfg.resume else None
    stale = sorted(metrics_dir.glob("*.json"))
    if resume_from is None and stale:  # resume=true, nothing to resume from
        log.warning(
            "resume=true but no complete checkpoint in %s: starting over",
            run_dir / CHECKPOINTS_DIR,
        )
        for path in [*stale, run_dir / SUMMARY]:
            path.unlink(missing_ok=True)
    if resume_from is None:
        (run_dir / PARTS).unlink(missing_ok=True)
    return resume_from


def pruned_by(run_dir: Path, last: CheckpointRef) -> dict[str, Any] | None:
    """Whether the pruner stopped the run at or before checkpoint `last` (then it is finished)."""
    pruned = read_pruned(run_dir)
    return pruned if pruned is not None and pruned["iteration"] <= last.iteration else None


def finished(
    cfg: Config, run_dir: Path, last: CheckpointRef, resume: Resume | None = None
) -> dict[str, Any]:
    """`resume=true` on a run whose last iteration is checkpointed, or that was pruned: nothing
    to train, so no model loads and no server starts; say so and (re)write the summary, with the
    config the run used (a resume's changes apply to nothing here, and are not recorded)."""
    if resume is not None and resume.changes:
        log.info(
            "nothing trains, so this resume's changes are not applied: %s",
            ", ".join(f"{k}={new}" for k, (_, new) in resume.changes.items()),
        )
        cfg = cast(Config, OmegaConf.to_object(resume.saved))
    if (pruned := pruned_by(run_dir, last)) is not None:
        log.info(
            "run %s was pruned after iteration %d (%s %.4f, prune.pruner=%s): nothing to "
            "resume; its checkpoint %s and metrics are kept",
            run_dir,
            pruned["iteration"],
            pruned.get("metric"),
            pruned.get("value", float("nan")),
            pruned.get("pruner"),
            last.path.name,
        )
    else:
        log.info(
            "run %s is complete: checkpoint %s holds its last iteration (train.iterations=%d), "
            "nothing to resume; raise train.iterations to train further",
            run_dir,
            last.path.name,
            cfg.train.iterations,
        )
    # The wall time of a run that recorded no parts (written before parts were) is its old one.
    wall_time_s = (read_json(run_dir / SUMMARY) or {}).get("wall_time_s", 0.0)
    if not isinstance(wall_time_s, int | float):
        wall_time_s = 0.0
    # Still nothing loads: a rule reads the two models' configs only.
    return summarize(cfg, run_dir, wall_time_s, Display(), lr_transfer(cfg.train, cfg.model))


def check_models(cfg: Config, resume_from: CheckpointRef | None) -> None:
    """Fail before anything starts (the loggers, the server, `weights/`) when a local model
    directory this run loads lacks files or holds a truncated one, naming them. A resumed policy
    loads from its checkpoint, verified by `resume_point`."""
    if resume_from is None or cfg.model.lora.enabled:  # a LoRA checkpoint holds no base
        check_model_source(resolve_model(cfg.model.train_id))
    if cfg.train.kl_coef > 0:  # the reference model: weights only, the tokenizer is the policy's
        check_model_source(resolve_model(cfg.model.ref_id or cfg.model.train_id), tokenizer=False)


# ---- records --------------------------------------------------------------------------------


def summarize(
    cfg: Config,
    run_dir: Path,
    wall_time_s: float,
    display: Display,
    transfer: LrTransfer | None = None,
) -> dict[str, Any]:
    """Write summary.json (see grail/core/records.py for `wall_time_s`) and show it; returns it.
    "pruned" when the run's prune_trial.json says the pruner stopped it. `transfer`: the lr
    train.lr_rule made of train.lr, recorded as `lr_rule` beside the config's stated train.lr."""
    summary = write_summary(
        run_dir,
        wall_time_s,
        pruned=read_pruned(run_dir),
        environment=cfg.data.environment,
        config=config_record(cfg),
        lr_rule=None if transfer is None else transfer.record(),
    )
    display.summary(summary, run_dir)
    return summary


def config_record(cfg: Config) -> dict[str, Any]:
    """The config as summary.json records it."""
    return cast(dict[str, Any], OmegaConf.to_container(OmegaConf.structured(cfg)))


class Recorder:
    """Where a run's records go: the JSON files, the metric loggers and the display."""

    def __init__(
        self,
        run_dir: Path,
        cfg: Config,
        loggers: MetricLoggers,
        display: Display,
        part: RunPart | None = None,
    ):
        self.run_dir, self.cfg, self.loggers, self.display = run_dir, cfg, loggers, display
        self.part = part

    def train(self, record: dict[str, Any]) -> None:
        iteration = record["iteration"]
        write_metrics(train_metrics_path(self.run_dir, iteration), record, "train_iteration")
        self.loggers.log("train", record, step=iteration + 1)
        if self.part is not None:
            self.part.save(iterations=1)

    def evaluate(self, source: RolloutSource, iteration: int) -> float:
        """Evaluate the current weights (iteration -1: the baseline), record it; seconds taken."""
        name = "baseline" if iteration < 0 else iteration_name(iteration)
        t0 = time.perf_counter()
        advance = self.display.task(f"eval {name}", self.cfg.eval.num_ids)
        batch = source.evaluate(advance)
        record = {
            "schema_version": SCHEMA_VERSION,
            "iteration": iteration,
            "environment": self.cfg.data.environment,
            **eval_metrics(batch, self.cfg.eval.report_ks),
            "eval_s": (eval_s := time.perf_counter() - t0),
        }
        write_metrics(eval_metrics_path(self.run_dir, iteration), record, "eval")
        self.loggers.log("eval", record, step=iteration + 1)  # the baseline (-1) at step 0
        self.display.done(
            f"eval {name}: success {record['success_rate']:.3f} reward {record['reward_mean']:.3f}"
        )
        return eval_s


def overlap_s(a: tuple[float, float] | None, b: tuple[float, float]) -> float:
    """Length of the intersection of two [start, end] intervals (0 when disjoint or `a` is None)."""
    if a is None:
        return 0.0
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def batch_metrics(batch: RolloutBatch, zero_variance_group_frac: float) -> dict[str, Any]:
    """Rollout statistics of a training batch, for its iteration's record
    (`zero_variance_group_frac`: the trainer's, computed with the advantages)."""
    samples = batch.samples
    rewards = [s.reward for s in samples]
    lengths = [len(s.completion_ids) for s in samples]
    return {
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "success_rate": sum(s.success for s in samples) / len(samples),
        "truncated_frac": sum(s.truncated for s in samples) / len(samples),
        "zero_variance_group_frac": zero_variance_group_frac,
        "completion_length": {
            "mean": statistics.fmean(lengths),
            "min": min(lengths),
            "max": max(lengths),
        },
        "tokens": {
            "prompt": sum(len(g.prompt_ids) * len(g.samples) for g in batch.groups),
            "completion": sum(lengths),
        },
        **episode_metrics(samples),
    }


def environment_time(batch: RolloutBatch) -> dict[str, float]:
    """`timings.env_s` of an episode batch: the environment's seconds (its steps and tools),
    summed over episodes that ran concurrently, so it can exceed the generation time."""
    stats = [s.episode for s in batch.samples if s.episode is not None]
    return {"env_s": sum(e.env_s for e in stats)} if stats else {}


def episode_metrics(samples: list[Sample]) -> dict[str, Any]:
    """An episode batch's record `episodes` (nothing for single completions): turns per
    episode, the tokens the policy sampled among the completion tokens, tool calls and the
    policy's tool mistakes, and episodes a budget ended (the environment's time is a timing:
    `environment_time`)."""
    stats = [s.episode for s in samples if s.episode is not None]
    if not stats:
        return {}
    turns = [e.turns for e in stats]
    return {
        "episodes": {
            "turns_mean": statistics.fmean(turns),
            "turns_max": max(turns),
            "sampled_tokens": sum(s.num_sampled for s in samples),
            "tool_calls": sum(e.tool_calls for e in stats),
            "tool_errors": sum(e.tool_errors for e in stats),
            "truncated": sum(e.truncated for e in stats),
        }
    }


def weight_sync_record(sync: WeightSync) -> dict[str, Any]:
    """The iteration record's `weight_sync`: the server's in-place or restart sync, and the
    route that carried the weights (grail/inference/weights/), with why a fast route fell
    back to disk this time and how often that happened so far."""
    result = sync.result
    record: dict[str, Any] = {
        "mode": result.mode_used,
        "fell_back": result.fell_back,
        "transfer": result.transfer,
        "transfer_fallbacks": result.transfer_fallbacks,
    }
    if result.transfer_fallback_reason is not None:
        record["transfer_fallback_reason"] = result.transfer_fallback_reason[:500]
    return record


def iteration_record(
    iteration: int,
    rollouts: GeneratedBatch,
    train_metrics: dict[str, float | bool | None],
    sync: WeightSync,
    lr: float,
    timings: dict[str, float],
    pipelined: bool,
) -> dict[str, Any]:
    """The train_iteration record (grail/schemas/train_iteration.schema.json) of one iteration;
    `train_metrics` are `Trainer.update`'s."""
    train = dict(train_metrics)
    zero_variance_group_frac = train.pop("zero_variance_group_frac")
    rollout = batch_metrics(rollouts.batch, zero_variance_group_frac)  # type: ignore[arg-type]
    grad_norm = cast(float, train.pop("grad_norm"))  # always a number (nan when not finite)
    return {
        "schema_version": SCHEMA_VERSION,
        "iteration": iteration,
        **rollout,
        **train,
        "grad_norm": grad_norm if math.isfinite(grad_norm) else None,
        "kl": train_metrics.get("kl"),  # None without a reference model (kl_coef = 0)
        "lr": lr,
        # Null for a batch loaded from the study's store: this run generated no tokens.
        "tokens_per_s": (
            None
            if rollouts.reused is not None
            else rollout["tokens"]["completion"] / rollouts.generation_s
        ),
        "weight_sync": weight_sync_record(sync),
        **(
            {} if rollouts.resampling is None else {"dynamic_sampling": asdict(rollouts.resampling)}
        ),
        **({} if rollouts.reused is None else {"rollouts_reused": asdict(rollouts.reused)}),
        **({} if rollouts.service is None else {"service": rollouts.service}),
        **({} if rollouts.fleet is None else {"fleet": rollouts.fleet}),
        "policy": {
            "version": rollouts.policy_version,
            "staleness": iteration - rollouts.policy_version,
            "pipelined": pipelined,
        },
        "timings": timings,
    }
