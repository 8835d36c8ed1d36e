"""The built-in server's answers: the OpenAI completion and chat completion bodies (choices,
vLLM's logprobs, usage), and their JSON encoding choice by choice for large answers (`app` builds
those off the event loop). Logprobs of ``-inf`` are sent as -9999.0, as vLLM does."""

from __future__ import annotations

import itertools
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson

from grail.inference.builtin.schema import ChatCompletionRequest, CompletionRequest
from grail.inference.builtin.sequences import SequenceOutput

LOGPROB_FLOOR = -9999.0  # what vLLM sends instead of -inf


def usage(prompts: list[list[int]], outs: list[SequenceOutput]) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_answer(
    req: CompletionRequest,
    prompts: list[list[int]],
    outs: list[SequenceOutput],
    model: str,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """The ``/v1/completions`` body: choice ``p * n + i`` is sample ``i`` of prompt ``p``."""
    choices = []
    for idx, out in enumerate(outs):
        choice: dict[str, Any] = {
            "index": idx,
            "text": out.text,
            "logprobs": None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        if req.logprobs is not None:
            choice["logprobs"] = completion_logprobs(
                out, token_namer(token_text, req.return_tokens_as_token_ids)
            )
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
            choice["prompt_token_ids"] = prompts[idx // req.n]
        choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage(prompts, outs),
    }


def chat_answer(
    req: ChatCompletionRequest,
    prompt: list[int],
    outs: list[SequenceOutput],
    model: str,
    token_text: Callable[[int], str],
) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body."""
    namer = token_namer(token_text, req.return_tokens_as_token_ids)
    choices = []
    for idx, out in enumerate(outs):
        choice: dict[str, Any] = {
            "index": idx,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": {"content": chat_logprobs(out, namer)} if req.logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        if req.return_token_ids:
            choice["token_ids"] = out.token_ids
        choices.append(choice)
    response: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage([prompt], outs),
    }
    if req.return_token_ids:
        response["prompt_token_ids"] = prompt
    return response


def encode_by_choice(answer: dict[str, Any]) -> bytes:
    """``answer`` as JSON, its choices encoded one at a time: an encoder holds the GIL until it
    returns (it is C), so the event loop and the engine wait for one choice's encoding at most
    rather than the whole answer's (tens of MB with logprobs). orjson: 14x json's speed here;
    its numbers read back to the same floats (the log-probs are finite: `_clamp`)."""

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value)

    rest = dumps({k: v for k, v in answer.items() if k != "choices"})
    choices = b",".join(dumps(choice) for choice in answer["choices"])
    return rest[:-1] + b',"choices":[' + choices + b"]}"


def token_namer(token_text: Callable[[int], str], as_ids: bool) -> Callable[[int], str]:
    """How a token is named in logprobs: its text (``token_text``: `Engine.token_text`), or
    ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``), which keeps distinct tokens with the
    same text apart."""
    return (lambda t: f"token_id:{t}") if as_ids else token_text


def completion_logprobs(out: SequenceOutput, name: Callable[[int], str]) -> dict[str, Any]:
    """vLLM's completion logprobs: per token its name, logprob, text offset, and a dict of the
    sampled token followed by the top-k alternatives (tokens with the same name share a key)."""
    tokens = [name(t) for t in out.token_ids]
    logprobs = [_clamp(x) for x in out.logprobs]
    top: list[dict[str, float]] = [{text: lp} for text, lp in zip(tokens, logprobs, strict=True)]
    for step, alternatives in zip(top, out.top_logprobs or (), strict=False):
        for alt, lp in alternatives:
            step.setdefault(name(alt), _clamp(lp))
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": top,
        "text_offset": list(itertools.accumulate(map(len, tokens), initial=0))[:-1],
    }


def chat_logprobs(out: SequenceOutput, name: Callable[[int], str]) -> list[dict[str, Any]]:
    """OpenAI chat logprobs: ``[{token, logprob, bytes, top_logprobs: [...]}]``."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = name(token)
        return {"token": text, "logprob": _clamp(logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for j, token in enumerate(out.token_ids):
        alts = out.top_logprobs[j] if out.top_logprobs else []
        content.append(
            {**entry(token, out.logprobs[j]), "top_logprobs": [entry(a, lp) for a, lp in alts]}
        )
    return content


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR) if not math.isnan(logprob) else LOGPROB_FLOOR
