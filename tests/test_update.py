"""One policy update (`grail.train.update`): packing and the forward passes it makes."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from grail.algo.grpo import GRPOLossConfig, token_logprobs
from grail.envs.base import Problem
from grail.models.loading import load_model
from grail.rollouts.batch import Group, RolloutBatch, Sample
from grail.train import microbatch, update
from grail.train.microbatch import completion_logits, microbatches, pack_microbatch
from grail.train.update import UpdateSettings, policy_update


def _sample(ids: list[int], logprobs: list[float], advantage: float) -> Sample:
    return Sample(ids, logprobs, "length", "", 0.0, {}, False, advantage)


def _batch(groups: int, replicas: int, seed: int) -> RolloutBatch:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for g in range(groups):
        prompt = torch.randint(3, 500, (4 + g,), generator=gen).tolist()
        samples = []
        for _ in range(replicas):
            n = int(torch.randint(1, 5, (), generator=gen))
            ids = torch.randint(3, 500, (n,), generator=gen).tolist()
            logprobs = (-torch.rand(n, generator=gen) * 3).tolist()
            samples.append(_sample(ids, logprobs, float(torch.randn((), generator=gen))))
        out.append(Group(Problem(g, [], ""), prompt, samples))
    return RolloutBatch(out)


def test_pack_stores_each_prompt_once_and_right_pads_completions() -> None:
    items = [
        ([5, 6, 7], _sample([8, 9], [-0.5, -math.inf], 1.5)),
        ([5], _sample([10, 11, 12], [-0.1, -0.2, -0.3], -1.0)),
        ([5, 6, 7], _sample([13], [-0.7], 0.5)),
    ]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    assert mb.prompt_ids.tolist() == [[5, 6, 7], [0, 0, 5]]
    assert mb.prompt_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert mb.prompt_index.tolist() == [0, 1, 0]
    assert mb.completion_ids.tolist() == [[8, 9, 0], [10, 11, 12], [13, 0, 0]]
    assert mb.completion_mask.tolist() == [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    # -inf (a token the server's filter excluded) is clamped so the TIS weight stays finite.
    want = [[-0.5, -1e4, 0.0], [-0.1, -0.2, -0.3], [-0.7, 0.0, 0.0]]
    assert torch.equal(mb.behaviour_logprobs, torch.tensor(want, dtype=torch.float32))
    assert mb.advantages.tolist() == [1.5, -1.0, 0.5] and mb.num_tokens == 6


def _logprobs_and_grads(model: torch.nn.Module, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
    items = microbatches(batch, batch_size=64)[0]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    logprobs = token_logprobs(completion_logits(model, mb), mb.completion_ids)
    model.zero_grad()
    (logprobs * mb.completion_mask).sum().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logprobs * mb.completion_mask, grads


def test_shared_prompt_pass_equals_running_every_sequence_in_full(tiny_model_dir: Path) -> None:
    """Running each prompt once and its completions on its cache gives the log-probs and the
    gradients of running every prompt + completion in full (gradient checkpointing forces the
    full path), with prompts and completions of different lengths."""
    model = load_model(tiny_model_dir).train()
    batch = _batch(groups=5, replicas=4, seed=3)
    calls: list[int] = []
    model.register_forward_hook(lambda *_: calls.append(1))
    shared = _logprobs_and_grads(model, batch)
    assert len(calls) == 2  # the distinct prompts, then the completions on their cache
    model.gradient_checkpointing_enable()
    full = _logprobs_and_grads(model, batch)
    assert len(calls) == 3  # every row in full, in one pass
    torch.testing.assert_close(shared[0], full[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(shared[1], full[1], rtol=1e-4, atol=1e-6)
    # And the full path itself agrees with one unpadded sequence run alone.
    group = batch.groups[1]
    sample = group.samples[2]
    ids = torch.tensor([group.prompt_ids + sample.completion_ids])
    n = len(sample.completion_ids)
    with torch.no_grad():
        alone = token_logprobs(model(input_ids=ids).logits[:, -n - 1 : -1], ids[:, -n:])
    torch.testing.assert_close(full[0][1 * 4 + 2, :n], alone[0], rtol=0, atol=1e-5)


def test_a_sliding_window_model_runs_every_row_in_full(tiny_model_dir: Path) -> None:
    """A sliding-window cache drops the keys its window has passed, so it cannot stand in for the
    prompt: the rows run in full (the last forward sees whole sequences) and stay exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_model_dir)
    config.update({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0})
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    widths: list[int] = []
    model.register_forward_pre_hook(
        lambda _, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    batch = _batch(groups=3, replicas=2, seed=5)
    items = microbatches(batch, batch_size=64)[0]
    mb = pack_microbatch(items, pad_token_id=0, device="cpu")
    with torch.no_grad():
        logprobs = token_logprobs(completion_logits(model, mb), mb.completion_ids)
    assert widths[-1] == mb.prompt_ids.shape[1] + mb.completion_ids.shape[1]
    for row, (prompt, sample) in enumerate(items):
        ids = torch.tensor([prompt + sample.completion_ids])
        n = len(sample.completion_ids)
        with torch.no_grad():
            alone = token_logprobs(model(input_ids=ids).logits[:, -n - 1 : -1], ids[:, -n:])
        torch.testing.assert_close(logprobs[row, :n], alone[0], rtol=0, atol=1e-5)


def test_pack_refuses_log_probabilities_that_do_not_match_the_tokens() -> None:
    with pytest.raises(ValueError, match="2 completion tokens but 1 behaviour"):
        pack_microbatch([([5], _sample([8, 9], [-0.5], 1.0))], pad_token_id=0, device="cpu")


def _run_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: RolloutBatch,
    settings: UpdateSettings,
) -> dict[str, float | bool | None]:
    return policy_update(
        model,
        None,
        optimizer,
        scheduler,
        batch,
        settings,
        pad_token_id=0,
        device=torch.device("cpu"),
        backward=lambda loss: loss.backward(),
        clip_grad_norm=lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c),
    )


def _dapo_settings(grad_accum_steps: int) -> UpdateSettings:
    """dapo over micro-batches of 4 samples, `grad_accum_steps` of them per optimizer step."""
    return UpdateSettings(
        loss=GRPOLossConfig(loss_type="dapo", max_completion_length=4),
        temperature=1.0,
        batch_size=4,
        grad_accum_steps=grad_accum_steps,
        grad_clip=1.0,
    )


@pytest.mark.parametrize(("grad_accum", "steps"), [(4, 1), (2, 2), (1, 4)])
def test_old_logprobs_cost_one_forward_per_micro_batch_after_the_first_step(
    tiny_model_dir: Path, grad_accum: int, steps: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four micro-batches: each is trained with one forward; the old log-probs need one more
    forward for every micro-batch that trains after the first optimizer step (none with a single
    step: TRL's rule), and those stay exactly on-policy for the first step's micro-batches."""
    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    forwards: list[bool] = []  # grad enabled?, one per completion_logits call

    def counted(m: torch.nn.Module, mb: microbatch.MicroBatch) -> Tensor:
        forwards.append(torch.is_grad_enabled())
        return completion_logits(m, mb)

    monkeypatch.setattr(microbatch, "completion_logits", counted)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    settings = _dapo_settings(grad_accum_steps=grad_accum)
    batch = _batch(4, 4, seed=1)
    metrics = _run_update(model, optimizer, scheduler, batch, settings)
    old_passes = 4 - grad_accum if steps > 1 else 0
    assert forwards.count(False) == old_passes  # no-grad passes: old log-probs only
    assert forwards.count(True) == 4
    assert metrics["optimizer_steps"] == steps
    # the iteration's completion tokens, not a per-micro-batch average
    assert metrics["num_tokens"] == sum(len(s.completion_ids) for s in batch.samples)
    if steps == 1:
        assert metrics["clip_frac"] == 0.0  # ratio exactly 1 everywhere


def _zero_advantage(batch: RolloutBatch) -> RolloutBatch:
    for s in batch.samples:
        s.advantage = 0.0
    return batch


@pytest.mark.parametrize(
    ("loss", "expected"),
    [
        ({}, True),
        ({"kl_coef": 0.05}, False),  # the KL term has a gradient of its own
        ({"entropy_coef": 0.01}, False),  # so has the entropy bonus
    ],
)
def test_only_zero_advantages_without_kl_or_entropy_carry_no_gradient(
    loss: dict[str, float], expected: bool
) -> None:
    config = GRPOLossConfig(**loss)  # type: ignore[arg-type]
    assert update.carries_no_gradient(_zero_advantage(_batch(2, 3, seed=0)), config) is expected
    one_signal = _zero_advantage(_batch(2, 3, seed=0))
    one_signal.groups[1].samples[2].advantage = -1e-30
    assert not update.carries_no_gradient(one_signal, config)


@pytest.mark.parametrize("grad_accum", [4, 1])  # one optimizer step, four
def test_a_batch_without_gradient_skips_the_passes_but_takes_the_same_steps(
    tiny_model_dir: Path, grad_accum: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All advantages 0, no KL or entropy term: no forward pass, yet the weights, the optimizer
    state and the schedule end exactly where the full passes leave them. AdamW still moves the
    weights on a zero gradient (momentum of the step before, weight decay), so the steps are
    taken, not skipped."""
    settings = UpdateSettings(
        loss=GRPOLossConfig(loss_type="grpo"),
        temperature=1.0,
        batch_size=4,
        grad_accum_steps=grad_accum,
        grad_clip=1.0,
    )

    def train(skip: bool) -> dict[str, Any]:
        torch.manual_seed(0)
        model = load_model(tiny_model_dir)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        _run_update(model, optimizer, scheduler, _batch(4, 4, seed=1), settings)  # momentum
        before = [p.detach().clone() for p in model.parameters()]
        forwards: list[int] = []
        hook = model.register_forward_hook(lambda *_: forwards.append(1))
        with monkeypatch.context() as patch:
            if not skip:
                patch.setattr(update, "carries_no_gradient", lambda *_: False)
            metrics = _run_update(
                model, optimizer, scheduler, _zero_advantage(_batch(4, 4, seed=2)), settings
            )
        hook.remove()
        return {
            "model": model,
            "optimizer": optimizer,
            "scheduler": scheduler,
            "before": before,
            "forwards": len(forwards),
            "metrics": metrics,
        }

    skipped, full = train(skip=True), train(skip=False)
    metrics, full_metrics = skipped["metrics"], full["metrics"]
    assert skipped["forwards"] == 0 and full["forwards"] >= 4
    steps = 4 // grad_accum
    assert metrics["update_skipped"] is True and full_metrics["update_skipped"] is False
    assert metrics["optimizer_steps"] == full_metrics["optimizer_steps"] == steps
    assert metrics["grad_norm"] == full_metrics["grad_norm"] == 0.0
    assert metrics["loss_total"] == full_metrics["loss_total"] == 0.0
    assert metrics["clip_frac_low"] == full_metrics["clip_frac_low"] == 0.0
    assert metrics["clip_frac_high"] == full_metrics["clip_frac_high"] == 0.0
    assert metrics["num_tokens"] == full_metrics["num_tokens"]
    assert metrics["entropy"] is None and metrics["logprob_mismatch"] is None  # not measured
    assert set(metrics) == set(full_metrics)  # the same fields, whichever way it went
    # The schedule advanced by the same steps; the weights and AdamW's moments agree exactly,
    # and the weights did move (a skipped optimizer step would have left them in place).
    assert (
        skipped["scheduler"].last_epoch == full["scheduler"].last_epoch == 2 * steps
    )  # this update and the one before
    named = zip(skipped["model"].named_parameters(), full["model"].parameters(), strict=True)
    for i, ((name, p), q) in enumerate(named):
        assert torch.equal(p, q), name
        assert not torch.equal(p, skipped["before"][i]), f"{name} did not move"
        s, f = skipped["optimizer"].state[p], full["optimizer"].state[q]
        assert set(s) == set(f) and all(torch.equal(s[k], f[k]) for k in s), name


def test_an_empty_batch_is_refused_by_name(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    settings = UpdateSettings(GRPOLossConfig(), 1.0, batch_size=4, grad_accum_steps=1, grad_clip=1)
    with pytest.raises(ValueError, match="rollout batch with no samples"):
        _run_update(model, optimizer, scheduler, RolloutBatch([]), settings)


def test_each_micro_batch_is_normalised_for_its_step_and_the_whole_batch(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TRL's accumulation: every micro-batch's loss learns how many micro-batches its optimizer
    step has (a remainder step has fewer), how many the batch has, and the batch's completion
    tokens (dapo's normaliser); its loss is back-propagated as it is."""
    torch.manual_seed(0)
    model = load_model(tiny_model_dir)
    seen: list[tuple[int, int, float]] = []
    real = update.grpo_loss

    def recorded(*args: Any, **kwargs: Any) -> Any:
        seen.append(
            (kwargs["accumulation_steps"], kwargs["steps_per_generation"],
             kwargs["num_items_in_batch"])
        )  # fmt: skip
        return real(*args, **kwargs)

    monkeypatch.setattr(update, "grpo_loss", recorded)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    settings = _dapo_settings(grad_accum_steps=2)
    batch = _batch(5, 4, seed=2)  # 20 samples: micro-batches of 4 in steps of 2, 2 and 1
    metrics = _run_update(model, optimizer, scheduler, batch, settings)
    tokens = sum(len(s.completion_ids) for s in batch.samples)
    assert seen == [(2, 5, tokens)] * 4 + [(1, 5, tokens)]
    assert metrics["optimizer_steps"] == 3.0
