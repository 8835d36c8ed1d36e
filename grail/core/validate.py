"""Checks of a composed config that its types cannot express: keys outside the schema, choices,
ranges and combinations that cannot work, each error naming the key. One function per section;
`validate` runs them all, once per run (grail.train.launch.preflight)."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterator, Sequence
from dataclasses import fields, is_dataclass
from typing import get_type_hints

from grail.core.choices import (
    Backend,
    Choice,
    GpuStrategy,
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
from grail.core.config import Config
from grail.core.errors import ConfigError
from grail.core.placement import fleet_size, gpu_layout
from grail.core.server_urls import server_root


def _one_of(key: str, value: str, choices: type[Choice]) -> None:
    """A config built in code (not composed by Hydra, which checks this) may hold any string."""
    allowed = tuple(choices)
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


def _unknown_key_hint(key: str, known: Sequence[str]) -> str:
    """'did you mean train.lr?' for `key` (train.lrr) outside its section, whose keys are
    `known`; the section's keys when none is close."""
    section, _, name = key.rpartition(".")
    close = closest(name, known)
    if close:
        return f"did you mean {section + '.' if section else ''}{close}?"
    return f"{section or 'the top level'} has: {', '.join(known)}"


def check_known_keys(cfg: Config) -> None:
    """Refuse a key outside the schema (see `unknown_keys`), naming it and the closest valid one."""
    for key, known in unknown_keys(cfg):
        raise ConfigError(
            f"unknown config key {key} ({_unknown_key_hint(key, known)}); a key added with + or "
            "++ must still be one of the schema's (grail/core/config.py)"
        )


def unknown_key_message(key: str, schema: type = Config) -> str | None:
    """What to say of an override of `key` that the composed config lacks (Hydra's "Could not
    override 'train.lrr'", with its advice to add the key with `+`, which `check_known_keys`
    would then refuse): "unknown config key train.lrr (did you mean train.lr?)", from the first
    part of the key the schema's sections do not define. None when the key leads out of the
    schema's sections (a free-form field such as data.env_kwargs, whose keys the environment
    checks once added with `+`; hydra.*): Hydra's own message says it better there."""
    if key == "hydra" or key.startswith("hydra."):
        return None
    node: type = schema
    parts = key.split(".")
    for i, part in enumerate(parts):
        known = [f.name for f in fields(node)]
        if part not in known:
            unknown = ".".join(parts[: i + 1])
            # A key put in another section (train.lora.r for model.lora.r, temperature for
            # generation.temperature) is that section's key with the same tail.
            tail = "." + ".".join(parts[i:])
            elsewhere = [k for k in schema_keys(schema) if k.endswith(tail)]
            if elsewhere:
                return f"unknown config key {key} (did you mean {' or '.join(elsewhere[:3])}?)"
            return f"unknown config key {unknown} ({_unknown_key_hint(unknown, known)})"
        child = get_type_hints(node)[part]
        if not (is_dataclass(child) and isinstance(child, type)):
            return None
        node = child
    return None


def schema_keys(node: type, prefix: str = "") -> list[str]:
    """Every key of the schema `node` (a config dataclass), sections and their keys, dotted."""
    keys = []
    hints = get_type_hints(node)
    for f in fields(node):
        keys.append(prefix + f.name)
        child = hints[f.name]
        if is_dataclass(child) and isinstance(child, type):
            keys.extend(schema_keys(child, f"{prefix}{f.name}."))
    return keys


def float_values(node: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(key, value) of every float in `node` (a config dataclass) and its sections, e.g.
    ("train.lr", 0.001). Free-form fields (reward entries, env kwargs) are checked by what
    takes them."""
    for f in fields(node):  # type: ignore[arg-type]
        key, value = prefix + f.name, getattr(node, f.name)
        if isinstance(value, float):
            yield key, value
        elif is_dataclass(value) and not isinstance(value, type):
            yield from float_values(value, key + ".")


def check_finite(cfg: Config) -> None:
    """nan and inf pass every `> 0` check that NaN does not fail (inf > 0), and then crash the
    run after it started: train.lr=inf trained an iteration and lost its metrics, temperature=inf
    failed in the sampler. No key of the schema means anything at inf or nan."""
    for key, value in float_values(cfg):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be a finite number, got {value}")


def validate(cfg: Config) -> None:
    """Reject keys outside the schema and combinations that cannot work, naming the key. Types
    were checked by OmegaConf."""
    check_known_keys(cfg)
    check_finite(cfg)
    validate_gpu(cfg)
    validate_generation(cfg)
    validate_weight_transfer(cfg)
    validate_train(cfg)
    validate_data(cfg)
    validate_eval(cfg)
    _positive("checkpoint.save_interval", cfg.checkpoint.save_interval)
    _positive("checkpoint.keep_last_k", cfg.checkpoint.keep_last_k)
    validate_prune(cfg)
    validate_service(cfg)
    validate_lora(cfg)


def validate_gpu(cfg: Config) -> None:
    """The GPU lists and their strategy (`grail.core.placement.gpu_layout`); whether the GPUs
    exist is checked against the machine where the ranks start (`trainer_devices`)."""
    _one_of("gpu.strategy", cfg.gpu.strategy, GpuStrategy)
    gpu_layout(cfg.gpu, getattr(cfg.train, "processes", None), cfg.generation.servers)


def validate_generation(cfg: Config) -> None:
    gen = cfg.generation
    _one_of("generation.backend", gen.backend, Backend)
    _one_of("generation.weight_sync", gen.weight_sync, WeightSyncMode)
    _one_of("generation.weight_transfer", gen.weight_transfer, WeightTransfer)
    _positive("generation.max_new_tokens", gen.max_new_tokens)
    if gen.temperature <= 0:
        raise ConfigError(
            f"generation.temperature must be > 0 for GRPO sampling, got {gen.temperature}"
        )
    if not 0 < gen.top_p <= 1:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {gen.top_p}")
    fraction = gen.gpu_memory_fraction
    if fraction is not None and not 0 < fraction < 1:
        raise ConfigError(f"generation.gpu_memory_fraction must be in (0, 1), got {fraction}")
    for key in ("max_model_len", "max_num_seqs"):
        value = getattr(gen, key)
        if value is not None and value < 1:
            raise ConfigError(f"generation.{key} must be >= 1 or null, got {value}")
    if gen.max_restarts < 0:
        raise ConfigError(f"generation.max_restarts must be >= 0, got {gen.max_restarts}")
    _positive("generation.servers", gen.servers)
    validate_fleet(cfg)
    validate_urls(cfg)
    if gen.start_timeout_s is not None:
        _positive("generation.start_timeout_s", gen.start_timeout_s)
    _positive("generation.request_timeout_s", gen.request_timeout_s)


def validate_fleet(cfg: Config) -> None:
    """A fleet of vLLM or SGLang servers (`generation.servers`, or a `gpu.server_gpus` list):
    each server on a GPU of its own (several on one GPU would split its memory by hand)."""
    gen = cfg.generation
    servers = fleet_size(cfg.gpu, gen.servers)
    if servers == 1 or gen.backend == Backend.builtin:
        return  # built-in servers may share a GPU (or the CPU): they take GPUs in turn
    gpus = gpu_layout(cfg.gpu, getattr(cfg.train, "processes", None), gen.servers).server
    if len(gpus) != servers:
        named = cfg.gpu.server_gpus is not None or cfg.gpu.server_gpu is not None
        where = (
            f"the server GPUs are {list(gpus)}"
            if named
            else f"gpu.strategy={cfg.gpu.strategy} gives the servers GPUs {list(gpus)}"
        )
        raise ConfigError(
            f"generation.servers={servers} with generation.backend={gen.backend}: each "
            f"{gen.backend} server needs a GPU of its own, and {where}; name one GPU per server "
            "in gpu.server_gpus (e.g. gpu.server_gpus=[0,1] for two), or use fewer servers"
        )


def validate_urls(cfg: Config) -> None:
    """`generation.urls`, servers the user runs (grail/inference/external.py): well-formed,
    each once, and only with what a server grail did not start can do: load the weights from
    disk in place (no restart, no fast route, no adapter)."""
    gen = cfg.generation
    urls = list(gen.urls)
    if gen.url_model is not None and not gen.url_model.strip():
        raise ConfigError("generation.url_model must be a model name or null, got ''")
    if not urls:
        return
    roots: dict[str, str] = {}
    for url in urls:
        try:
            root = server_root(url)
        except ValueError as exc:
            raise ConfigError(
                f"generation.urls: {url!r} {exc} (expected e.g. http://127.0.0.1:8000/v1)"
            ) from None
        if root in roots:
            raise ConfigError(
                f"generation.urls names the server {root} twice ({roots[root]!r}, {url!r})"
            )
        roots[root] = url
    why = "a server grail did not start"
    if gen.servers > 1:
        raise ConfigError(
            f"generation.urls with generation.servers={gen.servers}: grail starts no server when "
            "given URLs; list every server in generation.urls and leave generation.servers at 1"
        )
    if gen.weight_sync != WeightSyncMode.in_place:
        raise ConfigError(
            f"generation.weight_sync={gen.weight_sync} with generation.urls: grail cannot "
            f"restart {why}; use generation.weight_sync=in_place"
        )
    if gen.weight_transfer not in (WeightTransfer.auto, WeightTransfer.disk):
        raise ConfigError(
            f"generation.weight_transfer={gen.weight_transfer} with generation.urls: {why} takes "
            "the weights from disk (a directory it reads); use generation.weight_transfer=disk"
        )
    if cfg.model.lora.enabled:
        raise ConfigError(
            "model.lora.enabled with generation.urls: serving the adapter needs flags at the "
            "server's start, which grail does not control for a server it did not start"
        )


def validate_train(cfg: Config) -> None:
    t = cfg.train
    _one_of("train.loss_type", t.loss_type, LossType)
    _one_of("train.importance_sampling_level", t.importance_sampling_level, ImportanceSamplingLevel)
    _one_of("train.scale_rewards", t.scale_rewards, ScaleRewards)
    _one_of("train.kl_estimator", t.kl_estimator, KLEstimator)
    _one_of("train.is_correction", t.is_correction, ISCorrection)
    _one_of("train.lr_rule", t.lr_rule, LrRule)
    if t.tis_cap is not None:
        raise ConfigError(
            f"train.tis_cap was replaced by TRL's importance-sampling modes: for the same "
            f"correction (the ratio truncated above) set train.is_correction=token_truncate "
            f"train.is_clip_max={t.tis_cap} (train.is_clip_min bounds it below; "
            "sequence_truncate, token_mask and sequence_mask are the other modes)"
        )
    if t.kl_target is not None:
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
    lo, hi = t.is_clip_min, t.is_clip_max
    for key, bound in (("is_clip_min", lo), ("is_clip_max", hi)):
        if bound is not None and bound <= 0:
            raise ConfigError(f"train.{key} must be > 0 or null, got {bound}")
    if lo is not None and hi is not None and lo >= hi:
        raise ConfigError(f"train.is_clip_min ({lo}) must be < train.is_clip_max ({hi})")
    for key in ("iterations", "lr", "batch_size", "grad_accum_steps", "epsilon", "grad_clip"):
        _positive(f"train.{key}", getattr(t, key))
    if t.lr > 1:  # AdamW steps each weight by ~lr: past 1 the weights are noise (1e308 overflowed)
        raise ConfigError(f"train.lr must be <= 1, got {t.lr}")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be in [0, 1), got {getattr(t, key)}")
    if t.micro_batch_tokens is not None and t.micro_batch_tokens < 0:
        raise ConfigError(
            "train.micro_batch_tokens must be >= 0 (0: off) or null (4096 on CUDA, 0 on CPU), "
            f"got {t.micro_batch_tokens}"
        )
    if t.processes is not None and t.processes < 1:
        raise ConfigError(f"train.processes must be >= 1, got {t.processes}")
    _positive("train.collective_timeout_s", t.collective_timeout_s)
    if t.nodes < 1:
        raise ConfigError(f"train.nodes must be >= 1, got {t.nodes}")
    for key in ("kl_coef", "entropy_coef", "warmup_steps", "weight_decay"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if t.epsilon_high is not None and t.epsilon_high < t.epsilon:
        raise ConfigError(
            f"train.epsilon_high ({t.epsilon_high}) must be >= train.epsilon ({t.epsilon})"
        )


def validate_data(cfg: Config) -> None:
    data = cfg.data
    if data.max_resample_rounds < 0:
        raise ConfigError(f"data.max_resample_rounds must be >= 0, got {data.max_resample_rounds}")
    if data.rollouts_per_problem < 2:
        raise ConfigError(
            f"data.rollouts_per_problem must be >= 2 (GRPO compares samples within a group), "
            f"got {data.rollouts_per_problem}"
        )
    _positive("data.problems_per_iteration", data.problems_per_iteration)
    _positive("data.num_train_seeds", data.num_train_seeds)
    _positive("data.max_turns", data.max_turns)
    _positive("data.env_step_timeout_s", data.env_step_timeout_s)
    if data.max_episode_tokens is not None:
        _positive("data.max_episode_tokens", data.max_episode_tokens)


def validate_eval(cfg: Config) -> None:
    """Evaluation's own keys, and its seeds apart from the training seeds."""
    if not cfg.eval.enabled:
        return
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
    if route == "shared" and not gpu_layout(cfg.gpu, servers=cfg.generation.servers).shared:
        raise ConfigError(
            f"{key} needs the server on the trainer's device (gpu.strategy=single, got "
            f"{cfg.gpu.strategy}, or gpu.server_gpus among gpu.training_gpus); with its own GPU "
            "the built-in server syncs from disk"
        )
    if route == "nccl" and gen.backend == "builtin":
        raise ConfigError(
            f"{key} is for generation.backend=vllm or sglang; the built-in server takes "
            "weight_transfer=shared or disk"
        )
    if route == "nccl" and gpu_layout(cfg.gpu, servers=cfg.generation.servers).shared:
        raise ConfigError(
            f"{key} needs gpu.strategy=multi (or gpu.server_gpus apart from gpu.training_gpus): "
            "NCCL cannot connect two processes on one GPU (the server must have its own)"
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
    if prune.min_seeds < 2:
        raise ConfigError(
            f"prune.min_seeds must be >= 2 (settings are compared over seeds), got "
            f"{prune.min_seeds}"
        )
    if not 0 < prune.alpha < 1:
        raise ConfigError(f"prune.alpha must be in (0, 1), got {prune.alpha}")
    if not cfg.eval.enabled:
        raise ConfigError(
            f"prune.pruner={prune.pruner} compares settings by their evaluations: it needs "
            "eval.enabled=true"
        )
    if cfg.study_dir is None:
        raise ConfigError(
            f"prune.pruner={prune.pruner} needs a study_dir, where the runs it compares keep "
            "their Optuna storage: a sweep (-m) sets it to its hydra.sweep.dir; for a single run "
            "set study_dir=PATH (the same for every run of the study)"
        )
