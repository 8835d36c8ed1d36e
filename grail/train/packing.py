"""Padding-free micro-batches: samples concatenated into one row, up to a token budget.

With `train.micro_batch_tokens` set, each micro-batch of `train.batch_size` samples (what the
loss normalises over and the optimizer steps on) is run in pieces of at most that many tokens.
A piece is ONE row holding its samples one after the other, prompt then completion, with
position ids starting again at 0 for every sample, so no token attends across samples and
padding costs nothing. A model on sdpa (transformers' default) is switched to packed sdpa
(grail/models/packed_attention.py: sdpa per sample, told the samples' lengths); eager, flash and
flex attention read the layout from the position ids alone (attention_mask=None, no cache:
`masking_utils.find_packed_sequence_indices` gives eager a block-diagonal causal mask and
flash-attention its varlen sequence starts). A sample longer than the budget is a piece of its
own.

The output layer runs on the completion-predicting positions only, `head_chunk_tokens` rows at a
time, each chunk under activation checkpointing: the [tokens, vocabulary] logits of one chunk
exist at a time, forward and backward (the backward recomputes them), where a plain forward keeps
the whole micro-batch's logits for the backward pass (at Qwen2.5's 151,936-token vocabulary,
16k tokens x 152k x 2 bytes = 5 GB in bf16, plus the float32 gradient). Own code, not liger's
fused linear cross-entropy: liger's kernel runs on CUDA only (the CPU tests could not check it),
and plain chunks were faster on an H100 at the 0.5B shape (19.4% MFU against liger's 12.5%,
same batch: docs/gpu.md).

The pieces of a micro-batch are normalised as the whole micro-batch (`grpo_loss`'s
`microbatch_counts`), so their gradients add up to the unpacked micro-batch's: the budget changes
speed and memory, not the update (up to float rounding; tested for every loss type).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from peft import PeftModel
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from grail.algo.logprobs import token_entropy, token_logprobs
from grail.models.lora import AdapterOff
from grail.models.packed_attention import packed_sdpa_enabled
from grail.rollouts.batch import Sample

# Completion-predicting positions per output-layer chunk: at a 152k vocabulary one chunk's
# logits are 4096 x 152k x 2 B = 1.2 GB in bf16 (chunks of 4096 measured in docs/gpu.md).
DEFAULT_HEAD_CHUNK_TOKENS = 4096

T = TypeVar("T")

# train.micro_batch_tokens=null on CUDA. Chosen when the packed row's attention was sdpa with a
# dense [T, T] block-diagonal mask (no flash kernel, every score of the row computed: ~16% of the
# linear layers' work at 4096 tokens, ~65% at 16384 at the 0.5B shape; 3.6% MFU measured on an
# H200, docs/benchmarks.md). Packed sdpa attends per sample, so the budget now bounds memory
# only; 4096 stays until a larger one is measured on a GPU. On CPU null means 0 (unpacked
# micro-batches, which share each prompt's forward pass among its completions: faster for short
# completions).
DEFAULT_CUDA_MICRO_BATCH_TOKENS = 4096


def resolve_micro_batch_tokens(value: int | None, device: torch.device) -> int:
    """`train.micro_batch_tokens` as used on `device`: null is 4096 on CUDA and 0 (off) else."""
    if value is None:
        return DEFAULT_CUDA_MICRO_BATCH_TOKENS if device.type == "cuda" else 0
    return value


@dataclass
class PackedRow:
    """The forward input of a padding-free piece: its samples (prompt + completion each) in one
    row, and where in that row the completion tokens are predicted."""

    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T] 0, 1, ... again from 0 at each sample
    predict_at: Tensor  # [N] positions whose output predicts a completion token, sample-major
    target_ids: Tensor  # [N] the completion tokens they predict
    segment_lengths: tuple[int, ...]  # the samples' lengths (prompt + completion), in row order


def split_by_tokens(
    items: Sequence[tuple[list[int], Sample]], budget: int
) -> list[list[tuple[list[int], Sample]]]:
    """Consecutive runs of `items` of at most `budget` prompt + completion tokens each (a longer
    sample alone). Order is kept, so a run's pieces are the same whatever came before."""
    pieces: list[list[tuple[list[int], Sample]]] = []
    current: list[tuple[list[int], Sample]] = []
    used = 0
    for prompt, sample in items:
        length = len(prompt) + len(sample.completion_ids)
        if current and used + length > budget:
            pieces.append(current)
            current, used = [], 0
        current.append((prompt, sample))
        used += length
    if current:
        pieces.append(current)
    return pieces


def packed_row(items: Sequence[tuple[list[int], Sample]], device: torch.device | str) -> PackedRow:
    """The one-row layout of `items` (module docstring)."""
    ids: list[int] = []
    positions: list[int] = []
    predict_at: list[int] = []
    targets: list[int] = []
    lengths: list[int] = []
    for prompt, sample in items:
        if not prompt:
            raise ValueError("a sample has an empty prompt: nothing predicts its first token")
        start = len(ids)
        completion = list(sample.completion_ids)
        sequence = list(prompt) + completion
        ids += sequence
        positions += range(len(sequence))
        lengths.append(len(sequence))
        # Position p's output predicts token p + 1: the last prompt token predicts the first
        # completion token, and so on up to the completion's second-to-last token.
        first = start + len(prompt) - 1
        predict_at += range(first, first + len(completion))
        targets += completion
    return PackedRow(
        input_ids=torch.tensor([ids], device=device),
        position_ids=torch.tensor([positions], device=device),
        predict_at=torch.tensor(predict_at, dtype=torch.long, device=device),
        target_ids=torch.tensor(targets, dtype=torch.long, device=device),
        segment_lengths=tuple(lengths),
    )


def decoder_and_head(model: torch.nn.Module) -> tuple[Any, Any, AbstractContextManager[Any]]:
    """The transformer body, the output layer, and the context to run them in: a LoRA model's
    reference (`AdapterOff`) is the same modules with the adapter disabled."""
    context: AbstractContextManager[Any] = nullcontext()
    if isinstance(model, AdapterOff):
        model = model.peft_model[0]
        context = model.disable_adapter()
    base: Any = model.get_base_model() if isinstance(model, PeftModel) else model
    return base.get_decoder(), base.get_output_embeddings(), context


def _head_logprobs(
    head: torch.nn.Module,
    hidden: Tensor,
    target_ids: Tensor,
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
) -> tuple[Tensor, Tensor]:
    """Log-probabilities of `target_ids` [n] and the entropy [n] (zeros when not asked;
    without gradient unless `entropy_grad`) of the output layer applied to `hidden` [n, H]."""
    logits = head(hidden).unsqueeze(0)  # [1, n, V]
    logprobs = token_logprobs(logits, target_ids.unsqueeze(0), temperature)[0]
    if not entropy:
        return logprobs, torch.zeros_like(logprobs)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        ent = token_entropy(logits if entropy_grad else logits.detach(), temperature)[0]
    return logprobs, ent


def packed_logprobs(
    model: torch.nn.Module,
    row: PackedRow,
    temperature: float,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    head_chunk_tokens: int = DEFAULT_HEAD_CHUNK_TOKENS,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> tuple[Tensor, Tensor | None]:
    """Per completion token of `row`, in sample-major order: log softmax(logits / T) of the
    token [N] and, with `entropy`, the entropy of that distribution [N] (None otherwise;
    differentiable only with `entropy_grad`).

    Differentiable when grad is enabled: the output layer runs in checkpointed chunks of
    `head_chunk_tokens` positions (module docstring). `autocast` is the mixed-precision context
    the trainer's forward runs in (accelerate's), since the body and the head are called
    directly rather than through the model's wrapped forward.
    """
    root = model.peft_model[0] if isinstance(model, AdapterOff) else model
    return _as_forward_of(
        root,
        lambda: _packed_logprobs(
            model, row, temperature, entropy, entropy_grad, head_chunk_tokens, autocast
        ),
    )


_FSDP_FORWARD = "grail_packed_forward"


def _as_forward_of(root: torch.nn.Module, run: Callable[[], T]) -> T:
    """`run()`, as a forward pass of `root` when FSDP2 shards it (the update sharded over ranks,
    issue 29). The packed path calls the body and the output layer itself, not `root.forward`:
    without FSDP2's hooks around it, the root's own parameters (embeddings, final norm, output
    layer) would stay sharded and their gradients unreduced. `register_fsdp_forward_method` is
    FSDP2's way to run its forward hooks around another method (a no-op on other modules)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return run()
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    if not isinstance(root, FSDPModule):
        return run()
    if not hasattr(root, _FSDP_FORWARD):
        setattr(root, _FSDP_FORWARD, lambda call: call())
        register_fsdp_forward_method(root, _FSDP_FORWARD)
    return getattr(root, _FSDP_FORWARD)(run)


def _packed_logprobs(
    model: torch.nn.Module,
    row: PackedRow,
    temperature: float,
    entropy: bool,
    entropy_grad: bool,
    head_chunk_tokens: int,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> tuple[Tensor, Tensor | None]:
    decoder, head, context = decoder_and_head(model)
    # With packed sdpa (grail/models/packed_attention.py) each sample attends alone, told by
    # its length; other attentions read the samples from the position ids.
    # The lengths as a tensor: data to a compiled body (train.compile), where a tuple of ints
    # would be constants it recompiles for at every batch.
    per_sample = (
        {"segment_lengths": torch.tensor(row.segment_lengths)}
        if packed_sdpa_enabled(decoder)
        else {}
    )
    with context, autocast():
        hidden = decoder(
            input_ids=row.input_ids,
            position_ids=row.position_ids,
            attention_mask=None,  # packed: the position ids separate the samples
            use_cache=False,
            **per_sample,
        ).last_hidden_state[0, row.predict_at]  # [N, H]
        pieces: list[tuple[Tensor, Tensor]] = []
        for start in range(0, hidden.shape[0], head_chunk_tokens):
            h = hidden[start : start + head_chunk_tokens]
            ids = row.target_ids[start : start + head_chunk_tokens]
            if torch.is_grad_enabled():
                pieces.append(
                    checkpoint(
                        _head_logprobs,
                        head,
                        h,
                        ids,
                        temperature,
                        entropy,
                        entropy_grad,
                        use_reentrant=False,
                    )
                )
            else:
                pieces.append(_head_logprobs(head, h, ids, temperature, entropy, entropy_grad))
    logprobs = torch.cat([lp for lp, _ in pieces])
    return logprobs, (torch.cat([e for _, e in pieces]) if entropy else None)


def to_padded(values: Tensor, mask: Tensor) -> Tensor:
    """Sample-major per-token `values` [N] in the right-padded [B, K] layout of `mask` (1.0 on
    completion tokens, N of them), zeros on padding; differentiable."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask.bool(), values)
