"""The built-in engine's batched kernels give every row exactly what it gets on its own.

The engine decodes many sequences at once but promises per-sequence results that do not depend on
the batch (the trainer compares runs bitwise, and a request's samples must not change with what
else the server is doing). These tests pin the two batched pieces against one-row-at-a-time
references: token sampling (`draw`) and row-wise attention with rows grouped by padding.

The static decode path (``decode="graph"``, the CUDA default) is pinned to the eager path on
CPU: same tokens for greedy and seeded sampling, and a decode step with no host read.
"""

from __future__ import annotations

import collections
import math
import shutil
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from grail.inference.builtin.engine import Engine, SequenceOutput
from grail.inference.builtin.invariance import _rowwise_attention, attention_batch_invariant
from grail.inference.builtin.sampling import GREEDY_EPS, SamplingParams, draw, draw_rows
from grail.inference.builtin.slots import SLOT_ATTENTION, Capacity, SlotState, decode_step
from grail.inference.builtin.static import DRAW_BLOCK, resolve_decode, row_buckets


@pytest.fixture
def one_thread() -> Iterator[None]:
    """PyTorch's CPU attention is batch-invariant with one thread (the engine probes it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _draw_one(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[int, float, list[tuple[int, float]] | None]:
    """One row, the way the engine sampled before it batched rows (the reference)."""
    greedy = params.temperature < GREEDY_EPS
    scaled = logits if greedy else logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        token = int(torch.argmax(logits).item())
    else:
        filtered = scaled
        if 0 < params.top_k < filtered.shape[-1]:
            kth = torch.topk(filtered, params.top_k).values[-1]
            filtered = filtered.masked_fill(filtered < kth, -math.inf)
        if params.top_p < 1.0:
            probs_sorted, order = torch.sort(torch.softmax(filtered, dim=-1), descending=True)
            drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
            filtered = filtered.masked_fill(drop, -math.inf)
        probs = torch.softmax(filtered.double(), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.rand((), generator=generator, dtype=torch.float64)
        token = int(torch.searchsorted(cdf, (u * cdf[-1]).reshape(1), right=True).item())
        if token >= probs.shape[-1] or probs[token].item() == 0.0:
            token = int(torch.argmax(probs).item())
    top = None
    if params.logprobs:
        best = torch.topk(logp, min(params.logprobs, logp.shape[-1]))
        top = list(zip(best.indices.tolist(), best.values.tolist(), strict=True))
    return token, float(logp[token].item()), top


def _generators(rows: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + r) for r in range(rows)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=1, temperature=0.7, top_k=5, logprobs=3),
        SamplingParams(max_tokens=1, temperature=0.9, top_p=0.8),
        SamplingParams(max_tokens=1, temperature=1.3, top_k=3, top_p=0.5, logprobs=2),
        SamplingParams(max_tokens=1, temperature=0.0, logprobs=4),
    ],
    ids=["plain", "top_k", "top_p", "top_k+top_p", "greedy"],
)
def test_batched_sampling_equals_sampling_one_row_at_a_time(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = torch.randn(37, 300) * 4
    logits[3] = (logits[3] * 2).round() / 2  # many exact ties
    logits[5, 7:] = -math.inf  # most of the vocabulary impossible
    tokens, logprobs, top = draw(logits, params, _generators(37, 11))
    alone = [_draw_one(logits[r], params, g) for r, g in enumerate(_generators(37, 11))]
    assert tokens == [t for t, _, _ in alone]
    assert logprobs == [lp for _, lp, _ in alone]  # bitwise, not approximately
    assert top == ([a for _, _, a in alone] if params.logprobs else None)
    assert len(set(tokens)) > 1 or params.temperature == 0.0  # the draws are really sampled


def test_each_row_draws_from_its_own_generator() -> None:
    """A row's draw depends on its own seed only, not on which rows share the batch."""
    torch.manual_seed(1)
    logits = torch.randn(8, 64)
    params = SamplingParams(max_tokens=1, temperature=1.0)
    together, _, _ = draw(logits, params, _generators(8, 100))
    subset, _, _ = draw(logits[[2, 5]], params, [_generators(8, 100)[i] for i in (2, 5)])
    assert subset == [together[2], together[5]]


def _attention_inputs(
    batch: int, q_len: int, k_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(q_len * 1000 + k_len)
    heads, kv_heads, dim = 4, 2, 16
    return (
        torch.randn(batch, heads, q_len, dim, generator=gen),
        torch.randn(batch, kv_heads, k_len, dim, generator=gen),
        torch.randn(batch, kv_heads, k_len, dim, generator=gen),
    )


@pytest.mark.parametrize("in_room", [False, True])
@pytest.mark.parametrize(("q_len", "k_len"), [(1, 23), (23, 23), (5, 23)])
def test_grouped_rowwise_attention_equals_row_by_row(
    one_thread: None, q_len: int, k_len: int, in_room: bool
) -> None:
    """Rows with the same padding share one attention call; each row's output is bitwise the one
    it gets alone (on contiguous copies), padded queries stay zero, and rows of other lengths are
    unaffected; also when the keys and values are views with room after them (NaN there: a read
    past a row's keys would show)."""
    if not attention_batch_invariant(4, 2, 16, torch.float32, torch.device("cpu")):
        pytest.skip("this PyTorch's CPU attention is not batch-invariant even with one thread")
    pad_starts = [0, 3, 0, 3, 3, 9, 0]  # three groups, interleaved (gathered, not sliced)
    q, k, v = _attention_inputs(len(pad_starts), q_len, k_len)
    if in_room:  # the cache's keys and values as RoomyLayer holds them: views, read in place
        k = torch.cat([k, torch.full_like(k[:, :, :7], float("nan"))], dim=2)[:, :, :k_len]
        v = torch.cat([v, torch.full_like(v[:, :, :7], float("nan"))], dim=2)[:, :, :k_len]
        assert not k.is_contiguous()
    module = torch.nn.Module()
    grouped, _ = _rowwise_attention(
        module, q, k, v, None, 0.25, grail_pad_starts=pad_starts, grail_group_rows=True
    )
    by_row, _ = _rowwise_attention(module, q, k, v, None, 0.25, grail_pad_starts=pad_starts)
    assert torch.equal(grouped, by_row)
    for b, start in enumerate(pad_starts):
        first_real_query = max(0, start - (k_len - q_len))
        assert not grouped[b, :first_real_query].any()
        alone, _ = _rowwise_attention(
            module,
            q[b : b + 1],
            k[b : b + 1].contiguous(),
            v[b : b + 1].contiguous(),
            None,
            0.25,
            grail_pad_starts=[start],
        )
        assert torch.equal(grouped[b], alone[0])


def test_rowwise_attention_groups_rows_whatever_the_engines_thread_count() -> None:
    """With several threads PyTorch's CPU attention splits short queries by batch size, so the
    engine attends on one thread: rows still share a call, bitwise as alone, and the engine's
    own count (the linear layers') is back after it. Before, a 2-thread server attended every
    row on its own and decoded slower than a 1-thread one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert attention_batch_invariant(4, 2, 16, torch.float32, torch.device("cpu"))
        pad_starts = [0, 3, 0, 3, 3, 9, 0]
        q, k, v = _attention_inputs(len(pad_starts), 1, 23)
        module = torch.nn.Module()
        grouped, _ = _rowwise_attention(
            module, q, k, v, None, 0.25, grail_pad_starts=pad_starts, grail_group_rows=True
        )
        assert torch.get_num_threads() == 2
        for b, start in enumerate(pad_starts):
            alone, _ = _rowwise_attention(
                module,
                q[b : b + 1],
                k[b : b + 1],
                v[b : b + 1],
                None,
                0.25,
                grail_pad_starts=[start],
            )
            assert torch.equal(grouped[b], alone[0])
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- the static path
#
# decode="graph" (the default on CUDA: static KV cache, on-device finish flags, host reads every
# few steps, CUDA graphs there) runs on CPU without graphs; these tests pin its logic to the
# eager path, the CPU default. Logprobs agree to float rounding (attention reduces over a
# different number of masked slots), tokens exactly.

PROMPTS = [[5, 77, 301, 12, 260, 9], [40, 41, 42], list(range(100, 121)), [7] * 250]
MIXED: list[tuple[SamplingParams, int, int]] = [  # (params, n, seed)
    (SamplingParams(max_tokens=20, temperature=0.0, logprobs=3), 1, 0),
    (SamplingParams(max_tokens=33, temperature=1.0), 3, 7),
    (SamplingParams(max_tokens=17, temperature=0.8, top_k=20, top_p=0.9, logprobs=2), 2, 11),
    (SamplingParams(max_tokens=40, temperature=1.2, stop_token_ids=tuple(range(3, 40))), 2, 5),
    (SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True, top_k=300), 1, 3),
    (SamplingParams(max_tokens=30, temperature=1.0, stop=("es", "it", "a")), 2, 9),
    (SamplingParams(max_tokens=1, temperature=1.0), 1, 2),
]


@pytest.fixture(scope="module")
def eager(tiny_model_dir: Path) -> Iterator[Engine]:
    engine = Engine(tiny_model_dir)  # the CPU default: eager, batch-invariant
    engine.start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def graph(tiny_model_dir: Path) -> Iterator[Engine]:
    # max_batch_size 5: sequences queue and join running batches; buckets 1, 2, 4, 5.
    engine = Engine(tiny_model_dir, decode="graph", max_batch_size=5)
    engine.start()
    yield engine
    engine.stop()


def _generate(
    engine: Engine, jobs: list[tuple[SamplingParams, int, int]], prompts: list[list[int]]
) -> list[SequenceOutput]:
    futures = []
    for params, n, seed in jobs:
        futures += engine.submit_many(prompts, params, n=n, seed=seed)
    return [f.result(60) for f in futures]


def _assert_same(got: list[SequenceOutput], want: list[SequenceOutput]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == (
            w.token_ids,
            w.text,
            w.finish_reason,
            w.stop_reason,
        )
        torch.testing.assert_close(g.logprobs, w.logprobs, rtol=0, atol=2e-5)
        assert (g.top_logprobs is None) == (w.top_logprobs is None)
        for gs, ws in zip(g.top_logprobs or [], w.top_logprobs or [], strict=True):
            assert [t for t, _ in gs] == [t for t, _ in ws]
            torch.testing.assert_close([v for _, v in gs], [v for _, v in ws], rtol=0, atol=2e-5)


def test_draw_rows_gives_each_row_what_draw_gives_it_alone() -> None:
    """The static path samples rows of different settings in one op set, with no host read;
    each row's token and logprobs are bitwise `draw`'s for its own settings and uniform."""
    torch.manual_seed(3)
    settings = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=1.0),
        SamplingParams(max_tokens=1, temperature=0.7, top_k=5),
        SamplingParams(max_tokens=1, temperature=0.9, top_p=0.8),
        SamplingParams(max_tokens=1, temperature=1.3, top_k=3, top_p=0.5),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=400),  # k >= vocab: off
    ]
    rows = [settings[r % len(settings)] for r in range(36)]
    logits = torch.randn(len(rows), 300) * 4
    logits[2] = (logits[2] * 2).round() / 2  # exact ties
    logits[7, 7:] = -math.inf  # most of the vocabulary impossible
    generators = _generators(len(rows), 21)
    uniforms = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators])
    tokens, logp = draw_rows(
        logits,
        torch.tensor([p.temperature for p in rows]),
        torch.tensor([p.top_k for p in rows]),
        torch.tensor([p.top_p for p in rows]),
        uniforms,
    )
    for r, params in enumerate(rows):
        (want,), (want_lp,), _ = draw(
            logits[r : r + 1], params, _generators(len(rows), 21)[r : r + 1]
        )
        assert int(tokens[r]) == want, (r, params)
        assert float(logp[r, want]) == want_lp  # bitwise
    assert len(set(tokens.tolist())) > 5  # really sampled
    # filtered=False (no row filters) takes the same draws for unfiltered rows.
    plain = [r for r, p in enumerate(rows) if p.top_k in (0, 400) and p.top_p == 1.0]
    sub, _ = draw_rows(
        logits[plain],
        torch.tensor([rows[r].temperature for r in plain]),
        torch.zeros(len(plain), dtype=torch.long),
        torch.ones(len(plain)),
        uniforms[plain],
        filtered=False,
    )
    assert sub.tolist() == tokens[plain].tolist()


def test_a_generator_gives_the_same_uniforms_in_blocks_as_one_at_a_time() -> None:
    """Why the static path's seeded samples are the eager path's on CPU: it draws each
    sequence's uniforms at admission in blocks (`static.DRAW_BLOCK`), eager one per step."""
    one = torch.Generator().manual_seed(5)
    block = torch.Generator().manual_seed(5)
    singles = [torch.rand((), generator=one, dtype=torch.float64) for _ in range(2 * DRAW_BLOCK)]
    blocks = [torch.rand(DRAW_BLOCK, generator=block, dtype=torch.float64) for _ in range(2)]
    assert torch.equal(torch.stack(singles), torch.cat(blocks))


def test_graph_decode_gives_the_eager_paths_tokens(eager: Engine, graph: Engine) -> None:
    """Greedy and seeded sampling, top-k / top-p, top logprobs, stop ids, EOS, stop strings,
    max_tokens (1 included), n > 1, prompts of 3 to 250 tokens, more sequences than rows (so
    sequences join running batches), finished rows leaving: the eager path's results."""
    want = _generate(eager, MIXED, PROMPTS)
    before = collections.Counter(graph._static.stats)  # type: ignore[union-attr]
    got = _generate(graph, MIXED, PROMPTS)
    _assert_same(got, want)
    reasons = collections.Counter((o.finish_reason, type(o.stop_reason).__name__) for o in want)
    assert reasons[("stop", "int")] and reasons[("stop", "str")] and reasons[("length", "NoneType")]
    stats = graph._static.stats - before  # type: ignore[union-attr]
    assert stats["admissions"] > 4 and stats["compactions"] > 0, stats  # the logic ran


def test_graph_decode_stops_at_eos_as_eager_does(
    eager: Engine, graph: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EOS ends a sequence (kept in token_ids, finish "stop", no stop_reason) unless ignore_eos,
    also when it is a stop id too. The tiny model hardly ever draws its EOS (id 2), so ids 2 to
    59 are EOS on both engines here."""
    for engine in (eager, graph):
        monkeypatch.setattr(engine, "eos_ids", frozenset(range(2, 60)))
    jobs = [
        (SamplingParams(max_tokens=40, temperature=1.0), 2, 13),
        (SamplingParams(max_tokens=40, temperature=1.0, ignore_eos=True), 1, 13),
        (SamplingParams(max_tokens=40, temperature=1.0, stop_token_ids=(5, 6, 7, 8)), 1, 4),
    ]
    want = _generate(eager, jobs, PROMPTS)
    _assert_same(_generate(graph, jobs, PROMPTS), want)
    eos = [o for o in want[:8] if o.finish_reason == "stop"]
    assert eos and all(o.stop_reason is None and 2 <= o.token_ids[-1] < 60 for o in eos)
    assert all(o.finish_reason == "length" for o in want[8:12])  # ignore_eos


def test_a_cancelled_request_leaves_its_rows(graph: Engine) -> None:
    """A request whose waiter gave up (its futures cancelled, as the server does) stops decoding
    at the next read, and the next request gets the rows."""
    stats = graph._static.stats  # type: ignore[union-attr]
    start = stats["steps"]
    params = SamplingParams(max_tokens=500, temperature=1.0, ignore_eos=True)
    futures = graph.submit_many(PROMPTS[:1], params, n=5, seed=0)  # every row
    deadline = time.monotonic() + 30
    while stats["steps"] == start and time.monotonic() < deadline:
        time.sleep(0.005)
    for future in futures:
        future.cancel()
    (out,) = _generate(graph, [(SamplingParams(max_tokens=8, temperature=1.0), 1, 0)], PROMPTS[:1])
    assert len(out.token_ids) == 8
    assert stats["steps"] - start < 100  # not the 499 steps the cancelled request asked for


def test_graph_decode_reads_the_device_once_per_chunk(graph: Engine) -> None:
    """The host looks at results every `CHECK_EVERY` steps, not every token."""
    before = collections.Counter(graph._static.stats)  # type: ignore[union-attr]
    params = SamplingParams(max_tokens=64, temperature=1.0, ignore_eos=True)
    outs = _generate(graph, [(params, 1, 4)], PROMPTS[:3])
    assert [len(o.token_ids) for o in outs] == [64] * 3
    stats = graph._static.stats - before  # type: ignore[union-attr]
    # Token 0 comes from the prefill; 63 decode steps in chunks of 16, 16, 16, 15.
    assert stats["steps"] == 63 and stats["reads"] == stats["chunks"] == 4, stats


def test_graph_decode_follows_weight_updates(
    eager: Engine, graph: Engine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """An in-place weight update between batches: the static cache and its steps serve the new
    weights (as eager does), and the old ones again after a second update."""
    moved = tmp_path / "moved"
    shutil.copytree(tiny_model_dir, moved)
    tensors = load_file(moved / "model.safetensors")
    gen = torch.Generator().manual_seed(1)
    save_file(
        {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in tensors.items()},
        moved / "model.safetensors",
        metadata={"format": "pt"},
    )
    jobs = [(SamplingParams(max_tokens=12, temperature=1.0, logprobs=2), 2, 1)]
    first = _generate(graph, jobs, PROMPTS[:2])
    try:
        for engine in (graph, eager):
            engine.update_weights(moved, "moved")
        _assert_same(_generate(graph, jobs, PROMPTS[:2]), _generate(eager, jobs, PROMPTS[:2]))
        assert _generate(graph, jobs, PROMPTS[:2])[0].logprobs != first[0].logprobs
    finally:
        for engine in (graph, eager):
            engine.update_weights(tiny_model_dir, "default")
    _assert_same(_generate(graph, jobs, PROMPTS[:2]), first)


def test_graph_decode_serves_a_lora_adapter(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from grail.core.config import LoraConfig
    from grail.models.lora import with_new_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = with_new_adapter(base, LoraConfig(enabled=True, r=4))
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(tmp_path / "adapter")
    jobs = [(SamplingParams(max_tokens=12, temperature=0.0), 1, 0), MIXED[1]]
    outs = []
    for decode in ("eager", "graph"):
        engine = Engine(tiny_model_dir, lora_dir=tmp_path / "adapter", decode=decode)
        engine.start()
        try:
            outs.append(_generate(engine, jobs, PROMPTS[:2]))
        finally:
            engine.stop()
    _assert_same(outs[1], outs[0])
    plain = _generate_once(tiny_model_dir, jobs[:1])
    assert plain[0].token_ids != outs[1][0].token_ids  # the adapter changes what is served


def _generate_once(model_dir: Path, jobs: list[tuple[SamplingParams, int, int]]) -> list[Any]:
    engine = Engine(model_dir, decode="graph")
    engine.start()
    try:
        return _generate(engine, jobs, PROMPTS[:2])
    finally:
        engine.stop()


def test_a_decode_step_reads_nothing_on_the_host(tiny_model_dir: Path) -> None:
    """The step a CUDA graph records runs on the meta device, where every host read
    (``.item()``, ``bool(tensor)``, ``.tolist()``, data-dependent shapes) raises: so it has
    none, in any sampling kind."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.set_attn_implementation(SLOT_ATTENTION)
    capacity = Capacity(rows=8, slots=512, draws=256, stops=4, top=4, ring=16)
    state = SlotState.allocate(config, capacity, torch.device("meta"), torch.float32)
    with torch.inference_mode():
        for sample, filtered, top in [(False, False, 0), (True, False, 0), (True, True, 4)]:
            decode_step(model, state, 8, 256, sample=sample, filtered=filtered, top=top)
        with pytest.raises(RuntimeError, match="meta tensors"):  # the probe does catch reads
            draw(torch.zeros(2, 8, device="meta"), SamplingParams(max_tokens=1), _generators(2, 0))


def test_decode_mode_defaults_and_refusals() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    plain = types.SimpleNamespace(layer_types=["full_attention"], rope_parameters={})
    sliding = types.SimpleNamespace(layer_types=["sliding_attention"], rope_parameters={})
    assert resolve_decode(None, cpu, None, plain) == "eager"
    assert resolve_decode(None, cuda, None, plain) == "graph"
    assert resolve_decode(None, cuda, True, plain) == "eager"  # invariance needs eager
    assert resolve_decode(None, cuda, None, sliding) == "eager"
    assert resolve_decode("graph", cpu, None, plain) == "graph"
    assert resolve_decode("static", cuda, False, plain) == "static"
    with pytest.raises(ValueError, match="not batch-invariant"):
        resolve_decode("graph", cpu, True, plain)
    with pytest.raises(ValueError, match="sliding-window"):
        resolve_decode("graph", cuda, None, sliding)
    with pytest.raises(ValueError, match="decode must be one of"):
        resolve_decode("fast", cuda, None, plain)
    assert row_buckets(5) == [1, 2, 4, 5] and row_buckets(256)[-2:] == [128, 256]
    assert row_buckets(1) == [1]
