"""The built-in engine's prefix cache: the keys and values of finished sequences, reused by a
later request that continues one (an episode's next turn), bit for bit what computing that
request's prompt from nothing gives.

Why "units". A position's keys and values depend on how it was computed: in a prefill chunk
together with the positions before it, or alone in a decode step. PyTorch's CPU attention rounds
a query differently in a chunk of queries than alone (measured: 40 of 40 random prompts differed
in the last logit by ~1e-7 between one chunk and the same tokens in chunks and single steps), so
"prefill the prefix again" is not "what the cache holds", and a turn's tokens would depend on
whether its prefix was still cached. So the engine computes a prompt in *units*, fixed by the
prompt itself and the spans of it that the policy sampled (`units`):

    the first prompt                 one chunk (a plain prefill, as every request had it)
    each sampled token but the last  alone (the decode steps that fed it)
    the last sampled token of a turn one chunk, together with the context after it (the
      + what follows, up to the      environment's turn): what a request continuing the
      next sampled span              sequence prefills after the cached prefix

A request tells which of its prompt's tokens were sampled with the built-in server's
``sampled_spans`` extension. With a cached prefix the engine computes only the units after it; on
a miss (evicted, another server, a weight update since) it computes all of them, a replay: slower,
the same numbers. Batch invariance (`invariance`) makes a unit's numbers independent of the rows
it runs with, so a hit and a miss give the same tokens and log-probabilities (tested). A request
without spans is one chunk, as it always was, and never reads the cache.

An entry serves one continuation: the request that continues it takes it (the sequence it computes
leaves a longer entry when it finishes; a second request continuing the same prefix replays it).
Entries not taken live until evicted, oldest first, beyond `capacity_tokens`, and all go when the
weights change. Taking an entry frees what it holds as soon as its continuation has copied it: left
in place, stale entries kept every turn's batch tensors alive, so each new batch's keys and values
came from fresh memory (page faults: ~10 ms more for each 256-row copy of benchmarks/episodes.py's
cache). An entry holds views of the keys and values of the batch its sequence finished in (copying
them was the engine's largest cost at the end of a turn), so a batch's tensors stay until its last
entry goes: memory can exceed the entries' own tokens by the batch's padding and spare room (up to
~2x). The units are the engine's whenever it decodes batch-invariantly, cache memory or none
(``--prefix-cache-mb 0`` replays every continued prompt): a server's numbers never depend on its
cache. Numbers differ in rounding from the same prompt sent without spans (one chunk).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from grail.inference.builtin.batch import KVRow

#: [start, end) positions of prompt tokens the policy sampled, as a request sends them.
Span = tuple[int, int]


def check_spans(spans: Sequence[Sequence[int]], length: int) -> tuple[Span, ...]:
    """`spans` as a tuple of (start, end), or ValueError saying what is wrong: each span needs
    0 < start < end <= length (a prompt precedes the first sampled token), in order, not
    overlapping."""
    out: list[Span] = []
    previous = 0
    for i, span in enumerate(spans):
        if len(span) != 2 or not all(type(x) is int for x in span):
            raise ValueError(f"span {i} must be [start, end] (two integers), got {list(span)!r}")
        start, end = span
        if not (previous <= start < end <= length) or start == 0:
            raise ValueError(
                f"span {i} [{start}, {end}) must satisfy {max(previous, 1)} <= start < end <= "
                f"{length} (the prompt's length): spans are sampled tokens after a prompt, in "
                "order and not overlapping"
            )
        out.append((start, end))
        previous = end
    return tuple(out)


def units(length: int, spans: Sequence[Span]) -> list[tuple[int, int]]:
    """The [start, end) units in which the engine computes a prompt of `length` tokens whose
    `spans` were sampled (see the module docstring); they tile [0, length)."""
    out: list[tuple[int, int]] = []
    start = 0
    for first, end in spans:
        out.append((start, first))  # the prompt, or the context since the last turn
        out.extend((t, t + 1) for t in range(first, end - 1))  # decode steps
        start = end - 1  # a turn's last sampled token was never fed: it leads the next chunk
    out.append((start, length))
    return out


@dataclass
class Entry:
    """What a finished sequence leaves: the spans it was computed with (its request's and its
    own sampled tokens) and its keys and values, where they lie in its batch's tensors."""

    spans: tuple[Span, ...]
    kv: KVRow


class PrefixCache:
    """Finished sequences' keys and values by their tokens, oldest out first, each taken by the
    request that continues it; with
    a capacity of 0 it keeps nothing (every continued prompt is replayed).

    Only the engine's worker thread uses it."""

    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(
                f"capacity_tokens must be >= 0 (0: keep nothing), got {capacity_tokens}"
            )
        self.capacity_tokens = capacity_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], Entry] = collections.OrderedDict()
        self._tokens = 0
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def store(self, tokens: tuple[int, ...], spans: tuple[Span, ...], kv: KVRow) -> None:
        """Keep the keys and values of `tokens` (computed in the units of `spans`)."""
        if not tokens or len(tokens) > self.capacity_tokens:
            return
        old = self._entries.pop(tokens, None)
        if old is not None:
            self._tokens -= len(tokens)
        self._entries[tokens] = Entry(spans, kv)
        self._tokens += len(tokens)
        while self._tokens > self.capacity_tokens:
            evicted, _ = self._entries.popitem(last=False)
            self._tokens -= len(evicted)

    def lookup(self, prompt: tuple[int, ...], spans: tuple[Span, ...]) -> tuple[int, Entry | None]:
        """The longest cached prefix of `prompt` that was computed in the units `spans` give it
        (it ends where a sampled span's last token starts a chunk), as (its length, entry), or
        (0, None). A hit takes the entry out of the cache (see the module docstring)."""
        for i in range(len(spans) - 1, -1, -1):
            cut = spans[i][1] - 1
            entry = self._entries.get(prompt[:cut])
            if entry is not None and entry.spans == spans[: i + 1]:
                del self._entries[prompt[:cut]]
                self._tokens -= cut
                self.hits += 1
                return cut, entry
        if spans:
            self.misses += 1
        return 0, None

    def clear(self) -> None:
        """Forget every entry (the weights changed)."""
        self._entries.clear()
        self._tokens = 0
