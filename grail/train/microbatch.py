"""A micro-batch as the forward pass runs it, and the policy's log-probabilities of it.

Layout of a micro-batch: every distinct prompt is stored once, LEFT-padded so that all prompts end
in the last prompt column, and every completion RIGHT-padded so that all start right after it;
`prompt_index` names each completion's prompt. Position ids are computed from the masks, so
padding does not shift positions.

The forward pass shares prompts the way the inference server does: it runs each distinct prompt
once (a group of G completions of one problem has one prompt), copies the prompt's key/value
cache to its completions' rows and runs only the completion tokens on top of it. Gradients flow
through the shared cache, so the loss and its gradient are those of running every prompt +
completion in full (up to float rounding), at 1/G of the prompt work: on the default task (16
completions of 4 tokens per 15-token prompt) the training pass took 2.5x less time. Where the
cache cannot carry gradients or positions exactly (gradient checkpointing switches the cache off
in training; sliding-window and linear-attention caches drop or fold keys) the rows are run in
full instead. Only the logits of completion positions are produced (`logits_to_keep`), which
keeps the [B, K, V] float32 work small when prompts are long and the vocabulary large.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from grail.algo.logprobs import token_entropy, token_logprobs
from grail.rollouts.batch import RolloutBatch, Sample
from grail.train.packing import (
    PackedRow,
    packed_logprobs,
    packed_row,
    split_by_tokens,
    to_padded,
)


@dataclass
class MicroBatch:
    prompt_ids: Tensor  # [P, Lp] the distinct prompts, left-padded
    prompt_mask: Tensor  # [P, Lp]
    prompt_index: Tensor  # [B] row -> its prompt
    completion_ids: Tensor  # [B, K] right-padded
    completion_mask: Tensor  # [B, K] 1.0 on completion tokens: what the rows attend to
    # [B, K] 1.0 on the tokens the policy sampled: what the loss covers. An episode's completion
    # also holds the environment's turns (context: attended to, predicted, never trained on);
    # for single completions it is `completion_mask` itself.
    loss_mask: Tensor
    behaviour_logprobs: Tensor  # [B, K] the server's log-probs, 0 on padding and context
    advantages: Tensor  # [B]
    num_tokens: int  # sampled tokens (loss_mask.sum()), counted on the host: no sync
    # Padding-free pieces (grail/train/packing.py): the one-row forward input, and the
    # (completions, sampled tokens) of the whole micro-batch the loss normalises by.
    packed: PackedRow | None = None
    whole: tuple[int, int] | None = None
    # A pass a rank runs only to keep FSDP2's collectives in step with the other ranks
    # (grail/train/rank_share.py): its loss is multiplied by 0 and its metrics are dropped.
    dummy: bool = False


def pack_microbatch(
    items: Sequence[tuple[list[int], Sample]],
    pad_token_id: int,
    device: torch.device | str,
    min_width: int = 1,
) -> MicroBatch:
    """Pack (prompt ids, sample) pairs into the tensors of one micro-batch, the completions padded
    to at least `min_width` columns."""
    index: dict[tuple[int, ...], int] = {}
    prompt_index = [index.setdefault(tuple(prompt), len(index)) for prompt, _ in items]
    prompts = list(index)
    width = max(len(p) for p in prompts)
    samples = [s for _, s in items]
    lengths = [len(s.completion_ids) for s in samples]
    k = max(*lengths, min_width)
    # Padded Python rows, then one tensor each: a tensor per row costs more than the copying.
    prompt_ids = torch.tensor([[pad_token_id] * (width - len(p)) + list(p) for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    for s in samples:
        if len(s.behaviour_logprobs) != len(s.completion_ids):
            raise ValueError(
                f"a sample has {len(s.completion_ids)} completion tokens but "
                f"{len(s.behaviour_logprobs)} behaviour log-probabilities"
            )
    completion_ids = torch.tensor(
        [list(s.completion_ids) + [pad_token_id] * (k - len(s.completion_ids)) for s in samples]
    )
    completion_mask = torch.tensor(
        [[1.0] * n + [0.0] * (k - n) for n in lengths], dtype=torch.float32
    )
    loss_mask = completion_mask
    if any(s.sampled_mask is not None for s in samples):
        loss_mask = torch.tensor([_sampled_row(s, k) for s in samples], dtype=torch.float32)
    # A server may report -inf for a token its top-k/top-p filter excluded; keep the TIS weight
    # and the mismatch metric finite (the weight is capped either way).
    behaviour = torch.tensor(
        [list(s.behaviour_logprobs) + [0.0] * (k - len(s.behaviour_logprobs)) for s in samples],
        dtype=torch.float32,
    ).clamp(min=-1e4)
    return MicroBatch(
        prompt_ids=prompt_ids.to(device),
        prompt_mask=prompt_mask.to(device),
        prompt_index=torch.tensor(prompt_index).to(device),
        completion_ids=completion_ids.to(device),
        completion_mask=completion_mask.to(device),
        loss_mask=loss_mask.to(device),
        behaviour_logprobs=behaviour.to(device),
        advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32).to(device),
        num_tokens=sum(s.num_sampled for s in samples),
    )


def _sampled_row(sample: Sample, width: int) -> list[float]:
    """`sample`'s loss-mask row: 1.0 on the tokens the policy sampled, padded to `width`."""
    mask = sample.sampled_mask
    n = len(sample.completion_ids)
    if mask is None:
        return [1.0] * n + [0.0] * (width - n)
    if len(mask) != n:
        raise ValueError(
            f"a sample's sampled_mask has {len(mask)} values for {n} completion tokens"
        )
    if any(m not in (0, 1) for m in mask):
        raise ValueError("a sample's sampled_mask holds a value other than 0 and 1")
    return [float(m) for m in mask] + [0.0] * (width - n)


def _positions(mask: Tensor) -> Tensor:
    return (mask.cumsum(-1) - 1).clamp(min=0)


def _full_attention_cache(out: Any) -> Cache | None:
    """The forward pass's key/value cache if every layer of it keeps all keys (a sliding-window
    or linear-attention layer drops or folds what it has passed, so it cannot stand in for the
    prompt); else None."""
    cache = getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return None
    return cache


def completion_logits(model: torch.nn.Module, mb: MicroBatch) -> Tensor:
    """Logits [B, K, V]: row b, column t predicts completion token t of row b."""
    k = mb.completion_ids.shape[1]
    rows = mb.prompt_index
    # Gradient checkpointing turns the cache off in training (transformers warns and drops it).
    if not (getattr(model, "is_gradient_checkpointing", False) and model.training):
        # The last prompt position predicts the first completion token; the completion's own
        # positions (all but its last token) predict the rest, on the prompt's cache.
        prompt = model(
            input_ids=mb.prompt_ids,
            attention_mask=mb.prompt_mask,
            position_ids=_positions(mb.prompt_mask),
            logits_to_keep=1,
            use_cache=True,
        )
        first = prompt.logits[rows]
        if k == 1:
            return first
        cache = _full_attention_cache(prompt)
        if cache is not None:
            cache.batch_select_indices(rows)
            rest = model(
                input_ids=mb.completion_ids[:, :-1],
                attention_mask=torch.cat(
                    [mb.prompt_mask[rows], mb.completion_mask[:, :-1].long()], dim=1
                ),
                position_ids=mb.prompt_mask.sum(-1)[rows, None]
                + torch.arange(k - 1, device=rows.device),
                past_key_values=cache,
                use_cache=True,
            )
            return torch.cat([first, rest.logits], dim=1)
    # Every row in full: its prompt, then its completion.
    mask = torch.cat([mb.prompt_mask[rows], mb.completion_mask.long()], dim=1)
    out = model(
        input_ids=torch.cat([mb.prompt_ids[rows], mb.completion_ids], dim=1),
        attention_mask=mask,
        position_ids=_positions(mask),
        logits_to_keep=k + 1,
        use_cache=False,
    )
    return out.logits[:, :-1]


def microbatches(batch: RolloutBatch, batch_size: int) -> list[list[tuple[list[int], Sample]]]:
    items = [(g.prompt_ids, s) for g in batch.groups for s in g.samples]
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)]


def microbatch_pieces(
    items: Sequence[tuple[list[int], Sample]],
    pad_token_id: int,
    device: torch.device,
    micro_batch_tokens: int,
) -> list[MicroBatch]:
    """One micro-batch as the forward passes run it: whole (padded, prompts shared) when
    `micro_batch_tokens` is 0, else padding-free pieces of at most that many tokens."""
    if micro_batch_tokens == 0:
        return [pack_microbatch(items, pad_token_id, device)]
    whole = (len(items), sum(s.num_sampled for _, s in items))
    return [
        replace(
            pack_microbatch(piece, pad_token_id, device),
            packed=packed_row(piece, device),
            whole=whole,
        )
        for piece in split_by_tokens(items, micro_batch_tokens)
    ]


def policy_logprobs(
    model: torch.nn.Module,
    mb: MicroBatch,
    temperature: float,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[Tensor, Tensor | None]:
    """[B, K] log-probabilities of `mb`'s completion tokens under `model` (sampling temperature
    applied) and, with `entropy`, the per-token entropy (carrying gradient with `entropy_grad`,
    for the entropy bonus; a metric otherwise); padding holds zeros when packed."""
    if mb.packed is not None:
        logprobs, ent = packed_logprobs(
            model,
            mb.packed,
            temperature,
            entropy=entropy,
            entropy_grad=entropy_grad,
            autocast=autocast,
        )
        mask = mb.completion_mask
        return to_padded(logprobs, mask), None if ent is None else to_padded(ent, mask)
    logits = completion_logits(model, mb)
    logprobs = token_logprobs(logits, mb.completion_ids, temperature)
    if not entropy:
        return logprobs, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        return logprobs, token_entropy(logits if entropy_grad else logits.detach(), temperature)
