"""Episodes in the policy update (`grail.train.update`): a sample's `sampled_mask` marks the
tokens the policy sampled (1) among the context the environment added (0, behaviour log-prob
0.0). The context is attended to but never trained on; a mask of all ones is the single
completion it always was, to the bit. (TRL's masked rows: tests/test_trl_parity.py; packed ==
padded with masks: tests/test_packing.py.)"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.batches import updated
from torch import Tensor

from grail.algo.grpo import GRPOLossConfig, grpo_loss, token_entropy, token_logprobs
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train.microbatch import microbatches, pack_microbatch
from grail.train.update import UpdateSettings

TEMPERATURE = 0.8
PACKED_TOKENS = 20  # train.micro_batch_tokens of the packed runs: several pieces per micro-batch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """These tiny ops only lose to thread synchronisation, and on a loaded machine badly: the
    file took 131 s on 2 threads beside another test run, 8 s on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _batch(groups: int, replicas: int, seed: int, masked: bool) -> RolloutBatch:
    """Prompts and completions of spread lengths, advantages of both signs; with `masked`, every
    completion an episode: its first token sampled, about a third of the others context (inside
    completions and at their ends) with behaviour log-prob 0.0. Behaviour log-probs near the
    tiny model's own (~ -ln 512) keep the importance weights near 1, where they bite."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, 500, (3 + g,), generator=gen).tolist()
        samples = []
        for _ in range(replicas):
            n = int(torch.randint(1, 9, (), generator=gen))
            ids = torch.randint(3, 500, (n,), generator=gen).tolist()
            behaviour = (-6.0 - torch.rand(n, generator=gen)).tolist()
            advantage = float(torch.randn((), generator=gen))
            mask = None
            if masked:
                mask = [1] + (torch.rand(n - 1, generator=gen) > 0.35).long().tolist()
                behaviour = [lp if m else 0.0 for lp, m in zip(behaviour, mask, strict=True)]
            sample = Sample(ids, behaviour, "stop", "", 0.0, {}, False, advantage, mask)
            samples.append(sample)
        out.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(out)


def _models(tiny_model_dir: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model and a reference a little away from it (so the KL term is not 0)."""
    torch.manual_seed(0)
    base = load_model(tiny_model_dir)
    ref = copy.deepcopy(base).eval().requires_grad_(False)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return base, ref


def _settings(
    loss: dict[str, Any], batch_size: int, grad_accum: int, tokens: int
) -> UpdateSettings:
    config = GRPOLossConfig(max_completion_length=8, **loss)
    return UpdateSettings(config, TEMPERATURE, batch_size, grad_accum, 1.0, tokens)


# Every loss type, both levels, each term (KL, entropy bonus, the importance-sampling correction
# that reads the behaviour log-probs) somewhere.
LOSSES = [
    {"loss_type": "grpo", "kl_coef": 0.05, "entropy_coef": 0.01, "is_correction": "token_truncate"},
    {"loss_type": "bnpo", "importance_sampling_level": "sequence", "is_correction": "sequence_mask",
     "is_clip_min": 0.5},
    {"loss_type": "dr_grpo", "kl_coef": 0.05, "is_correction": "token_mask", "is_clip_min": 0.5},
    {"loss_type": "dapo", "entropy_coef": 0.01, "importance_sampling_level": "sequence"},
]  # fmt: skip
LOSS_IDS = [str(loss["loss_type"]) for loss in LOSSES]


# --------------------------------------------------------------------------------------------
# A mask of all ones is today's single completion, to the bit
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["all", "some"])  # samples carrying [1] * n; the rest None
@pytest.mark.parametrize("tokens", [0, PACKED_TOKENS], ids=["padded", "packed"])
@pytest.mark.parametrize("loss", [LOSSES[0], LOSSES[3]], ids=["grpo", "dapo"])
def test_a_mask_of_all_sampled_tokens_is_bit_identical_to_none(
    tiny_model_dir: Path, loss: dict[str, Any], tokens: int, which: str
) -> None:
    """`sampled_mask=[1] * n` builds a loss mask of its own (not the completion mask itself), yet
    the update's metrics and the parameters AdamW leaves (two optimizer steps, so old log-probs
    are frozen for the second) are bitwise those of `sampled_mask=None`."""
    base, ref = _models(tiny_model_dir)
    plain = _batch(groups=4, replicas=4, seed=1, masked=False)
    ones = copy.deepcopy(plain)
    for i, s in enumerate(ones.samples):
        if which == "all" or i % 3 == 0:
            s.sampled_mask = [1] * len(s.completion_ids)
    # The all-ones path really is the other one: a separate loss-mask tensor.
    plain_mb = pack_microbatch(microbatches(plain, 4)[0], 0, "cpu")
    ones_mb = pack_microbatch(microbatches(ones, 4)[0], 0, "cpu")
    assert plain_mb.loss_mask is plain_mb.completion_mask
    assert ones_mb.loss_mask is not ones_mb.completion_mask
    assert torch.equal(ones_mb.loss_mask, ones_mb.completion_mask)

    settings = _settings(loss, batch_size=4, grad_accum=2, tokens=tokens)
    results = []
    for batch in (plain, ones):
        model = copy.deepcopy(base)
        metrics, grads = updated(model, ref, batch, settings, adamw=True)
        results.append((metrics, grads, [p.detach() for p in model.parameters()]))
    (want, want_grads, want_params), (got, got_grads, got_params) = results
    assert got == want  # every metric, to the bit (none is NaN here)
    assert want["optimizer_steps"] == 2.0 and want["num_tokens"] == sum(
        len(s.completion_ids) for s in plain.samples
    )
    assert all(torch.equal(g, w) for g, w in zip(got_grads, want_grads, strict=True))
    assert all(torch.equal(g, w) for g, w in zip(got_params, want_params, strict=True))
    assert not all(
        torch.equal(p, q) for p, q in zip(want_params, base.parameters(), strict=True)
    )  # the update moved the weights: the comparison is not of two untouched models


# --------------------------------------------------------------------------------------------
# A masked sample is trained on its sampled tokens only
# --------------------------------------------------------------------------------------------


def _by_hand(
    model: torch.nn.Module,
    ref: torch.nn.Module,
    batch: RolloutBatch,
    config: GRPOLossConfig,
    masks: list[Any],
) -> list[tuple[float, Tensor]]:
    """The loss of `batch` as one micro-batch and its gradient, from each prompt + completion
    run alone (no padding, no shared prompt, no packing), by `grpo_loss` over each mask in
    `masks` (a function of the sample giving its row) in turn, on the same forward pass."""
    rows = [(g.prompt_ids, s) for g in batch.groups for s in g.samples]
    width = max(len(s.completion_ids) for _, s in rows)

    def padded(values: list[Tensor]) -> Tensor:
        return torch.stack([torch.nn.functional.pad(v, (0, width - v.shape[0])) for v in values])

    logps, entropies, refs = [], [], []
    for prompt, sample in rows:
        ids = torch.tensor([prompt + sample.completion_ids])
        target = torch.tensor([sample.completion_ids])
        n = len(sample.completion_ids)
        logits = model(input_ids=ids).logits[:, -n - 1 : -1]
        logps.append(token_logprobs(logits, target, TEMPERATURE)[0])
        entropies.append(token_entropy(logits, TEMPERATURE)[0])
        with torch.no_grad():
            ref_logits = ref(input_ids=ids).logits[:, -n - 1 : -1]
            refs.append(token_logprobs(ref_logits, target, TEMPERATURE)[0])
    logp = padded(logps)
    params = list(model.parameters())
    results = []
    for mask_of in masks:
        mask = padded([torch.tensor(mask_of(s), dtype=torch.float32) for _, s in rows])
        loss, _ = grpo_loss(
            logp,
            logp.detach(),
            torch.tensor([s.advantage for _, s in rows]),
            mask,
            config,
            ref_logprobs=padded(refs),
            behaviour_logprobs=padded([torch.tensor(s.behaviour_logprobs) for _, s in rows]),
            entropy=padded(entropies),
            num_items_in_batch=int(mask.sum()),
        )
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        results.append((float(loss.detach()), torch.cat([g.flatten() for g in grads])))
    return results


@pytest.mark.parametrize("tokens", [0, PACKED_TOKENS], ids=["padded", "packed"])
@pytest.mark.parametrize("loss", LOSSES, ids=LOSS_IDS)
def test_a_masked_sample_is_trained_on_its_sampled_tokens_only(
    tiny_model_dir: Path, loss: dict[str, Any], tokens: int
) -> None:
    """One micro-batch of episodes: the update's loss and gradient are `grpo_loss` over the
    sampled tokens of the same logits (each sequence run alone, by hand), `num_tokens` counts
    the sampled tokens only, and the same by hand over every completion token (context trained
    on) is far from it."""
    base, ref = _models(tiny_model_dir)
    batch = _batch(groups=3, replicas=3, seed=2, masked=True)
    sampled = sum(s.num_sampled for s in batch.samples)
    assert sampled < sum(len(s.completion_ids) for s in batch.samples)  # context to leave out
    settings = _settings(loss, batch_size=9, grad_accum=1, tokens=tokens)
    metrics, grads = updated(copy.deepcopy(base), ref, batch, settings)
    assert metrics["num_tokens"] == sampled
    # By hand over the sampled tokens, and (what training on the context too would give, so
    # that the comparison can fail) over every completion token.
    (want_loss, want_grad), (all_loss, all_grad) = _by_hand(
        copy.deepcopy(base),
        ref,
        batch,
        settings.loss,
        [lambda s: s.sampled_mask, lambda s: [1] * len(s.completion_ids)],
    )
    assert metrics["loss_total"] == pytest.approx(want_loss, rel=1e-5, abs=1e-7)
    assert len(grads) == 1
    assert float((grads[0] - want_grad).norm() / want_grad.norm()) < 1e-5
    torch.testing.assert_close(grads[0], want_grad, rtol=1e-3, atol=1e-6)
    assert abs(all_loss - want_loss) > 1e-3 * max(abs(want_loss), 1e-2)
    assert float((all_grad - want_grad).norm() / want_grad.norm()) > 1e-3


def _probe_batch() -> RolloutBatch:
    """Two groups; the probed sample (group 0, sample 0) has context in the middle (tokens 2-3)
    and at its end (token 5): sampled 1 1 0 0 1 0."""
    batch = _batch(groups=2, replicas=3, seed=5, masked=False)
    probe = batch.groups[0].samples[0]
    gen = torch.Generator().manual_seed(6)
    probe.completion_ids = torch.randint(3, 500, (6,), generator=gen).tolist()
    probe.sampled_mask = [1, 1, 0, 0, 1, 0]
    probe.behaviour_logprobs = [-6.3, -6.1, 0.0, 0.0, -6.6, 0.0]
    probe.advantage = 1.3
    return batch


@pytest.mark.parametrize("tokens", [0, PACKED_TOKENS], ids=["padded", "packed"])
def test_the_mask_covers_the_sampled_positions_not_their_neighbours(
    tiny_model_dir: Path, tokens: int
) -> None:
    """Context is attended to: a new id for the context token in the middle changes the loss of
    the sampled tokens after it. It is not trained on: a new id for the trailing context token
    (nothing after it to attend), or a new behaviour log-prob for any context token, leaves the
    loss and the gradient bitwise as they were, while a new behaviour log-prob for the sampled
    token just before either context span does change them. A mask one position off, either
    way, would fail one of these."""
    base, _ = _models(tiny_model_dir)
    loss = {"loss_type": "grpo", "entropy_coef": 0.01, "is_correction": "token_truncate"}
    settings = _settings(loss, batch_size=6, grad_accum=1, tokens=tokens)

    def run(change: Any = None) -> tuple[float, Tensor]:
        batch = _probe_batch()
        if change is not None:
            change(batch.groups[0].samples[0])
        metrics, grads = updated(copy.deepcopy(base), None, batch, settings)
        assert metrics["num_tokens"] == sum(s.num_sampled for s in batch.samples)
        return float(metrics["loss_total"]), grads[0]  # type: ignore[arg-type]

    def set_id(t: int) -> Any:
        return lambda s: s.completion_ids.__setitem__(t, 7 if s.completion_ids[t] != 7 else 8)

    def set_behaviour(t: int) -> Any:
        return lambda s: s.behaviour_logprobs.__setitem__(t, s.behaviour_logprobs[t] - 1.5)

    want_loss, want_grad = run()
    for unchanged in (set_id(5), set_behaviour(2), set_behaviour(3), set_behaviour(5)):
        got_loss, got_grad = run(unchanged)
        assert got_loss == want_loss and torch.equal(got_grad, want_grad)
    for changed in (set_id(2), set_behaviour(1), set_behaviour(4)):
        got_loss, got_grad = run(changed)
        assert abs(got_loss - want_loss) > 1e-4 * abs(want_loss)
        assert float((got_grad - want_grad).norm() / want_grad.norm()) > 1e-4
