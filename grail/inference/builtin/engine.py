"""The generation engine behind the built-in server: one worker thread owns the model.

What the numbers mean (the trainer relies on these, see /work/shared/PROTOCOLS.md rule 3):

- ``logprob`` of a sampled token ``y`` at step ``t`` is computed in float32 as

      logprob_t = log_softmax(logits_t / T)[y]            (T > 0)
      logprob_t = log_softmax(logits_t)[y]                (T = 0, greedy: y = argmax logits_t)

  i.e. the distribution AFTER temperature and BEFORE top-k / top-p filtering (SGLang's default,
  vLLM's ``processed_logprobs`` without truncation). The trainer computes the same quantity, so
  sample with ``top_p=1`` and top-k off when the logprobs must be exactly on-policy: with
  filtering, the token is drawn from the renormalised truncated distribution while the reported
  logprob is that of the untruncated one.
- Sampling: top-k keeps the logits >= the k-th largest, top-p keeps the smallest prefix of the
  sorted distribution whose mass reaches ``top_p`` (top-k first, then top-p, as vLLM). The token
  is drawn by inverse CDF with ONE uniform from the sequence's own ``torch.Generator``, so a
  sequence's draw never depends on what else is in the batch.
- Seeds: sample ``i`` of a request with seed ``s`` uses a generator seeded with ``s + i`` (vLLM's
  rule), so ``n=4, seed=s`` reproduces four ``n=1`` requests with seeds ``s..s+3``. No seed: a
  fresh random seed per sample.
- Stopping: on an EOS id (tokenizer's, config's and generation_config's), the EOS id is kept in
  ``token_ids`` and ``finish_reason`` is "stop"; on a stop string the text is cut before it (the
  tokens that produced it stay in ``token_ids``); after ``max_tokens`` tokens it is "length".

Batching. Requests are split into sequences (one per sample) and queued. The worker takes the
waiting sequences, up to ``max_batch_size`` (default 256, vLLM's ``max_num_seqs``), in arrival
order, and decodes them together: the distinct prompts are prefilled once (left padding,
attention mask, position ids), their KV cache (transformers ``DynamicCache``) is expanded to one
row per sequence, then one token per row per step, sampled for all rows with one set of tensor
ops (every op is per row, so each row gets the numbers it would get alone); finished rows are
dropped from the cache. A request is answered as soon as its own sequences finish. When rows
free up, queued sequences are prefilled and merged into the running batch (the shorter side's
cache is left-padded to the longer), so a short request never waits for a long one to finish.
The batch size bounds the KV cache in memory: rows x layers x 2 x kv_heads x head_dim x context
elements (for a 0.5B Qwen2 in float32 at 1024 tokens, ~25 MB per row).

Batch invariance (CPU). With plain batching a row's numbers depend on its neighbours: the
attention reduction runs over the padded length, and BLAS picks a different GEMM kernel for a
different number of rows (MKL on AVX-512, 2 threads: row outputs of a 896x4864 layer differ by
up to ~6e-5 between 1, 2-3 and 4 rows; all multiples of 4 agree). Since the harness sends
concurrent requests, batch composition is timing-dependent, so "same config and seed -> same
metrics" needs invariance. In batch-invariant mode (default on CPU) the engine therefore

1. computes attention row by row over that row's own tokens only (padding sliced away, not
   masked), so the reduction lengths are those of the row alone; rows with the same padding
   share one attention call where a start-up probe finds the kernel's per-row results
   independent of the batch size (PyTorch's CPU kernel with one thread; with several it splits
   short queries by batch size, and each row then gets its own call);
2. measures at start-up, on the model's own linear layers, the smallest ``q`` (1, 2, 4, 8 or 16)
   such that a row's output is the same for every row count that is a multiple of ``q``, and
   always runs batches of a multiple of ``q`` rows (at most ``q - 1`` inert filler rows).

The result (tested): a request's tokens and logprobs are bitwise identical whether it runs alone
or batched with other prompts of other lengths. On CUDA the default is off (cuBLAS chooses
kernels by shape heuristics, and the per-row attention loop costs too much there); results then
vary by float rounding with batch composition.

Weight updates load the new safetensors on the caller's thread (serving continues), then the
worker copies them into the live parameters once the running batch has drained (sequences queued
after the update are not admitted before it): a batch never mixes weights.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    PreTrainedModel,
)

logger = logging.getLogger(__name__)

ROWWISE_ATTENTION = "grail_rowwise"
# Temperatures below this are treated as greedy (vLLM's _SAMPLING_EPS).
GREEDY_EPS = 1e-5


class WeightUpdateError(ValueError):
    """A weight update that was refused; the old weights keep serving."""


class EngineStopped(RuntimeError):
    """The engine stopped before the sequence finished."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, already validated by the server."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no top alternatives; k: k alternatives per step


@dataclass
class SequenceOutput:
    """One finished sample. ``top_logprobs[t]`` lists (token id, logprob), best first."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    text: str
    finish_reason: str  # "stop" | "length"
    stop_reason: int | str | None  # the stop string or stop token id, None for EOS or length


@dataclass
class _Sequence:
    prompt: tuple[int, ...]
    params: SamplingParams
    generator: torch.Generator
    future: concurrent.futures.Future[SequenceOutput]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text_len: int = 0  # length of the decoded text at the last stop-string check


@dataclass
class _Control:
    """A job the worker runs with no batch in flight (weight copies): queued sequences are not
    admitted past it, so it waits for the running batch and precedes the requests after it."""

    fn: Any
    future: concurrent.futures.Future[Any]


@dataclass
class _Batch:
    """The rows being decoded: row r feeds ``tokens[r]`` at position ``next_pos[r]`` next;
    ``pad_starts[r]`` left-padding positions precede its prompt in ``cache`` and ``mask``.
    A ``None`` row is an inert filler (see ``Engine.row_quantum``)."""

    rows: list[_Sequence | None]
    cache: DynamicCache
    mask: torch.Tensor
    pad_starts: list[int]
    next_pos: list[int]
    tokens: list[int]


def _running(seq: _Sequence | None) -> bool:
    return seq is not None and not seq.future.done()


def _left_pad(batch: _Batch, extra: int) -> _Batch:
    """The same rows with ``extra`` more (masked) padding positions on the left."""
    layers = [
        (F.pad(layer.keys, (0, 0, extra, 0)), F.pad(layer.values, (0, 0, extra, 0)))
        for layer in batch.cache.layers
    ]
    return _Batch(
        rows=batch.rows,
        cache=DynamicCache(layers),
        mask=F.pad(batch.mask, (extra, 0)),
        pad_starts=[p + extra for p in batch.pad_starts],
        next_pos=batch.next_pos,
        tokens=batch.tokens,
    )


def _merge(a: _Batch, b: _Batch) -> _Batch:
    """One batch holding the rows of ``a`` then ``b``, left-padded to a common length."""
    width = max(a.mask.shape[1], b.mask.shape[1])
    if a.mask.shape[1] < width:
        a = _left_pad(a, width - a.mask.shape[1])
    if b.mask.shape[1] < width:
        b = _left_pad(b, width - b.mask.shape[1])
    layers = [
        (torch.cat([la.keys, lb.keys]), torch.cat([la.values, lb.values]))
        for la, lb in zip(a.cache.layers, b.cache.layers, strict=True)
    ]
    return _Batch(
        rows=a.rows + b.rows,
        cache=DynamicCache(layers),
        mask=torch.cat([a.mask, b.mask]),
        pad_starts=a.pad_starts + b.pad_starts,
        next_pos=a.next_pos + b.next_pos,
        tokens=a.tokens + b.tokens,
    )


def _row_groups(starts: Sequence[int], grouped: bool) -> list[tuple[int, list[int]]]:
    """Rows that may share one attention call: those with the same padding (so the same
    unpadded length), in row order; one row per group when ``grouped`` is off."""
    if not grouped:
        return [(int(s), [b]) for b, s in enumerate(starts)]
    groups: dict[int, list[int]] = {}
    for b, s in enumerate(starts):
        groups.setdefault(int(s), []).append(b)
    return list(groups.items())


def _rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    grail_pad_starts: Sequence[int] | None = None,
    grail_group_rows: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention computed separately for each row over its own (unpadded) keys.

    ``grail_pad_starts[b]`` is the number of left-padding positions of row ``b``. Query position
    ``j`` sits at absolute position ``Tk - Tq + j``; queries inside the padding get zeros (their
    outputs and cached keys are never read by real positions). Returns ``[B, Tq, H, D]`` like the
    transformers attention functions.

    ``grail_group_rows``: rows with the same padding run in one call (as a batch of rows of equal
    length). Only where the engine measured that the attention kernel's per-row results do not
    depend on the batch size (``attention_batch_invariant``): true of PyTorch's CPU kernel with
    one thread, not with several (it then splits short queries differently by batch size).
    """
    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    starts = grail_pad_starts if grail_pad_starts is not None else [0] * batch
    out = query.new_zeros(batch, q_len, heads, head_dim)
    gqa = key.shape[1] != heads
    for start, rows in _row_groups(starts, grail_group_rows):
        q_start = max(0, start - (k_len - q_len))
        sel: slice | torch.Tensor = slice(rows[0], rows[-1] + 1)  # a run of rows: views
        if rows[-1] - rows[0] + 1 != len(rows):
            sel = torch.tensor(rows, device=query.device)  # scattered rows: gathered
        q, k, v = query[sel], key[sel], value[sel]
        q = q[:, :, q_start:].contiguous()
        k = k[:, :, start:].contiguous()
        v = v[:, :, start:].contiguous()
        n_rows, cols = q.shape[2], k.shape[2]
        if n_rows == 1:
            mask, causal = None, False
        elif n_rows == cols:
            mask, causal = None, True
        else:  # queries are the last `n_rows` of `cols` positions
            offset = cols - n_rows
            mask = torch.ones(n_rows, cols, dtype=torch.bool, device=q.device).tril(offset)
            causal = False
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        out[sel, q_start:] = o.transpose(1, 2)
    return out, None


def attention_batch_invariant(
    heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> bool:
    """Whether ``scaled_dot_product_attention`` gives each row the same result in a batch of rows
    as alone, for this head layout at the current thread count (probed with random inputs on
    decode, prefill and partial-prefill shapes). A measurement, like ``linear_row_quantum``."""
    generator = torch.Generator(device="cpu").manual_seed(0)
    gqa = kv_heads != heads
    with torch.inference_mode():
        for q_len, k_len in ((1, 1), (1, 9), (1, 300), (3, 40), (17, 17), (2, 700)):
            for batch in (2, 3, 8, 32):
                q = torch.randn(batch, heads, q_len, head_dim, generator=generator)
                k = torch.randn(batch, kv_heads, k_len, head_dim, generator=generator)
                v = torch.randn(batch, kv_heads, k_len, head_dim, generator=generator)
                q, k, v = (x.to(device=device, dtype=dtype) for x in (q, k, v))
                mask = None
                if 1 < q_len < k_len:
                    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
                    mask = mask.tril(k_len - q_len)
                kw: dict[str, Any] = {
                    "attn_mask": mask,
                    "is_causal": q_len == k_len > 1,
                    "enable_gqa": gqa,
                }
                together = F.scaled_dot_product_attention(q, k, v, **kw)
                for b in range(batch):
                    alone = F.scaled_dot_product_attention(
                        q[b : b + 1], k[b : b + 1], v[b : b + 1], **kw
                    )
                    if not torch.equal(alone[0], together[b]):
                        return False
    return True


AttentionInterface.register(ROWWISE_ATTENTION, _rowwise_attention)


def linear_row_quantum(
    model: torch.nn.Module, max_rows: int = 256, max_features: int = 4096
) -> int | None:
    """Smallest q in (1, 2, 4, 8, 16) such that a linear layer's row outputs are the same for
    every row count that is a multiple of q (probed up to ``max_rows``), or None.

    Why multiples: MKL computes full blocks of rows with one kernel and a remainder with another,
    and how it splits rows depends on the thread count (measured on AVX-512 with 2 threads: all
    M >= 12 agree, with 16 threads all M >= 28, but every multiple of 4 agrees in both). Probed
    on each distinct (in, out, bias, dtype) linear of the model with random inputs, the output
    features truncated to ``max_features`` to keep a large vocabulary head cheap. A measurement
    of the BLAS in use at this thread count, not a proof; the end-to-end invariance is tested.
    """
    linears: dict[tuple[Any, ...], torch.nn.Linear] = {}
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            key = (module.in_features, module.out_features, module.bias is not None)
            linears.setdefault((*key, module.weight.dtype), module)
    generator = torch.Generator(device="cpu").manual_seed(0)
    sizes = sorted({*range(1, 65), 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, max_rows})
    sizes = [m for m in sizes if m <= max_rows]
    agrees = dict.fromkeys(sizes, True)
    with torch.inference_mode():
        for lin in linears.values():
            weight = lin.weight[:max_features]
            bias = lin.bias[:max_features] if lin.bias is not None else None
            x = torch.randn(max_rows, lin.in_features, generator=generator)
            x = x.to(device=weight.device, dtype=weight.dtype)
            ref = F.linear(x, weight, bias)
            for m in sizes:
                if agrees[m] and not torch.equal(F.linear(x[:m], weight, bias), ref[:m]):
                    agrees[m] = False
    for quantum in (1, 2, 4, 8, 16):
        if all(ok for m, ok in agrees.items() if m % quantum == 0):
            return quantum
    return None


def _group_attention_ok(model: PreTrainedModel, device: torch.device, dtype: torch.dtype) -> bool:
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    if not heads:
        return False
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return attention_batch_invariant(heads, kv_heads, head_dim, dtype, device)


def _eos_ids(tokenizer: Any, model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (tokenizer.eos_token_id, model.config.eos_token_id):
        if source is not None:
            ids.update(source if isinstance(source, list) else [source])
    gen = getattr(model, "generation_config", None)
    if gen is not None and gen.eos_token_id is not None:
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
    return frozenset(int(i) for i in ids)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless ``name`` says otherwise."""
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _resolve(future: concurrent.futures.Future[Any], value: Any) -> None:
    """Set a result unless the waiter already gave up (a cancelled future)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_result(value)


def _draw(
    logits: torch.Tensor, params: SamplingParams, generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float], list[list[tuple[int, float]]] | None]:
    """Sample one token per row of ``logits`` [R, V] (float32) under ``params``; row r draws its
    uniform from ``generators[r]``. Returns the tokens, their logprobs
    ``log_softmax(logits / T)[token]`` and, when ``params.logprobs`` asks for them, the top
    alternatives (token id, logprob) per row, best first (see the module docstring)."""
    greedy = params.temperature < GREEDY_EPS
    scaled = logits if greedy else logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    if greedy:
        token = torch.argmax(logits, dim=-1)
    else:
        filtered = scaled
        vocab = filtered.shape[-1]
        if 0 < params.top_k < vocab:
            kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, -math.inf)
        if params.top_p < 1.0:
            probs_sorted, order = torch.sort(
                torch.softmax(filtered, dim=-1), dim=-1, descending=True
            )
            # Drop a token when the mass before it already reaches top_p (keeps >= 1 token).
            drop_sorted = (probs_sorted.cumsum(-1) - probs_sorted) >= params.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            filtered = filtered.masked_fill(drop, -math.inf)
        probs = torch.softmax(filtered.double(), dim=-1)
        cdf = probs.cumsum(-1)
        u = torch.stack(
            [
                torch.rand((), generator=g, device=logits.device, dtype=torch.float64)
                for g in generators
            ]
        )
        token = torch.searchsorted(cdf, u.unsqueeze(-1) * cdf[:, -1:], right=True).squeeze(-1)
        # Rounding at the top end of the CDF can point past the last token or at a token of
        # probability 0: take the most likely token then.
        past = token >= vocab
        hit = probs.gather(-1, token.clamp(max=vocab - 1).unsqueeze(-1)).squeeze(-1)
        bad = past | (hit == 0.0)
        if bool(bad.any()):
            token = torch.where(bad, torch.argmax(probs, dim=-1), token)
    chosen = logp.gather(-1, token.unsqueeze(-1)).squeeze(-1)
    top = None
    if params.logprobs:
        best = torch.topk(logp, min(params.logprobs, logp.shape[-1]), dim=-1)
        top = [
            list(zip(ids, values, strict=True))
            for ids, values in zip(best.indices.tolist(), best.values.tolist(), strict=True)
        ]
    return token.tolist(), chosen.tolist(), top


class Engine:
    """Loads an HF causal LM and serves generation requests from one worker thread."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str | None = None,
        max_batch_size: int = 256,
        batch_invariant: bool | None = None,
        max_model_len: int | None = None,
    ) -> None:
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"--model {self.model_dir}: no config.json (not an HF dir)")
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}: CUDA is not available on this machine")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.max_batch_size = max_batch_size
        self.dtype = resolve_dtype(dtype, self.device)

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model: PreTrainedModel = model.to(self.device).eval()
        self.model.requires_grad_(False)
        config = self.model.config
        self.vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        context = int(getattr(config, "max_position_embeddings", 0) or 0) or None
        if max_model_len is not None and context is not None and max_model_len > context:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
                f"{context}"
            )
        self.max_model_len = max_model_len or context or 2048
        self.eos_ids = _eos_ids(self.tokenizer, self.model)
        pad = self.tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else min(self.eos_ids, default=0))

        if batch_invariant is None:
            batch_invariant = self.device.type == "cpu"
        sliding = "sliding_attention" in (getattr(config, "layer_types", None) or [])
        # Admitting queued sequences into a running batch re-pads the KV cache, which a sliding-
        # window cache does not support: such models admit new sequences only into an empty batch.
        self.continuous = not sliding
        # Batches always hold a multiple of `row_quantum` rows (see the module docstring).
        self.row_quantum = 1
        self.batch_invariant = False
        # Rows of equal padding share one attention call (see `_rowwise_attention`).
        self.group_attention = False
        if batch_invariant and sliding:
            logger.warning("batch invariance off: sliding-window attention is not supported by it")
        elif batch_invariant:
            quantum = linear_row_quantum(self.model, max_rows=max(256, max_batch_size))
            if quantum is None:
                logger.warning(
                    "batch invariance off: linear-layer outputs on this BLAS depend on the number "
                    "of rows; results vary by float rounding with batch composition"
                )
            else:
                self.model.set_attn_implementation(ROWWISE_ATTENTION)
                self.row_quantum = quantum
                self.batch_invariant = True
                self.group_attention = _group_attention_ok(self.model, self.device, self.dtype)

        self.weight_version = "default"
        self._token_text: dict[int, str] = {}
        self._tok_lock = threading.Lock()
        self._queue: collections.deque[_Sequence | _Control] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="grail-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker; sequences not finished get ``EngineStopped``."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        self._fail_queued(EngineStopped("the engine is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # ---------------------------------------------------------------- tokens

    # The event loop encodes while the worker decodes; HF fast tokenizers can fail with
    # "Already borrowed" when one instance is used from two threads at once, hence the lock.

    def encode(self, text: str) -> list[int]:
        """Tokenize a completion prompt (special tokens added as the tokenizer defines, as vLLM)."""
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=True)["input_ids"])

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render messages with the tokenizer's chat template, then tokenize without adding
        special tokens again (the template already holds them), as vLLM does. Content given as
        a list of ``{"type": "text", "text": ...}`` parts is joined with newlines (as vLLM)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        flat = []
        for message in messages:
            content = message.get("content")
            if isinstance(content, list):
                texts = [p.get("text", "") for p in content if isinstance(p, dict)]
                message = {**message, "content": "\n".join(texts)}
            flat.append(message)
        with self._tok_lock:
            text = self.tokenizer.apply_chat_template(
                flat,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(template_kwargs or {}),
            )
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def token_text(self, token_id: int) -> str:
        """The text of one token on its own (special tokens included), cached."""
        text = self._token_text.get(token_id)
        if text is None:
            with self._tok_lock:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of completion tokens, special tokens (EOS) left out."""
        with self._tok_lock:
            return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    # ---------------------------------------------------------------- requests

    def submit(
        self, prompt: Sequence[int], params: SamplingParams, n: int = 1, seed: int | None = None
    ) -> list[concurrent.futures.Future[SequenceOutput]]:
        """Queue ``n`` samples of one prompt; sample ``i`` is seeded with ``seed + i``."""
        return self.submit_many([prompt], params, n, seed)

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        n: int = 1,
        seed: int | None = None,
    ) -> list[concurrent.futures.Future[SequenceOutput]]:
        """Queue ``n`` samples of each prompt at once, prompt-major; sample ``i`` of every prompt
        is seeded with ``seed + i`` (as vLLM does for a batch of prompts). Queued atomically, so
        the samples of one request are prefilled together when they fit in ``max_batch_size``."""
        if not self.alive:
            raise EngineStopped("the engine is not running")
        seqs = []
        for prompt in prompts:
            base = secrets.randbits(62) if seed is None else seed
            for i in range(n):
                generator = torch.Generator(device=self.device)
                generator.manual_seed((base + i) % (2**64))
                future: concurrent.futures.Future[SequenceOutput] = concurrent.futures.Future()
                seqs.append(_Sequence(tuple(prompt), params, generator, future))
        with self._cond:
            self._queue.extend(seqs)
            self._cond.notify_all()
        return [s.future for s in seqs]

    def update_weights(self, model_path: str | Path, weight_version: str | None = None) -> str:
        """Copy the safetensors weights of ``model_path`` into the live model, in place.

        Reading and checking happen on the calling thread while the engine keeps serving; the
        copy runs on the worker once the running batch has drained. Raises ``WeightUpdateError``
        (old weights intact) on a missing directory, missing files, unknown or missing tensor
        names, or wrong shapes. Returns a human-readable summary.
        """
        start = time.perf_counter()
        tensors = self._read_checkpoint(Path(model_path))
        future: concurrent.futures.Future[None] = concurrent.futures.Future()

        def copy() -> None:
            state = self.model.state_dict()
            with torch.no_grad():
                for name, tensor in tensors.items():
                    state[name].copy_(tensor)
            if weight_version is not None:
                self.weight_version = weight_version

        with self._cond:
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            self._queue.append(_Control(copy, future))
            self._cond.notify_all()
        future.result()
        seconds = time.perf_counter() - start
        return (
            f"loaded {len(tensors)} tensors from {model_path} in {seconds:.2f} s; "
            f"weight_version={self.weight_version}"
        )

    def _read_checkpoint(self, path: Path) -> dict[str, torch.Tensor]:
        if not path.is_dir():
            raise WeightUpdateError(f"model_path {path} is not a directory")
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted({path / f for f in weight_map.values()})
        elif (path / "model.safetensors").is_file():
            files = [path / "model.safetensors"]
        else:
            files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightUpdateError(f"no *.safetensors weights in {path}")

        state = self.model.state_dict()
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            if not file.is_file():
                raise WeightUpdateError(f"{file} is listed in the index but missing")
            try:
                with safe_open(file, framework="pt", device="cpu") as handle:
                    for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                        if name in tensors:
                            raise WeightUpdateError(f"tensor {name} appears twice in {path}")
                        if name not in state:
                            raise WeightUpdateError(
                                f"tensor {name} in {file.name} is not a weight of the served model"
                            )
                        shape = tuple(handle.get_slice(name).get_shape())
                        if shape != tuple(state[name].shape):
                            raise WeightUpdateError(
                                f"tensor {name}: shape {list(shape)} in {file.name}, model has "
                                f"{list(state[name].shape)}"
                            )
                        tensors[name] = handle.get_tensor(name)
            except WeightUpdateError:
                raise
            except Exception as exc:  # corrupt or unreadable file
                raise WeightUpdateError(f"cannot read {file}: {exc}") from exc

        # Every parameter must be covered by at least one of its names (tied weights share one).
        aliases: dict[int, list[str]] = {}
        for name, param in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        missing = [names[0] for names in aliases.values() if not any(n in tensors for n in names)]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise WeightUpdateError(f"{path} lacks {len(missing)} model weights: {shown}")
        return tensors

    # ---------------------------------------------------------------- worker

    def _fail_queued(self, exc: BaseException) -> None:
        with self._cond:
            items = list(self._queue)
            self._queue.clear()
        for item in items:
            if not item.future.done():
                item.future.set_exception(exc)

    def _next_work(self) -> _Control | list[_Sequence] | None:
        """Block until there is work: a control job, or the waiting sequences (up to the cap)."""
        with self._cond:
            while not self._queue and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            if isinstance(self._queue[0], _Control):
                return self._queue.popleft()  # type: ignore[return-value]
        return self._take(self.max_batch_size)

    def _take(self, limit: int) -> list[_Sequence]:
        """Up to ``limit`` queued sequences in arrival order, never past a control job (a
        weight update waits for the batch before it and precedes the requests after it)."""
        taken: list[_Sequence] = []
        with self._cond:
            while self._queue and isinstance(self._queue[0], _Sequence) and len(taken) < limit:
                taken.append(self._queue.popleft())  # type: ignore[arg-type]
        return taken

    def _worker(self) -> None:
        while True:
            work = self._next_work()
            if work is None:
                return
            if isinstance(work, _Control):
                try:
                    work.future.set_result(work.fn())
                except Exception as exc:
                    work.future.set_exception(exc)
                continue
            admitted: list[_Sequence] = []
            try:
                with torch.inference_mode():
                    self._run(work, admitted)
            except Exception as exc:
                logger.exception("generation failed")
                for seq in admitted:
                    if not seq.future.done():
                        seq.future.set_exception(exc)

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
        out = self.model(
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

    def _run(self, seqs: list[_Sequence], admitted: list[_Sequence]) -> None:
        """Decode until no row is left, admitting queued sequences whenever rows free up.

        Every sequence taken is appended to ``admitted`` (so the caller can fail them all if a
        forward raises). Admission stops at a queued control job, so a weight update waits for
        this batch to drain and the batch never mixes weights.
        """
        batch: _Batch | None = None
        new = seqs
        while True:
            if new:
                admitted.extend(new)
                part = self._prefill(new)
                batch = part if batch is None else _merge(batch, part)
            if batch is not None:
                batch = self._compact(batch)
            if self._stopping:
                for seq in admitted:
                    if not seq.future.done():
                        seq.future.set_exception(EngineStopped("the engine is shutting down"))
                return
            # Compacted: every row that is not a filler was running a moment ago.
            live = 0 if batch is None else sum(1 for s in batch.rows if s is not None)
            new = self._take(self.max_batch_size - live) if self.continuous else []
            if new:
                continue  # prefill them so that the next step decodes them too
            if batch is None:
                return
            self._step(batch)

    def _prefill(self, seqs: list[_Sequence]) -> _Batch:
        """Prefill the distinct prompts once (left padding), give each sequence its own row of
        that cache, and sample every sequence's first token."""
        dev = self.device
        uniq: dict[tuple[int, ...], int] = {}
        for seq in seqs:
            uniq.setdefault(seq.prompt, len(uniq))
        prompts = list(uniq)
        prompts += [prompts[0]] * self._fill(len(prompts))
        width = max(len(p) for p in prompts)
        pad_starts = [width - len(p) for p in prompts]
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for r, p in enumerate(prompts):
            ids[r, pad_starts[r] :] = torch.tensor(p, dtype=torch.long)
            mask[r, pad_starts[r] :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        logits = self._forward(ids.to(dev), mask.to(dev), positions.to(dev), cache, pad_starts)

        rows: list[_Sequence | None] = [*seqs, *([None] * self._fill(len(seqs)))]
        index = [uniq[s.prompt] for s in seqs] + [0] * (len(rows) - len(seqs))
        select = torch.tensor(index, device=dev)
        cache.batch_select_indices(select)
        logits = logits[select]
        tokens = [self.pad_id] * len(rows)
        tokens[: len(seqs)] = self._sample_rows(seqs, logits[: len(seqs)])
        return _Batch(
            rows=rows,
            cache=cache,
            mask=mask.to(dev)[select],
            pad_starts=[pad_starts[i] for i in index],
            next_pos=[len(prompts[i]) for i in index],
            tokens=tokens,
        )

    def _compact(self, batch: _Batch) -> _Batch | None:
        """Drop finished rows, keeping as fillers only those the row quantum requires."""
        running = [_running(s) for s in batch.rows]
        live = [r for r, on in enumerate(running) if on]
        if not live:
            return None
        keep = live + [r for r, on in enumerate(running) if not on]
        keep = keep[: len(live) + self._fill(len(live))]
        if len(keep) == len(batch.rows):
            return batch
        index = torch.tensor(keep, device=self.device)
        batch.cache.batch_select_indices(index)
        live_set = set(live)
        return _Batch(
            rows=[batch.rows[r] if r in live_set else None for r in keep],
            cache=batch.cache,
            mask=batch.mask[index],
            pad_starts=[batch.pad_starts[r] for r in keep],
            next_pos=[batch.next_pos[r] for r in keep],
            tokens=[batch.tokens[r] for r in keep],
        )

    def _step(self, batch: _Batch) -> None:
        """Feed every row its last token and sample the next one."""
        dev = self.device
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
        step_ids = torch.tensor(batch.tokens, device=dev).unsqueeze(1)
        step_pos = torch.tensor(batch.next_pos, device=dev).unsqueeze(1)
        logits = self._forward(step_ids, batch.mask, step_pos, batch.cache, batch.pad_starts)
        batch.next_pos = [p + 1 for p in batch.next_pos]
        live = [(r, seq) for r, seq in enumerate(batch.rows) if seq is not None and _running(seq)]
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
            drawn, logprobs, top = _draw(rows, params, [s.generator for s in members])
            for j, (seq, token, logprob) in enumerate(zip(members, drawn, logprobs, strict=True)):
                seq.token_ids.append(token)
                seq.logprobs.append(logprob)
                if top is not None:
                    seq.top_logprobs.append(top[j])
                tokens[index[j]] = token
                self._maybe_finish(seq)
        return tokens

    def _maybe_finish(self, seq: _Sequence) -> None:
        """Resolve ``seq.future`` if its last token ends it (EOS, stop id, stop string, length)."""
        params = seq.params
        token = seq.token_ids[-1]
        reason: str | None = None
        stop_reason: int | str | None = None
        text: str | None = None
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_ids and not params.ignore_eos:
            reason = "stop"
        elif params.stop:
            full = self.decode(seq.token_ids)
            # Only text new since the last step can complete a stop string.
            since = max(0, seq.text_len - max(len(s) for s in params.stop))
            seq.text_len = len(full)
            hits = [(full.find(s, since), s) for s in params.stop if full.find(s, since) >= 0]
            if hits:
                cut, stop_reason = min(hits)
                reason, text = "stop", full[:cut]
        if reason is None and len(seq.token_ids) >= params.max_tokens:
            reason = "length"
        if reason is None:
            return
        if text is None:
            text = self.decode(seq.token_ids)
        _resolve(
            seq.future,
            SequenceOutput(
                token_ids=list(seq.token_ids),
                logprobs=list(seq.logprobs),
                top_logprobs=list(seq.top_logprobs) if params.logprobs else None,
                text=text,
                finish_reason=reason,
                stop_reason=stop_reason,
            ),
        )
