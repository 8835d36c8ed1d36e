"""``grail.algo.grpo.grpo_loss`` against TRL 1.16's own ``GRPOTrainer.compute_loss``.

A real ``trl.GRPOTrainer`` is built once (module fixture) on the tiny offline model in float64.
Both sides then see the same generation batch and evaluate the same model (train mode) on it:

    TRL   ``trainer.compute_loss(model, micro_batch)`` (= ``_compute_loss``) per micro-batch
    ours  a forward pass on prompt + completion, ``token_logprobs`` / ``token_entropy`` of
          ``logits[:, P-1:-1]`` at the same temperature, and ``grpo_loss`` with the same settings
          (the forward pass of each micro-batch is made once, its graph kept and back-propagated
          through by every case: the parameters never change, so repeating it would only cost)

and every micro-batch's loss (|Δ| <= 1e-6; float64 gives ~1e-15) and every optimizer window's
accumulated parameter gradient (per parameter max|Δ| <= 1e-6 · max|g_TRL|, g_TRL != 0) must
agree. The grid is every combination of loss_type (grpo, bnpo, dr_grpo, dapo) × importance
sampling level (token, sequence) × KL (β 0 / 0.1, TRL's default ``use_bias_correction_kl``) ×
entropy bonus (0 / 0.05) × 1 or 2 micro-batches per optimizer step × vLLM importance-sampling
correction (none, token_truncate, token_mask, sequence_truncate, sequence_mask): 320 cases.
A second grid runs the same comparison on episodes (a masked batch, below): loss_type × level ×
KL on/off × the entropy bonus on × 2 micro-batches per step × correction (none, token_truncate,
sequence_mask): 48 cases.
``GRPOTrainer.loss_is_scaled_for_ga`` is True, so TRL's training step back-propagates exactly
the loss ``compute_loss`` returns (asserted below); gradients here are summed over a window's
micro-batches as that loop does.

Where the inputs come from (the path taken for the importance-sampling ratio): TRL computes
it with its own code. ``_generate_and_score_completions`` is driven once per correction mode
with a ``rollout_func`` (TRL's experimental hook returning prompt_ids, completion_ids and the
sampler's per-token logprobs) and ``trainer.use_vllm = True`` set after construction, with
``_last_loaded_step = state.global_step`` so that no vLLM weight sync is attempted. So TRL
itself produces, as in training: the padded prompt/completion tensors, the "old" per-token
log-probs (its own no-grad forward pass at generation time), the sampling log-probs (with a
``None`` from the sampler mapped to NaN), ``importance_sampling_ratio``, the group advantages
from the rewards, and ``num_items_in_batch``. ``gradient_accumulation_steps=2`` with
``steps_per_generation=4`` makes TRL compute the old log-probs even with the correction off
(mode "none": ``use_vllm`` False). The batch is split into micro-batches with TRL's
``split_tensor_dict``; TRL's ``_prepare_inputs`` would also shuffle the rows first, which is
skipped so the micro-batches keep the token counts designed below. Only the reference
log-probs (β > 0) are hand-made and added to the inputs: the trainer is built with β = 0,
so it holds no reference model.

How the inputs are made to bite:
- Off-policy: the old log-probs are computed at θ_old = θ + 0.03·noise, the loss at θ, so the
  policy ratios fall inside and outside [1 − 0.2, 1 + 0.28] (asymmetric ε), with advantages of
  both signs, at token and at sequence level.
- The sampler's log-probs are old − D with hand-made D, so that for every correction mode some
  ratios lie inside and some outside [0.5, 2]; one sampler log-prob is None (NaN).
- Prompts of 2-6 tokens (left padded), completions of 1-8 tokens (right padded; 8 =
  max_completion_length), micro-batches of 14, 12, 18 and 6 completion tokens (50 in all).
``test_inputs_exercise_every_branch`` asserts all of this, so the grid cannot pass because
nothing was clipped, masked or normalised differently.

Episodes (multi-turn rollouts: the policy's sampled spans with the environment's context
between them). The same completions are generated again, in the masked grid's three correction
modes, with the rollout_func also returning TRL's ``env_mask`` (``ENV_MASK``: 1 on sampled
tokens, 0 on context), which TRL keeps as ``tool_mask``: its loss, its normalisers
(``num_items_in_batch`` = Σ completion_mask·tool_mask, 35 tokens) and its importance-sampling
ratio cover ``completion_mask * tool_mask``, and ours is given that product as its mask (as
grail's micro-batches give the loss their ``loss_mask``). The sampler reports 0.0 on context,
grail's behaviour log-prob there. Zeros lie inside completions on five rows, one row ends in
context, the NaN sampler token is context (TRL must mask it before its ``nan_to_num``), and the
last micro-batch holds a single sampled token (two of its rows wholly context); over the sampled
tokens the policy and importance-sampling ratios still fall inside and outside their ranges
(``test_masked_inputs_exercise_every_branch``).

TRL's fused LM head. ``GRPOTrainer`` patches the model's forward so that TRL's
``_get_per_token_logps_and_entropies`` gets log-probs and entropies from
``ChunkedLogProbFunction``, which accumulates in float32 whatever the model's dtype (~1e-7).
For the float64 grid that kernel is replaced (``trl.trainer.utils._ChunkedLogProbFunction``,
the name TRL's patched forward calls) by an exact float64 one with the same signature:
log_softmax(hidden·Wᵀ/T) gathered at the labels, and −Σ p log p. Everything else (TRL's
patched forward, label shifting and masking, and all of ``_compute_loss``) is TRL's own code.
``test_parity_with_trls_float32_kernel`` runs a few cases with TRL's real kernel at float32
tolerances (~5e-8 loss, ~1e-6 relative gradient seen), so the stand-in hides nothing.

The ``test_*_is_exercised`` tests prove the grid can fail: on the same inputs they evaluate
what a loss that got one of TRL's subtler choices wrong would give (no KL bias correction; the
entropy bonus normalised like the dr_grpo policy term, computed by hand; dapo normalised by the
optimizer window's own token count, by hand; the importance-sampling weight left out, or masked
where TRL truncates; the env mask ignored, the context trained on as if sampled) and assert
each differs from TRL by over 100 times the tolerance.

Runtime: ~45 s of CPU on 2 cores (398 tests; torch runs single-threaded here, which is faster
for these tiny ops; the previous thread count is restored afterwards).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
import trl
import trl.trainer.utils as trl_utils
from datasets import Dataset
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from grail.algo.grpo import GRPOLossConfig, grpo_loss, token_entropy, token_logprobs
from grail.models.tiny import ensure_tiny_model

# --------------------------------------------------------------------------------------------
# The hand-made generation batch: 3 prompts' groups of 4 completions, 4 micro-batches of 3.
# --------------------------------------------------------------------------------------------

TEMPERATURE = 0.7
EPSILON, EPSILON_HIGH = 0.2, 0.28
IS_CLIP_MIN, IS_CLIP_MAX = 0.5, 2.0
BETA, ENTROPY_COEF = 0.1, 0.05
MAX_COMPLETION_LENGTH = 8
NUM_GENERATIONS = 4
MICRO_BATCH = 3
STEPS_PER_GENERATION = 4  # micro-batches in the generation batch
OLD_POLICY_NOISE = 0.03  # θ_old = θ + this · N(0, 1): the policy the batch was scored with

PROMPT_LENGTHS = [3, 5, 2, 6, 4, 3, 2, 5, 6, 4, 3, 2]
COMPLETION_LENGTHS = [8, 1, 5, 3, 7, 2, 6, 8, 4, 2, 1, 3]  # micro-batches: 14, 12, 18, 6 tokens
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.9, 0.1, 0.3, 0.0, 0.0, 1.0, 0.7, 0.4]
# D = old − sampling log-prob per completion token: token ratios exp(D) and sequence ratios
# exp(ΣD) on both sides of [0.5, 2] (ln 2 ≈ 0.693), none near a bound.
IS_LOG_DELTAS = [
    [0.1, -0.2, 0.9, -0.3, 0.05, -1.2, 0.2, 0.15],  # Σ -0.3
    [1.4],  # Σ 1.4
    [-0.4, 0.3, -0.1, 0.2, -0.9],  # Σ -0.9
    [0.25, -0.15, 0.1],  # Σ 0.2
    [0.3, -0.6, 0.0, 0.4, 0.35, 0.2, 0.3],  # the sampler's log-prob of token 2 is None: Σ 0.95
    [-0.05, 0.1],  # Σ 0.05
    [0.8, -0.2, 0.1, -0.3, 0.2, -0.1],  # Σ 0.5
    [-0.5, -0.4, 0.2, -0.3, 0.1, -0.6, 0.3, -0.2],  # Σ -1.4
    [0.2, 0.2, -0.1, 0.1],  # Σ 0.4
    [-1.0, 0.2],  # Σ -0.8
    [0.0],  # Σ 0
    [0.6, 0.5, 0.4],  # Σ 1.5
]
NAN_TOKEN = (4, 2)  # (completion, token) whose sampler log-prob is None -> NaN

# The masked batch: the same completions as episodes, 1 where the policy sampled the token, 0
# on context (a tool result, the next user turn) that the rollout_func reports as TRL's
# `env_mask`. Zeros inside completions (rows 0, 2, 4, 6, 7), a row ending in context (7), the
# NaN sampler token on context (row 4), and a last micro-batch with one sampled token in all
# (rows 9 and 10 wholly context). Over the sampled tokens the sequence IS ratios exp(Σ D) are
# still on both sides of [0.5, 2]: Σ D = -0.95, 1.4, -1.2, 0.2, 0.55, 0.05, 0.8, -1.0, 0.4,
# 0, 0, 0.5.
ENV_MASK = [
    [1, 1, 0, 0, 0, 1, 1, 1],
    [1],
    [1, 0, 1, 1, 1],
    [1, 1, 1],
    [1, 1, 0, 0, 1, 1, 1],
    [1, 1],
    [1, 1, 1, 0, 1, 1],
    [1, 1, 1, 0, 0, 1, 1, 0],
    [1, 1, 1, 1],
    [0, 0],
    [0],
    [0, 1, 0],
]  # micro-batches: 10, 10, 14, 1 sampled tokens (35 in all)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LEVELS = ("token", "sequence")
IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

MASKED_IS_MODES = ("none", "token_truncate", "sequence_mask")

LOSS_TOL = 1e-6  # absolute, per micro-batch loss
GRAD_RTOL = 1e-6  # per parameter: max|g_ours - g_trl| <= GRAD_RTOL * max|g_trl|


class Case(NamedTuple):
    loss_type: str
    level: str
    beta: float
    entropy_coef: float
    accumulation: int  # micro-batches per optimizer step
    is_mode: str
    env_mask: bool = False  # the masked batch (ENV_MASK), our mask completion_mask * tool_mask

    @property
    def id(self) -> str:
        kl = "kl" if self.beta else "nokl"
        ent = "ent" if self.entropy_coef else "noent"
        masked = "-envmask" if self.env_mask else ""
        return (
            f"{self.loss_type}-{self.level}-{kl}-{ent}-acc{self.accumulation}-{self.is_mode}"
            f"{masked}"
        )


GRID = [
    Case(*c)
    for c in itertools.product(
        LOSS_TYPES, LEVELS, (0.0, BETA), (0.0, ENTROPY_COEF), (1, 2), IS_MODES
    )
]
MASKED_GRID = [
    Case(lt, level, beta, ENTROPY_COEF, 2, mode, env_mask=True)
    for lt, level, beta, mode in itertools.product(LOSS_TYPES, LEVELS, (0.0, BETA), MASKED_IS_MODES)
]


# --------------------------------------------------------------------------------------------
# The float64 stand-in for TRL's fused LM-head kernel
# --------------------------------------------------------------------------------------------


class ExactLogProbFunction:
    """``trl.kernels.chunked_logprob.ChunkedLogProbFunction`` in exact float64 autograd: the same
    arguments and outputs (log-probs, entropy, and None for the fields GRPO does not request)."""

    @staticmethod
    def apply(
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        targets: Tensor,
        temperature: float,
        chunk_size: int,
        final_logit_softcapping: float | None = None,
        logit_scale: float = 1.0,
        outputs: tuple[str, ...] = ("log_probs",),
    ) -> tuple[Tensor, Tensor | None, None, None, None]:
        unsupported = set(outputs) - {"log_probs", "entropy"}
        assert not unsupported, f"stand-in does not compute {unsupported}"
        z = hidden @ weight.t()
        if bias is not None:
            z = z + bias
        z = z * logit_scale
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        logp = torch.log_softmax(z / temperature, dim=-1)
        log_probs = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return log_probs, entropy, None, None, None


# --------------------------------------------------------------------------------------------
# The trainer, the batch TRL prepares from it, and the two losses
# --------------------------------------------------------------------------------------------


@dataclass(repr=False)  # pytest would print every tensor on a failure
class Setup:
    trainer: Any  # trl.GRPOTrainer
    model: torch.nn.Module
    params: list[Tensor]
    prompt_width: int
    batches: dict[str, dict[str, Any]]  # is_mode -> TRL's generation batch (+ ref log-probs)
    micro_batches: dict[str, list[dict[str, Any]]]  # is_mode -> TRL's split of it
    # The same with ENV_MASK returned as env_mask (MASKED_IS_MODES only): TRL's tool_mask.
    masked_batches: dict[str, dict[str, Any]]
    masked_micro_batches: dict[str, list[dict[str, Any]]]
    current_logps: Tensor  # [12, C] at θ (the policy the loss is evaluated at), no grad
    # Our forward pass of each micro-batch (log-probs, entropies) with its autograd graph kept:
    # θ never changes, so every case back-propagates through the same graph (retain_graph)
    # instead of repeating an identical forward pass.
    our_forward: list[tuple[Tensor, Tensor]]


@contextlib.contextmanager
def _preserved_rng() -> Iterator[None]:
    """TRL's trainer seeds the global RNGs (transformers.set_seed); give other tests theirs back."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        yield
    random.setstate(py_state)
    np.random.set_state(np_state)


def _completion_logps(
    model: torch.nn.Module, prompts: list[list[int]], completions: list[list[int]]
) -> list[list[float]]:
    """Per-token log-probs of each completion, one unpadded sequence at a time, no grad."""
    out = []
    with torch.no_grad():
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = torch.tensor([prompt + completion])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            logits = logits[:, len(prompt) - 1 : -1]
            out.append(token_logprobs(logits, torch.tensor([completion]), TEMPERATURE)[0].tolist())
    return out


def _build(output_dir: str) -> Setup:
    path = ensure_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).double()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    completions = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in COMPLETION_LENGTHS]

    rollout: dict[str, list[list[Any]]] = {}

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list[list[Any]]]:
        return rollout

    def reward_func(
        prompts: list[Any], completions: list[Any], reward: list[float], **_: Any
    ) -> list[float]:
        return list(reward)

    num_rows = len(REWARDS)
    dataset = Dataset.from_dict(
        {"prompt": [f"prompt {i // NUM_GENERATIONS}" for i in range(num_rows)], "reward": REWARDS}
    )
    args = trl.GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        report_to="none",
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        shuffle_dataset=False,
        num_generations=NUM_GENERATIONS,
        per_device_train_batch_size=MICRO_BATCH,
        # 2 does not divide the 4 micro-batches of a generation, so TRL computes the old log-probs
        # itself even with the importance-sampling correction off.
        gradient_accumulation_steps=2,
        steps_per_generation=STEPS_PER_GENERATION,
        num_iterations=1,
        max_completion_length=MAX_COMPLETION_LENGTH,
        mask_truncated_completions=False,
        temperature=TEMPERATURE,  # baked into TRL's fused LM head at construction
        epsilon=EPSILON,
        epsilon_high=EPSILON_HIGH,
        beta=0.0,  # no reference model; β is switched per case and ref log-probs are supplied
        scale_rewards="group",
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_clip_min=IS_CLIP_MIN,
        vllm_importance_sampling_clip_max=IS_CLIP_MAX,
    )
    with _preserved_rng():
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=reward_func,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            rollout_func=rollout_func,
        )
    model.train()
    params = list(model.parameters())
    theta = [p.detach().clone() for p in params]

    # Generate (score the old log-probs) at θ_old; the loss is then evaluated at θ.
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * OLD_POLICY_NOISE)
    old = _completion_logps(model, prompts, completions)
    sampling: list[list[float | None]] = [
        [o - d for o, d in zip(olds, deltas, strict=True)]
        for olds, deltas in zip(old, IS_LOG_DELTAS, strict=True)
    ]
    sampling[NAN_TOKEN[0]][NAN_TOKEN[1]] = None  # the sampler could not score this token
    rollout.update(prompt_ids=prompts, completion_ids=completions, logprobs=sampling)

    inputs = [{"prompt": p, "reward": r} for p, r in zip(dataset["prompt"], REWARDS, strict=True)]
    trainer._last_loaded_step = trainer.state.global_step  # no vLLM weight sync to attempt

    def generate(mode: str) -> dict[str, Any]:
        trainer.use_vllm = mode != "none"
        trainer.vllm_importance_sampling_mode = "token_truncate" if mode == "none" else mode
        batch: dict[str, Any] = trainer._generate_and_score_completions(inputs)
        return batch

    batches = {mode: generate(mode) for mode in IS_MODES}
    # The episodes: the sampler reports 0.0 on context tokens, as grail's samples hold (the
    # NaN token, on context, stays None: TRL must mask it before its nan_to_num).
    masked_sampling: list[list[float | None]] = [
        [
            lp if m or (i, t) == NAN_TOKEN else 0.0
            for t, (lp, m) in enumerate(zip(lps, mask, strict=True))
        ]
        for i, (lps, mask) in enumerate(zip(sampling, ENV_MASK, strict=True))
    ]
    rollout.update(logprobs=masked_sampling, env_mask=ENV_MASK)
    masked_batches = {mode: generate(mode) for mode in MASKED_IS_MODES}
    with torch.no_grad():
        for p, t in zip(params, theta, strict=True):
            p.copy_(t)

    completion_ids = batches["none"]["completion_ids"]
    ref = batches["none"]["old_per_token_logps"] + 0.3 * torch.randn(
        completion_ids.shape, generator=gen, dtype=torch.float64
    )
    for batch in [*batches.values(), *masked_batches.values()]:
        batch["ref_per_token_logps"] = ref
    micro_batches, masked_micro_batches = (
        {
            mode: trl_utils.split_tensor_dict(batch, STEPS_PER_GENERATION)
            for mode, batch in b.items()
        }
        for b in (batches, masked_batches)
    )
    # So one forward pass per micro-batch serves every mode, masked or not.
    for batch in [*batches.values(), *masked_batches.values()]:
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
            assert torch.equal(batch[key], batches["none"][key]), key
    prompt_width = batches["none"]["prompt_ids"].shape[1]
    with torch.no_grad():
        current, _ = _our_forward(model, prompt_width, batches["none"])
    forwards = [_our_forward(model, prompt_width, mb) for mb in micro_batches["none"]]
    return Setup(
        trainer,
        model,
        params,
        prompt_width,
        batches,
        micro_batches,
        masked_batches,
        masked_micro_batches,
        current,
        forwards,
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # these tiny ops only lose to thread synchronisation
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func's "experimental" warning
            mp.setattr(trl_utils, "_ChunkedLogProbFunction", ExactLogProbFunction)
            yield _build(str(tmp_path_factory.mktemp("trl_parity")))
    finally:
        torch.set_num_threads(threads)


def configure_trl(trainer: Any, case: Case) -> None:
    """Set every attribute ``_compute_loss`` reads for this case."""
    assert trainer.model.training  # TRL's `mode` is "train" only then
    trainer.loss_type = case.loss_type
    trainer.importance_sampling_level = case.level
    trainer.epsilon_low, trainer.epsilon_high = EPSILON, EPSILON_HIGH
    trainer.beta = case.beta
    trainer.entropy_coef = case.entropy_coef
    trainer._entropy_bonus_enabled = case.entropy_coef != 0.0
    trainer.use_vllm = case.is_mode != "none"
    trainer.vllm_importance_sampling_correction = True
    if case.is_mode != "none":
        trainer.vllm_importance_sampling_mode = case.is_mode
    trainer.vllm_importance_sampling_clip_min = IS_CLIP_MIN
    trainer.vllm_importance_sampling_clip_max = IS_CLIP_MAX
    trainer.current_gradient_accumulation_steps = case.accumulation
    trainer.args.steps_per_generation = STEPS_PER_GENERATION
    trainer.max_completion_length = MAX_COMPLETION_LENGTH
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}


def _our_forward(
    model: torch.nn.Module, prompt_width: int, mb: dict[str, Any]
) -> tuple[Tensor, Tensor]:
    """Our per-token log-probs and entropies of the completion tokens (with gradient)."""
    ids = torch.cat([mb["prompt_ids"], mb["completion_ids"]], dim=1)
    mask = torch.cat([mb["prompt_mask"], mb["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, prompt_width - 1 : -1]
    return (
        token_logprobs(logits, mb["completion_ids"], TEMPERATURE),
        token_entropy(logits, TEMPERATURE),
    )


def loss_config(case: Case, **overrides: Any) -> GRPOLossConfig:
    settings: dict[str, Any] = {
        "loss_type": case.loss_type,
        "importance_sampling_level": case.level,
        "epsilon": EPSILON,
        "epsilon_high": EPSILON_HIGH,
        "kl_coef": case.beta,
        "kl_estimator": "k3",
        "kl_bias_correction": True,
        "entropy_coef": case.entropy_coef,
        "is_correction": case.is_mode,
        "is_clip_min": IS_CLIP_MIN,
        "is_clip_max": IS_CLIP_MAX,
        "max_completion_length": MAX_COMPLETION_LENGTH,
    }
    settings.update(overrides)
    return GRPOLossConfig(**settings)


def loss_mask(mb: dict[str, Any]) -> Tensor:
    """The tokens TRL's loss covers: ``completion_mask * tool_mask`` (the sampled tokens of an
    episode), or the completion mask where the rollout_func returned no env_mask."""
    mask: Tensor = mb["completion_mask"]
    return mask * mb["tool_mask"] if "tool_mask" in mb else mask


def our_loss(
    mb: dict[str, Any],
    logps: Tensor,
    entropy: Tensor,
    case: Case,
    mask: Tensor | None = None,
    **overrides: Any,
) -> Tensor:
    """``grpo_loss`` on ``mb`` over ``mask`` (``loss_mask(mb)`` unless given)."""
    loss, _ = grpo_loss(
        logps,
        mb["old_per_token_logps"],
        mb["advantages"],
        loss_mask(mb) if mask is None else mask,
        loss_config(case, **overrides),
        ref_logprobs=mb["ref_per_token_logps"],
        behaviour_logprobs=mb["sampling_per_token_logps"],
        entropy=entropy,
        num_items_in_batch=mb["num_items_in_batch"],
        accumulation_steps=case.accumulation,
        steps_per_generation=STEPS_PER_GENERATION,
    )
    return loss


class Result(NamedTuple):
    losses: list[float]  # per micro-batch, in order
    grads: list[list[Tensor]]  # per optimizer window: the gradient of every parameter


# (index of the micro-batch in the generation batch, the micro-batch, its optimizer window)
LossOf = Callable[[int, dict[str, Any], list[dict[str, Any]]], Tensor]


def run(setup: Setup, case: Case, loss_of: LossOf, retain_graph: bool = False) -> Result:
    """Losses of the generation batch's micro-batches and the gradient accumulated over each
    optimizer window of ``case.accumulation`` micro-batches (what ``loss.backward()`` leaves in
    ``.grad`` when the optimizer steps)."""
    mbs = (setup.masked_micro_batches if case.env_mask else setup.micro_batches)[case.is_mode]
    losses: list[float] = []
    grads: list[list[Tensor]] = []
    for start in range(0, STEPS_PER_GENERATION, case.accumulation):
        window = mbs[start : start + case.accumulation]
        acc = [torch.zeros_like(p) for p in setup.params]
        for i, mb in enumerate(window, start=start):
            loss = loss_of(i, mb, window)
            losses.append(loss.item())
            step = torch.autograd.grad(loss, setup.params, retain_graph=retain_graph)
            for a, g in zip(acc, step, strict=True):
                a += g
        grads.append(acc)
    return Result(losses, grads)


def trl_result(setup: Setup, case: Case) -> Result:
    configure_trl(setup.trainer, case)
    return run(setup, case, lambda _, mb, __: setup.trainer.compute_loss(setup.model, mb))


def our_result(
    setup: Setup, case: Case, loss_fn: Callable[..., Tensor] | None = None, **overrides: Any
) -> Result:
    """Ours with ``grpo_loss`` (settings ``overrides``), or ``loss_fn(mb, window, logps,
    entropy)`` to evaluate an alternative objective on the same forward pass."""

    def loss_of(i: int, mb: dict[str, Any], window: list[dict[str, Any]]) -> Tensor:
        logps, entropy = setup.our_forward[i]
        if loss_fn is not None:
            return loss_fn(mb, window, logps, entropy)
        return our_loss(mb, logps, entropy, case, **overrides)

    return run(setup, case, loss_of, retain_graph=True)


def loss_gap(ours: Result, ref: Result) -> float:
    return max(abs(a - b) for a, b in zip(ours.losses, ref.losses, strict=True))


def grad_gap(ours: Result, ref: Result) -> float:
    """max over windows and parameters of max|g - g_ref| / max|g_ref|."""
    gaps = []
    for window, ref_window in zip(ours.grads, ref.grads, strict=True):
        for g, r in zip(window, ref_window, strict=True):
            scale = r.abs().max().item()
            assert scale > 0, "a parameter has an all-zero TRL gradient: the check would be vacuous"
            gaps.append((g - r).abs().max().item() / scale)
    return max(gaps)


# --------------------------------------------------------------------------------------------
# The grid
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", GRID, ids=[c.id for c in GRID])
def test_loss_and_gradients_match_trl(setup: Setup, case: Case) -> None:
    ref = trl_result(setup, case)
    ours = our_result(setup, case)
    assert len(ref.losses) == STEPS_PER_GENERATION
    assert len(ref.grads) == STEPS_PER_GENERATION // case.accumulation
    assert all(math.isfinite(x) and x != 0.0 for x in ref.losses), ref.losses
    lg, gg = loss_gap(ours, ref), grad_gap(ours, ref)
    assert lg <= LOSS_TOL, f"losses: TRL {ref.losses} vs ours {ours.losses} (max |Δ| {lg:.3g})"
    assert gg <= GRAD_RTOL, f"gradients differ: max relative |Δ| {gg:.3g} (losses {lg:.3g})"


@pytest.mark.parametrize("case", MASKED_GRID, ids=[c.id for c in MASKED_GRID])
def test_loss_and_gradients_match_trl_on_masked_sequences(setup: Setup, case: Case) -> None:
    """Episodes: TRL's rollout_func returned an env_mask, and TRL's loss, its normalisers
    (num_items_in_batch counts the sampled tokens) and its importance-sampling ratio cover
    completion_mask * tool_mask; ours is given that product as its mask."""
    ref = trl_result(setup, case)
    ours = our_result(setup, case)
    assert all(math.isfinite(x) and x != 0.0 for x in ref.losses), ref.losses
    lg, gg = loss_gap(ours, ref), grad_gap(ours, ref)
    assert lg <= LOSS_TOL, f"losses: TRL {ref.losses} vs ours {ours.losses} (max |Δ| {lg:.3g})"
    assert gg <= GRAD_RTOL, f"gradients differ: max relative |Δ| {gg:.3g} (losses {lg:.3g})"


# --------------------------------------------------------------------------------------------
# The inputs reach every branch (so the grid cannot pass vacuously)
# --------------------------------------------------------------------------------------------


def test_inputs_exercise_every_branch(setup: Setup) -> None:
    trainer = setup.trainer
    # What `_compute_loss` reads besides the switched settings, at TRL's defaults:
    assert trainer.loss_is_scaled_for_ga is True  # the training step back-propagates it as is
    assert trainer.args.use_bias_correction_kl is True
    assert trainer.top_entropy_quantile == 1.0 and trainer.off_policy_mask_threshold is None
    assert trainer.args.delta is None and not trainer.aux_loss_enabled
    assert not trainer.use_adaptive_entropy and trainer.accelerator.num_processes == 1
    assert trainer.temperature == TEMPERATURE
    assert trl_utils._ChunkedLogProbFunction is ExactLogProbFunction

    batch = setup.batches["none"]
    assert "importance_sampling_ratio" not in batch
    for mode in IS_MODES:  # TRL prepared the same batch in every mode
        for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask"):
            assert torch.equal(setup.batches[mode][key], batch[key])
        for key in ("advantages", "old_per_token_logps", "sampling_per_token_logps"):
            torch.testing.assert_close(
                setup.batches[mode][key], batch[key], rtol=0, atol=0, equal_nan=True
            )
        assert int(setup.batches[mode]["num_items_in_batch"]) == sum(COMPLETION_LENGTHS)

    # Padding: prompts left (different lengths), completions right, one of a single token.
    prompt_mask, mask = batch["prompt_mask"], batch["completion_mask"].bool()
    assert prompt_mask.sum(-1).tolist() == PROMPT_LENGTHS and bool(prompt_mask[:, -1].all())
    assert mask.sum(-1).tolist() == COMPLETION_LENGTHS and bool(mask[:, 0].all())
    assert min(COMPLETION_LENGTHS) == 1 and max(COMPLETION_LENGTHS) == MAX_COMPLETION_LENGTH
    # dapo: the windows hold different token counts, none equal to N·G/S.
    per_mb = [int(mb["completion_mask"].sum()) for mb in setup.micro_batches["none"]]
    assert per_mb == [14, 12, 18, 6]
    n = sum(per_mb)
    for g in (1, 2):
        windows = [sum(per_mb[i : i + g]) for i in range(0, STEPS_PER_GENERATION, g)]
        assert n * g / STEPS_PER_GENERATION not in windows and len(set(windows)) > 1

    # Policy ratios (θ against TRL's old log-probs at θ_old) inside and outside the clip range
    # on the side where clipping bites, at both levels.
    adv = batch["advantages"].double()
    assert bool((adv > 0).any()) and bool((adv < 0).any())
    log_ratio = (setup.current_logps - batch["old_per_token_logps"]) * mask
    levels = {
        "token": (log_ratio.exp(), adv[:, None].expand_as(mask), mask),
        "sequence": (
            (log_ratio.sum(-1) / mask.sum(-1)).exp(),
            adv,
            torch.ones_like(adv, dtype=torch.bool),
        ),
    }
    for level, (ratio, a, units) in levels.items():
        high = (ratio > 1 + EPSILON_HIGH) & (a > 0) & units
        low = (ratio < 1 - EPSILON) & (a < 0) & units
        inside = (ratio > 1 - EPSILON) & (ratio < 1 + EPSILON_HIGH) & units
        assert bool(high.any()) and bool(low.any()) and bool(inside.any()), level

    # Importance sampling: one NaN sampler log-prob; raw ratios below, inside and above
    # [IS_CLIP_MIN, IS_CLIP_MAX] (none near a bound) in every mode, and TRL truncated or masked.
    sampling = batch["sampling_per_token_logps"]
    assert torch.isnan(sampling).nonzero().tolist() == [list(NAN_TOKEN)]
    diff = torch.nan_to_num((batch["old_per_token_logps"] - sampling) * mask, nan=0.0)
    for mode in IS_MODES[1:]:
        sequence = mode.startswith("sequence")
        raw = (diff.sum(-1, keepdim=True) if sequence else diff).exp()
        units = torch.ones_like(raw, dtype=torch.bool) if sequence else mask
        below, above = (raw < IS_CLIP_MIN) & units, (raw > IS_CLIP_MAX) & units
        inside = units & ~below & ~above
        assert bool(below.any()) and bool(above.any()) and bool(inside.any()), mode
        near = ((raw / IS_CLIP_MIN - 1).abs() < 0.02) | ((raw / IS_CLIP_MAX - 1).abs() < 0.02)
        assert not bool((near & units).any()), mode
        got = setup.batches[mode]["importance_sampling_ratio"]
        want = (
            raw.clamp(IS_CLIP_MIN, IS_CLIP_MAX)
            if mode.endswith("truncate")
            else raw.masked_fill(below | above, 0.0)
        )
        assert got.shape == raw.shape
        torch.testing.assert_close(got[units.expand_as(got)], want[units.expand_as(want)])


def test_masked_inputs_exercise_every_branch(setup: Setup) -> None:
    """The masked batch is the plain one with TRL's tool_mask added (ENV_MASK, padded with 1s),
    counted by num_items_in_batch; its context holds zeros inside completions, the NaN token
    and one wholly context micro-batch but for one token; and over the sampled tokens the
    policy and importance-sampling ratios still fall inside and outside their ranges."""
    plain = setup.batches["none"]
    completion_mask = plain["completion_mask"]
    for mode in MASKED_IS_MODES:
        batch = setup.masked_batches[mode]
        for key in ("advantages", "old_per_token_logps"):
            torch.testing.assert_close(batch[key], plain[key], rtol=0, atol=0)
        tool_mask = batch["tool_mask"]
        assert [
            row[:n] for row, n in zip(tool_mask.tolist(), COMPLETION_LENGTHS, strict=True)
        ] == ENV_MASK
        assert bool(tool_mask[completion_mask == 0].eq(1).all())  # TRL pads it with 1s
        assert int(batch["num_items_in_batch"]) == sum(map(sum, ENV_MASK)) == 35
    mask = (completion_mask * setup.masked_batches["none"]["tool_mask"]).bool()
    # Context inside completions, not only at their ends; a row ending in context; the NaN.
    inner = [
        any(m[t] == 0 and 1 in m[:t] and 1 in m[t + 1 :] for t in range(len(m))) for m in ENV_MASK
    ]
    assert sum(inner) >= 4 and ENV_MASK[7][-1] == 0 and ENV_MASK[NAN_TOKEN[0]][NAN_TOKEN[1]] == 0
    sampling = setup.masked_batches["token_truncate"]["sampling_per_token_logps"]
    assert torch.isnan(sampling).nonzero().tolist() == [list(NAN_TOKEN)]
    context = sampling.nan_to_num(0.0)[completion_mask.bool() & ~mask]
    assert context.tolist() == [0.0] * 15  # grail's behaviour log-prob of context (and the NaN)
    per_mb = [int(mb["completion_mask"].mul(mb["tool_mask"]).sum())
              for mb in setup.masked_micro_batches["none"]]  # fmt: skip
    assert per_mb == [10, 10, 14, 1]  # the last micro-batch: one sampled token

    adv = plain["advantages"].double()
    log_ratio = (setup.current_logps - plain["old_per_token_logps"]) * mask
    sequence_ratio = (log_ratio.sum(-1) / mask.sum(-1).clamp(min=1)).exp()
    for level, ratio, a, units in (
        ("token", log_ratio.exp(), adv[:, None].expand_as(mask), mask),
        ("sequence", sequence_ratio, adv, mask.any(-1)),
    ):
        high = (ratio > 1 + EPSILON_HIGH) & (a > 0) & units
        low = (ratio < 1 - EPSILON) & (a < 0) & units
        inside = (ratio > 1 - EPSILON) & (ratio < 1 + EPSILON_HIGH) & units
        assert bool(high.any()) and bool(low.any()) and bool(inside.any()), level
    # The one sampled token of the last micro-batch is inside the clip range (no zero gradient).
    assert 1 - EPSILON < float(log_ratio[11, 1].exp()) < 1 + EPSILON_HIGH

    diff = torch.nan_to_num((plain["old_per_token_logps"] - sampling) * mask, nan=0.0)
    for mode in MASKED_IS_MODES[1:]:
        sequence = mode.startswith("sequence")
        raw = (diff.sum(-1, keepdim=True) if sequence else diff).exp()
        units = torch.ones_like(raw, dtype=torch.bool) if sequence else mask
        below, above = (raw < IS_CLIP_MIN) & units, (raw > IS_CLIP_MAX) & units
        assert bool(below.any()) and bool(above.any()) and bool((units & ~below & ~above).any())
        near = ((raw / IS_CLIP_MIN - 1).abs() < 0.02) | ((raw / IS_CLIP_MAX - 1).abs() < 0.02)
        assert not bool((near & units).any()), mode
        got = setup.masked_batches[mode]["importance_sampling_ratio"]
        want = (
            raw.clamp(IS_CLIP_MIN, IS_CLIP_MAX)
            if mode.endswith("truncate")
            else raw.masked_fill(below | above, 0.0)
        )
        torch.testing.assert_close(got[units.expand_as(got)], want[units.expand_as(want)])


# --------------------------------------------------------------------------------------------
# TRL's real (float32) fused LM-head kernel
# --------------------------------------------------------------------------------------------

REAL_KERNEL = trl_utils._ChunkedLogProbFunction  # captured at import, before the fixture patches
REAL_KERNEL_CASES = [
    Case(lt, level, BETA, ENTROPY_COEF, 2, mode)
    for lt, level in itertools.product(LOSS_TYPES, LEVELS)
    for mode in (("token_truncate",) if level == "token" else ("sequence_mask",))
]


@pytest.mark.parametrize("case", REAL_KERNEL_CASES, ids=[c.id for c in REAL_KERNEL_CASES])
def test_parity_with_trls_float32_kernel(
    setup: Setup, case: Case, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The grid's float64 stand-in computes what TRL's kernel computes: with the real kernel
    the same comparison holds to its float32 accumulation (~1e-7)."""
    assert REAL_KERNEL is not ExactLogProbFunction
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", REAL_KERNEL)
    ref = trl_result(setup, case)
    ours = our_result(setup, case)
    lg, gg = loss_gap(ours, ref), grad_gap(ours, ref)
    assert gg > 1e-10, "expected float32 rounding: was TRL's real kernel not in use?"
    assert lg <= 1e-6, f"losses: TRL {ref.losses} vs ours {ours.losses}"
    assert gg <= 1e-4, f"gradients: max relative |Δ| {gg:.3g}"


# --------------------------------------------------------------------------------------------
# The grid can fail: what a loss that missed one of TRL's choices would give
# --------------------------------------------------------------------------------------------


def _assert_differs(ours: Result, ref: Result, what: str) -> None:
    lg, gg = loss_gap(ours, ref), grad_gap(ours, ref)
    assert lg > 100 * LOSS_TOL and gg > 100 * GRAD_RTOL, (
        f"{what}: only {lg:.3g} (loss) / {gg:.3g} (relative gradient) from TRL"
    )


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_bias_correction_is_exercised(setup: Setup, loss_type: str, level: str) -> None:
    """TRL weights the k3 KL by the (differentiable) policy ratio; without that weight every
    KL-on case would fail."""
    case = Case(loss_type, level, BETA, 0.0, 2, "token_truncate")
    ref = trl_result(setup, case)
    _assert_differs(our_result(setup, case, kl_bias_correction=False), ref, "no KL correction")


def test_entropy_normaliser_is_exercised(setup: Setup) -> None:
    """TRL's entropy bonus is a token mean over the micro-batch / G for every loss type; the
    dr_grpo policy normaliser B·max_completion_length would give a different loss."""
    case = Case("dr_grpo", "token", 0.0, ENTROPY_COEF, 1, "none")
    ref = trl_result(setup, case)

    def bonus_over(normaliser: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
        def loss_fn(mb: dict[str, Any], _: Any, logps: Tensor, entropy: Tensor) -> Tensor:
            policy = our_loss(mb, logps, entropy, case, entropy_coef=0.0)
            m = mb["completion_mask"].double()
            bonus = (entropy * m).sum() / normaliser(m) / case.accumulation
            return policy - ENTROPY_COEF * bonus

        return loss_fn

    # The hand-written bonus as TRL aggregates it reproduces TRL (so only the normaliser differs).
    token_mean = our_result(setup, case, loss_fn=bonus_over(lambda m: m.sum()))
    assert loss_gap(token_mean, ref) <= LOSS_TOL and grad_gap(token_mean, ref) <= GRAD_RTOL
    dr_grpo_norm = bonus_over(lambda m: torch.tensor(m.shape[0] * MAX_COMPLETION_LENGTH))
    _assert_differs(our_result(setup, case, loss_fn=dr_grpo_norm), ref, "dr_grpo entropy")


@pytest.mark.parametrize("accumulation", [1, 2])
def test_dapo_normaliser_is_exercised(setup: Setup, accumulation: int) -> None:
    """TRL's dapo divides by N·G/S (N: tokens of the generation batch); dividing by the
    tokens of the optimizer window itself differs when windows hold different counts."""
    case = Case("dapo", "token", 0.0, 0.0, accumulation, "none")
    ref = trl_result(setup, case)
    n = float(setup.batches["none"]["num_items_in_batch"])

    def window_tokens(mb: dict[str, Any], window: Any, logps: Tensor, entropy: Tensor) -> Tensor:
        tokens = sum(float(w["completion_mask"].sum()) for w in window)
        loss = our_loss(mb, logps, entropy, case)  # Σ m·ℓ / (N·G/S)
        return loss * (n * accumulation / STEPS_PER_GENERATION) / tokens

    _assert_differs(our_result(setup, case, loss_fn=window_tokens), ref, "dapo by window tokens")


@pytest.mark.parametrize("mode", IS_MODES[1:])
def test_is_correction_is_exercised(setup: Setup, mode: str) -> None:
    """Leaving TRL's importance-sampling weight out, or masking where TRL truncates (and the
    reverse), gives a different loss in every mode."""
    case = Case("grpo", "token", 0.0, 0.0, 1, mode)
    ref = trl_result(setup, case)
    sibling = {
        "token_truncate": "token_mask",
        "token_mask": "token_truncate",
        "sequence_truncate": "sequence_mask",
        "sequence_mask": "sequence_truncate",
    }[mode]
    _assert_differs(our_result(setup, case, is_correction="none"), ref, f"{mode} left out")
    _assert_differs(our_result(setup, case, is_correction=sibling), ref, f"{mode} as {sibling}")


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_env_mask_is_exercised(setup: Setup, loss_type: str) -> None:
    """On the masked batch, a loss over the completion mask alone (the context trained on as
    if sampled) differs from TRL's, with the correction off and on."""
    for mode in ("none", "token_truncate"):
        case = Case(loss_type, "token", BETA, ENTROPY_COEF, 2, mode, env_mask=True)
        ref = trl_result(setup, case)
        assert loss_gap(our_result(setup, case), ref) <= LOSS_TOL  # the product reproduces TRL

        def completion_mask_only(
            mb: dict[str, Any], _: Any, logps: Tensor, entropy: Tensor, case: Case = case
        ) -> Tensor:
            return our_loss(mb, logps, entropy, case, mask=mb["completion_mask"])

        ours = our_result(setup, case, loss_fn=completion_mask_only)
        _assert_differs(ours, ref, f"{loss_type}/{mode} without the env mask")
