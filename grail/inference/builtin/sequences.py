"""What the built-in engine decodes: one sequence per sample (`_Sequence`), what it answers
(`SequenceOutput`), and when a sequence ends (`maybe_finish`). Shared by the eager decode path
(`eager`) and the static one (`static`), so that both finish a sequence by the same rules."""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from grail.inference.builtin.sampling import SamplingParams


class EngineStopped(RuntimeError):
    """The engine stopped before the sequence finished."""


@dataclass
class SequenceOutput:
    """One finished sample. ``top_logprobs[t]`` lists (token id, logprob), best first."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop string or stop token id, None for EOS or length


@dataclass
class _Sequence:
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator
    future: concurrent.futures.Future[SequenceOutput]
    # The prompt's sampled spans (`prefix_cache`): () for a plain prompt, one chunk.
    spans: tuple[tuple[int, int], ...] = ()
    # Its request sent spans (an episode's turn, maybe the first): its keys and values go to the
    # prefix cache when it finishes, for the next turn. Plain requests leave nothing there.
    keep: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text_len: int = 0  # length of the decoded text at the last stop-string check
    # Set once `future` is done (answered, failed or cancelled by the app when its client went
    # away): read every step for every row, where `future.done()` takes the future's lock.
    done: bool = False

    def __post_init__(self) -> None:
        self.future.add_done_callback(self._now_done)

    def _now_done(self, _: concurrent.futures.Future[SequenceOutput]) -> None:
        self.done = True


@dataclass
class _Control:
    """A job the worker runs with no batch in flight (weight copies): queued sequences are not
    admitted past it, so it waits for the running batch and precedes the requests after it."""

    fn: Any
    future: concurrent.futures.Future[Any]


def _running(seq: _Sequence | None) -> bool:
    return seq is not None and not seq.done


def _resolve(future: concurrent.futures.Future[Any], value: Any) -> None:
    """Set a result unless the waiter already gave up (a cancelled future)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(value)


def maybe_finish(
    seq: _Sequence, eos_ids: frozenset[int], decode: Callable[[Sequence[int]], str]
) -> None:
    """Resolve ``seq.future`` if its last token ends it (EOS, stop id, stop string, length);
    ``decode`` gives the text of completion tokens."""
    params = seq.params
    token = seq.token_ids[-1]
    reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None
    if token in params.stop_token_ids:
        reason, stop_reason = "stop", token
    elif token in eos_ids and not params.ignore_eos:
        reason = "stop"
    elif params.stop:
        full = decode(seq.token_ids)
        # Only text new since the last step can complete a stop string.
        since = max(0, seq.text_len - max(len(s) for s in params.stop))
        seq.text_len = len(full)
        hits = [(full.find(s, since), s) for s in params.stop if full.find(s, since) >= 0]
        if hits:
            cut, stop_reason = min(hits)
            reason, text = "stop", full[:cut]
    if reason is None and len(seq.token_ids) >= params.max_tokens:
        reason = "length"
    if reason is None:
        return
    if text is None:
        text = decode(seq.token_ids)
    _resolve(
        seq.future,
        SequenceOutput(
            token_ids=list(seq.token_ids),
            logprobs=list(seq.logprobs),
            top_logprobs=list(seq.top_logprobs) if params.logprobs else None,
            text=text,
            finish_reason=reason,
            stop_reason=stop_reason,
        ),
    )
