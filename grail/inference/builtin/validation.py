"""A request's fields checked and turned into what the engine takes: `SamplingParams`, prompts
as token ids within the vocabulary and the context. Every refusal is an `APIError` (400) naming
the field, as vLLM does; unsupported features are refused rather than silently ignored."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from grail.core.http_api import APIError
from grail.inference.builtin.engine import Engine
from grail.inference.builtin.prefix_cache import Span, check_spans
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.builtin.schema import CompletionRequest, SamplingRequest

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


def check_unsupported(req: SamplingRequest) -> None:
    neutral: dict[str, Any] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
    }
    for name, value in neutral.items():
        got = getattr(req, name)
        if got is not None and got != value:
            raise APIError(f"{name}={got} is not supported by the built-in server", param=name)
    # vLLM extras that change results; anything else unknown is ignored, as vLLM does.
    extras_neutral: dict[str, Any] = {
        "min_tokens": 0,
        "include_stop_str_in_output": False,
        "prompt_logprobs": None,
        "use_beam_search": False,
        "skip_special_tokens": True,
    }
    for name, value in extras_neutral.items():
        got = (req.model_extra or {}).get(name, value)
        if got != value:
            raise APIError(f"{name}={got} is not supported by the built-in server", param=name)
    if req.logit_bias:
        raise APIError("logit_bias is not supported by the built-in server", param="logit_bias")
    if req.stream:
        raise APIError("stream=true is not supported by the built-in server", param="stream")
    if isinstance(req, CompletionRequest):
        if req.echo:
            raise APIError("echo=true is not supported by the built-in server", param="echo")
        if req.best_of not in (None, req.n):
            raise APIError("best_of is not supported by the built-in server", param="best_of")
        if req.suffix:
            raise APIError("suffix is not supported by the built-in server", param="suffix")


def sampling_params(
    req: SamplingRequest, max_tokens: int, logprobs: int | None, engine: Engine
) -> SamplingParams:
    if req.n < 1:
        raise APIError(f"n must be at least 1, got {req.n}", param="n")
    if max_tokens < 1:
        raise APIError(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        raise APIError(
            f"temperature must be a finite number >= 0, got {req.temperature}",
            param="temperature",
        )
    if not (0.0 < req.top_p <= 1.0):
        raise APIError(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    top_k = req.top_k if req.top_k is not None else 0
    if top_k < -1:
        raise APIError(f"top_k must be -1, 0 (off) or >= 1, got {top_k}", param="top_k")
    if logprobs is not None and not (0 <= logprobs <= MAX_LOGPROBS):
        raise APIError(
            f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", param="logprobs"
        )
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if any(s == "" for s in stop):
        raise APIError("stop strings must not be empty", param="stop")
    stop_ids = list(req.stop_token_ids or [])
    for t in stop_ids:
        if not (0 <= t < engine.vocab_size):
            raise APIError(
                f"stop_token_ids: {t} is outside the vocabulary [0, {engine.vocab_size})",
                param="stop_token_ids",
            )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(top_k, 0),
        stop=tuple(stop),
        stop_token_ids=tuple(stop_ids),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )


def prompt_items(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts as sent: texts or token-id lists (a list of ids is one prompt)."""
    raw = req.prompt
    items: list[str | list[int]]
    if isinstance(raw, str):
        items = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        items = [list(raw)]  # type: ignore[arg-type]
    else:
        items = list(raw)  # type: ignore[arg-type]
    if not items:
        raise APIError("prompt is empty", param="prompt")
    return items


def prompt_ids(items: list[str | list[int]], engine: Engine) -> list[list[int]]:
    """The prompts as token-id lists, texts tokenized (slow for long texts: call it off the
    event loop when there are any), checked against the vocabulary."""
    prompts = []
    for p, item in enumerate(items):
        ids = engine.encode(item) if isinstance(item, str) else item
        if not ids:
            raise APIError(f"prompt {p} is empty", param="prompt")
        if min(ids) < 0 or max(ids) >= engine.vocab_size:  # C loops; the message needs a Python one
            bad = next(t for t in ids if not (0 <= t < engine.vocab_size))
            raise APIError(
                f"prompt {p}: token id {bad} is outside the vocabulary [0, {engine.vocab_size})",
                param="prompt",
            )
        prompts.append(ids)
    return prompts


def check_seeds(req: CompletionRequest, prompts: int) -> None:
    if req.seeds is None:
        return
    if req.seed is not None:
        raise APIError(
            "seed and seeds are exclusive: send seeds (one per prompt) or seed, not both",
            param="seeds",
        )
    if len(req.seeds) != prompts:
        raise APIError(
            f"seeds has {len(req.seeds)} entries but the request has {prompts} prompt(s): "
            "send one seed per prompt",
            param="seeds",
        )


def sampled_spans(req: CompletionRequest, prompts: list[list[int]]) -> list[list[Span]] | None:
    """The request's `sampled_spans`, checked against its prompts (400 naming the field)."""
    if req.sampled_spans is None:
        return None
    if len(req.sampled_spans) != len(prompts):
        raise APIError(
            f"sampled_spans has {len(req.sampled_spans)} entries but the request has "
            f"{len(prompts)} prompt(s): send one list of spans per prompt",
            param="sampled_spans",
        )
    checked = []
    for p, (spans, prompt) in enumerate(zip(req.sampled_spans, prompts, strict=True)):
        try:
            checked.append(list(check_spans(spans, len(prompt))))
        except ValueError as exc:
            raise APIError(f"sampled_spans of prompt {p}: {exc}", param="sampled_spans") from None
    return checked


def check_context(prompt: Sequence[int], max_tokens: int, engine: Engine) -> None:
    if len(prompt) + max_tokens > engine.max_model_len:
        raise APIError(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
            f"{max_tokens} in the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
        )
