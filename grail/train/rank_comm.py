"""What the policy update says to the other ranks when it runs sharded over N of them (FSDP2,
issue 29): who it is, how FSDP2 must reduce its gradients, and its metrics.

torch.distributed's default group is the world the update is sharded over; the launcher
(torchrun) sets it up, with its timeout, before the first update. FSDP2 is imported only here and
only on that path: a 1-rank run never loads it.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when torch.distributed is not
    initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def sum_gradients_over_ranks(model: torch.nn.Module) -> None:
    """Make FSDP2 SUM `model`'s gradients over the ranks instead of averaging them.

    Each rank's loss is its share of the 1-rank loss (the normalisers count the full batch), so
    the 1-rank gradient is the sum of the ranks' gradients; FSDP2 divides the reduce-scattered sum
    by the world size by default. `set_gradient_divide_factor(1.0)` is its setting for that
    (rather than multiplying every loss by N, which would also scale the loss metrics); with
    float32 gradients FSDP2 would reduce with NCCL's PREMUL_SUM(1/factor), which gloo lacks, so
    `set_force_sum_reduction_for_comms` asks for a plain SUM (then a division by 1, skipped).
    Refuses a model FSDP2 does not shard: its gradients would never be reduced at all."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError(
            f"policy_update runs on {dist.get_world_size()} ranks but the model is not sharded "
            "with FSDP2 (torch.distributed.fsdp.fully_shard): its gradients would not be summed"
        )
    for module in sharded:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def all_gather(value: T) -> list[T]:
    """Every rank's `value`, in rank order (a picklable object: metrics, not tensors)."""
    out: list[T | None] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out  # type: ignore[return-value]  # filled in by all_gather_object
