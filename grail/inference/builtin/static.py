"""The static decode path's host side (`StaticDecoder`): the engine's ``decode="graph"`` and
``decode="static"`` modes (see `engine`; the device side is `slots`).

The eager path looks at every token on the host (``.tolist()`` after every step, stop checks
in Python) and grows its KV cache by concatenation, so a GPU waits for Python at every step.
Here the host plans a chunk of up to ``check_every`` steps, launches them without waiting
(each a CUDA graph replay with ``decode="graph"`` on CUDA), and then reads the chunk's tokens
once:

- Admission (between chunks): new sequences are prefilled by the eager path's own
  `EagerDecoder.prefill` (so their first token is the eager path's), their KV copied into free rows
  of the static cache (`slots.SlotState`), their settings, stop ids and pre-drawn uniforms
  written to the device.
- Chunk: rows are compacted into the smallest row bucket (powers of two up to
  ``max_batch_size``) when finished rows leave room; the window is the multiple of
  `slots.SLOT_QUANTUM` that covers every live row's positions to the end of the chunk; the
  chunk is no longer than the longest row still needs. A row that ends mid-chunk (stop id, EOS,
  ``max_tokens``: checked on the device) stops there and waits for the read (at most
  ``check_every - 1`` idle steps), which costs less than reading the device at every end.
- Read: the rows' new tokens are handed to the host's `sequences.maybe_finish`, the eager
  path's rule. Rows with stop strings (text, so host-only) go token by token, and one that met
  a stop string mid-chunk drops its later tokens, which changes nothing else: a row's tokens
  depend only on its own earlier tokens and draws. Other rows go in bulk: the device applied
  their rules already, so only a row it finished can end, on its last token.

Seeded sampling. Every step of a sequence draws one uniform from its own generator (as
`sampling.draw` does); here they are drawn at admission, in blocks of `DRAW_BLOCK`, so that no
generator is touched while the device decodes. On CPU a generator gives the same numbers in
blocks as one at a time (tested), so the seeded tokens are the eager path's; on CUDA a block
draw and a scalar draw differ, so the tokens for a seed differ from the eager CUDA path's, but a
sample still depends only on its own seed (``seed + i``), never on the batch.

CUDA graphs: one per (row bucket, window, sampling kind, top alternatives), captured on first
use after one real step on a side stream (which warms up the kernels), replayed afterwards; all
share one memory pool (steps never run concurrently, and nothing a step leaves in the pool is
read after it). They hold the addresses of the state buffers and the weights: a larger state
drops them, and so does a weight update that moves a parameter (in-place copies keep them).
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from grail.inference.builtin.batch import Batch, kv
from grail.inference.builtin.host import DecodeHost
from grail.inference.builtin.sampling import GREEDY_EPS
from grail.inference.builtin.sequences import EngineStopped, _running, _Sequence
from grail.inference.builtin.slots import SLOT_QUANTUM, Capacity, SlotState, decode_step

logger = logging.getLogger(__name__)

CHECK_EVERY = 16  # decode steps between host reads
DRAW_BLOCK = 256  # uniforms are drawn from a sequence's generator this many at a time


DECODE_MODES = ("eager", "static", "graph")


def static_unsupported(config: Any) -> str | None:
    """Why the static decode path cannot serve a model with ``config``, or None."""
    if "sliding_attention" in (getattr(config, "layer_types", None) or []):
        return "sliding-window attention is not supported by the static KV cache"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in str(rope) or rope == "longrope":
        # These recompute their frequencies from the largest position: a host read per step.
        return f"rope_type {rope!r} reads positions on the host"
    return None


def resolve_decode(
    decode: str | None, device: torch.device, batch_invariant: bool | None, config: Any
) -> str:
    """The engine's decode mode: ``decode`` checked, or by default "graph" on CUDA (unless
    batch invariance is asked for or the model is unsupported) and "eager" elsewhere."""
    if decode is not None and decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {list(DECODE_MODES)}, got {decode!r}")
    unsupported = static_unsupported(config)
    if decode is None:
        if device.type != "cuda" or batch_invariant:
            return "eager"
        if unsupported is not None:
            logger.warning("decode=eager: %s", unsupported)
            return "eager"
        return "graph"
    if decode != "eager" and unsupported is not None:
        raise ValueError(f"decode={decode!r}: {unsupported}; use decode='eager'")
    if decode != "eager" and batch_invariant:
        raise ValueError(f"decode={decode!r} is not batch-invariant; use decode='eager'")
    return decode


def row_buckets(max_rows: int) -> list[int]:
    """Batch sizes a step runs at: powers of two below ``max_rows``, then ``max_rows``."""
    sizes = [1]
    while sizes[-1] * 2 < max_rows:
        sizes.append(sizes[-1] * 2)
    return sizes if sizes[-1] == max_rows else [*sizes, max_rows]


def _round_up(n: int, quantum: int) -> int:
    return -(-n // quantum) * quantum


def _greedy(seq: _Sequence) -> bool:
    return seq.params.temperature < GREEDY_EPS


@dataclass(frozen=True)
class Chunk:
    """Steps launched between two host reads, all at the same shapes (one CUDA graph)."""

    rows: int
    window: int
    steps: int
    sample: bool
    filtered: bool
    top: int

    @property
    def key(self) -> tuple[int, int, bool, bool, int]:
        return (self.rows, self.window, self.sample, self.filtered, self.top)


class StaticDecoder:
    """Decodes the engine's batches on the static KV cache; ``prefill``: the eager path's
    (`EagerDecoder.prefill`), which admitted sequences go through; ``graphs``: CUDA graphs (CUDA
    only)."""

    def __init__(
        self,
        host: DecodeHost,
        prefill: Callable[[list[_Sequence]], Batch],
        graphs: bool,
        check_every: int = CHECK_EVERY,
    ) -> None:
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        self.host = host
        self.prefill = prefill
        self.model = host.model
        self.device = host.device
        self.check_every = check_every
        self.buckets = row_buckets(host.max_batch_size)
        self.use_graphs = graphs and self.device.type == "cuda"
        self.state: SlotState | None = None
        self.rows: list[_Sequence | None] = []
        self.graphs: dict[tuple[int, int, bool, bool, int], Any] = {}
        self._pool: Any = None
        self._weights = self._weight_pointers()
        # Counts the tests and benchmarks read: steps, chunks, reads, captures, replays, ...
        self.stats: collections.Counter[str] = collections.Counter()

    # ---------------------------------------------------------------- the engine's entry points

    def run(self, seqs: list[_Sequence], admitted: list[_Sequence]) -> None:
        """`EagerDecoder.run` on the static cache: decode until no row is left, admitting queued
        sequences between chunks (never past a queued control job: `DecodeHost.take`)."""
        # CUDA graphs are captured and replayed on the current device: make it the engine's.
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
        try:
            with on_device:
                self._loop(seqs, admitted)
        except BaseException:
            self._reset()  # a half-updated state is not worth keeping
            raise

    def _loop(self, seqs: list[_Sequence], admitted: list[_Sequence]) -> None:
        host = self.host
        new = seqs
        while True:
            if new:
                admitted.extend(new)
                self.admit(new)
            if host.stopping:
                for seq in admitted:
                    if not seq.future.done():
                        seq.future.set_exception(EngineStopped("the engine is shutting down"))
                self._reset()
                return
            new = host.take(host.max_batch_size - self.live)
            if new:
                continue
            if not self.live:
                return
            chunk = self.plan()
            self.launch(chunk)
            self.read(chunk)

    def weights_changed(self) -> None:
        """After a control job: drop the CUDA graphs if a parameter moved (graphs hold the
        addresses; the engine's in-place copies keep them)."""
        pointers = self._weight_pointers()
        if pointers != self._weights:
            self._weights = pointers
            self.graphs.clear()
            self.stats["graphs_dropped"] += 1

    @property
    def live(self) -> int:
        return sum(seq is not None for seq in self.rows)

    # ---------------------------------------------------------------- admission

    def admit(self, seqs: list[_Sequence]) -> None:
        """Prefill ``seqs`` (first token sampled and checked as on the eager path) and give
        each one that goes on a free row of the static cache."""
        batch = self.prefill(seqs)
        keep = [i for i, seq in enumerate(batch.rows) if _running(seq)]
        if not keep:
            return
        new: list[_Sequence] = [batch.rows[i] for i in keep]  # type: ignore[misc]
        free = [r for r, seq in enumerate(self.rows) if seq is None]
        free += range(len(self.rows), len(self.rows) + len(new))
        dest = free[: len(new)]
        width = kv(batch.cache.layers[0])[0].shape[2]
        live = [seq for seq in self.rows if seq is not None]
        self._ensure(self._capacity(max(dest) + 1, live + new, width))
        state = self.state
        assert state is not None
        self.rows += [None] * (state.capacity.rows - len(self.rows))
        dev = self.device
        dst = torch.tensor(dest, device=dev)

        # KV: the prefill left-padded row i by pad_starts[i]; slot j of its row is column
        # pad_starts[i] + j (columns past the prompt are clamped copies, masked until written).
        index = torch.tensor(keep, device=dev)
        pads = torch.tensor([batch.pad_starts[i] for i in keep], device=dev)
        cols = (pads.unsqueeze(-1) + torch.arange(width, device=dev)).clamp(max=width - 1)
        for layer, (src_keys, src_values) in enumerate(map(kv, batch.cache.layers)):
            for buffer, full in ((state.keys[layer], src_keys), (state.values[layer], src_values)):
                part = full.index_select(0, index)
                where = cols.view(len(keep), 1, width, 1).expand(
                    -1, part.shape[1], -1, part.shape[3]
                )
                buffer[:, :, :width].index_copy_(0, dst, part.gather(2, where))

        def put(name: str, values: list[Any], dtype: torch.dtype) -> None:
            getattr(state, name).index_copy_(0, dst, torch.tensor(values, dtype=dtype).to(dev))

        put("tokens", [batch.tokens[i] for i in keep], torch.long)
        put("pos", [batch.next_pos[i] for i in keep], torch.long)
        put("count", [len(seq.token_ids) for seq in new], torch.long)
        put("finished", [False] * len(new), torch.bool)
        put("max_tokens", [seq.params.max_tokens for seq in new], torch.long)
        put(
            "temperature", [0.0 if _greedy(s) else s.params.temperature for s in new], torch.float32
        )
        put("top_k", [seq.params.top_k for seq in new], torch.long)
        put("top_p", [seq.params.top_p for seq in new], torch.float32)
        stops = state.capacity.stops
        put("stop_ids", [self._padded(self._stop_ids(seq), stops) for seq in new], torch.long)
        uniforms = torch.zeros(len(new), state.capacity.draws, dtype=torch.float64, device=dev)
        for j, seq in enumerate(new):
            blocks = -(-(seq.params.max_tokens - 1) // DRAW_BLOCK)
            if not _greedy(seq) and blocks:
                # Token 0 drew its uniform at the prefill; tokens 1.. draw from here on.
                uniforms[j, : blocks * DRAW_BLOCK] = torch.cat(
                    [
                        torch.rand(
                            DRAW_BLOCK, generator=seq.generator, device=dev, dtype=torch.float64
                        )
                        for _ in range(blocks)
                    ]
                )
        state.uniforms.index_copy_(0, dst, uniforms)
        for r, seq in zip(dest, new, strict=True):
            self.rows[r] = seq
        self.stats["admissions"] += 1
        self.stats["admitted"] += len(new)

    def _stop_ids(self, seq: _Sequence) -> list[int]:
        """The tokens that end ``seq`` on the device: its stop ids, and EOS unless ignored (the
        host then finds which, as `DecodeHost.finish` does)."""
        ids = list(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids += sorted(self.host.eos_ids)
        return list(dict.fromkeys(ids))

    @staticmethod
    def _padded(ids: list[int], width: int) -> list[int]:
        return ids + [-1] * (width - len(ids))

    def _capacity(self, rows: int, seqs: list[_Sequence], width: int) -> Capacity:
        longest = max(len(s.prompt) + s.params.max_tokens for s in seqs)
        stops = max(len(self._stop_ids(s)) for s in seqs)
        top = max(s.params.logprobs or 0 for s in seqs)
        return Capacity(
            rows=self._bucket(rows),
            slots=_round_up(max(longest, width), SLOT_QUANTUM),
            draws=_round_up(max(s.params.max_tokens for s in seqs), DRAW_BLOCK),
            stops=max(4, 1 << (stops - 1).bit_length()) if stops else 4,
            top=self._top(top),
            ring=self.check_every,
        )

    def _top(self, k: int) -> int:
        """Top alternatives computed for ``k`` asked: a power of two (fewer graph shapes)."""
        return 0 if k <= 0 else min(1 << (k - 1).bit_length(), self.host.vocab_size)

    def _ensure(self, need: Capacity) -> None:
        config = self.model.config
        if self.state is None:
            self.state = SlotState.allocate(config, need, self.device, self.host.dtype)
        elif not self.state.capacity.covers(need):
            self.state = self.state.grown(config, self.state.capacity.union(need))
            self.graphs.clear()  # they hold the old buffers' addresses
            self.stats["reallocations"] += 1

    def _bucket(self, rows: int) -> int:
        for size in self.buckets:
            if size >= rows:
                return size
        raise ValueError(f"{rows} rows exceed max_batch_size {self.buckets[-1]}")

    # ---------------------------------------------------------------- chunks

    def compact(self) -> None:
        """Move the live rows above the smallest bucket that holds them all into free rows
        below it, so that steps run at that bucket."""
        live = [r for r, seq in enumerate(self.rows) if seq is not None]
        if not live or self.state is None:
            return
        target = self._bucket(len(live))
        if live[-1] < target:
            return
        movers = [r for r in live if r >= target]
        holes = [r for r in range(target) if self.rows[r] is None][: len(movers)]
        src = torch.tensor(movers, device=self.device)
        self.state.move_rows(src, torch.tensor(holes, device=self.device))
        self.state.free(src)
        for s, d in zip(movers, holes, strict=True):
            self.rows[d], self.rows[s] = self.rows[s], None
        self.stats["compactions"] += 1

    def plan(self) -> Chunk:
        """The next chunk's shapes and length (compacting first), from what the host knows."""
        self.compact()
        assert self.state is not None
        live = [(r, seq) for r, seq in enumerate(self.rows) if seq is not None]
        seqs = [seq for _, seq in live]
        # Up to check_every steps, and no more than the longest row still needs; rows that
        # reach max_tokens sooner stop on the device and wait for the read.
        left = max(s.params.max_tokens - len(s.token_ids) for s in seqs)
        steps = max(1, min(self.check_every, left))
        # The last step feeds position len(prompt) + len(token_ids) - 1 + steps - 1.
        reach = max(len(s.prompt) + len(s.token_ids) - 1 for s in seqs) + steps
        vocab = self.host.vocab_size
        sampled = [s for s in seqs if not _greedy(s)]
        return Chunk(
            rows=self._bucket(live[-1][0] + 1),
            window=min(_round_up(reach, SLOT_QUANTUM), self.state.capacity.slots),
            steps=steps,
            sample=bool(sampled),
            filtered=any(0 < s.params.top_k < vocab or s.params.top_p < 1.0 for s in sampled),
            top=self._top(max(s.params.logprobs or 0 for s in seqs)),
        )

    def launch(self, chunk: Chunk) -> None:
        """Queue the chunk's steps on the device; nothing here waits for it."""
        state = self.state
        assert state is not None
        state.step.zero_()

        def step() -> None:
            decode_step(
                self.model,
                state,
                chunk.rows,
                chunk.window,
                sample=chunk.sample,
                filtered=chunk.filtered,
                top=chunk.top,
            )

        for _ in range(chunk.steps):
            self._run_step(chunk.key, step)
        self.stats["steps"] += chunk.steps
        self.stats["chunks"] += 1

    def _run_step(self, key: tuple[int, int, bool, bool, int], step: Callable[[], None]) -> None:
        if not self.use_graphs:
            step()
            return
        graph = self.graphs.get(key)
        if graph is not None:
            graph.replay()
            self.stats["replays"] += 1
            return
        # This step runs for real on a side stream (CUDA graphs want one warm-up run there:
        # lazy kernel and library initialisation), then the next ones are recorded.
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            step()
        current.wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the event loop's thread may use CUDA meanwhile (weight reads).
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                step()  # recorded, not run
        except Exception:
            logger.exception("CUDA graph capture failed; decoding on without CUDA graphs")
            self.use_graphs = False
            self.graphs.clear()
            return
        self.graphs[key] = graph
        self.stats["captures"] += 1

    def read(self, chunk: Chunk) -> None:
        """Wait for the chunk, hand every live row's new tokens to the host's finish checks,
        and free the rows that ended (or whose request went away)."""
        state = self.state
        assert state is not None
        rows, steps = chunk.rows, chunk.steps
        counts, finished = torch.stack([state.count[:rows], state.finished[:rows].long()]).tolist()
        # Row-major: row r's new tokens are the first counts[r] - len(token_ids) of its ring
        # column (every live row was running when the chunk began, and stops only once).
        tokens = state.ring_tokens[:steps, :rows].t().tolist()
        logprobs = state.ring_logprobs[:steps, :rows].t().tolist()
        top_ids = top_logprobs = None
        if chunk.top:
            top_ids = state.ring_top_ids[:steps, :rows, : chunk.top].transpose(0, 1).tolist()
            top_logprobs = (
                state.ring_top_logprobs[:steps, :rows, : chunk.top].transpose(0, 1).tolist()
            )
        self.stats["reads"] += 1
        freed = []
        for r in range(rows):
            seq = self.rows[r]
            if seq is None:
                continue
            new = counts[r] - len(seq.token_ids)
            k = seq.params.logprobs
            tops = []
            if k and top_ids is not None and top_logprobs is not None:
                pairs = zip(top_ids[r][:new], top_logprobs[r][:new], strict=True)
                tops = [list(zip(i[:k], v[:k], strict=True)) for i, v in pairs]
            if seq.params.stop:
                # Stop strings need text, token by token, as on the eager path.
                for j in range(new):
                    if not _running(seq):
                        break
                    seq.token_ids.append(tokens[r][j])
                    seq.logprobs.append(logprobs[r][j])
                    if tops:
                        seq.top_logprobs.append(tops[j])
                    self.host.finish(seq)
            elif _running(seq):
                # Otherwise the device applied the host's rules (stop ids, EOS, length): only
                # a row it finished can end, and on its last token.
                seq.token_ids += tokens[r][:new]
                seq.logprobs += logprobs[r][:new]
                if tops:
                    seq.top_logprobs += tops[:new]
                if finished[r]:
                    self.host.finish(seq)
            if not _running(seq):
                freed.append(r)
                self.rows[r] = None
            elif finished[r]:
                raise RuntimeError(
                    f"static decode: row {r} finished on the device after "
                    f"{len(seq.token_ids)} tokens, but the host's stop checks did not end it"
                )
        if freed:
            state.free(torch.tensor(freed, device=self.device))

    # ---------------------------------------------------------------- helpers

    def _reset(self) -> None:
        self.rows = []
        self.state = None
        self.graphs.clear()

    def _weight_pointers(self) -> tuple[int, ...]:
        tensors = itertools.chain(self.model.parameters(), self.model.buffers())
        return tuple(t.data_ptr() for t in tensors)
