"""Typed configuration for `grail-train`.

The dataclasses are registered with Hydra's ConfigStore as the schema of `conf/offline_grpo.yaml`,
so an unknown key or a value of the wrong type fails when Hydra composes the config, before any
model loads, with an error that names the key. `validate` then checks the combinations a type
cannot express (for example evaluation seeds that overlap the training pool).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from grail.core.choices import (
    Backend,
    ImportanceSamplingLevel,
    ISCorrection,
    KLEstimator,
    LossType,
    LrRule,
    Mode,
    PruneMetric,
    PrunerName,
    ScaleRewards,
    WeightSyncMode,
    WeightTransfer,
)
from grail.core.placement import GpuConfig


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
    backend: Backend = Backend.builtin  # builtin | vllm | sglang
    max_new_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off
    weight_sync: WeightSyncMode = WeightSyncMode.in_place  # in_place | restart
    weight_transfer: WeightTransfer = (
        WeightTransfer.auto
    )  # auto | disk | shared | nccl (WeightTransfer above)
    # None: 1 if reproducible (the default), else half the cores, all in sync mode for a model of
    # 1M+ body parameters (split_cores)
    server_threads: int | None = None
    start_timeout_s: float | None = None  # None: the backend's default (built-in 120, else 900)
    # One request's limit, and in a fleet the deadline of every call to a server (weight syncs
    # included): a server that misses it is set aside and its requests go to the others.
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
    # Episodes only: send each turn with the spans of the tokens the policy sampled, so that the
    # built-in server continues the episode from its prefix cache instead of prefilling it all
    # again (grail/inference/builtin/prefix_cache.py). Same config, same metrics either way, but
    # true's differ from false's in float rounding (and so in the tokens drawn), hence opt-in:
    # the measured learning numbers of docs/episodes.md are false's.
    prefix_cache: bool = False
    # Inference servers the run starts (a fleet, grail/rollouts/fleet.py): each group goes to one
    # of them, weights go to all. server_threads is then per server (None: the share split).
    servers: int = 1
    # Servers the user runs (grail/inference/external.py): OpenAI-compatible servers of
    # `backend` at these URLs (each its root or its /v1), which grail never starts or stops.
    # Empty: grail starts its own. One URL serves as one server, several as a fleet.
    urls: list[str] = field(default_factory=list)
    # The model to request from them; None: the one model each lists at /v1/models.
    url_model: str | None = None


@dataclass
class TrainConfig:
    iterations: int = 20
    lr: float = 1e-3
    # Transfer rules (grail/models/lr_rules.py, docs/transfer.md "Transfer rules"): state lr for
    # another model, lr_reference, fine-tuned in full, so that one lr carries over across widths,
    # sizes and LoRA. The trainer uses lr x m(model.train_id) / m(lr_reference), x 10 under
    # LoRA. none: lr as given (lr_reference ignored) | hidden: m = (2000 / hidden_size)^p, p per
    # model family | params: m = 1 / sqrt(parameter count).
    lr_rule: LrRule = LrRule.none
    # The model lr is stated for: a preset (tiny), a local directory or a hub id, read as
    # model.train_id is (its config.json only, never its weights). Required unless lr_rule=none.
    lr_reference: str | None = None
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
    loss_type: LossType = LossType.dapo  # grpo | bnpo | dr_grpo | dapo (TRL's default: dapo)
    importance_sampling_level: ImportanceSamplingLevel = (
        ImportanceSamplingLevel.token
    )  # token | sequence
    epsilon: float = 0.2
    epsilon_high: float | None = None
    scale_rewards: ScaleRewards = ScaleRewards.group  # group | batch | none
    # Importance sampling between the trainer's and the server's log-probabilities (grpo.py):
    # none | token_truncate | token_mask | sequence_truncate | sequence_mask, with the ratio clipped
    # (truncate) or zeroed (mask) outside [is_clip_min, is_clip_max]; null bounds are open.
    # TRL's defaults (docs/objective.md).
    is_correction: ISCorrection = ISCorrection.sequence_mask
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
    kl_estimator: KLEstimator = KLEstimator.k3  # k1 | k2 | k3
    is_ratio_max: float | None = None  # cap on the policy ratio (TRL's delta)
    logratio_clamp: float | None = None  # clamp |log ratio| before exp
    # The trainer's torch threads; None: 1 if reproducible (the default), else all cores (half
    # when pipelined)
    threads: int | None = None
    # One step off-policy: the server generates iteration i+1's rollouts (with the weights before
    # iteration i's update) while iteration i trains; importance sampling (is_correction) corrects
    # the lag.
    pipeline: bool = False
    # Trainer processes (ranks): 1 trains in grail-train's own process; N > 1 starts N ranks with
    # torch's elastic launcher (gloo on CPU, one NCCL rank per training GPU), the model sharded
    # with FSDP2, rank 0 driving the loop (grail/train/distributed.py). None: one per GPU of
    # gpu.training_gpus, else 1 (grail.core.placement.trainer_processes).
    processes: int | None = None
    # How long a rank waits in one collective (a command from rank 0 included) before it fails.
    collective_timeout_s: float = 1800.0
    # Machines the trainer spans, train.processes ranks on each (torchrun's --nnodes): every node
    # runs the same grail-train command with the same hydra.run.dir, on a filesystem all nodes see;
    # node 0 drives (grail/core/nodes.py, docs/gpu.md "Two nodes").
    nodes: int = 1
    # This node's rank (torchrun's --node-rank); None: SLURM_NODEID in a SLURM job.
    node_rank: int | None = None
    # Node 0's HOST:PORT, where the ranks meet (torchrun's --master-addr:--master-port); None in a
    # SLURM job: its first host, a port from its job id.
    rdzv_endpoint: str | None = None
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
    # Episodes (an environment that answers the policy's turns, grail/envs/episodes.py): at most
    # max_turns policy turns of at most generation.max_new_tokens each, and at most
    # max_episode_tokens tokens in all, prompt included (null: the tokenizer's model_max_length,
    # or generation.max_model_len when set); an episode a budget ends counts as truncated. An
    # environment step (or tool call) that takes longer than env_step_timeout_s stops the run
    # naming the environment and the seed. Single-turn environments ignore all three.
    max_turns: int = 8
    max_episode_tokens: int | None = None
    env_step_timeout_s: float = 60.0


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
    """Early stopping of the runs of a setting shown worse than the best setting over seeds at a
    rung (grail/study/prune.py, grail/study/rungs.py, docs/sweeps.md). Off by default;
    `+prune=asha` sets it."""

    pruner: PrunerName | None = None  # null: off | asha (rungs on the successive-halving schedule)
    # The first rung, in iterations trained: no run is pruned before it.
    min_iterations: int = 10
    reduction_factor: int = 3  # rungs at min_iterations x reduction_factor^k
    # A setting is compared at a rung once this many of its seeds reached it, and pruned only when
    # shown worse than the best over at least this many shared seeds.
    min_seeds: int = 3
    alpha: float = 0.05  # family-wise error of "worse" at a rung (Holm over the settings there)
    # Spend alpha over the run: a rung a fraction t of train.iterations in judges at alpha x t^3
    # (grail/study/rungs.py spent_alpha), so an early rung prunes only on overwhelming evidence:
    # early curves do not predict late ones (issue 27: the early leader collapses, the best learns
    # late).
    spending: bool = True
    # What settings are compared by at a rung: auc (mean eval success over the evals so far,
    # steadier) | success (that eval's success rate).
    metric: PruneMetric = PruneMetric.auc


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
    # Every sampled span of a pushed group (/v1/groups) must be a turn this run's /v1/turns
    # sampled, with its log-probs: the run trains only on what its own server produced, with the
    # run's sampling settings. false: trust pushed tokens (an environment that samples from the
    # inference server itself, Atropos-style).
    check_spans: bool = True
    # How long an iteration waits for its groups before the run stops with an error (null: for
    # ever): a run whose clients went away ends instead of holding its GPU.
    wait_timeout_s: float | None = 3600.0


@dataclass
class Config:
    seed: int = 0
    # Same config and seed -> same metrics on any x86-64 CPU with AVX2 of one vendor, not only on
    # this machine: pins torch's CPU kernels, MKL's and the CPU thread counts
    # (grail/core/reproducible.py). On by default: the default job then learns alike on AVX2 and
    # AVX-512 CPUs, at no measured cost on 2 cores (docs/benchmarks.md); false lets a CPU run use
    # every core and the CPU's own kernels. CPU runs only: GPUs are not made to agree.
    reproducible: bool = True
    mode: Mode = Mode.train  # train | service (see Mode)
    resume: bool = False
    # Where the runs of one study share state: the pruner's Optuna storage, rollouts reused between
    # runs. null: a sweep's hydra.sweep.dir (every run of `grail-train -m` joins it), none for a
    # single run. Set it to make single runs, or several sweeps, one study.
    study_dir: str | None = None
    # The fidelity this run measures its setting at, as a multi-fidelity race names its rung
    # (hydra.sweeper.ladder, e.g. "train.iterations=67"; docs/transfer.md): set by the race,
    # recorded in the run's config and summary, and what grail-report groups a study's runs by.
    # Changes nothing in the run. null: not part of a ladder.
    fidelity: str | None = None
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
