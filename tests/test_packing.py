"""Padding-free micro-batches (`grail.train.packing`, `train.micro_batch_tokens`): the packed
layout, its log-probabilities, and an update that equals the padded one."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers.batches import updated
from torch import Tensor

from grail.algo.grpo import GRPOLossConfig, token_logprobs
from grail.algo.logprobs import token_entropy
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.models.lora import AdapterOff, with_new_adapter
from grail.models.packed_attention import PACKED_SDPA, packed_sdpa_enabled, use_packed_sdpa
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train.microbatch import microbatch_pieces, microbatches, policy_logprobs
from grail.train.packing import (
    DEFAULT_CUDA_MICRO_BATCH_TOKENS,
    decoder_and_head,
    packed_logprobs,
    packed_row,
    resolve_micro_batch_tokens,
    split_by_tokens,
)
from grail.train.update import UpdateSettings


def _sample(ids: list[int], advantage: float, gen: torch.Generator) -> Sample:
    logprobs = (-torch.rand(len(ids), generator=gen) * 3).tolist()
    return Sample(ids, logprobs, "length", "", 0.0, {}, False, advantage)


def _batch(groups: int, replicas: int, seed: int, max_len: int = 9) -> RolloutBatch:
    """Prompts and completions of spread lengths, advantages of both signs."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, 500, (3 + 2 * g,), generator=gen).tolist()
        samples = []
        for _ in range(replicas):
            n = int(torch.randint(1, max_len, (), generator=gen))
            ids = torch.randint(3, 500, (n,), generator=gen).tolist()
            samples.append(_sample(ids, float(torch.randn((), generator=gen)), gen))
        out.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(out)


def test_split_keeps_order_and_budget_and_puts_a_long_sample_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    items = [([1] * p, _sample([5] * c, 0.0, gen)) for p, c in [(3, 2), (2, 2), (4, 9), (1, 1)]]
    pieces = split_by_tokens(items, budget=10)
    assert [[len(p) + len(s.completion_ids) for p, s in piece] for piece in pieces] == [
        [5, 4],
        [13],  # longer than the budget: alone
        [2],
    ]
    assert [it for piece in pieces for it in piece] == items


def test_packed_row_restarts_positions_and_predicts_each_completion_token() -> None:
    gen = torch.Generator().manual_seed(0)
    items = [([7, 8], _sample([20, 21, 22], 1.0, gen)), ([9], _sample([30], -1.0, gen))]
    row = packed_row(items, "cpu")
    assert row.input_ids.tolist() == [[7, 8, 20, 21, 22, 9, 30]]
    assert row.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    # position p predicts token p + 1: 8 -> 20, 20 -> 21, 21 -> 22; 9 -> 30
    assert row.predict_at.tolist() == [1, 2, 3, 5]
    assert row.target_ids.tolist() == [20, 21, 22, 30]


@pytest.mark.parametrize("attention", ["sdpa", PACKED_SDPA])
def test_packed_log_probs_equal_each_sample_run_alone(tiny_model_dir: Path, attention: str) -> None:
    """No token attends across samples in the packed row, and the chunked output layer gives
    each token's log-probability and entropy: those of the sample run alone, unpadded. With
    sdpa's block-diagonal mask and with packed sdpa (sdpa per sample)."""
    model = load_model(tiny_model_dir).eval()
    if attention == PACKED_SDPA:
        assert use_packed_sdpa(model)
    assert packed_sdpa_enabled(model) == (attention == PACKED_SDPA)
    batch = _batch(groups=3, replicas=3, seed=1)
    items = microbatches(batch, batch_size=64)[0]
    with torch.no_grad():
        logprobs, entropy = packed_logprobs(
            model, packed_row(items, "cpu"), 0.7, entropy=True, head_chunk_tokens=5
        )
        assert entropy is not None
        start = 0
        for prompt, sample in items:
            ids = torch.tensor([prompt + sample.completion_ids])
            n = len(sample.completion_ids)
            logits = model(input_ids=ids).logits[:, -n - 1 : -1]
            alone = token_logprobs(logits, ids[:, -n:], 0.7)[0]
            torch.testing.assert_close(logprobs[start : start + n], alone, rtol=0, atol=1e-5)
            torch.testing.assert_close(
                entropy[start : start + n], token_entropy(logits, 0.7)[0], rtol=0, atol=1e-5
            )
            start += n
        assert start == logprobs.shape[0]


def _grads_of(model: torch.nn.Module, loss: Tensor) -> Tensor:
    model.zero_grad()
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("attention", ["sdpa", PACKED_SDPA])
def test_packed_and_padded_log_probs_have_the_same_gradients(
    tiny_model_dir: Path, attention: str
) -> None:
    """The chunked, checkpointed output layer back-propagates what the padded forward does,
    entropy included (several chunks, several pieces); packed sdpa's padded passes fall back to
    sdpa with the mask, its packed ones attend per sample."""
    model = load_model(tiny_model_dir).train()
    if attention == PACKED_SDPA:
        assert use_packed_sdpa(model)
    items = microbatches(_batch(groups=4, replicas=3, seed=2), batch_size=64)[0]
    padded = microbatch_pieces(items, 0, torch.device("cpu"), micro_batch_tokens=0)[0]
    weights = torch.randn(padded.completion_mask.shape, generator=torch.Generator().manual_seed(3))

    def objective(mb_logprobs: Tensor, mb_entropy: Tensor, mask: Tensor, w: Tensor) -> Tensor:
        return ((mb_logprobs * w + 0.3 * mb_entropy) * mask).sum()

    lp, ent = policy_logprobs(model, padded, 1.0, entropy=True, entropy_grad=True)
    assert ent is not None
    want = _grads_of(model, objective(lp, ent, padded.completion_mask, weights))
    pieces = microbatch_pieces(items, 0, torch.device("cpu"), micro_batch_tokens=24)
    assert len(pieces) > 2
    total = torch.zeros(())
    row = 0
    for mb in pieces:
        lp, ent = policy_logprobs(model, mb, 1.0, entropy=True, entropy_grad=True)
        assert ent is not None
        b, k = mb.completion_mask.shape
        total = total + objective(lp, ent, mb.completion_mask, weights[row : row + b, :k])
        row += b
    got = _grads_of(model, total)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    ("loss_type", "kl_coef", "entropy_coef", "grad_accum", "per_sample"),
    [
        ("dapo", 0.0, 0.0, 1, False),
        ("grpo", 0.05, 0.0, 2, False),
        ("bnpo", 0.0, 0.01, 1, False),
        ("dr_grpo", 0.05, 0.01, 2, False),
        ("dapo", 0.0, 0.0, 1, True),
        ("dr_grpo", 0.05, 0.01, 2, True),
    ],
)
def test_packed_update_equals_the_padded_update(
    tiny_model_dir: Path,
    loss_type: str,
    kl_coef: float,
    entropy_coef: float,
    grad_accum: int,
    per_sample: bool,
) -> None:
    """train.micro_batch_tokens changes how the forward passes run, not the update: every
    optimizer step's gradient and the loss metrics equal the padded update's, for each loss
    type's normaliser, with the KL term and the entropy bonus, over several optimizer steps;
    `per_sample`: policy and reference on packed sdpa, as the trainer runs them."""
    torch.manual_seed(0)
    base = load_model(tiny_model_dir)
    ref = copy.deepcopy(base).eval().requires_grad_(False) if kl_coef > 0 else None
    batch = _batch(groups=4, replicas=4, seed=4)
    loss = GRPOLossConfig(
        loss_type=loss_type, max_completion_length=8, kl_coef=kl_coef, entropy_coef=entropy_coef
    )

    def settings(tokens: int) -> UpdateSettings:
        return UpdateSettings(loss, 1.0, 4, grad_accum, 1.0, micro_batch_tokens=tokens)

    want, want_grads = updated(copy.deepcopy(base), ref, batch, settings(0))
    policy, packed_ref = copy.deepcopy(base), copy.deepcopy(ref)
    if per_sample:
        assert use_packed_sdpa(policy) and (packed_ref is None or use_packed_sdpa(packed_ref))
    got, got_grads = updated(policy, packed_ref, batch, settings(20))
    assert len(got_grads) == len(want_grads) == 4 // grad_accum
    for g, w in zip(got_grads, want_grads, strict=True):
        assert float((g - w).norm() / w.norm()) < 1e-5  # float rounding, elementwise near 0
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-6)
    for key in ("loss_total", "loss_pg", "loss_kl", "loss_entropy", "kl", "entropy"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    assert got["num_tokens"] == want["num_tokens"]


def _with_context(batch: RolloutBatch, seed: int) -> RolloutBatch:
    """`batch` as episodes: each completion's first token sampled, about a third of the others
    context (in the middle and at the end; behaviour log-prob 0.0 there), and one completion of
    context but for its first token. The sampled tokens' behaviour log-probs near the tiny
    model's own (~ -ln 512), so that importance weights are near 1 and few are masked."""
    gen = torch.Generator().manual_seed(seed)
    for s in batch.samples:
        n = len(s.completion_ids)
        s.sampled_mask = [1] + (torch.rand(n - 1, generator=gen) > 0.35).long().tolist()
        near = (-6.0 - torch.rand(n, generator=gen)).tolist()
        s.behaviour_logprobs = [
            lp if m else 0.0 for lp, m in zip(near, s.sampled_mask, strict=True)
        ]
    longest = max(batch.samples, key=lambda s: len(s.completion_ids))
    longest.sampled_mask = [1] + [0] * (len(longest.completion_ids) - 1)
    longest.behaviour_logprobs = longest.behaviour_logprobs[:1] + [0.0] * (
        len(longest.completion_ids) - 1
    )
    return batch


@pytest.mark.parametrize(
    ("loss_type", "kl_coef", "entropy_coef", "grad_accum", "per_sample", "is_correction"),
    [
        ("dapo", 0.0, 0.01, 1, False, "token_truncate"),
        ("grpo", 0.05, 0.0, 2, False, "sequence_mask"),
        ("bnpo", 0.0, 0.01, 1, True, "none"),
        ("dr_grpo", 0.05, 0.01, 2, True, "token_mask"),
    ],
)
def test_packed_update_equals_the_padded_update_with_context_tokens(
    tiny_model_dir: Path,
    loss_type: str,
    kl_coef: float,
    entropy_coef: float,
    grad_accum: int,
    per_sample: bool,
    is_correction: str,
) -> None:
    """`test_packed_update_equals_the_padded_update` on episodes (samples with a
    `sampled_mask`): the packed path predicts every completion position, context included, and
    scatters them into the attention mask's layout; the loss then covers the sampled tokens, and
    its normalisers count those of the whole micro-batch, as the padded path's do. With the
    importance-sampling correction, which reads the behaviour log-probs (0.0 on context)."""
    torch.manual_seed(0)
    base = load_model(tiny_model_dir)
    ref = copy.deepcopy(base).eval().requires_grad_(False) if kl_coef > 0 else None
    batch = _with_context(_batch(groups=4, replicas=4, seed=4), seed=5)
    sampled = sum(s.num_sampled for s in batch.samples)
    assert 0 < sampled < sum(len(s.completion_ids) for s in batch.samples)
    loss = GRPOLossConfig(
        loss_type=loss_type,
        max_completion_length=8,
        kl_coef=kl_coef,
        entropy_coef=entropy_coef,
        is_correction=is_correction,
        is_clip_min=0.1,
    )

    def settings(tokens: int) -> UpdateSettings:
        return UpdateSettings(loss, 1.0, 4, grad_accum, 1.0, micro_batch_tokens=tokens)

    want, want_grads = updated(copy.deepcopy(base), ref, batch, settings(0))
    policy, packed_ref = copy.deepcopy(base), copy.deepcopy(ref)
    if per_sample:
        assert use_packed_sdpa(policy) and (packed_ref is None or use_packed_sdpa(packed_ref))
    got, got_grads = updated(policy, packed_ref, batch, settings(20))
    assert len(got_grads) == len(want_grads) == 4 // grad_accum
    for g, w in zip(got_grads, want_grads, strict=True):
        assert float((g - w).norm() / w.norm()) < 1e-5  # float rounding, elementwise near 0
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-6)
    for key in ("loss_total", "loss_pg", "loss_kl", "loss_entropy", "kl", "entropy"):
        if key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-7), key
    assert got["num_tokens"] == want["num_tokens"] == sampled


def test_lora_reference_runs_packed_with_the_adapter_off(tiny_model_dir: Path) -> None:
    """Under LoRA the KL reference is the same modules with the adapter disabled; the packed
    path reaches the body and the output layer through peft and disables it too."""
    from grail.core.config import LoraConfig

    torch.manual_seed(0)
    model = with_new_adapter(load_model(tiny_model_dir), LoraConfig(enabled=True, r=4))
    for name, p in model.named_parameters():
        if "lora_B" in name:  # a nonzero adapter, so that on and off differ
            torch.nn.init.normal_(p, std=0.5)
    items = microbatches(_batch(groups=2, replicas=2, seed=5), batch_size=64)[0]
    padded = microbatch_pieces(items, 0, torch.device("cpu"), micro_batch_tokens=0)[0]
    packed = microbatch_pieces(items, 0, torch.device("cpu"), micro_batch_tokens=10_000)[0]
    mask = padded.completion_mask
    with torch.no_grad():
        for m in (model, AdapterOff(model)):
            want = policy_logprobs(m, padded, 1.0)[0] * mask
            got = policy_logprobs(m, packed, 1.0)[0]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        on, off = (policy_logprobs(m, packed, 1.0)[0] for m in (model, AdapterOff(model)))
    assert not torch.allclose(on, off)


def test_micro_batch_tokens_default_is_on_for_cuda_only() -> None:
    assert resolve_micro_batch_tokens(None, torch.device("cpu")) == 0
    assert resolve_micro_batch_tokens(None, torch.device("cuda")) == DEFAULT_CUDA_MICRO_BATCH_TOKENS
    assert resolve_micro_batch_tokens(512, torch.device("cpu")) == 512


def test_packed_sdpa_leaves_other_attentions_and_refuses_lengths_that_do_not_fit(
    tiny_model_dir: Path,
) -> None:
    eager = load_model(tiny_model_dir)
    eager.set_attn_implementation("eager")
    assert not use_packed_sdpa(eager)  # eager reads the samples from the position ids itself
    assert eager.config._attn_implementation == "eager"
    model = load_model(tiny_model_dir).eval()
    assert use_packed_sdpa(model)
    with pytest.raises(ValueError, match="segment_lengths sum to 7"):
        model.get_decoder()(
            input_ids=torch.tensor([[5, 6, 7, 8, 9]]),
            position_ids=torch.tensor([[0, 1, 2, 0, 1]]),
            segment_lengths=(3, 4),
        )


def test_a_compiled_body_attends_per_sample_without_recompiling_for_new_lengths(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.compile with packed pieces: the samples' lengths reach the per-sample attention as
    data, so after the first batches (static, then dynamic shapes) rows of new lengths and sample
    counts run without compiling again, with the eager model's log-probs."""
    # A cache of compiled kernels of its own: once in a full CI run (never alone, nor after the
    # files that compile or change thread counts) the compiled body gave NaN, which points at a
    # kernel other processes had left in the shared cache (/tmp/torchinductor_$USER).
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    eager = load_model(tiny_model_dir).eval()
    compiled = load_model(tiny_model_dir).eval()
    for model in (eager, compiled):
        assert use_packed_sdpa(model)
    decoder_and_head(compiled)[0].compile()
    graphs = []
    for seed in range(6):
        group = _batch(1, 2 + seed % 3, seed=seed).groups[0]
        row = packed_row([(group.prompt_ids, s) for s in group.samples], torch.device("cpu"))
        with torch.no_grad():
            got, _ = packed_logprobs(compiled, row, 1.0)
            want, _ = packed_logprobs(eager, row, 1.0)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[5] == graphs[4] == graphs[3] == graphs[2] > 0, graphs
