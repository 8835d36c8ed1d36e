"""Tests of the GRPO objective against an independent float64 reference written with loops.

The reference (``_reference``) re-derives every loss variant and metric from the formulas, one
sequence and one token at a time in plain Python floats; it never calls the implementation.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from grail.algo.advantages import compute_advantages
from grail.algo.grpo import GRPOLossConfig, grpo_loss, token_entropy, token_logprobs

# --------------------------------------------------------------------------------------------
# A hand-made batch: 5 completions padded to 5 tokens, lengths 5, 3, 4, 1 and 0 (an empty one).
# Deltas logp - old are chosen on both sides of every clip boundary used below and well away
# from each boundary, so finite differences never straddle a kink.
# --------------------------------------------------------------------------------------------

PAD = 123.0  # arbitrary garbage in padded positions: the loss must not see it
LENGTHS = [5, 3, 4, 1, 0]
MASK = [[1 if t < n else 0 for t in range(5)] for n in LENGTHS]
LOGP = [
    [-0.7, -1.9, -0.3, -2.4, -0.05],
    [-1.1, -0.4, -2.8, PAD, PAD],
    [-0.9, -1.6, -0.2, -3.1, PAD],
    [-0.6, PAD, PAD, PAD, PAD],
    [PAD, PAD, PAD, PAD, PAD],
]
DELTA = [  # logp - old
    [0.6, -0.5, 0.8, 0.35, 0.2],
    [1.2, -0.3, 0.3, 0.0, 0.0],
    [-1.3, 0.15, -0.3, 0.05, 0.0],
    [-0.5, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0],
]
OLD = [[LOGP[b][t] - DELTA[b][t] if MASK[b][t] else -PAD for t in range(5)] for b in range(5)]
REF = [  # logp - ref in [-0.4, 0.5]
    [LOGP[b][t] - d if MASK[b][t] else PAD for t, d in enumerate(row)]
    for b, row in enumerate(
        [
            [0.2, -0.4, 0.1, 0.3, -0.2],
            [0.5, 0.05, -0.3, 0, 0],
            [-0.1, 0.25, 0.4, -0.35, 0],
            [0.15, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
        ]
    )
]
BEH = [  # old - behaviour: tokens and sequence sums on both sides of the clip bounds below
    [OLD[b][t] - d if MASK[b][t] else PAD for t, d in enumerate(row)]
    for b, row in enumerate(
        [
            [0.7, -0.2, 0.1, 0.0, -0.6],
            [0.5, 0.3, -0.1, 0, 0],
            [0.05, -0.3, 0.9, 0.2, 0],
            [-0.25, 0, 0, 0, 0],
            [0, 0, 0, 0, 0],
        ]
    )
]
ENT = [[1.3, 0.4, 2.2, 0.9, 0.1], [0.7, 1.8, 0.2, PAD, PAD], [1.1, 0.6, 2.9, 0.3, PAD]]
ENT += [[1.5, PAD, PAD, PAD, PAD], [PAD] * 5]
ADV = [1.5, -0.8, 0.7, -1.2, 0.3]
N_ITEMS = 40  # completion tokens in the (larger) generation batch this micro-batch belongs to
MAX_LEN = 6
# (accumulation_steps G, steps_per_generation S): alone, or one of 2 micro-batches of a step in a
# generation batch of 3 (N_ITEMS tokens in all).
ACCUMULATION = [(1, 1), (2, 3)]
# Token ratios exp(old - behaviour) fall below 0.8 (-0.6, -0.3, -0.25) and above 1.5 (0.7, 0.5,
# 0.9); sequence ratios exp(sum) are 1.0, 2.01, 2.34, 0.78, 1.0 around [0.8, 2.2].
TOKEN_IS = {"is_clip_min": 0.8, "is_clip_max": 1.5}
SEQUENCE_IS = {"is_clip_min": 0.8, "is_clip_max": 2.2}

# Every clip, cap, clamp and bonus at once (the importance-sampling mode is added per scenario).
EVERY_TERM = {
    "epsilon": 0.15,
    "epsilon_high": 0.3,
    "kl_coef": 0.1,
    "entropy_coef": 0.02,
    "is_ratio_max": 1.45,
    "logratio_clamp": 1.0,
}
SCENARIOS: dict[str, dict] = {
    "plain": {},
    "asym_kl_k1": {"epsilon_high": 0.28, "kl_coef": 0.05, "kl_estimator": "k1"},
    "asym_kl_k2": {"epsilon_high": 0.28, "kl_coef": 0.05, "kl_estimator": "k2"},
    "asym_kl_k3_entropy": {
        "epsilon_high": 0.28,
        "kl_coef": 0.05,
        "kl_estimator": "k3",
        "entropy_coef": 0.01,
    },
    "ratio_cap": {"is_ratio_max": 1.45},
    "logratio_clamp": {"logratio_clamp": 1.0, "is_ratio_max": 2.5},
    "kl_uncorrected": {"kl_coef": 0.05, "kl_bias_correction": False},
    "token_truncate": {"is_correction": "token_truncate", **TOKEN_IS},
    "token_truncate_above": {"is_correction": "token_truncate", "is_clip_max": 1.5},
    "token_mask": {"is_correction": "token_mask", **TOKEN_IS},
    "sequence_truncate": {"is_correction": "sequence_truncate", **SEQUENCE_IS},
    "sequence_mask": {"is_correction": "sequence_mask", **SEQUENCE_IS},
    "everything": {**EVERY_TERM, "is_correction": "token_truncate", **TOKEN_IS},
    "everything_sequence_mask": {**EVERY_TERM, "is_correction": "sequence_mask", **SEQUENCE_IS},
}


def _importance_weight(log_r: float, mode: str, lo: float | None, hi: float | None) -> tuple:
    """(weight, clipped or masked) of one importance ratio exp(log_r) under `mode`."""
    r = math.exp(log_r)
    outside = (lo is not None and r < lo) or (hi is not None and r > hi)
    if mode.endswith("truncate"):
        return min(max(r, lo or 0.0), hi or math.inf), float(outside)
    return (0.0 if outside else r), float(outside)


def _reference(
    logp: list[list[float]],
    settings: dict,
    loss_type: str,
    level: str,
    accumulation: tuple[int, int] = (1, 1),
) -> dict[str, float]:
    """Loss parts and metrics from the formulas, one sequence and token at a time, in floats."""
    g_steps, s_steps = accumulation
    eps_lo = settings.get("epsilon", 0.2)
    eps_hi = settings.get("epsilon_high") or eps_lo
    beta = settings.get("kl_coef", 0.0)
    estimator = settings.get("kl_estimator", "k3")
    alpha = settings.get("entropy_coef", 0.0)
    cap = settings.get("is_ratio_max")
    clamp_c = settings.get("logratio_clamp")
    is_mode = settings.get("is_correction", "none")
    is_lo, is_hi = settings.get("is_clip_min"), settings.get("is_clip_max", 3.0)
    kl_corrected = settings.get("kl_bias_correction", True)

    kinks = [math.log(1 - eps_lo), math.log(1 + eps_hi)]
    kinks += [math.log(cap)] if cap else []
    kinks += [clamp_c, -clamp_c] if clamp_c else []

    n_seq = len(logp)
    pg_rows: list[list[float]] = []
    kl_rows: list[list[float]] = []
    ent_rows: list[list[float]] = []
    units: list[dict[str, float]] = []  # one per token (token level) or per sequence
    is_units: list[tuple[float, float]] = []  # (weight, outside) per token or per sequence
    gaps: list[float] = []
    kls: list[float] = []
    ents: list[float] = []
    for b in range(n_seq):
        toks = [t for t in range(5) if MASK[b][t]]
        seq_s = sum(logp[b][t] - OLD[b][t] for t in toks) / max(len(toks), 1)
        pg_row, kl_row, ent_row = [], [], []
        a = ADV[b]
        seq_w = 1.0
        if is_mode.startswith("sequence"):
            seq_w, seq_out = _importance_weight(
                sum(OLD[b][t] - BEH[b][t] for t in toks), is_mode, is_lo, is_hi
            )
            is_units.append((seq_w, seq_out))

        def ratio_terms(s: float, a: float = a) -> tuple[float, dict[str, float]]:
            for k in kinks:
                assert abs(s - k) > 1e-3, "test data too close to a clip boundary"
            clamped = 0.0
            if clamp_c is not None and abs(s) > clamp_c:
                s, clamped = math.copysign(clamp_c, s), 1.0
            r = math.exp(s)
            r2 = min(max(r, 1 - eps_lo), 1 + eps_hi)
            r1 = min(r, cap) if cap is not None else r
            pg = -min(r1 * a, r2 * a)
            low = float(r < 1 - eps_lo and a < 0)
            high = float(r > 1 + eps_hi and a > 0)
            unit = {
                "ratio": r,
                "low": low,
                "high": high,
                "clip": max(low, high),
                "cap": float(cap is not None and r > cap),
                "clamp": clamped,
            }
            return pg, unit

        if level == "sequence":
            seq_pg, seq_unit = ratio_terms(seq_s)
            units.append(seq_unit)
        for t in toks:
            if level == "token":
                pg, unit = ratio_terms(logp[b][t] - OLD[b][t])
                units.append(unit)
            else:
                pg, unit = seq_pg, seq_unit
            log_w = OLD[b][t] - BEH[b][t]
            if is_mode.startswith("token"):
                w, out = _importance_weight(log_w, is_mode, is_lo, is_hi)
                is_units.append((w, out))
            else:
                w = seq_w
            gaps.append(abs(log_w))
            d = REF[b][t] - logp[b][t]
            kl = {"k1": -d, "k2": 0.5 * d * d, "k3": math.exp(d) - d - 1}[estimator]
            kls.append(kl)
            ents.append(ENT[b][t])
            pg_row.append(w * pg)
            # TRL's bias-corrected KL: times the policy ratio (after the log-ratio clamp).
            kl_row.append(beta * kl * (unit["ratio"] if kl_corrected else 1.0))
            ent_row.append(-alpha * ENT[b][t])
        pg_rows.append(pg_row)
        kl_rows.append(kl_row)
        ent_rows.append(ent_row)

    n_tok = sum(LENGTHS)

    def aggregate(rows: list[list[float]]) -> float:
        """The loss type's normaliser (TRL's), for a step of micro-batches like this one."""
        if loss_type == "grpo":
            return sum(sum(r) / max(len(r), 1) for r in rows) / n_seq
        total = sum(sum(r) for r in rows)
        if loss_type == "bnpo":
            return total / max(n_tok, 1)
        if loss_type == "dr_grpo":
            return total / (n_seq * MAX_LEN)
        return total / (N_ITEMS * g_steps / s_steps) * g_steps

    # Metrics report each term times G; the returned loss is divided by G (see _run).
    out = {
        "loss_pg": aggregate(pg_rows),
        "loss_kl": aggregate(kl_rows),
        # The entropy bonus is a token mean whatever the loss type (TRL).
        "loss_entropy": sum(sum(r) for r in ent_rows) / max(n_tok, 1),
    }
    out["loss_total"] = out["loss_pg"] + out["loss_kl"] + out["loss_entropy"]
    out["ratio_mean"] = statistics.fmean(u["ratio"] for u in units)
    out["ratio_max"] = max(u["ratio"] for u in units)
    out["clip_frac_low"] = statistics.fmean(u["low"] for u in units)
    out["clip_frac_high"] = statistics.fmean(u["high"] for u in units)
    out["clip_frac"] = statistics.fmean(u["clip"] for u in units)
    out["ratio_cap_frac"] = statistics.fmean(u["cap"] for u in units)
    out["logratio_clamp_frac"] = statistics.fmean(u["clamp"] for u in units)
    weights = [w for w, _ in is_units] or [1.0]
    out["is_clip_frac"] = statistics.fmean(o for _, o in is_units) if is_units else 0.0
    out["is_weight_mean"] = statistics.fmean(weights)
    out["is_ess"] = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    out["num_tokens"] = float(n_tok)
    out["kl"] = statistics.fmean(kls)
    out["entropy"] = statistics.fmean(ents)
    out["logprob_mismatch"] = statistics.fmean(gaps)
    out["logprob_mismatch_max"] = max(gaps)
    return out


def _t(rows: list[list[float]], requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64, requires_grad=requires_grad)


def _run(
    settings: dict,
    loss_type: str,
    level: str,
    logp: torch.Tensor | None = None,
    accumulation: tuple[int, int] = (1, 1),
) -> tuple[torch.Tensor, dict[str, float], torch.Tensor]:
    config = GRPOLossConfig(
        loss_type=loss_type,
        importance_sampling_level=level,
        max_completion_length=MAX_LEN if loss_type == "dr_grpo" else None,
        **settings,
    )
    logp = _t(LOGP, requires_grad=True) if logp is None else logp
    loss, metrics = grpo_loss(
        logp,
        _t(OLD),
        torch.tensor(ADV, dtype=torch.float64),
        torch.tensor(MASK),
        config,
        ref_logprobs=_t(REF),
        behaviour_logprobs=_t(BEH),
        entropy=_t(ENT),
        num_items_in_batch=N_ITEMS if loss_type == "dapo" else None,
        accumulation_steps=accumulation[0],
        steps_per_generation=accumulation[1],
    )
    return loss, metrics, logp


@pytest.mark.parametrize("accumulation", ACCUMULATION)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_metrics_and_gradient_match_float64_reference(
    loss_type: str, level: str, scenario: str, accumulation: tuple[int, int]
) -> None:
    settings = SCENARIOS[scenario]
    steps = accumulation[0]
    loss, metrics, logp = _run(settings, loss_type, level, accumulation=accumulation)
    expected = _reference(LOGP, settings, loss_type, level, accumulation)

    assert loss.dtype == torch.float64
    # The returned loss is what is back-propagated: one micro-batch's share of the step's loss.
    assert loss.item() * steps == pytest.approx(expected["loss_total"], rel=1e-12, abs=1e-14)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, rel=1e-10, abs=1e-12), key
    assert all(isinstance(v, float) for v in metrics.values())

    # d loss / d logp by central differences on the reference, token by token.
    loss.backward()
    h = 1e-6
    for b in range(5):
        for t in range(5):
            if not MASK[b][t]:
                assert logp.grad[b, t].item() == 0.0
                continue
            up = [row[:] for row in LOGP]
            down = [row[:] for row in LOGP]
            up[b][t] += h
            down[b][t] -= h
            fd = (
                _reference(up, settings, loss_type, level, accumulation)["loss_total"]
                - _reference(down, settings, loss_type, level, accumulation)["loss_total"]
            ) / (2 * h * steps)
            assert logp.grad[b, t].item() == pytest.approx(fd, rel=1e-6, abs=1e-9), (b, t)


def test_scenarios_exercise_every_clip_and_cap() -> None:
    """Guards the reference test: each mechanism actually fires on the hand-made batch."""
    _, m, _ = _run(SCENARIOS["everything"], "bnpo", "token")
    for key in ("clip_frac_low", "clip_frac_high", "ratio_cap_frac", "logratio_clamp_frac"):
        assert 0 < m[key] < 1, key
    assert 0 < m["is_clip_frac"] < 1 and m["is_ess"] < 1
    _, m, _ = _run(SCENARIOS["everything"], "grpo", "sequence")
    for key in ("clip_frac_low", "clip_frac_high", "ratio_cap_frac"):
        assert 0 < m[key] < 1, key


def test_on_policy_gradient_is_reinforce() -> None:
    """With old == logp (one update per batch) the ratio is 1 and grpo's gradient is -A/(B·n_b)."""
    logp = _t(LOGP, requires_grad=True)
    loss, metrics = grpo_loss(
        logp,
        logp.detach(),
        torch.tensor(ADV, dtype=torch.float64),
        torch.tensor(MASK),
        GRPOLossConfig(),
    )
    loss.backward()
    for b in range(5):
        for t in range(5):
            want = -ADV[b] / (5 * LENGTHS[b]) if MASK[b][t] else 0.0
            assert logp.grad[b, t].item() == pytest.approx(want, rel=1e-12)
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_frac"] == 0.0
    assert metrics["is_ess"] == 1.0 and metrics["is_clip_frac"] == 0.0
    assert "kl" not in metrics and "entropy" not in metrics and "logprob_mismatch" not in metrics


def test_gradient_flows_only_through_logprobs_and_entropy() -> None:
    config = GRPOLossConfig(
        kl_coef=0.1,
        entropy_coef=0.01,
        is_correction="token_truncate",
        is_clip_max=1.5,
        epsilon_high=0.28,
    )
    logp = _t(LOGP, requires_grad=True)
    old, ref, beh, ent = (_t(x, requires_grad=True) for x in (OLD, REF, BEH, ENT))
    adv = torch.tensor(ADV, dtype=torch.float64, requires_grad=True)
    loss, _ = grpo_loss(
        logp, old, adv, torch.tensor(MASK), config, ref_logprobs=ref, behaviour_logprobs=beh,
        entropy=ent,
    )  # fmt: skip
    loss.backward()
    assert old.grad is None and ref.grad is None and beh.grad is None and adv.grad is None
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    # The entropy bonus acts through entropy's gradient: -α / (tokens in the micro-batch) per
    # completion token, whatever the loss type (TRL's token mean).
    for b in range(5):
        for t in range(5):
            want = -0.01 / sum(LENGTHS) if MASK[b][t] else 0.0
            assert ent.grad[b, t].item() == pytest.approx(want, rel=1e-12)


def test_padding_contents_never_reach_loss_or_gradient() -> None:
    config = GRPOLossConfig(
        kl_coef=0.1,
        entropy_coef=0.01,
        is_correction="token_truncate",
        is_clip_max=1.5,
        loss_type="bnpo",
    )
    pad = ~torch.tensor(MASK, dtype=torch.bool)

    def run(fill: float) -> tuple[float, torch.Tensor]:
        tensors = [_t(x) for x in (LOGP, OLD, REF, BEH, ENT)]
        for x in tensors:
            x[pad] = fill
        logp = tensors[0].requires_grad_()
        loss, _ = grpo_loss(
            logp, tensors[1], torch.tensor(ADV, dtype=torch.float64), torch.tensor(MASK), config,
            ref_logprobs=tensors[2], behaviour_logprobs=tensors[3], entropy=tensors[4],
        )  # fmt: skip
        loss.backward()
        return loss.item(), logp.grad

    clean_loss, clean_grad = run(0.0)
    for fill in (float("nan"), float("inf"), -1e30):
        loss, grad = run(fill)
        assert loss == clean_loss
        assert torch.equal(grad, clean_grad)


def test_zero_variance_groups_get_zero_advantage_and_zero_policy_gradient() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.2], [0.7, 0.7, 0.7], [0.0, 1.0, 1.0], [0.1, 0.1, 0.1]])
    adv, stats = compute_advantages(rewards)
    assert stats["zero_variance_groups"] == 2.0
    assert stats["zero_variance_group_frac"] == 0.5
    assert torch.equal(adv[1], torch.zeros(3)) and torch.equal(adv[3], torch.zeros(3))
    assert (adv[0] != 0).all() and (adv[2] != 0).all()

    # 12 completions of 4 tokens; the ratio is far from 1 so every clip and cap is in play.
    torch.manual_seed(0)
    logp = (-torch.rand(12, 4) * 3).requires_grad_()
    old = logp.detach() + torch.randn(12, 4)
    mask = torch.ones(12, 4)
    mask[:, 3] = 0
    config = GRPOLossConfig(epsilon_high=0.28, is_ratio_max=3.0, logratio_clamp=2.0)
    loss, _ = grpo_loss(logp, old, adv.flatten(), mask, config)
    loss.backward()
    zero_rows = [3, 4, 5, 9, 10, 11]
    assert torch.equal(logp.grad[zero_rows], torch.zeros(6, 4))
    assert (logp.grad[[0, 1, 2, 6, 7, 8], :3] != 0).any(dim=1).all()


def test_dapo_micro_batch_losses_sum_to_the_generation_batch_loss() -> None:
    """dapo divides by tokens of the whole generation batch, so micro-batch losses add up."""
    config = GRPOLossConfig(loss_type="dapo", epsilon_high=0.28)
    logp, old, adv, mask = _t(LOGP), _t(OLD), torch.tensor(ADV, dtype=torch.float64), MASK
    mask = torch.tensor(mask)
    n = int(mask.sum())
    full, _ = grpo_loss(logp, old, adv, mask, config, num_items_in_batch=n)
    halves = (slice(0, 2), slice(2, 5))  # 8 and 5 completion tokens

    def part(s: slice, steps: int) -> float:
        loss, _ = grpo_loss(
            logp[s], old[s], adv[s], mask[s], config, num_items_in_batch=n,
            accumulation_steps=steps, steps_per_generation=2,
        )  # fmt: skip
        return loss.item()

    # One optimizer step over both micro-batches: the parts add up to the whole batch's loss.
    assert part(halves[0], 2) + part(halves[1], 2) == pytest.approx(full.item(), rel=1e-12)
    # A step per micro-batch: each is normalised by the batch's tokens spread evenly over the
    # steps (TRL: num_items_in_batch * G / steps_per_generation = 13 / 2), not by its own count.
    for s in halves:
        own = grpo_loss(logp[s], old[s], adv[s], mask[s], config, num_items_in_batch=n)[0]
        assert part(s, 1) == pytest.approx(own.item() * n / (n / 2), rel=1e-12)


def test_bf16_logprobs_are_computed_in_float32() -> None:
    logp = torch.tensor(LOGP[:3], dtype=torch.bfloat16, requires_grad=True)
    old = torch.tensor(OLD[:3], dtype=torch.bfloat16)
    loss, _ = grpo_loss(logp, old, torch.tensor(ADV[:3]), torch.tensor(MASK[:3]), GRPOLossConfig())
    assert loss.dtype == torch.float32
    loss.backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# compute_advantages
# --------------------------------------------------------------------------------------------

REWARDS = [[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4], [3.0, 3.0, 3.0, 3.0], [0.0, 0.0, 5.0, 1.0]]


def _expected_advantages(mode: str, eps: float) -> list[list[float]]:
    flat = [r for g in REWARDS for r in g]
    out = []
    for g in REWARDS:
        mu = statistics.fmean(g)
        if len(set(g)) == 1:
            out.append([0.0] * len(g))
            continue
        scale = {"group": statistics.stdev(g) + eps, "batch": statistics.stdev(flat) + eps}
        out.append([(r - mu) / scale.get(mode, 1.0) for r in g])
    return out


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("eps", [1e-4, 0.0])
def test_advantages_match_statistics_module(mode: str, eps: float) -> None:
    adv, stats = compute_advantages(torch.tensor(REWARDS), scale_rewards=mode, eps=eps)
    assert adv.dtype == torch.float32 and adv.shape == (4, 4)
    expected = torch.tensor(_expected_advantages(mode, eps), dtype=torch.float32)
    torch.testing.assert_close(adv, expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(adv[2], torch.zeros(4))
    flat = [r for g in REWARDS for r in g]
    assert stats["zero_variance_groups"] == 1.0
    assert stats["zero_variance_group_frac"] == 0.25
    assert stats["reward_mean"] == pytest.approx(statistics.fmean(flat))
    assert stats["reward_std"] == pytest.approx(statistics.stdev(flat))
    assert stats["reward_std_group_mean"] == pytest.approx(
        statistics.fmean(statistics.stdev(g) for g in REWARDS)
    )
    assert stats["adv_clip_frac"] == 0.0 and "adv_clip_value" not in stats


def test_group_scaled_advantages_have_zero_mean_and_unit_std_per_group() -> None:
    adv, _ = compute_advantages(torch.tensor(REWARDS), eps=0.0)
    for g in (0, 1, 3):
        assert adv[g].double().mean().item() == pytest.approx(0.0, abs=1e-7)
        assert adv[g].double().std().item() == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("percentile", [50.0, 80.0, 100.0])
def test_percentile_clip_uses_groups_with_signal(percentile: float) -> None:
    adv, stats = compute_advantages(torch.tensor(REWARDS), clip_percentile=percentile)
    raw = np.array(_expected_advantages("group", 1e-4))
    signal = np.abs(raw[[0, 1, 3]]).ravel()  # group 2 has no variance: left out
    c = float(np.percentile(signal, percentile))  # numpy's default: linear interpolation
    torch.testing.assert_close(adv, torch.tensor(np.clip(raw, -c, c), dtype=torch.float32))
    assert stats["adv_clip_value"] == pytest.approx(c)
    assert stats["adv_clip_frac"] == pytest.approx(float((np.abs(raw) > c).mean()))
    assert adv.abs().max().item() <= c + 1e-6
    if percentile == 100.0:
        assert stats["adv_clip_frac"] == 0.0


def test_percentile_clip_with_only_zero_variance_groups_is_a_no_op() -> None:
    adv, stats = compute_advantages(torch.ones(3, 4), clip_percentile=90.0)
    assert torch.equal(adv, torch.zeros(3, 4))
    assert stats["zero_variance_group_frac"] == 1.0 and stats["adv_clip_frac"] == 0.0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards": torch.ones(4)}, r"\[num_groups, group_size\]"),
        ({"rewards": torch.ones(3, 1)}, "group_size must be >= 2"),
        ({"rewards": torch.ones(0, 4)}, "no groups"),
        ({"rewards": torch.tensor([[1.0, float("nan")]])}, "non-finite.*group 0, sample 1"),
        ({"scale_rewards": "global"}, "unknown scale_rewards 'global'"),
        ({"clip_percentile": 0.0}, "clip_percentile"),
        ({"clip_percentile": 101.0}, "clip_percentile"),
        ({"eps": -1.0}, "eps"),
    ],
)
def test_advantage_errors(kwargs: dict, match: str) -> None:
    args = {"rewards": torch.ones(2, 3), **kwargs}
    with pytest.raises(ValueError, match=match):
        compute_advantages(**args)


# --------------------------------------------------------------------------------------------
# token_logprobs / token_entropy
# --------------------------------------------------------------------------------------------


F32 = {"rtol": 2e-6, "atol": 2e-6}  # float32 arithmetic against a float64 reference


def _direct_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def _direct_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 21, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_and_entropy_match_direct_formula(
    chunk_size: int, temperature: float
) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 7, 11) * 3  # B*T = 21: chunks of 4 and 5 leave a remainder
    ids = torch.randint(0, 11, (3, 7))
    lp = token_logprobs(logits, ids, temperature=temperature, chunk_size=chunk_size)
    ent = token_entropy(logits, temperature=temperature, chunk_size=chunk_size)
    assert lp.dtype == torch.float32 and lp.shape == (3, 7)
    assert ent.dtype == torch.float32 and ent.shape == (3, 7)
    torch.testing.assert_close(lp.double(), _direct_logprobs(logits, ids, temperature), **F32)
    torch.testing.assert_close(ent.double(), _direct_entropy(logits, temperature), **F32)


def test_temperature_changes_the_result() -> None:
    torch.manual_seed(2)
    logits, ids = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    assert not torch.allclose(token_logprobs(logits, ids, 0.5), token_logprobs(logits, ids, 1.0))


def test_non_contiguous_logits_are_read_in_place() -> None:
    torch.manual_seed(3)
    full = torch.randn(4, 9, 13, requires_grad=True)
    ids = torch.randint(0, 13, (4, 8))
    shifted = full[:, :-1]  # the usual causal-LM shift: not flattenable without a copy
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp = token_logprobs(shifted, ids, temperature=0.9, chunk_size=3)
    assert [t.data_ptr() for t in saved if t.dim() == 3] == [full.data_ptr()]
    torch.testing.assert_close(lp.double(), _direct_logprobs(shifted.detach(), ids, 0.9), **F32)
    lp.sum().backward()
    want = torch.autograd.grad(_direct_logprobs(full[:, :-1], ids, 0.9).sum(), full)[0]
    torch.testing.assert_close(full.grad.double(), want.double(), **F32)


@pytest.mark.parametrize("chunk_size", [3, 8, 20, 1000])
def test_results_do_not_depend_on_the_logits_layout(chunk_size: int) -> None:
    """Shifted (non-contiguous) logits, read a block of whole sequences at a time, give bitwise
    the values and gradients of a contiguous copy: every row is reduced on its own."""
    torch.manual_seed(6)
    full = torch.randn(7, 5, 31, requires_grad=True)
    copy = full.detach()[:, :-1].contiguous().requires_grad_()
    ids = torch.randint(0, 31, (7, 4))
    shifted = full[:, :-1]
    lp = token_logprobs(shifted, ids, 0.8, chunk_size)
    ent = token_entropy(shifted, 0.8, chunk_size)
    lp_copy = token_logprobs(copy, ids, 0.8, chunk_size)
    ent_copy = token_entropy(copy, 0.8, chunk_size)
    assert torch.equal(lp, lp_copy) and torch.equal(ent, ent_copy)
    weights = torch.randn(7, 4)
    ((lp - ent) * weights).sum().backward()
    ((lp_copy - ent_copy) * weights).sum().backward()
    assert torch.equal(full.grad[:, :-1], copy.grad)
    assert not full.grad[:, -1].any()


@pytest.mark.parametrize("chunk_size", [1, 3, 4, 9, 100])
def test_row_blocks_cover_every_row_once_within_the_chunk_size(chunk_size: int) -> None:
    from grail.algo.logprobs import _row_blocks

    x = torch.randn(5, 5, 3)[:, :-1]  # [5, 4, 3], not flattenable
    blocks = list(_row_blocks(x, chunk_size))
    assert blocks[0][0] == 0 and blocks[-1][1] == 20
    assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
    for r0, r1, rows in blocks:
        assert 0 < r1 - r0 <= chunk_size
        assert torch.equal(rows.reshape(-1, 3), x.reshape(-1, 3)[r0:r1])
        assert rows.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()  # a view


def test_bf16_logits_are_upcast_to_float32() -> None:
    torch.manual_seed(4)
    logits = (torch.randn(2, 6, 50) * 4).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, 50, (2, 6))
    lp = token_logprobs(logits, ids, temperature=0.8, chunk_size=5)
    ent = token_entropy(logits, temperature=0.8, chunk_size=5)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    # Same bf16 inputs, float32 arithmetic: agrees with float64 to float32 precision, where a
    # log-softmax computed in bf16 itself is off by orders of magnitude more.
    want_lp = _direct_logprobs(logits.detach(), ids, 0.8)
    torch.testing.assert_close(lp.double(), want_lp, **F32)
    torch.testing.assert_close(ent.double(), _direct_entropy(logits.detach(), 0.8), **F32)
    in_bf16 = torch.log_softmax(logits.detach() / 0.8, dim=-1).gather(-1, ids.unsqueeze(-1))
    assert (in_bf16.squeeze(-1).double() - want_lp).abs().max() > 1e-3
    (lp.sum() + ent.sum()).backward()
    assert logits.grad.dtype == torch.bfloat16
    x = logits.detach().double().requires_grad_()
    direct = _direct_logprobs(x, ids, 0.8) + _direct_entropy(x, 0.8)
    (want,) = torch.autograd.grad(direct.sum(), x)
    torch.testing.assert_close(logits.grad.double(), want, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("fn", ["logprobs", "entropy"])
def test_gradients_pass_gradcheck(fn: str) -> None:
    torch.manual_seed(5)
    logits = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 7, (2, 5))
    if fn == "logprobs":
        assert torch.autograd.gradcheck(lambda x: token_logprobs(x, ids, 0.7, 3), (logits,))
    else:
        assert torch.autograd.gradcheck(lambda x: token_entropy(x, 0.7, 3), (logits,))


@pytest.mark.parametrize("fn", ["logprobs", "entropy"])
def test_backward_keeps_no_float32_copy_of_the_logits(fn: str) -> None:
    """Only the input logits (same storage) and per-row vectors are saved for backward."""
    logits = torch.randn(4, 16, 64, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 64, (4, 16))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = token_logprobs(logits, ids, chunk_size=8) if fn == "logprobs" else None
        out = token_entropy(logits, chunk_size=8) if out is None else out
    big = [t for t in saved if t.numel() > 4 * 16]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr()
    assert big[0].dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: token_logprobs(torch.randn(2, 3), torch.zeros(2).long()), r"\[B, T, V\]"),
        (lambda: token_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 4).long()), "shape"),
        (lambda: token_logprobs(torch.randn(2, 3, 4), torch.full((2, 3), 4)), r"out of range"),
        (lambda: token_logprobs(torch.randn(2, 3, 4), torch.full((2, 3), -1)), r"out of range"),
        (lambda: token_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 3), 1.0), "integer"),
        (lambda: token_logprobs(torch.randn(2, 3, 4), torch.zeros(2, 3).long(), 0.0), "temperat"),
        (lambda: token_entropy(torch.randn(2, 3, 4), chunk_size=0), "chunk_size"),
        (lambda: token_entropy(torch.randn(2, 3, 4), temperature=-1.0), "temperature"),
    ],
)  # fmt: skip
def test_token_function_errors(call, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --------------------------------------------------------------------------------------------
# Errors: config and loss inputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, "unknown loss_type 'ppo'"),
        ({"importance_sampling_level": "seq"}, "unknown importance_sampling_level 'seq'"),
        ({"kl_estimator": "k4"}, "unknown kl_estimator 'k4'"),
        ({"loss_type": "dr_grpo"}, "dr_grpo' requires max_completion_length"),
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon_high": -0.1}, "epsilon_high"),
        ({"kl_coef": -0.1}, "kl_coef"),
        ({"entropy_coef": float("nan")}, "entropy_coef"),
        ({"is_ratio_max": 1.2, "epsilon_high": 0.28}, r"is_ratio_max .* 1 \+ epsilon_high"),
        ({"logratio_clamp": 0.0}, "logratio_clamp"),
        ({"is_clip_max": -2.0}, "is_clip_max"),
        ({"is_clip_min": 2.0, "is_clip_max": 1.5}, "is_clip_min"),
        ({"is_correction": "token"}, "unknown is_correction"),
        ({"max_completion_length": 0}, "max_completion_length"),
    ],
)
def test_config_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GRPOLossConfig(**kwargs)


def _loss_inputs() -> dict:
    return {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.zeros(2),
        "mask": torch.ones(2, 3),
        "config": GRPOLossConfig(),
    }


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"config": GRPOLossConfig(loss_type="dapo")}, "dapo' requires num_items_in_batch"),
        ({"config": GRPOLossConfig(loss_type="dapo"), "num_items_in_batch": 0}, "> 0"),
        ({"config": GRPOLossConfig(loss_type="dapo"), "num_items_in_batch": 5}, "whole generation"),
        ({"config": GRPOLossConfig(kl_coef=0.1)}, "requires ref_logprobs"),
        ({"config": GRPOLossConfig(entropy_coef=0.1)}, "requires entropy"),
        ({"config": GRPOLossConfig(is_correction="sequence_mask")}, "requires behaviour_logprobs"),
        ({"accumulation_steps": 0}, "accumulation_steps must be a positive int"),
        (
            {"config": GRPOLossConfig(loss_type="dapo"), "num_items_in_batch": 6,
             "accumulation_steps": 2},
            "exceeds steps_per_generation",
        ),
        (
            {"config": GRPOLossConfig(loss_type="dr_grpo", max_completion_length=2)},
            "more than max_completion_length",
        ),
        ({"old_logprobs": torch.zeros(2, 4)}, r"old_logprobs shape \(2, 4\)"),
        ({"ref_logprobs": torch.zeros(3, 3)}, r"ref_logprobs shape \(3, 3\)"),
        ({"behaviour_logprobs": torch.zeros(2)}, "behaviour_logprobs shape"),
        ({"entropy": torch.zeros(2, 2)}, "entropy shape"),
        ({"mask": torch.ones(2, 4)}, "mask shape"),
        ({"mask": torch.full((2, 3), 0.5)}, "only 0 and 1"),
        ({"advantages": torch.zeros(2, 3)}, r"advantages must be \[B\] = \[2\]"),
        ({"advantages": torch.tensor([0.0, float("nan")])}, "NaN"),
        ({"logprobs": torch.zeros(2, 3, 4)}, r"\[B, T\]"),
        ({"logprobs": torch.zeros(0, 3)}, "empty batch"),
        ({"config": {"loss_type": "grpo"}}, "GRPOLossConfig"),
    ],
)  # fmt: skip
def test_loss_errors(override: dict, match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        grpo_loss(**{**_loss_inputs(), **override})
