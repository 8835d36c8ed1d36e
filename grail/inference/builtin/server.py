"""``grail-serve``: an OpenAI-compatible HTTP server around the built-in generation engine.

It speaks the subset of vLLM's protocol the harness uses (see docs/protocols.md), so one
client path serves the built-in server, vLLM and SGLang:

- ``GET /health``: 200 once the engine runs, 503 if its worker died.
- ``GET /v1/models``: the served model card (with ``max_model_len``, ``weight_version`` and
  ``batch_invariant``).
- ``POST /v1/completions``: prompt as text, token ids, or a batch of either; ``n``,
  ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``stop_token_ids``,
  ``ignore_eos``, ``logprobs`` (k alternatives), ``return_token_ids``,
  ``return_tokens_as_token_ids`` (logprob entries named ``token_id:N``: distinct tokens can
  share a text). Choices are prompt-major: choice ``p * n + i`` is sample ``i`` of prompt ``p``.
  Extension: ``seeds`` (a list of ints, one per prompt, instead of ``seed``) samples prompt ``p``'s
  sample ``i`` with ``seeds[p] + i``, exactly what a request for prompt ``p`` alone with
  ``seed=seeds[p]`` gives (``seed`` gives every prompt the same ``seed + i``, as vLLM does). It
  lets a client batch many prompts into one request with the seeds of one request per prompt;
  ``seeds`` with ``seed``, or of another length than the prompts, is a 400 naming ``seeds``.
- ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template;
  ``logprobs: true`` (+ ``top_logprobs: k``) gives ``logprobs.content``.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?}`` (SGLang's shape):
  in-place weight reload, ``{"success", "message"}``, HTTP 400 when refused.
- ``POST /update_weights_from_tensor`` ``{"serialized_named_tensors", "weight_version"?,
  "device_uuid"?}`` (SGLang's shape): the same, from the trainer's tensors in shared memory or
  CUDA IPC rather than from disk (``tensor_update.py``).

Security and availability (``Limits``, docs/protocols.md): with ``--api-key`` every route but
``GET /health`` needs ``Authorization: Bearer <key>`` (401 otherwise), the weight reload included;
there is no ``/docs``, ``/redoc`` or ``/openapi.json``. A body over ``--max-request-bytes`` gets
413 before it is read; ``n``, the tokens one request may generate and the sequences waiting in the
engine are bounded (400 naming the flag, 503 while the engine's queue is full). Tokenizer work and
the building of large answers run off the event loop, so ``/health`` keeps answering.

Logprobs are log-softmax(logits / T) before top-k/top-p (see ``engine``'s docstring); ``-inf``
is sent as -9999.0 as vLLM does. Errors use the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``. Unsupported features (streaming, echo,
penalties, ``best_of``, ``logit_bias``, ``min_p``, ``min_tokens``, ``prompt_logprobs``, ...) are
refused with a 400 naming the field rather than silently ignored; other unknown fields are
ignored, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import itertools
import json
import logging
import math
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from grail.core.http_api import APIError, Gate, describe_validation_errors, error_response
from grail.inference.builtin.engine import Engine, EngineStopped, SequenceOutput
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.builtin.tensor_update import add_tensor_route
from grail.inference.builtin.weights import WeightUpdateError

logger = logging.getLogger("grail.serve")

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
LOGPROB_FLOOR = -9999.0  # what vLLM sends instead of -inf
# --------------------------------------------------------------------------- limits

# 8 MiB holds about 1.2 million token ids as JSON (at most 7 bytes each with the comma): the
# harness's largest request, 256 sequences of which n share a prompt, carries 256 / n prompts, so
# 8 MiB is 128 prompts of 9k tokens at n=2, or 16 of 75k tokens at n=16. It parses in ~0.15 s.
DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_MAX_N = 1024  # GRPO groups are 2 to a few hundred samples
# The harness's client keeps at most 64 requests (generation.max_concurrency) of at most 256
# sequences (the batch size) in flight: 64 full batches waiting are what it sends at most.
QUEUED_BATCHES = 64
# Answers of more generated tokens than this are built off the event loop (tens of ms inline).
INLINE_ANSWER_TOKENS = 16384


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server, and how much work may wait in it; each field is
    the `grail-serve` flag of the same name (`for_engine` gives the defaults)."""

    max_request_bytes: int
    max_n: int
    #: prompts x n x max_tokens of one request
    max_request_tokens: int
    #: sequences submitted and not finished (waiting or decoding)
    max_queued_seqs: int

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")

    @classmethod
    def for_engine(
        cls,
        max_batch_size: int,
        max_model_len: int,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_n: int = DEFAULT_MAX_N,
        max_request_tokens: int | None = None,
        max_queued_seqs: int | None = None,
    ) -> Limits:
        """The limits of a server with this batch size and context; None sizes a limit to them:
        a request may generate one full batch (max_batch_size sequences of max_model_len tokens,
        so a request the engine can decode at once is never refused), and 64 full batches may
        wait."""
        return cls(
            max_request_bytes=max_request_bytes,
            max_n=max_n,
            max_request_tokens=(
                max_batch_size * max_model_len if max_request_tokens is None else max_request_tokens
            ),
            max_queued_seqs=(
                QUEUED_BATCHES * max_batch_size if max_queued_seqs is None else max_queued_seqs
            ),
        )


def _check_request_size(limits: Limits, prompts: int, n: int, max_tokens: int) -> None:
    """400 naming the limit and its flag when a request asks too much; before any tokenizing."""
    if n > limits.max_n:
        raise APIError(
            f"n={n} is more than this server allows per prompt (--max-n {limits.max_n})",
            param="n",
        )
    sequences = prompts * n
    if sequences > limits.max_queued_seqs:
        raise APIError(
            f"the request asks for {sequences} sequences ({prompts} prompt(s) x n={n}), more "
            f"than the server ever holds at once (--max-queued-seqs {limits.max_queued_seqs}); "
            "split the prompts over several requests",
            param="prompt" if prompts > 1 else "n",
        )
    tokens = sequences * max_tokens
    if tokens > limits.max_request_tokens:
        raise APIError(
            f"the request may generate {tokens} tokens ({prompts} prompt(s) x n={n} x "
            f"max_tokens={max_tokens}), more than one request may "
            f"(--max-request-tokens {limits.max_request_tokens}); lower n or max_tokens, or "
            "split the prompts over several requests",
            param="max_tokens",
        )


class _Admission:
    """Counts the sequences submitted to the engine and not finished (waiting or decoding), and
    refuses a request that would take them past the limit: 503, since the same request succeeds
    once the engine has worked through its queue (the harness's client retries 503)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.unfinished = 0
        self._lock = threading.Lock()

    def reserve(self, count: int) -> None:
        with self._lock:
            if self.unfinished + count > self.limit:
                raise APIError(
                    f"the server is busy: {self.unfinished} sequences are waiting or decoding and "
                    f"this request adds {count}, more than --max-queued-seqs {self.limit} in "
                    "all; retry later",
                    status=503,
                )
            self.unfinished += count

    def release(self, count: int) -> None:
        with self._lock:
            self.unfinished -= count


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token stands for: a text of more than ``max_model_len`` times this
    cannot fit the context, whatever it tokenizes to. Vocabulary entries spell a byte-level BPE
    token one character per byte (a text character is at least one byte), a SentencePiece one
    with its own characters, so an entry is never shorter than the text it matches."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)


def _check_text_length(chars: int, limit: int, what: str, param: str) -> None:
    if chars > limit:
        raise APIError(
            f"{what} has {chars} characters, more than the model's context can hold (at most "
            f"{limit} characters: the context length in tokens times the longest token); "
            "shorten it",
            param=param,
        )


def _message_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' contents (text parts of list contents included)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            texts = (part.get("text") for part in content if isinstance(part, dict))
            total += sum(len(text) for text in texts if isinstance(text, str))
    return total


# --------------------------------------------------------------------------- request models

# Lists are validated fail-fast (the first wrong element ends it): otherwise pydantic builds an
# error per wrong element, per branch of a union, and a body of a million floats as a prompt held
# the event loop for 90 s. A dict of unsupported settings is kept unvalidated for the same reason.
_Ids = Annotated[list[int], Field(fail_fast=True)]
_Texts = Annotated[list[str], Field(fail_fast=True)]


class _SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions. Unknown fields are ignored (as vLLM)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: str | _Texts | None = None
    stop_token_ids: _Ids | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    # Accepted only at their neutral value: the engine does not implement them.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, Any] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | _Ids | _Texts | Annotated[list[_Ids], Field(fail_fast=True)]
    seeds: _Ids | None = None  # extension: one seed per prompt (see the module docstring)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[dict[str, Any]], Field(fail_fast=True)]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model_path: str = Field(min_length=1)
    weight_version: str | None = None


# --------------------------------------------------------------------------- validation


def _check_unsupported(req: _SamplingRequest) -> None:
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


def _sampling_params(
    req: _SamplingRequest, max_tokens: int, logprobs: int | None, engine: Engine
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


def _prompt_items(req: CompletionRequest) -> list[str | list[int]]:
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


def _prompt_ids(items: list[str | list[int]], engine: Engine) -> list[list[int]]:
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


def _check_seeds(req: CompletionRequest, prompts: int) -> None:
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


def _check_context(prompt: Sequence[int], max_tokens: int, engine: Engine) -> None:
    if len(prompt) + max_tokens > engine.max_model_len:
        raise APIError(
            f"This model's maximum context length is {engine.max_model_len} tokens. However, you "
            f"requested {len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, "
            f"{max_tokens} in the completion). Reduce the prompt or max_tokens.",
            param="max_tokens",
        )


def _clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR) if not math.isnan(logprob) else LOGPROB_FLOOR


# --------------------------------------------------------------------------- app


def create_app(
    engine: Engine,
    served_model_name: str,
    api_key: str | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The FastAPI app; it starts the engine's worker on startup and stops it on shutdown.

    ``api_key``: every route but ``/health`` needs it as a Bearer token (None: no key).
    ``limits``: see `Limits` (None: the defaults for this engine)."""
    limits = limits or Limits.for_engine(engine.max_batch_size, engine.max_model_len)
    admission = _Admission(limits.max_queued_seqs)
    max_prompt_chars = engine.max_model_len * _longest_token_chars(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    # No /docs, /redoc or /openapi.json: the protocol is documented in docs/protocols.md, and a
    # server with a key answers nothing but /health without it.
    app = FastAPI(
        title="grail-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message, param = describe_validation_errors(errors)
        if (param or "").split(".")[0] == "prompt":
            message = (
                "prompt must be a string, a list of token ids, a list of strings or a list of "
                "token-id lists"
            )
            param = "prompt"
        if request.url.path == "/update_weights_from_disk":
            return JSONResponse({"success": False, "message": message}, status_code=400)
        return error_response(message, 400, param)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn still logs the traceback.
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    app.add_middleware(Gate, api_key=api_key, max_body_bytes=limits.max_request_bytes)

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(f"The model `{name}` does not exist.", status=404, param="model")

    async def run(
        prompts: list[list[int]],
        params: SamplingParams,
        n: int,
        seed: int | None,
        seeds: list[int] | None = None,
    ) -> list[SequenceOutput]:
        """All samples, prompt-major; the event loop only waits on the engine's futures."""
        count = len(prompts) * n
        admission.reserve(count)
        try:
            futures = engine.submit_many(prompts, params, n=n, seed=seed, seeds=seeds)
            await _all_done(futures)
            return [f.result() for f in futures]
        except EngineStopped as exc:
            raise APIError(str(exc), status=503) from exc
        finally:
            admission.release(count)

    async def answer(build: Callable[[], dict[str, Any]], outs: list[SequenceOutput]) -> Response:
        """The JSON answer; a large one is built and encoded off the event loop, choice by choice
        (`_encode_by_choice`), so that ``/health`` and other requests are not held up meanwhile.
        A JSONResponse is sent as is; a dict would first be walked by jsonable_encoder."""
        if sum(len(o.token_ids) for o in outs) <= INLINE_ANSWER_TOKENS:
            return JSONResponse(build())
        body = await asyncio.to_thread(lambda: _encode_by_choice(build()))
        return Response(body, media_type="application/json")

    def usage(prompts: list[list[int]], outs: list[SequenceOutput]) -> dict[str, int]:
        prompt_tokens = sum(len(p) for p in prompts)
        completion_tokens = sum(len(o.token_ids) for o in outs)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "grail",
            "root": str(engine.model_dir),
            "parent": None,
            "max_model_len": engine.max_model_len,
            "weight_version": engine.weight_version,
            "batch_invariant": engine.batch_invariant,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Response:
        check_model(req.model)
        _check_unsupported(req)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        params = _sampling_params(req, max_tokens, req.logprobs, engine)
        items = _prompt_items(req)
        _check_request_size(limits, len(items), req.n, max_tokens)
        _check_seeds(req, len(items))
        texts = [(p, item) for p, item in enumerate(items) if isinstance(item, str)]
        for p, text in texts:
            _check_text_length(len(text), max_prompt_chars, f"prompt {p}", "prompt")
        # Tokenizing runs off the event loop (the tokenizer releases the GIL while it works).
        prompts = (
            await asyncio.to_thread(_prompt_ids, items, engine)
            if texts
            else _prompt_ids(items, engine)
        )
        for p in prompts:
            _check_context(p, max_tokens, engine)
        outs = await run(prompts, params, req.n, req.seed, req.seeds)
        return await answer(lambda: completion_answer(req, prompts, outs), outs)

    def completion_answer(
        req: CompletionRequest, prompts: list[list[int]], outs: list[SequenceOutput]
    ) -> dict[str, Any]:
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
                choice["logprobs"] = _completion_logprobs(
                    out, _token_namer(engine, req.return_tokens_as_token_ids)
                )
            if req.return_token_ids:
                choice["token_ids"] = out.token_ids
                choice["prompt_token_ids"] = prompts[idx // req.n]
            choices.append(choice)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": served_model_name,
            "choices": choices,
            "usage": usage(prompts, outs),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> Response:
        check_model(req.model)
        _check_unsupported(req)
        if not req.messages:
            raise APIError("messages is empty", param="messages")
        if (req.model_extra or {}).get("seeds") is not None:
            raise APIError("seeds is only supported on /v1/completions; use seed", param="seeds")
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
        requested = req.max_completion_tokens or req.max_tokens
        # n first, before any rendering; max_tokens is known once the prompt is.
        _check_request_size(limits, 1, req.n, max(requested or 1, 1))
        _check_text_length(_message_chars(req.messages), max_prompt_chars, "messages", "messages")
        try:
            prompt = await asyncio.to_thread(
                engine.render_chat,
                req.messages,
                req.add_generation_prompt,
                req.chat_template_kwargs,
            )
        except Exception as exc:  # template errors name the problem in the message
            raise APIError(f"cannot render messages: {exc}", param="messages") from exc
        if not prompt:
            raise APIError("the rendered prompt is empty", param="messages")
        # Unset: the rest of the context, as vLLM (a prompt that fills it fails the check below).
        max_tokens = (
            requested if requested is not None else max(1, engine.max_model_len - len(prompt))
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(req, max_tokens, logprobs, engine)
        _check_request_size(limits, 1, req.n, max_tokens)
        _check_context(prompt, max_tokens, engine)
        outs = await run([prompt], params, req.n, req.seed)
        return await answer(lambda: chat_answer(req, prompt, outs), outs)

    def chat_answer(
        req: ChatCompletionRequest, prompt: list[int], outs: list[SequenceOutput]
    ) -> dict[str, Any]:
        namer = _token_namer(engine, req.return_tokens_as_token_ids)
        choices = []
        for idx, out in enumerate(outs):
            choice: dict[str, Any] = {
                "index": idx,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": {"content": _chat_logprobs(out, namer)} if req.logprobs else None,
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
            "model": served_model_name,
            "choices": choices,
            "usage": usage([prompt], outs),
        }
        if req.return_token_ids:
            response["prompt_token_ids"] = prompt
        return response

    @app.post("/update_weights_from_disk")
    async def update_weights(req: UpdateWeightsRequest) -> JSONResponse:
        try:
            message = await asyncio.to_thread(
                engine.update_weights, req.model_path, req.weight_version
            )
        except WeightUpdateError as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
        except EngineStopped as exc:
            return JSONResponse({"success": False, "message": str(exc)}, status_code=503)
        logger.info("weights updated: %s", message)
        return JSONResponse({"success": True, "message": message})

    add_tensor_route(app, engine, lambda message: logger.info("weights updated: %s", message))
    return app


async def _all_done(futures: Sequence[concurrent.futures.Future[Any]]) -> None:
    """Wait until every engine future is done, with ONE wake-up of the event loop (the last
    future's), where gathering ``asyncio.wrap_future``s wakes it once per sample. Cancelled (the
    client went away): cancel the futures, so the engine stops decoding them."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    remaining = len(futures)
    lock = threading.Lock()

    def wake() -> None:
        if not done.done():
            done.set_result(None)

    def one_done(_: concurrent.futures.Future[Any]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0
        if last:
            with suppress(RuntimeError):  # the loop closed (shutdown): nobody is waiting
                loop.call_soon_threadsafe(wake)

    for future in futures:
        future.add_done_callback(one_done)
    try:
        await done
    except asyncio.CancelledError:
        for future in futures:
            future.cancel()
        raise


def _encode_by_choice(answer: dict[str, Any]) -> bytes:
    """``answer`` as JSON (as JSONResponse encodes it), its choices encoded one at a time: one
    ``json.dumps`` holds the GIL until it returns (it is C), so the event loop waits for one
    choice's encoding at most rather than the whole answer's (tens of MB with logprobs)."""

    def dumps(value: Any) -> bytes:
        return json.dumps(
            value, ensure_ascii=False, allow_nan=False, separators=(",", ":")
        ).encode()

    rest = dumps({k: v for k, v in answer.items() if k != "choices"})
    choices = b",".join(dumps(choice) for choice in answer["choices"])
    return rest[:-1] + b',"choices":[' + choices + b"]}"


def _token_namer(engine: Engine, as_ids: bool) -> Callable[[int], str]:
    """How a token is named in logprobs: its text, or ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``), which keeps distinct tokens with the same text apart."""
    return (lambda t: f"token_id:{t}") if as_ids else engine.token_text


def _completion_logprobs(out: SequenceOutput, name: Callable[[int], str]) -> dict[str, Any]:
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


def _chat_logprobs(out: SequenceOutput, name: Callable[[int], str]) -> list[dict[str, Any]]:
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


# --------------------------------------------------------------------------- CLI


class _Server(uvicorn.Server):
    """uvicorn's server, announcing readiness once the socket listens."""

    ready_line = ""

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            print(self.ready_line.format(url=f"http://{host}:{port}"), flush=True)


def _positive(text: str) -> int:
    """argparse type of the limit flags."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="grail-serve", description="OpenAI-compatible server for an HF causal LM directory."
    )
    parser.add_argument(
        "--model",
        required=True,
        help="HF model directory, or 'tiny': the offline tiny model (grail-train's default)",
    )
    parser.add_argument("--served-model-name", help="name clients send (default: dir name)")
    parser.add_argument(
        "--lora-dir",
        help="a peft LoRA adapter directory served over the model (its layers are added at "
        "start; POST /update_weights_from_disk with an adapter directory swaps the adapter)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument(
        "--api-key", help="Bearer key every route but GET /health requires (default: none)"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=256, help="sequences decoded together at most"
    )
    parser.add_argument("--max-model-len", type=int, help="context limit (default: the model's)")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="results independent of batch composition (default: on for CPU, off for CUDA)",
    )
    parser.add_argument(
        "--decode",
        choices=["eager", "static", "graph"],
        help="decode path: graph (static KV cache + CUDA graphs; default on CUDA), static (the "
        "same without graphs), eager (default on CPU; the only batch-invariant one)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    limits = parser.add_argument_group("limits (see docs/protocols.md)")
    limits.add_argument(
        "--max-request-bytes",
        type=_positive,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 before they are read (default: 8 MiB)",
    )
    limits.add_argument(
        "--max-n",
        type=_positive,
        default=DEFAULT_MAX_N,
        help="samples per prompt (default: %(default)s)",
    )
    limits.add_argument(
        "--max-request-tokens",
        type=_positive,
        help="prompts x n x max_tokens of one request (default: --max-batch-size x the context "
        "length, one full batch)",
    )
    limits.add_argument(
        "--max-queued-seqs",
        type=_positive,
        help=f"sequences waiting or decoding; more get 503 (default: {QUEUED_BATCHES} x "
        "--max-batch-size)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    # The model names grail-train's model.train_id takes ('tiny': built offline, cached). Imported
    # here: the tiny model's builder (tokenizers, Qwen2) adds ~0.2 s to every other start.
    from grail.models.tiny import resolve_model

    model = resolve_model(args.model)
    model_dir = Path(model).resolve()
    name = args.served_model_name or (args.model if model != args.model else model_dir.name)
    try:
        engine = Engine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            batch_invariant=args.batch_invariant,
            max_model_len=args.max_model_len,
            lora_dir=args.lora_dir,
            decode=args.decode,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        hint = " (--model takes an HF model directory or 'tiny')" if not model_dir.is_dir() else ""
        print(f"grail-serve: cannot load {model_dir}: {exc}{hint}", file=sys.stderr, flush=True)
        return 1
    limits = Limits.for_engine(
        engine.max_batch_size,
        engine.max_model_len,
        max_request_bytes=args.max_request_bytes,
        max_n=args.max_n,
        max_request_tokens=args.max_request_tokens,
        max_queued_seqs=args.max_queued_seqs,
    )
    app = create_app(engine, name, args.api_key, limits)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=5,
    )
    server = _Server(config)
    invariance = (
        f"batch-invariant (row quantum {engine.row_quantum})"
        if engine.batch_invariant
        else "not batch-invariant"
    )
    server.ready_line = (
        f"grail-serve ready: model '{name}' at {{url}} "
        f"({engine.device}, {str(engine.dtype).removeprefix('torch.')}, {invariance}, "
        f"max_model_len {engine.max_model_len})"
    )
    # Everything loaded so far (torch, transformers, the model) lives as long as the process: take
    # it out of the garbage collector's view. Otherwise every full collection walks its ~400k
    # objects, a ~200 ms pause of every request in flight, every few hundred requests.
    gc.collect()
    gc.freeze()
    with suppress(KeyboardInterrupt):  # SIGINT after the graceful shutdown already ran
        server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
