"""Typed configuration for `grail-train`.

The dataclasses are registered with Hydra's ConfigStore as the schema of `conf/offline_grpo.yaml`,
so an unknown key or a value of the wrong type fails when Hydra composes the config, before any
model loads, with an error that names the key. `validate` then checks the combinations a type
cannot express (for example evaluation seeds that overlap the training pool).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal, get_args

from omegaconf import MISSING

from grail.core.errors import ConfigError
from grail.core.placement import GpuConfig, gpu_placement

# Every choice a config key offers, defined once: `validate` checks against these, and the
# components that take the values (grail/algo/grpo.py, grail/inference/) use the same types.
# (OmegaConf structured configs cannot hold Literal fields, so the fields are typed `str`.)
Backend = Literal["builtin", "vllm", "sglang"]  # the rollout servers (grail/inference/backends/)
BACKENDS: tuple[str, ...] = get_args(Backend)
GpuStrategy = Literal["single", "multi"]
WeightSyncMode = Literal["in_place", "restart"]
# How a weight sync hands the server the new weights (grail/inference/weights/, docs/gpu.md):
# disk: safetensors in the server's dtype, reloaded from disk; shared: the built-in server reads
# the trainer's tensors in place (CUDA IPC, or shared memory on CPU); nccl: vLLM/SGLang receive
# a broadcast from the trainer over NCCL (server on its own GPU); auto: shared for the built-in
# server on the trainer's device, nccl for vLLM/SGLang with gpu.strategy=multi, else disk.
WeightTransfer = Literal["auto", "disk", "shared", "nccl"]
LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ImportanceSamplingLevel = Literal["token", "sequence"]
ScaleRewards = Literal["group", "batch", "none"]
KLEstimator = Literal["k1", "k2", "k3"]
# Importance-sampling correction between the trainer's and the server's log-probabilities: TRL's
# vllm_importance_sampling_mode values, and "none" (vllm_importance_sampling_correction=False).
ISCorrection = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
PrunerName = Literal["asha", "median"]  # grail/study/prune.py; null (None) switches pruning off
PruneMetric = Literal["auc", "success"]
# train: the loop owns the prompts and the scoring | service: clients send prompts and rewards over
# HTTP (grail/service/)
Mode = Literal["train", "service"]


@dataclass
class LoraConfig:
    """LoRA (peft): only the adapter trains and syncs; the base stays frozen in the server's
    dtype, and the KL reference is the base with the adapter off (no second model)."""

    enabled: bool = False
    r: int = 16
    alpha: float = 32.0  # the update is scaled by alpha / r
    dropout: float = 0.0
    # null: every linear layer of the transformer blocks (peft's "all-linear": q, k, v, o, gate,
    # up and down projections for Qwen2 and Llama), never the output layer
    target_modules: list[str] | None = None
    # Modules trained in full beside the adapter and synced with it (peft's modules_to_save),
    # matched by name suffix: e.g. [norm] (every RMSNorm weight) for the tiny default model,
    # whose frozen random embeddings and norms cap its logits too low to learn through LoRA alone.
    modules_to_save: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    # "tiny" builds (once, cached) the offline tiny model; otherwise a local directory or hub id.
    train_id: str = "tiny"
    # Reference policy for the KL term; None means "the same weights as train_id at the start".
    ref_id: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class GenerationConfig:
    backend: str = "builtin"  # builtin | vllm | sglang
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    weight_sync: str = "in_place"  # in_place | restart
    weight_transfer: str = "auto"  # auto | disk | shared | nccl (WeightTransfer above)
    server_threads: int | None = None  # None: half the cores (see split_cores)
    start_timeout_s: float | None = None  # None: the backend's default (built-in 120, else 900)
    request_timeout_s: float = 120.0
    max_concurrency: int = 64
    # Flags appended to the server's command line (flags the harness sets itself are refused).
    extra_args: list[str] = field(default_factory=list)
    # vLLM/SGLang only. Fraction of the server GPU's memory for weights + KV cache; None: 0.30
    # when gpu.strategy=single shares the GPU with the trainer, 0.85 when the server has its own.
    gpu_memory_fraction: float | None = None
    max_model_len: int | None = None  # vLLM --max-model-len, SGLang --context-length; None: model
    max_num_seqs: int | None = None  # sequences decoded at once; None: the server's default
    # A server that dies mid-run is restarted from the newest weights and the batch retried, at
    # most this many times per batch.
    max_restarts: int = 2


@dataclass
class TrainConfig:
    iterations: int = 20
    lr: float = 1e-3
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    batch_size: int = 32  # micro-batch, in samples: what the loss normalises over
    grad_accum_steps: int = 1
    # Padding-free micro-batches (grail/train/packing.py): each micro-batch of batch_size samples
    # runs in pieces of at most this many prompt + completion tokens, packed into one row. Speed
    # and memory only: the update is the same up to float rounding. 0: off (padded micro-batches
    # that share each prompt's forward pass among its completions, fastest for short
    # completions); null: 4096 on CUDA, 0 on CPU.
    micro_batch_tokens: int | None = None
    compile: bool = False  # torch.compile the transformer body of the policy (CUDA: ~1.4x)
    warmup_steps: int = 0
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    loss_type: str = "dapo"  # grpo | bnpo | dr_grpo | dapo (TRL's default: dapo)
    importance_sampling_level: str = "token"  # token | sequence
    epsilon: float = 0.2
    epsilon_high: float | None = None
    scale_rewards: str = "group"  # group | batch | none
    # Importance sampling between the trainer's and the server's log-probabilities (grpo.py):
    # none | token_truncate | token_mask | sequence_truncate | sequence_mask, with the ratio clipped
    # (truncate) or zeroed (mask) outside [is_clip_min, is_clip_max]; null bounds are open.
    # TRL's defaults (docs/objective.md).
    is_correction: str = "sequence_mask"
    is_clip_min: float | None = None
    is_clip_max: float | None = 3.0
    kl_bias_correction: bool = True  # KL term times the policy ratio (TRL's use_bias_correction_kl)
    # Adaptive KL (grail/algo/kl_control.py): with kl_target set, the coefficient starts at kl_coef
    # and after each optimizer step moves by kl_adapt_rate towards a per-token KL of kl_target,
    # within [kl_coef_min, kl_coef_max]. null: kl_coef stays fixed.
    kl_target: float | None = None
    kl_adapt_rate: float = 1.5
    kl_coef_min: float = 0.001
    kl_coef_max: float = 0.2
    kl_estimator: str = "k3"  # k1 | k2 | k3
    is_ratio_max: float | None = None  # cap on the policy ratio (TRL's delta)
    logratio_clamp: float | None = None  # clamp |log ratio| before exp
    threads: int | None = None  # trainer's torch threads; None: all cores, pipelined half
    # One step off-policy: the server generates iteration i+1's rollouts (with the weights before
    # iteration i's update) while iteration i trains; importance sampling (is_correction) corrects
    # the lag.
    pipeline: bool = False
    tis_cap: float | None = None  # removed: is_correction/is_clip_max (validate names them)


@dataclass
class DataConfig:
    environment: str = MISSING
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    # Extra reward functions added to the environment's reward: built-in names ("correctness",
    # "keyword_match", "strict_format") or "package.module:function", e.g.
    # [{fn: strict_format, weight: 0.2}]. Loaded (and checked) before any model loads.
    rewards: list[Any] = field(default_factory=list)
    problems_per_iteration: int = 16
    rollouts_per_problem: int = 8
    train_seed_start: int = 0
    num_train_seeds: int = 100_000
    # DAPO's dynamic sampling: leave out groups whose rewards are all equal (no learning signal)
    # and generate more problems until the batch holds problems_per_iteration informative
    # groups, in at most max_resample_rounds extra rounds per iteration
    # (grail/rollouts/generation.py).
    dynamic_sampling: bool = False
    max_resample_rounds: int = 3
    # With study_dir set: iteration 0's rollouts are stored in <study_dir>/rollouts/ by the first
    # run that generates them, and loaded by every run of the study that would generate the same
    # ones (same initial weights, seed, data.* and generation settings; train.* may differ), with
    # the same metrics as generating them (grail/rollouts/shared.py, docs/sweeps.md).
    reuse_initial_rollouts: bool = True


@dataclass
class EvalConfig:
    enabled: bool = True
    interval: int = 5
    num_ids: int = 64
    id_seed_start: int = 1_000_000
    replicates: int = 4
    report_ks: list[int] = field(default_factory=lambda: [1, 4])


@dataclass
class CheckpointConfig:
    save_interval: int = 5
    keep_last_k: int = 2


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "grail"


@dataclass
class PruneConfig:
    """Early stopping of runs clearly worse than the others of their study, by Optuna's pruners
    (grail/study/prune.py, docs/sweeps.md). Off by default; `+prune=asha` or `+prune=median` sets
    it."""

    pruner: str | None = None  # null: off | asha (successive halving) | median
    # No run is pruned before it has trained this many iterations (ASHA: its min_resource, the
    # first rung; the median rule: its warm-up steps).
    min_iterations: int = 10
    reduction_factor: int = 3  # asha: about 1 run in reduction_factor goes on past each rung
    warmup_runs: int = 2  # median: runs per study (seed) that complete before any is pruned
    # What runs are compared by at an eval: auc (mean eval success over the evals so far,
    # steadier) | success (this eval's success rate).
    metric: str = "auc"


@dataclass
class ServiceConfig:
    """The trainer as a service (`mode=service`, grail/service/): its HTTP API and its queue."""

    host: str = "127.0.0.1"
    port: int = 8400  # 0: any free port (the address is in RUN_DIR/service/endpoint.json)
    # Bearer key every route but /health needs. null: a random one, written (owner-only) to
    # RUN_DIR/service/endpoint.json beside the address.
    api_key: str | None = None
    # A completion sampled by policy version v takes rewards until the trainer reaches version
    # v + max_staleness; a queued group older than that when a batch is taken is dropped.
    max_staleness: int = 1
    max_body_bytes: int = 8 * 2**20  # larger request bodies get 413 before they are read
    # How long an iteration waits for its groups before the run stops with an error (null: for
    # ever): a run whose clients went away ends instead of holding its GPU.
    wait_timeout_s: float | None = 3600.0


@dataclass
class Config:
    seed: int = 0
    mode: str = "train"  # train | service (see Mode)
    resume: bool = False
    # Where the runs of one study share state: the pruner's Optuna storage, rollouts reused between
    # runs. null: a sweep's hydra.sweep.dir (every run of `grail-train -m` joins it), none for a
    # single run. Set it to make single runs, or several sweeps, one study.
    study_dir: str | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    prune: PruneConfig = field(default_factory=PruneConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)


def _one_of(key: str, value: str, choices: Any) -> None:
    """`choices`: a Literal type, whose arguments are the allowed values."""
    allowed = get_args(choices)
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key} must be > 0, got {value}")


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice a typo of `word` most likely meant, or None when none is close."""
    matches = difflib.get_close_matches(word, choices, n=1)
    return matches[0] if matches else None


def unknown_keys(node: object, prefix: str = "") -> list[tuple[str, list[str]]]:
    """Keys set on `node` (a config dataclass) and its sections that the schema does not define,
    each with the keys its section does define.

    Why this is needed on top of the schema: Hydra's `+key=value` and `++key=value` insert a key
    with the struct flag off (`OmegaConf.update(..., force_add=True)`), even into a structured
    node, and `OmegaConf.to_object` then sets it as a plain attribute of the dataclass instance,
    where nothing ever reads it: `+train.lrr=1e-3` ran with the default learning rate. (A key
    that YAML adds fails in composition already.) Free-form fields (`data.env_kwargs`, lists)
    are not sections; their keys are checked by what takes them.
    """
    known = [f.name for f in fields(node)]  # type: ignore[arg-type]
    found = [(prefix + key, known) for key in vars(node) if key not in known]
    for name in known:
        value = getattr(node, name)
        if is_dataclass(value) and not isinstance(value, type):
            found.extend(unknown_keys(value, f"{prefix}{name}."))
    return found


def check_known_keys(cfg: Config) -> None:
    """Refuse a key outside the schema (see `unknown_keys`), naming it and the closest valid one."""
    for key, known in unknown_keys(cfg):
        section, _, name = key.rpartition(".")
        where = f"{section}." if section else ""
        close = closest(name, known)
        hint = (
            f"did you mean {where}{close}?"
            if close
            else f"{section or 'the top level'} has: {', '.join(known)}"
        )
        raise ConfigError(
            f"unknown config key {key} ({hint}); a key added with + or ++ must still be one of "
            "the schema's (grail/core/config.py)"
        )


def validate(cfg: Config) -> None:
    """Reject keys outside the schema and combinations that cannot work, naming the key. Types
    were checked by OmegaConf."""
    check_known_keys(cfg)
    _one_of("gpu.strategy", cfg.gpu.strategy, GpuStrategy)
    _one_of("generation.backend", cfg.generation.backend, Backend)
    _one_of("generation.weight_sync", cfg.generation.weight_sync, WeightSyncMode)
    _one_of("generation.weight_transfer", cfg.generation.weight_transfer, WeightTransfer)
    validate_weight_transfer(cfg)
    _one_of("train.loss_type", cfg.train.loss_type, LossType)
    _one_of(
        "train.importance_sampling_level",
        cfg.train.importance_sampling_level,
        ImportanceSamplingLevel,
    )
    _one_of("train.scale_rewards", cfg.train.scale_rewards, ScaleRewards)
    _one_of("train.kl_estimator", cfg.train.kl_estimator, KLEstimator)
    _one_of("train.is_correction", cfg.train.is_correction, ISCorrection)
    if cfg.train.tis_cap is not None:
        raise ConfigError(
            f"train.tis_cap was replaced by TRL's importance-sampling modes: for the same "
            f"correction (the ratio truncated above) set train.is_correction=token_truncate "
            f"train.is_clip_max={cfg.train.tis_cap} (train.is_clip_min bounds it below; "
            "sequence_truncate, token_mask and sequence_mask are the other modes)"
        )
    if cfg.train.kl_target is not None:
        t = cfg.train
        if t.kl_target <= 0:
            raise ConfigError(f"train.kl_target must be > 0 or null, got {t.kl_target}")
        if t.kl_coef <= 0:
            raise ConfigError(
                "train.kl_target (adaptive KL) needs train.kl_coef > 0: the coefficient it "
                f"starts from (got {t.kl_coef})"
            )
        if t.kl_adapt_rate <= 1:
            raise ConfigError(f"train.kl_adapt_rate must be > 1, got {t.kl_adapt_rate}")
        if not 0 < t.kl_coef_min <= t.kl_coef_max:
            raise ConfigError(
                f"train.kl_coef_min ({t.kl_coef_min}) and train.kl_coef_max ({t.kl_coef_max}) "
                "must satisfy 0 < kl_coef_min <= kl_coef_max"
            )
    lo, hi = cfg.train.is_clip_min, cfg.train.is_clip_max
    for key, bound in (("is_clip_min", lo), ("is_clip_max", hi)):
        if bound is not None and bound <= 0:
            raise ConfigError(f"train.{key} must be > 0 or null, got {bound}")
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(f"train.is_clip_min ({lo}) must be < train.is_clip_max ({hi})")

    _positive("generation.max_new_tokens", cfg.generation.max_new_tokens)
    if cfg.generation.temperature <= 0:
        raise ConfigError(
            "generation.temperature must be > 0 for GRPO sampling, "
            f"got {cfg.generation.temperature}"
        )
    if not 0 < cfg.generation.top_p <= 1:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {cfg.generation.top_p}")
    fraction = cfg.generation.gpu_memory_fraction
    if fraction is not None and not 0 < fraction < 1:
        raise ConfigError(f"generation.gpu_memory_fraction must be in (0, 1), got {fraction}")
    for key in ("max_model_len", "max_num_seqs"):
        value = getattr(cfg.generation, key)
        if value is not None and value < 1:
            raise ConfigError(f"generation.{key} must be >= 1 or null, got {value}")
    if cfg.generation.max_restarts < 0:
        raise ConfigError(
            f"generation.max_restarts must be >= 0, got {cfg.generation.max_restarts}"
        )
    if cfg.generation.start_timeout_s is not None:
        _positive("generation.start_timeout_s", cfg.generation.start_timeout_s)
    for key in ("iterations", "lr", "batch_size", "grad_accum_steps", "epsilon"):
        _positive(f"train.{key}", getattr(cfg.train, key))
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(cfg.train, key) < 1:
            raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(cfg.train, key)}")
    if cfg.train.micro_batch_tokens is not None and cfg.train.micro_batch_tokens < 0:
        raise ConfigError(
            "train.micro_batch_tokens must be >= 0 (0: off) or null (4096 on CUDA, 0 on CPU), "
            f"got {cfg.train.micro_batch_tokens}"
        )
    for key in ("kl_coef", "entropy_coef", "warmup_steps"):
        if getattr(cfg.train, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(cfg.train, key)}")
    if cfg.train.epsilon_high is not None and cfg.train.epsilon_high < cfg.train.epsilon:
        raise ConfigError(
            f"train.epsilon_high ({cfg.train.epsilon_high}) must be >= train.epsilon "
            f"({cfg.train.epsilon})"
        )

    if cfg.data.max_resample_rounds < 0:
        raise ConfigError(
            f"data.max_resample_rounds must be >= 0, got {cfg.data.max_resample_rounds}"
        )
    if cfg.data.rollouts_per_problem < 2:
        raise ConfigError(
            f"data.rollouts_per_problem must be >= 2 (GRPO compares samples within a group), "
            f"got {cfg.data.rollouts_per_problem}"
        )
    _positive("data.problems_per_iteration", cfg.data.problems_per_iteration)
    _positive("data.num_train_seeds", cfg.data.num_train_seeds)

    for key in ("server_gpu", "training_gpu"):
        value = getattr(cfg.gpu, key)
        if value is not None and value < 0:
            raise ConfigError(f"gpu.{key} must be >= 0 or null, got {value}")
    server_gpu, training_gpu = gpu_placement(cfg.gpu)
    if cfg.gpu.strategy == "multi" and server_gpu == training_gpu:
        raise ConfigError(
            f"gpu.strategy=multi needs gpu.server_gpu ({server_gpu}) != gpu.training_gpu "
            f"({training_gpu}); use gpu.strategy=single to share one GPU"
        )

    if cfg.eval.enabled:
        _positive("eval.interval", cfg.eval.interval)
        _positive("eval.num_ids", cfg.eval.num_ids)
        _positive("eval.replicates", cfg.eval.replicates)
        train_lo = cfg.data.train_seed_start
        train_hi = train_lo + cfg.data.num_train_seeds
        eval_lo = cfg.eval.id_seed_start
        eval_hi = eval_lo + cfg.eval.num_ids
        if eval_lo < train_hi and train_lo < eval_hi:
            raise ConfigError(
                f"eval seeds [{eval_lo}, {eval_hi}) (eval.id_seed_start, eval.num_ids) overlap the "
                f"training seeds [{train_lo}, {train_hi}) (data.train_seed_start, "
                f"data.num_train_seeds)"
            )
        for k in cfg.eval.report_ks:
            if not 1 <= k <= cfg.eval.replicates:
                raise ConfigError(
                    f"eval.report_ks contains {k}, which must be in [1, eval.replicates="
                    f"{cfg.eval.replicates}]"
                )

    _positive("checkpoint.save_interval", cfg.checkpoint.save_interval)
    _positive("checkpoint.keep_last_k", cfg.checkpoint.keep_last_k)
    validate_prune(cfg)
    validate_service(cfg)
    validate_lora(cfg)


def validate_weight_transfer(cfg: Config) -> None:
    """An explicit generation.weight_transfer must be possible with this backend and placement
    (`auto` always is: it picks what is; grail/inference/weights/route.py)."""
    gen, route = cfg.generation, cfg.generation.weight_transfer
    key = f"generation.weight_transfer={route}"
    if route in ("auto", "disk"):
        return
    if gen.weight_sync == "restart":
        raise ConfigError(
            f"{key} with generation.weight_sync=restart: a restart loads the weights from disk; "
            "use weight_transfer=disk (or auto), or weight_sync=in_place"
        )
    if cfg.model.lora.enabled:
        raise ConfigError(
            f"{key} with model.lora.enabled: the LoRA adapter (a few MB) always syncs from "
            "disk; use weight_transfer=disk (or auto)"
        )
    if route == "shared" and gen.backend != "builtin":
        raise ConfigError(
            f"{key} needs generation.backend=builtin (got {gen.backend}); vLLM and SGLang take "
            "weight_transfer=nccl (gpu.strategy=multi) or disk"
        )
    if route == "shared" and cfg.gpu.strategy != "single":
        raise ConfigError(
            f"{key} needs the server on the trainer's device (gpu.strategy=single, got "
            f"{cfg.gpu.strategy}); with its own GPU the built-in server syncs from disk"
        )
    if route == "nccl" and gen.backend == "builtin":
        raise ConfigError(
            f"{key} is for generation.backend=vllm or sglang; the built-in server takes "
            "weight_transfer=shared or disk"
        )
    if route == "nccl" and cfg.gpu.strategy != "multi":
        raise ConfigError(
            f"{key} needs gpu.strategy=multi: NCCL cannot connect two processes on one GPU "
            "(the server must have its own)"
        )


def validate_lora(cfg: Config) -> None:
    lora = cfg.model.lora
    if not lora.enabled:
        return
    if lora.r < 1:
        raise ConfigError(f"model.lora.r must be >= 1, got {lora.r}")
    _positive("model.lora.alpha", lora.alpha)
    if not 0 <= lora.dropout < 1:
        raise ConfigError(f"model.lora.dropout must be in [0, 1), got {lora.dropout}")
    if lora.target_modules is not None and not lora.target_modules:
        raise ConfigError("model.lora.target_modules must be null (every linear layer) or a list")
    if lora.modules_to_save and cfg.generation.backend != "builtin":
        raise ConfigError(
            f"model.lora.modules_to_save with generation.backend={cfg.generation.backend}: "
            "vLLM's and SGLang's adapters carry LoRA matrices only; use the built-in server"
        )


def validate_service(cfg: Config) -> None:
    """The service's keys, and what a run fed by clients cannot do."""
    _one_of("mode", cfg.mode, Mode)
    service = cfg.service
    if not 0 <= service.port <= 65535:
        raise ConfigError(f"service.port must be in [0, 65535], got {service.port}")
    if service.max_staleness < 0:
        raise ConfigError(f"service.max_staleness must be >= 0, got {service.max_staleness}")
    _positive("service.max_body_bytes", service.max_body_bytes)
    if service.wait_timeout_s is not None:
        _positive("service.wait_timeout_s", service.wait_timeout_s)
    if service.api_key is not None and not service.api_key.strip():
        raise ConfigError("service.api_key must be a non-empty string or null (a random key)")
    if cfg.mode != "service":
        return
    # Clients decide what is generated and when: the loop neither prefetches nor resamples.
    for key, value in (
        ("train.pipeline", cfg.train.pipeline),
        ("data.dynamic_sampling", cfg.data.dynamic_sampling),
    ):
        if value:
            raise ConfigError(
                f"mode=service trains on the groups its clients complete, as they arrive: "
                f"{key}=true has no meaning there (set it to false)"
            )


def validate_prune(cfg: Config) -> None:
    """Pruning needs evaluations to compare runs by, and a study directory where runs meet."""
    prune = cfg.prune
    if prune.pruner is None:
        return
    _one_of("prune.pruner", prune.pruner, PrunerName)
    _one_of("prune.metric", prune.metric, PruneMetric)
    _positive("prune.min_iterations", prune.min_iterations)
    if prune.reduction_factor < 2:
        raise ConfigError(f"prune.reduction_factor must be >= 2, got {prune.reduction_factor}")
    if prune.warmup_runs < 0:
        raise ConfigError(f"prune.warmup_runs must be >= 0, got {prune.warmup_runs}")
    if not cfg.eval.enabled:
        raise ConfigError(
            f"prune.pruner={prune.pruner} compares runs by their evaluations: it needs "
            "eval.enabled=true"
        )
    if cfg.study_dir is None:
        raise ConfigError(
            f"prune.pruner={prune.pruner} needs a study_dir, where the runs it compares keep "
            "their Optuna storage: a sweep (-m) sets it to its hydra.sweep.dir; for a single run "
            "set study_dir=PATH (the same for every run of the study)"
        )
