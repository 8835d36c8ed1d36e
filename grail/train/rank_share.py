"""Which samples of a micro-batch each rank runs when the update is sharded over N ranks.

Every rank calls `policy_update` with the same full batch (issue 29); each computes, from that
batch alone, every rank's share, so the ranks agree on it without exchanging a message. A
micro-batch's samples are dealt out by their token count (prompt + completion), longest first, each
to the rank holding the fewest tokens so far (the lowest rank on a tie): the greedy rule for
balanced parts, within the longest sample of the best split. A rank keeps its samples in batch
order, so the prompts a group shares stay next to each other (the padded layout runs each distinct
prompt once).

FSDP2 all-gathers a layer's parameters in every forward and reduce-scatters its gradients in every
backward, on all ranks together: each rank must run the same number of forward passes, or the one
with fewer waits forever for the others. `passes` is that number for one micro-batch; a rank with
fewer pieces (or none: a micro-batch smaller than the world) makes up the difference with dummy
passes whose loss it multiplies by 0 (grail/train/update.py). Pure logic: no tensors, no
torch.distributed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from grail.rollouts.batch import Sample
from grail.train.packing import split_by_tokens

Item = tuple[list[int], Sample]


def share_by_tokens(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """The indices into `lengths` each of `world_size` ranks runs (module docstring): longest
    first to the least-loaded rank, each rank's indices ascending. A rank may get none."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        loads[rank] += lengths[i]
        shares[rank].append(i)
    return [sorted(share) for share in shares]


@dataclass(frozen=True)
class RankShare:
    """One rank's part of a micro-batch: its pieces (each a list of items run in one forward
    pass) and `passes`, the forward passes every rank runs for the micro-batch (the most pieces
    any rank has); `passes - len(pieces)` of this rank's are dummies."""

    pieces: list[list[Item]]
    passes: int


def _pieces(items: list[Item], micro_batch_tokens: int) -> list[list[Item]]:
    if not items:
        return []
    return split_by_tokens(items, micro_batch_tokens) if micro_batch_tokens > 0 else [items]


def rank_share(
    items: Sequence[Item], world_size: int, rank: int, micro_batch_tokens: int
) -> RankShare:
    """`rank`'s pieces of the micro-batch `items`: its share (`share_by_tokens`) whole when
    `micro_batch_tokens` is 0 (the padded layout), else in padding-free pieces of at most that
    many tokens (grail/train/packing.py); and the passes every rank runs."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    lengths = [len(prompt) + len(sample.completion_ids) for prompt, sample in items]
    per_rank = [
        _pieces([items[i] for i in share], micro_batch_tokens)
        for share in share_by_tokens(lengths, world_size)
    ]
    return RankShare(pieces=per_rank[rank], passes=max(1, *(len(p) for p in per_rank)))
