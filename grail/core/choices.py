"""Every choice a config key offers, defined once as an Enum: OmegaConf checks a value against its
members when Hydra composes the config (naming the key), and the components that take the values
(grail/algo/, grail/inference/) use the same types.

Members are named as their values, because OmegaConf reads `train.loss_type=dapo` by member name.
They are `str`s (StrEnum), so records, JSON and comparisons with plain strings see the value;
`repr` shows the value too, so error messages read as they did with plain strings.
"""

from __future__ import annotations

from enum import StrEnum


class Choice(StrEnum):
    def __repr__(self) -> str:
        return repr(self.value)


class Backend(Choice):
    """The rollout servers (grail/inference/backends/)."""

    builtin = "builtin"
    vllm = "vllm"
    sglang = "sglang"


class GpuStrategy(Choice):
    single = "single"  # server and trainer share a device
    multi = "multi"  # one GPU each


class WeightSyncMode(Choice):
    in_place = "in_place"
    restart = "restart"


class WeightTransfer(Choice):
    """How a weight sync hands the server the new weights (grail/inference/weights/, docs/gpu.md):
    disk: safetensors in the server's dtype, reloaded from disk; shared: the built-in server reads
    the trainer's tensors in place (CUDA IPC, or shared memory on CPU); nccl: vLLM/SGLang receive
    a broadcast from the trainer over NCCL (server on its own GPU); auto: shared for the built-in
    server on the trainer's device, nccl for vLLM/SGLang with gpu.strategy=multi, else disk."""

    auto = "auto"
    disk = "disk"
    shared = "shared"
    nccl = "nccl"


class LossType(Choice):
    grpo = "grpo"
    bnpo = "bnpo"
    dr_grpo = "dr_grpo"
    dapo = "dapo"


class LrRule(Choice):
    """How train.lr carries over to the trained model from train.lr_reference, the model it was
    stated for (grail/models/lr_rules.py): none: as given | hidden: by hidden size per model
    family | params: by 1/sqrt(parameter count)."""

    none = "none"
    hidden = "hidden"
    params = "params"


class ImportanceSamplingLevel(Choice):
    token = "token"
    sequence = "sequence"


class ScaleRewards(Choice):
    group = "group"
    batch = "batch"
    none = "none"


class KLEstimator(Choice):
    k1 = "k1"
    k2 = "k2"
    k3 = "k3"


class ISCorrection(Choice):
    """Importance-sampling correction between the trainer's and the server's log-probabilities:
    TRL's vllm_importance_sampling_mode values, and "none" (vllm_importance_sampling_correction
    =False)."""

    none = "none"
    token_truncate = "token_truncate"
    token_mask = "token_mask"
    sequence_truncate = "sequence_truncate"
    sequence_mask = "sequence_mask"


class PrunerName(Choice):
    """grail/study/prune.py; null (None) switches pruning off."""

    asha = "asha"


class PruneMetric(Choice):
    auc = "auc"
    success = "success"


class Mode(Choice):
    """train: the loop owns the prompts and the scoring | service: clients send prompts and
    rewards over HTTP (grail/service/)."""

    train = "train"
    service = "service"


BACKENDS: tuple[str, ...] = tuple(Backend)
