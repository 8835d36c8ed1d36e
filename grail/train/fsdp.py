"""FSDP2 sharding of the trained model over the ranks of a multi-process run, and the full weights
gathered back from the shards (for a weight sync and a checkpoint's HF directory).

Each decoder layer is its own `fully_shard` unit (its parameters are gathered just before it runs
and freed after), and the root takes what is left (embeddings, final norm, output layer). On CUDA
the units compute in bfloat16 and reduce gradients in float32 (`MixedPrecisionPolicy`), with
float32 master weights in the shards; on CPU everything stays float32, so that N gloo ranks compute
what one process does. Under LoRA the PeftModel is sharded the same way (its base's decoder layers
hold the adapters); the frozen base weights are sharded too, so no rank keeps a full copy.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from peft import PeftModel
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a transformers causal LM (or of the base of a PeftModel): the
    `ModuleList` its decoder keeps them in (`model.model.layers` for Llama, Qwen2, Mistral...)."""
    base: Any = model.get_base_model() if isinstance(model, PeftModel) else model
    decoder = base.get_decoder()
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise ValueError(
            f"cannot shard {type(base).__name__}: its decoder ({type(decoder).__name__}) keeps no "
            "`layers` list, which FSDP sharding wraps one by one"
        )
    return list(layers)


def mixed_precision(device: torch.device) -> MixedPrecisionPolicy:
    """bfloat16 compute with float32 gradient reduction on CUDA; float32 throughout on CPU."""
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def shard_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`fully_shard` every decoder layer of `model`, then the model itself (in place; returned).
    Needs the default process group (`torch.distributed.init_process_group`)."""
    policy = mixed_precision(device)
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's whole state dict, gathered from every rank's shards: on rank 0 the full
    tensors on CPU, one tensor at a time moved off the device (`cpu_offload`), so no rank ever
    holds more than one full copy; on the other ranks {}. A collective: every rank calls it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
