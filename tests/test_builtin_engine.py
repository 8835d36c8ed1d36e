"""The built-in engine's batched kernels give every row exactly what it gets on its own.

The engine decodes many sequences at once but promises per-sequence results that do not depend on
the batch (the trainer compares runs bitwise, and a request's samples must not change with what
else the server is doing). These tests pin the two batched pieces against one-row-at-a-time
references: token sampling (`draw`) and row-wise attention with rows grouped by padding.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch

from grail.inference.builtin.invariance import _rowwise_attention, attention_batch_invariant
from grail.inference.builtin.sampling import GREEDY_EPS, SamplingParams, draw


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


@pytest.mark.parametrize(("q_len", "k_len"), [(1, 23), (23, 23), (5, 23)])
def test_grouped_rowwise_attention_equals_row_by_row(
    one_thread: None, q_len: int, k_len: int
) -> None:
    """Rows with the same padding share one attention call; each row's output is bitwise the one
    it gets alone, padded queries stay zero, and rows of other lengths are unaffected."""
    if not attention_batch_invariant(4, 2, 16, torch.float32, torch.device("cpu")):
        pytest.skip("this PyTorch's CPU attention is not batch-invariant even with one thread")
    pad_starts = [0, 3, 0, 3, 3, 9, 0]  # three groups, interleaved (gathered, not sliced)
    q, k, v = _attention_inputs(len(pad_starts), q_len, k_len)
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
            module, q[b : b + 1], k[b : b + 1], v[b : b + 1], None, 0.25, grail_pad_starts=[start]
        )
        assert torch.equal(grouped[b], alone[0])
