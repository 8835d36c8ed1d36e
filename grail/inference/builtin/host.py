"""What a decoder needs of the engine it decodes for (`DecodeHost`). Both decode paths, eager
(`eager`) and static (`static`), see the engine only through this, so neither imports `engine`,
which composes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from grail.inference.builtin.sequences import _Sequence


class DecodeHost(Protocol):
    """The served model and its settings, the queue the decoders take sequences from, and the
    one rule that ends a sequence. Attributes are read when used, not copied: the engine's EOS
    ids, say, may change between batches (a test does that)."""

    model: PreTrainedModel
    device: torch.device
    dtype: torch.dtype
    max_batch_size: int
    vocab_size: int
    eos_ids: frozenset[int]
    pad_id: int

    @property
    def stopping(self) -> bool:
        """True once the engine is stopping: a decoder fails what it holds and returns."""
        ...

    def take(self, limit: int) -> list[_Sequence]:
        """Up to ``limit`` queued sequences, never past a queued control job (weight copy)."""
        ...

    def finish(self, seq: _Sequence) -> None:
        """Resolve ``seq.future`` if its last token ends it (`sequences.maybe_finish`)."""
        ...
