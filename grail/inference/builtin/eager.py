"""The eager decode path (`EagerDecoder`): the engine's ``decode="eager"`` mode (see `engine` for
the batching it implements), and the prefill the static path (`static`) admits sequences with.

The distinct prompts are prefilled once (left padding, attention mask, position ids), their KV
cache (transformers ``DynamicCache``) is expanded to one row per sequence, then one token per row
per step, sampled for all rows with one set of tensor ops (every op is per row, so each row gets
the numbers it would get alone); finished rows are dropped from the cache. When rows free up,
queued sequences are prefilled and merged into the running batch (the shorter side's cache is
left-padded to the longer). With batch invariance (`invariance`) batches always hold a multiple
of the row quantum (filler rows), and attention runs row by row.

With a prefix cache (`prefix_cache`), a prompt that says which of its tokens were sampled is
computed in that module's units, from the longest cached prefix on, and every finished sequence
leaves its keys and values there for a request that continues it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache

from grail.inference.builtin.batch import (
    Batch,
    KVRow,
    assemble,
    kv,
    merge,
    plain_layers,
    room_for,
    roomy,
    roomy_cache,
    stacked,
)
from grail.inference.builtin.host import DecodeHost
from grail.inference.builtin.prefix_cache import PrefixCache, Span, units
from grail.inference.builtin.sampling import SamplingParams, draw
from grail.inference.builtin.sequences import EngineStopped, _running, _Sequence


@dataclass
class _Partial:
    """A prompt being computed unit by unit: its keys and values so far (`length` tokens; None
    before its first unit) and the units to go; `logits` of its last position once computed."""

    prompt: tuple[int, ...]
    kv: KVRow | None
    length: int
    todo: list[tuple[int, int]]
    logits: torch.Tensor | None = None

    def computed(self) -> KVRow:
        assert self.kv is not None  # every prompt's units are computed before it is stacked
        return self.kv


class EagerDecoder:
    """Decodes the engine's batches on a growing ``DynamicCache``, looking at every token on the
    host. ``row_quantum``, ``batch_invariant`` and ``group_attention``: the engine's batch
    invariance (`invariance`); ``continuous``: whether queued sequences join a running batch
    (not with sliding-window attention, whose cache cannot be re-padded); ``prefix_cache``:
    where finished sequences' keys and values wait for a request that continues them (None:
    every prompt is one chunk, sampled spans or not)."""

    def __init__(
        self,
        host: DecodeHost,
        *,
        row_quantum: int = 1,
        batch_invariant: bool = False,
        group_attention: bool = False,
        continuous: bool = True,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        self.host = host
        self.prefix_cache = prefix_cache
        self.row_quantum = row_quantum
        self.batch_invariant = batch_invariant
        self.group_attention = group_attention
        self.continuous = continuous

    def run(self, seqs: list[_Sequence], admitted: list[_Sequence]) -> None:
        """Decode until no row is left, admitting queued sequences whenever rows free up.

        Every sequence taken is appended to ``admitted`` (so the caller can fail them all if a
        forward raises). Admission stops at a queued control job, so a weight update waits for
        this batch to drain and the batch never mixes weights.
        """
        batch: Batch | None = None
        new = seqs
        while True:
            part = None
            if new:
                admitted.extend(new)
                part = self.prefill(new)
            batch = self._compact(batch, part)
            if self.host.stopping:
                for seq in admitted:
                    if not seq.future.done():
                        seq.future.set_exception(EngineStopped("the engine is shutting down"))
                return
            # Compacted: every row that is not a filler was running a moment ago.
            live = 0 if batch is None else sum(1 for s in batch.rows if s is not None)
            new = self.host.take(self.host.max_batch_size - live) if self.continuous else []
            if new:
                continue  # prefill them so that the next step decodes them too
            if batch is None:
                return
            self._step(batch)

    def prefill(self, seqs: list[_Sequence]) -> Batch:
        """Prefill the sequences' prompts and sample every sequence's first token: plain prompts
        as one chunk each (`_prefill_chunks`), those with sampled spans in their units from the
        longest cached prefix on (`_prefill_units`), when there is a prefix cache."""
        if self.prefix_cache is None:
            return self._prefill_chunks(seqs)
        plain = [s for s in seqs if not s.spans]
        continued = [s for s in seqs if s.spans]
        if not continued:
            return self._prefill_chunks(plain)
        if not plain:
            return self._prefill_units(continued)
        return merge(self._prefill_chunks(plain), self._prefill_units(continued))

    def _prefill_chunks(self, seqs: list[_Sequence]) -> Batch:
        """Prefill the distinct prompts once (left padding), give each sequence its own row of
        that cache, and sample every sequence's first token."""
        dev = self.host.device
        uniq: dict[tuple[int, ...], int] = {}
        for seq in seqs:
            uniq.setdefault(seq.prompt, len(uniq))
        prompts = list(uniq)
        prompts += [prompts[0]] * self._fill(len(prompts))
        width = max(len(p) for p in prompts)
        pad_starts = [width - len(p) for p in prompts]
        ids = torch.full((len(prompts), width), self.host.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, pad_starts[r] :] = torch.tensor(p, dtype=torch.long)
            mask[r, pad_starts[r] :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.host.model.config)
        logits = self._forward(ids.to(dev), mask.to(dev), positions.to(dev), cache, pad_starts)

        rows: list[_Sequence | None] = [*seqs, *([None] * self._fill(len(seqs)))]
        index = [uniq[s.prompt] for s in seqs] + [0] * (len(rows) - len(seqs))
        select = torch.tensor(index, device=dev)
        logits = logits[select]
        tokens = [self.host.pad_id] * len(rows)
        tokens[: len(seqs)] = self._sample_rows(seqs, logits[: len(seqs)])
        prompts_batch = Batch(
            rows=[None] * len(prompts),
            cache=cache,
            mask=mask.to(dev),
            pad_starts=pad_starts,
            next_pos=[len(p) for p in prompts],
            tokens=[self.host.pad_id] * len(prompts),
        )
        if plain_layers(cache):  # each sample's row a copy of its prompt's, room to grow
            batch = assemble([(prompts_batch, i) for i in index])
            batch.rows, batch.tokens = rows, tokens
            return batch
        cache.batch_select_indices(select)
        return Batch(
            rows=rows,
            cache=cache,
            mask=prompts_batch.mask[select],
            pad_starts=[pad_starts[i] for i in index],
            next_pos=[len(prompts[i]) for i in index],
            tokens=tokens,
        )

    def _compact(self, batch: Batch | None, new: Batch | None = None) -> Batch | None:
        """The running rows of `batch`, then those of `new` (just prefilled), with as many
        fillers as the row quantum requires: finished rows dropped, in one copy of the keys and
        values (merging and then dropping copied them twice)."""
        if batch is None:
            batch, new = new, None
        if batch is None:
            return None
        sources = [batch] if new is None else [batch, new]
        live: list[tuple[Batch, int]] = []
        idle: list[tuple[Batch, int]] = []
        for source in sources:
            running = [_running(s) for s in source.rows]
            if self.prefix_cache is not None:
                self._keep_finished(source, running)
            for r, on in enumerate(running):
                if not on:
                    source.rows[r] = None  # a filler from now on, if the row quantum needs it
                (live if on else idle).append((source, r))
        if not live:
            return None
        picks = live + idle[: self._fill(len(live))]
        if self.group_attention:
            # Rows of one padding side by side: their shared attention call reads them as a
            # view. Scattered, it gathered their keys and values every step (measured: ~10% of
            # the server's time in benchmarks/episodes.py, whose turns join at many lengths).
            picks.sort(key=lambda pick: pick[0].pad_starts[pick[1]] - pick[0].mask.shape[1])
        if new is None and [r for _, r in picks] == list(range(len(batch.rows))):
            return batch
        if not plain_layers(batch.cache):  # a sliding window's layers: rows selected in place
            index = torch.tensor([r for _, r in picks], device=self.host.device)
            batch.cache.batch_select_indices(index)
            return Batch(
                rows=[batch.rows[r] for _, r in picks],
                cache=batch.cache,
                mask=batch.mask[index],
                pad_starts=[batch.pad_starts[r] for _, r in picks],
                next_pos=[batch.next_pos[r] for _, r in picks],
                tokens=[batch.tokens[r] for _, r in picks],
            )
        return assemble(picks)

    def _keep_finished(self, batch: Batch, running: list[bool]) -> None:
        """Store the keys and values of the rows that finished in the prefix cache."""
        assert self.prefix_cache is not None
        width = batch.mask.shape[1]
        # Views of the batch's keys and values, not copies (a clone per row and layer was ~1k
        # small copies at the end of a 256-episode turn, a gather per layer no faster): no step
        # writes where a finished row's tokens lie (`RoomyLayer` appends after them; selecting
        # or merging rows makes new tensors), so the views keep what they hold. The batch's
        # tensors live until their last entry is taken or evicted.
        layers = [kv(layer) for layer in batch.cache.layers]
        for r, seq in enumerate(batch.rows):
            if seq is None or running[r] or not seq.keep or not seq.token_ids:
                continue
            start = batch.pad_starts[r]
            tokens = seq.prompt + tuple(seq.token_ids[:-1])  # the last token was never fed
            if width - start != len(tokens):
                continue
            prompt = len(seq.prompt)
            spans = (*seq.spans, (prompt, prompt + len(seq.token_ids)))
            self.prefix_cache.store(tokens, spans, KVRow(layers, r, start))

    def _prefill_units(self, seqs: list[_Sequence]) -> Batch:
        """Compute the distinct prompts (with their spans) in their units (`prefix_cache`) from
        the longest cached prefix on, a round at a time: each round, the prompts whose next
        unit has the same length go through the model together. Then give each sequence its
        own row and sample its first token."""
        assert self.prefix_cache is not None
        keys: dict[tuple[tuple[int, ...], tuple[Span, ...]], int] = {}
        for seq in seqs:
            keys.setdefault((seq.prompt, seq.spans), len(keys))
        partial = []
        for prompt, spans in keys:
            done, entry = self.prefix_cache.lookup(prompt, spans)
            todo = [u for u in units(len(prompt), spans) if u[0] >= done]
            partial.append(_Partial(prompt, entry.kv if entry else None, done, todo))
        # One unit each, of one length, after cached keys and values (a hit, as every later
        # turn of an episode is): the round's own cache becomes the batch's, with room to grow,
        # instead of being copied into a new one.
        sizes = {
            p.todo[0][1] - p.todo[0][0] if len(p.todo) == 1 and p.length else None for p in partial
        }
        whole = len(partial) == len(seqs) and len(sizes) == 1 and None not in sizes
        cache = None
        while any(p.todo for p in partial):
            rounds: dict[tuple[int, bool], list[_Partial]] = {}
            for p in partial:
                if p.todo:  # first units apart: they start from no keys and values at all
                    start, end = p.todo[0]
                    rounds.setdefault((end - start, p.length == 0), []).append(p)
            for group in rounds.values():
                cache = self._next_unit(group, grow=whole)

        width = max(p.length for p in partial)
        index = [keys[(s.prompt, s.spans)] for s in seqs]
        index += [0] * self._fill(len(index))
        select = torch.tensor(index, device=self.host.device)
        if not whole or cache is None:
            cache = roomy_cache(stacked([partial[i].computed() for i in index])[0])
        mask = torch.zeros((len(partial), width), dtype=torch.long, device=self.host.device)
        for i, p in enumerate(partial):
            mask[i, width - p.length :] = 1
        rows: list[_Sequence | None] = [*seqs, *([None] * self._fill(len(seqs)))]
        last = [p.logits for p in partial]
        assert all(x is not None for x in last)  # every prompt ends with a unit computed here
        logits = torch.stack(last)[select]  # type: ignore[arg-type]
        tokens = [self.host.pad_id] * len(rows)
        tokens[: len(seqs)] = self._sample_rows(seqs, logits[: len(seqs)])
        return Batch(
            rows=rows,
            cache=cache,
            mask=mask[select],
            pad_starts=[width - partial[i].length for i in index],
            next_pos=[partial[i].length for i in index],
            tokens=tokens,
        )

    def _next_unit(self, group: list[_Partial], grow: bool = False) -> DynamicCache:
        """Feed every prompt of `group` its next unit (all of one length) after its keys and
        values so far (left-padded to the longest), in one forward; the cache it ran on (row r:
        `group[r]`, then fillers), with room to decode in after it when `grow`."""
        dev = self.host.device
        rows = group + [group[0]] * self._fill(len(group))
        past = max(p.length for p in rows)
        pad_starts = [past - p.length for p in rows]
        ids = torch.tensor([p.prompt[slice(*p.todo[0])] for p in rows], dtype=torch.long)
        size = ids.shape[1]
        mask = torch.ones((len(rows), past + size), dtype=torch.long)
        for r, pad in enumerate(pad_starts):
            mask[r, :pad] = 0
        positions = torch.tensor([[p.length + j for j in range(size)] for p in rows])
        if past == 0:
            cache = DynamicCache(config=self.host.model.config)
        else:
            room = room_for(past + size) - past if grow else size
            cache = roomy_cache(stacked([p.computed() for p in rows], room)[0])
        logits = self._forward(ids.to(dev), mask.to(dev), positions.to(dev), cache, pad_starts)
        layers = [kv(layer) for layer in cache.layers]
        for r, p in enumerate(group):
            p.kv = KVRow(layers, r, pad_starts[r])
            p.length += size
            p.todo.pop(0)
            p.logits = logits[r]
        return cache

    def _step(self, batch: Batch) -> None:
        """Feed every row its last token and sample the next one."""
        dev = self.host.device
        if self.batch_invariant:  # its row-wise attention reads the room's views (RoomyLayer)
            roomy(batch.cache)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
        step_ids = torch.tensor(batch.tokens, device=dev).unsqueeze(1)
        step_pos = torch.tensor(batch.next_pos, device=dev).unsqueeze(1)
        logits = self._forward(step_ids, batch.mask, step_pos, batch.cache, batch.pad_starts)
        batch.next_pos = [p + 1 for p in batch.next_pos]
        # Compacted just before: every row that is not a filler is running (a request cancelled
        # since decodes one more token, which its cancelled future refuses).
        live = [(r, seq) for r, seq in enumerate(batch.rows) if seq is not None]
        if len(live) < len(batch.rows):
            logits = logits[torch.tensor([r for r, _ in live], device=dev)]
        tokens = self._sample_rows([seq for _, seq in live], logits)
        for (r, _), token in zip(live, tokens, strict=True):
            batch.tokens[r] = token

    def _sample_rows(self, seqs: list[_Sequence], logits: torch.Tensor) -> list[int]:
        """Draw one token for each of ``seqs`` from its float32 ``logits`` row, record it and
        its logprob, and finish the sequences it ends; returns the tokens.

        Rows with the same sampling settings are drawn together (one tensor op per step, not one
        per row); every row op is a per-row reduction or elementwise, so each row's numbers are
        those it gets alone.
        """
        groups: dict[SamplingParams, list[int]] = {}
        for i, seq in enumerate(seqs):
            groups.setdefault(seq.params, []).append(i)
        tokens = [0] * len(seqs)
        for params, index in groups.items():
            rows = logits
            if len(index) < len(seqs):
                rows = logits[torch.tensor(index, device=logits.device)]
            members = [seqs[i] for i in index]
            drawn, logprobs, top = draw(rows, params, [s.generator for s in members])
            for j, (seq, token, logprob) in enumerate(zip(members, drawn, logprobs, strict=True)):
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                if top is not None:
                    seq.top_logprobs.append(top[j])
                tokens[index[j]] = token
                self.host.finish(seq)
        return tokens

    def _forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache,
        pad_starts: list[int],
    ) -> torch.Tensor:
        extra: dict[str, Any] = {}
        if self.batch_invariant:
            extra = {"grail_pad_starts": pad_starts, "grail_group_rows": self.group_attention}
        out = self.host.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            **extra,
        )
        return out.logits[:, -1, :].float()

    def _fill(self, count: int) -> int:
        """Filler rows that round ``count`` up to a multiple of the row quantum."""
        return -count % self.row_quantum
