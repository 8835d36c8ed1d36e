"""The generation engine behind the built-in server: one worker thread owns the model.

What a token's logprob means and how tokens are drawn: `sampling` (the trainer relies on it, see
docs/protocols.md). Batch invariance (row-wise attention, the row quantum): `invariance`.

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

Batch invariance (default on CPU, see `invariance`): attention runs row by row over each row's
own tokens, and batches always hold a multiple of the measured row quantum, so a request's tokens
and logprobs are bitwise identical whether it runs alone or batched with others.

Decode modes (``decode``): "eager" (the above, `eager`; default on CPU), and "graph" (default on
CUDA) or "static": a preallocated KV cache, fixed-shape steps that keep their state on the device,
host reads every few steps, and with "graph" on CUDA each step a CUDA graph replay (see `static`).
The queue both take sequences from: `work_queue`.

Weight updates load the new safetensors on the caller's thread (serving continues), then the
worker copies them into the live parameters once the running batch has drained (sequences queued
after the update are not admitted before it): a batch never mixes weights.
"""

from __future__ import annotations

import concurrent.futures
import logging
import secrets
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grail.inference.builtin.eager import EagerDecoder
from grail.inference.builtin.invariance import (
    ROWWISE_ATTENTION,
    group_attention_ok,
    head_layout,
    linear_row_quantum,
)
from grail.inference.builtin.lora import (
    adapter_settings,
    add_lora_layers,
    copy_adapter,
    is_adapter_dir,
    read_adapter,
)
from grail.inference.builtin.prefix_cache import PrefixCache, check_spans
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.builtin.sequences import (
    EngineStopped,
    SequenceOutput,
    _Control,
    _Sequence,
    maybe_finish,
)
from grail.inference.builtin.slots import SLOT_ATTENTION
from grail.inference.builtin.static import StaticDecoder, resolve_decode
from grail.inference.builtin.weights import read_checkpoint
from grail.inference.builtin.work_queue import WorkQueue

logger = logging.getLogger(__name__)


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


def _kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in the KV cache of a model with `config`."""
    _, kv_heads, head_dim = head_layout(config)
    size = torch.empty((), dtype=dtype).element_size()
    return int(config.num_hidden_layers * 2 * kv_heads * head_dim * size)


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """float32 on CPU and bfloat16 on CUDA unless ``name`` says otherwise."""
    if name is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


class Engine:
    """Loads an HF causal LM and serves generation requests from one worker thread.

    It composes the queue (`work_queue`) and the decoders (`eager`, `static`), and is the host
    they decode for (`host.DecodeHost`: the model, its settings, `take`, `finish`)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str | None = None,
        max_batch_size: int = 256,
        batch_invariant: bool | None = None,
        max_model_len: int | None = None,
        lora_dir: str | Path | None = None,
        decode: str | None = None,
        prefix_cache_mb: float = 1024.0,
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
        if not prefix_cache_mb >= 0:
            raise ValueError(
                f"prefix_cache_mb must be >= 0 (0: keep nothing), got {prefix_cache_mb}"
            )
        self.dtype = resolve_dtype(dtype, self.device)

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(
            self.model_dir, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model: PreTrainedModel = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers types .to's wrapper as taking the model
        self.model.requires_grad_(False)
        if lora_dir is not None:
            # Before the batch-invariance probes below, which measure every linear layer: the
            # LoRA layers' own included. Later adapter syncs copy into these layers.
            lora_dir = Path(lora_dir)
            add_lora_layers(self.model, adapter_settings(lora_dir))
            copy_adapter(self.model, read_adapter(lora_dir, self.model))
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

        self.decode_mode = resolve_decode(decode, self.device, batch_invariant, config)
        if self.decode_mode != "eager":
            batch_invariant = False
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
                self.group_attention = group_attention_ok(self.model, self.device, self.dtype)

        # Only where a hit and a miss give the same numbers (`prefix_cache`): batch-invariant
        # eager decoding. Without memory for it (0 MB) continued prompts are replayed, so that
        # the numbers never depend on the cache.
        self.prefix_cache: PrefixCache | None = None
        if self.batch_invariant:
            per_token = _kv_bytes_per_token(config, self.dtype)
            self.prefix_cache = PrefixCache(int(prefix_cache_mb * 2**20 // per_token))

        self._queue = WorkQueue()
        self._eager = EagerDecoder(
            self,
            row_quantum=self.row_quantum,
            batch_invariant=self.batch_invariant,
            group_attention=self.group_attention,
            continuous=self.continuous,
            prefix_cache=self.prefix_cache,
        )
        self._static: StaticDecoder | None = None
        if self.decode_mode != "eager":
            self.model.set_attn_implementation(SLOT_ATTENTION)
            self._static = StaticDecoder(
                self, self._eager.prefill, graphs=self.decode_mode == "graph"
            )

        self.weight_version = "default"
        self._token_text: dict[int, str] = {}
        self._tok_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="grail-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the worker; sequences not finished get ``EngineStopped``."""
        self._queue.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        self._queue.fail_all(EngineStopped("the engine is shutting down"))

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.stopping

    @property
    def stopping(self) -> bool:
        """True once `stop` was called (`host.DecodeHost`)."""
        return self._queue.stopping

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
                text = self._decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of completion tokens, special tokens (EOS) left out."""
        with self._tok_lock:
            return self._decode(list(token_ids), skip_special_tokens=True)

    def _decode(self, token_ids: list[int], *, skip_special_tokens: bool) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence of ids in, one text out
        return text

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
        seeds: Sequence[int] | None = None,
        spans: Sequence[Sequence[Sequence[int]]] | None = None,
    ) -> list[concurrent.futures.Future[SequenceOutput]]:
        """Queue ``n`` samples of each prompt at once, prompt-major; sample ``i`` of every prompt
        is seeded with ``seed + i`` (as vLLM does for a batch of prompts), or, given ``seeds``
        (one per prompt, not with ``seed``), sample ``i`` of prompt ``p`` with ``seeds[p] + i``.
        Queued atomically, so the samples of one request are prefilled together when they fit
        in ``max_batch_size``. ``spans``, one list per prompt: the [start, end) positions of
        its tokens that were sampled (`prefix_cache`; empty for an episode's first turn): the
        prompt is computed in their units, from a cached prefix when there is one (the same
        numbers, sooner), and the samples' keys and values are kept for the request that
        continues them; ignored where the engine is not batch-invariant. Without ``spans``
        nothing is kept."""
        if seeds is not None and (seed is not None or len(seeds) != len(prompts)):
            raise ValueError("seeds needs one seed per prompt, and no seed")
        if spans is not None and len(spans) != len(prompts):
            raise ValueError(f"spans needs one list per prompt: {len(spans)} for {len(prompts)}")
        keep = spans is not None and self.prefix_cache is not None
        sampled = [
            check_spans(s, len(p)) if self.prefix_cache is not None else ()
            for p, s in zip(prompts, spans or [[]] * len(prompts), strict=True)
        ]
        if not self.alive:
            raise EngineStopped("the engine is not running")
        seqs = []
        if seeds is None:
            seeds = [secrets.randbits(62) if seed is None else seed for _ in prompts]
        for prompt, base, spans_p in zip(prompts, seeds, sampled, strict=True):
            for i in range(n):
                generator = torch.Generator(device=self.device)
                generator.manual_seed((base + i) % (2**64))
                future: concurrent.futures.Future[SequenceOutput] = concurrent.futures.Future()
                seqs.append(_Sequence(tuple(prompt), params, generator, future, spans_p, keep=keep))
        self._queue.put_sequences(seqs)
        return [s.future for s in seqs]

    def update_weights(self, model_path: str | Path, weight_version: str | None = None) -> str:
        """Copy the safetensors weights of ``model_path`` into the live model, in place.

        Reading and checking happen on the calling thread while the engine keeps serving; the
        copy runs on the worker once the running batch has drained. Raises ``WeightUpdateError``
        (old weights intact) on a missing directory, missing files, unknown or missing tensor
        names, or wrong shapes. Returns a human-readable summary.
        """
        start = time.perf_counter()
        path = Path(model_path)
        adapter = is_adapter_dir(path)  # a LoRA adapter (lora.py), or the whole model
        tensors = read_adapter(path, self.model) if adapter else read_checkpoint(path, self.model)
        what = f"{'adapter ' if adapter else ''}tensors from {model_path}"
        return self.copy_weights(tensors, weight_version, what, adapter=adapter, start=start)

    def copy_weights(
        self,
        tensors: dict[str, torch.Tensor],
        weight_version: str | None,
        what: str,
        *,
        adapter: bool = False,
        start: float | None = None,
    ) -> str:
        """Copy checked `tensors` ({state-dict name: tensor}, or an adapter's {parameter name:
        tensor}) into the live model on the worker, between batches, and wait until done (on
        CUDA, synchronized: the tensors may be another process's memory, reused once we
        answer). Returns the summary the server logs."""
        start = time.perf_counter() if start is None else start
        future: concurrent.futures.Future[None] = concurrent.futures.Future()

        def copy() -> None:
            if adapter:
                copy_adapter(self.model, tensors)
            else:
                state = self.model.state_dict()
                with torch.no_grad():
                    for name, tensor in tensors.items():
                        state[name].copy_(tensor)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            if weight_version is not None:
                self.weight_version = weight_version

        self._queue.put_control(_Control(copy, future))
        future.result()
        seconds = time.perf_counter() - start
        return (
            f"loaded {len(tensors)} {what} in {seconds:.2f} s; weight_version={self.weight_version}"
        )

    def clear_prefix_cache(self) -> None:
        """Empty the prefix cache, on the worker between batches (as after a weight update)."""
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._queue.put_control(_Control(lambda: None, future))
        future.result()

    # ---------------------------------------------------------------- the decoders' host

    def take(self, limit: int) -> list[_Sequence]:
        """Up to ``limit`` queued sequences in arrival order, never past a control job (a
        weight update waits for the batch before it and precedes the requests after it)."""
        return self._queue.take(limit)

    def finish(self, seq: _Sequence) -> None:
        """Resolve ``seq.future`` if its last token ends it (`sequences.maybe_finish`)."""
        maybe_finish(seq, self.eos_ids, self.decode)

    # ---------------------------------------------------------------- worker

    def _worker(self) -> None:
        while True:
            work = self._queue.next_work(self.max_batch_size)
            if work is None:
                return
            if isinstance(work, _Control):
                try:
                    work.future.set_result(work.fn())
                except Exception as exc:
                    work.future.set_exception(exc)
                if self._static is not None:
                    self._static.weights_changed()
                if self.prefix_cache is not None:
                    self.prefix_cache.clear()  # keys and values of the old weights
                continue
            admitted: list[_Sequence] = []
            try:
                decoder = self._eager if self._static is None else self._static
                with torch.inference_mode():
                    decoder.run(work, admitted)
            except Exception as exc:
                logger.exception("generation failed")
                for seq in admitted:
                    if not seq.future.done():
                        seq.future.set_exception(exc)
