"""The policy being trained: model, reference model, optimizer and schedule, built from the config
(fresh, or from a checkpoint to resume) and updated one rollout batch at a time. Rollout sources
deliver rewards; the group-relative advantages are computed here, once, just before the update."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import huggingface_hub.utils
import torch
import transformers
from accelerate import Accelerator
from omegaconf import OmegaConf
from peft import PeftModel
from transformers import PreTrainedModel

from grail.algo.advantages import compute_advantages
from grail.algo.kl_control import AdaptiveKL
from grail.core.choices import ScaleRewards
from grail.core.config import Config
from grail.core.disk import writing
from grail.core.placement import cpu_threads, gpu_placement
from grail.core.records import follow_umask
from grail.core.reproducible import check_torch_honours
from grail.inference.weights.policy import PolicyWeights
from grail.models.loading import load_model, load_tokenizer
from grail.models.lora import (
    AdapterOff,
    base_state_dict,
    trainable_parameters,
    with_new_adapter,
    with_saved_adapter,
)
from grail.models.lr_transfer import LrTransfer, lr_transfer
from grail.models.packed_attention import use_packed_sdpa
from grail.models.tiny import resolve_model
from grail.rollouts.batch import Group, RolloutBatch
from grail.train.checkpoint import (
    CheckpointRef,
    load_source_state,
    load_trainer_state,
    set_rng_state,
    stage_checkpoint,
)
from grail.train.packing import decoder_and_head, resolve_micro_batch_tokens
from grail.train.update import UpdateSettings, policy_update

log = logging.getLogger("grail.train")

# Consecutive iterations of zero-variance groups only after which the trainer warns (once).
NO_SIGNAL_WARN_ITERATIONS = 10


def lr_multiplier(step: int, warmup_steps: int) -> float:
    """Linear warmup that starts at lr / (warmup + 1), not at 0 (a zero-lr step is wasted)."""
    return min(1.0, (step + 1) / (warmup_steps + 1))


def silence_library_progress_bars() -> None:
    """Turn off the progress bars libraries draw in this process. transformers draws one at
    every `save_pretrained` and model load, i.e. at every weight sync and checkpoint: hundreds
    of lines in a log or CI. The run's own progress is the Display's (grail/train/display.py).
    huggingface_hub's download bars (a hub model's first download, before the Display starts)
    stay on when stderr is a terminal and the user has them on."""
    hub_bars = not huggingface_hub.utils.are_progress_bars_disabled()
    with warnings.catch_warnings():
        # huggingface_hub warns that HF_HUB_DISABLE_PROGRESS_BARS=0 overrides the call: as meant.
        warnings.simplefilter("ignore")
        transformers.utils.logging.disable_progress_bar()  # turns huggingface_hub's off too
    if hub_bars and sys.stderr.isatty():
        huggingface_hub.utils.enable_progress_bars()


def assign_advantages(groups: list[Group], scale_rewards: ScaleRewards) -> dict[str, float]:
    """Set every sample's group-relative advantage (grail/algo/advantages.py); the batch's advantage
    statistics."""
    rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
    advantages, stats = compute_advantages(rewards, scale_rewards)
    for group, row in zip(groups, advantages.tolist(), strict=True):
        for sample, advantage in zip(group.samples, row, strict=True):
            sample.advantage = float(advantage)
    return stats


def no_signal_message(batch: RolloutBatch, iterations: int) -> str:
    """Why `iterations` iterations in a row, ending with `batch`, had zero-variance groups only:
    the likely cause, told by whether any completion succeeded."""
    samples = batch.samples
    if not any(s.success for s in samples):
        cause = (
            "the model never solves the task, so every completion gets the same reward. Use a "
            "model that solves it some of the time (env=sat needs a pretrained instruction "
            "model such as model=qwen2.5-0.5b: the tiny default model learns copy_digits only) "
            "or an easier task"
        )
    elif all(s.success for s in samples):
        cause = "the model solves every problem: the task is too easy for it"
    else:
        cause = (
            "each problem's completions all get the same reward: more rollouts per problem "
            "(data.rollouts_per_problem) or a higher generation.temperature let them differ"
        )
    rewards = [s.reward for s in samples]
    return (
        f"{iterations} iterations in a row had zero reward variance in every group (last batch: "
        f"reward {min(rewards):.3g}..{max(rewards):.3g}), so GRPO got no learning signal from "
        f"them. Likely cause: {cause}."
    )


def setup_torch(cfg: Config) -> Accelerator:
    """Seed, device and threads of the training process; deterministic kernels on CPU; no
    library progress bars."""
    silence_library_progress_bars()
    torch.manual_seed(cfg.seed)
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.set_device(gpu_placement(cfg.gpu, cfg.generation.servers)[1])
    else:
        torch.set_num_threads(
            cpu_threads(
                cfg.train.threads,
                cfg.generation.server_threads,
                pipelined=cfg.train.pipeline,
                reproducible=cfg.reproducible,
            )[0]
        )
        if cfg.reproducible:  # grail-train set the variables; fail if torch ran kernels before
            check_torch_honours()
    accelerator = Accelerator(cpu=not on_cuda, mixed_precision="bf16" if on_cuda else "no")
    torch.use_deterministic_algorithms(not on_cuda, warn_only=True)
    return accelerator


class Trainer:
    """Holds policy version `start_iteration` after construction and one more after each
    `update`. `source_state` is what the rollout source kept in the checkpoint resumed from
    ({} for a fresh run), for the source to start from."""

    def __init__(self, cfg: Config, accelerator: Accelerator, resume_from: CheckpointRef | None):
        self.cfg = cfg
        self.accelerator = accelerator
        self.settings = UpdateSettings.from_config(cfg)
        device = accelerator.device
        base_id = resolve_model(cfg.model.train_id)
        lora = cfg.model.lora
        # A full fine-tuning checkpoint holds the whole model; a LoRA one the adapter alone, over
        # the base the config names. The tokenizer is in every checkpoint.
        init_id = str(resume_from.path) if resume_from and not lora.enabled else base_id
        self.tokenizer = load_tokenizer(str(resume_from.path) if resume_from else base_id)
        model: PreTrainedModel | PeftModel = load_model(
            init_id, dtype=self._master_dtype(device), device=device
        )
        if lora.enabled:
            model = (
                with_saved_adapter(model, resume_from.path)
                if resume_from is not None
                else with_new_adapter(model, lora)
            )
        packed = resolve_micro_batch_tokens(cfg.train.micro_batch_tokens, device) > 0
        # Packed pieces attend per sample (grail/models/packed_attention.py) rather than through
        # sdpa's dense block-diagonal mask, compiled body or not: the samples' lengths reach the
        # attention as data, so a compiled body recompiles once for dynamic shapes, not per batch.
        per_sample = packed
        if per_sample:
            use_packed_sdpa(model)
        if cfg.train.compile:
            # The body only: the output layer runs in checkpointed chunks (packing.py), and the
            # body is what both the padded and the packed forward passes call.
            decoder_and_head(model)[0].compile()
        if cfg.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
            if lora.enabled:  # the frozen embeddings' output must carry grad for the checkpoints
                model.enable_input_require_grads()
        self.ref_model: torch.nn.Module | None = None
        if cfg.train.kl_coef > 0:
            if lora.enabled and cfg.model.ref_id is None:
                assert isinstance(model, PeftModel)
                self.ref_model = AdapterOff(model)  # the base: the same weights, adapter off
            else:
                self.ref_model = load_model(
                    resolve_model(cfg.model.ref_id or cfg.model.train_id),
                    dtype="float32",
                    device=device,
                )
                self.ref_model.eval().requires_grad_(False)
                if per_sample:
                    use_packed_sdpa(self.ref_model)
                self.ref_model = self._shard(self.ref_model)
        model = self._shard(model)
        # train.lr_rule: train.lr stated for another model, carried over to this one; without a
        # rule, train.lr itself (the default job's numbers stay bit for bit).
        self.lr_transfer: LrTransfer | None = lr_transfer(cfg.train, cfg.model)
        if self.lr_transfer is not None:
            log.info("%s", self.lr_transfer.describe())
        optimizer = torch.optim.AdamW(
            trainable_parameters(model),
            lr=cfg.train.lr if self.lr_transfer is None else self.lr_transfer.lr,
            betas=(cfg.train.adam_beta1, cfg.train.adam_beta2),
            weight_decay=cfg.train.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_multiplier(step, cfg.train.warmup_steps)
        )
        self.start_iteration = 0
        self.source_state: dict[str, Any] = {}
        # Iterations in a row (in this process) whose groups all had zero reward variance.
        self.no_signal_streak = 0
        self._warned_no_signal = False
        t = cfg.train
        self.kl_control = (
            None
            if t.kl_target is None
            else AdaptiveKL(t.kl_coef, t.kl_target, t.kl_adapt_rate, t.kl_coef_min, t.kl_coef_max)
        )
        if resume_from is not None:
            state = load_trainer_state(resume_from.path)
            self._load_optimizer(model, optimizer, state, resume_from.path)
            self.scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            self.start_iteration = state["iteration"] + 1
            if self.kl_control is not None and "kl_coef" in state:
                self.kl_control.value = float(state["kl_coef"])
            self.source_state = load_source_state(resume_from.path)
            log.info("resuming after iteration %d from %s", state["iteration"], resume_from.path)
        self.model, self.optimizer = accelerator.prepare(model, optimizer)

    def _shard(self, model: Any) -> Any:
        """The model as this process trains it: itself here; sharded over the ranks of a
        multi-process run (grail/train/distributed.py), before the optimizer takes its
        parameters."""
        return model

    def _load_optimizer(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        checkpoint: Path,
    ) -> None:
        """The optimizer's state as the checkpoint resumed from holds it (in trainer_state.pt)."""
        optimizer.load_state_dict(state["optimizer"])

    def _master_dtype(self, device: torch.device) -> str:
        """Full fine-tuning keeps float32 master weights. Under LoRA the base is frozen, so it
        stays in the server's dtype (bfloat16 on CUDA unless model.dtype says otherwise); the
        adapter peft adds is float32 either way."""
        if not self.cfg.model.lora.enabled or device.type != "cuda":
            return "float32"
        return "bfloat16" if self.cfg.model.dtype == "auto" else self.cfg.model.dtype

    @property
    def lora(self) -> bool:
        return self.cfg.model.lora.enabled

    @property
    def lr(self) -> float:
        """The learning rate the next update uses."""
        return float(self.scheduler.get_last_lr()[0])

    def update(
        self, batch: RolloutBatch, on_progress: Callable[[int], None] | None = None
    ) -> dict[str, float | bool | None]:
        """Set the batch's advantages (`assign_advantages`, with train.scale_rewards), then one
        pass over it (grail/train/update.py); the training metrics and the batch's
        `zero_variance_group_frac`. Warns once when NO_SIGNAL_WARN_ITERATIONS batches in a row
        had zero-variance groups only."""
        scale_rewards = self.cfg.train.scale_rewards
        stats = assign_advantages(batch.groups, scale_rewards)
        accelerator = self.accelerator
        metrics = policy_update(
            self.model,
            self.ref_model,
            self.optimizer,
            self.scheduler,
            batch,
            self.settings,
            pad_token_id=self.tokenizer.pad_token_id,
            device=accelerator.device,
            backward=accelerator.backward,
            clip_grad_norm=lambda c: accelerator.clip_grad_norm_(self.model.parameters(), c),
            on_microbatch_done=None if on_progress is None else lambda: on_progress(1),
            kl_control=self.kl_control,
            autocast=accelerator.autocast,
        )
        zero_variance_group_frac = stats["zero_variance_group_frac"]
        self._watch_signal(batch, zero_variance_group_frac)
        return {**metrics, "zero_variance_group_frac": zero_variance_group_frac}

    def _watch_signal(self, batch: RolloutBatch, zero_variance_group_frac: float) -> None:
        # Computed with the advantages (grail/algo/advantages.py): 1.0 exactly when all are tied.
        if zero_variance_group_frac == 1.0:
            self.no_signal_streak += 1
        else:
            self.no_signal_streak = 0
        if self.no_signal_streak >= NO_SIGNAL_WARN_ITERATIONS and not self._warned_no_signal:
            self._warned_no_signal = True
            log.warning(no_signal_message(batch, self.no_signal_streak))

    @property
    def weights(self) -> PolicyWeights:
        """The weights a sync sends (grail/inference/weights/): written to disk in the
        server's dtype, or handed over in memory; callable as `save_weights`."""
        return PolicyWeights(self.accelerator.unwrap_model(self.model), lora=self.lora)

    def save_weights(self, directory: Path) -> None:
        """What a weight sync sends the inference server, as a `save_pretrained` directory: the
        whole model, or under LoRA the adapter alone (peft's format)."""
        self.accelerator.unwrap_model(self.model).save_pretrained(
            directory, safe_serialization=True
        )
        follow_umask(directory)

    def save_server_model(self, directory: Path) -> None:
        """What the inference server starts from: the current weights, or under LoRA the frozen
        base (the adapter goes separately, `save_weights`). The tokenizer with it."""
        model = self.accelerator.unwrap_model(self.model)
        with writing(directory):  # a full disk: a DiskFullError naming the directory
            if self.lora:
                base = model.get_base_model()
                base.save_pretrained(directory, state_dict=base_state_dict(model))
            else:
                model.save_pretrained(directory, safe_serialization=True)
            self.tokenizer.save_pretrained(directory)
        follow_umask(directory)

    def stage_checkpoint(
        self, checkpoints_dir: Path, iteration: int, source_state: dict[str, Any]
    ) -> Path:
        """Write (not yet publish) the checkpoint after `iteration`, with the rollout source's
        `state()` (e.g. a batch already generated for the next iteration, so a resumed pipelined
        run trains on exactly it)."""
        return stage_checkpoint(
            checkpoints_dir,
            iteration,
            self.accelerator.unwrap_model(self.model),
            self.tokenizer,
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "config": OmegaConf.to_yaml(OmegaConf.structured(self.cfg)),
                # The adaptive KL coefficient (None when fixed: the config has it).
                "kl_coef": None if self.kl_control is None else self.kl_control.value,
            },
            source_state,
        )
