"""The built-in server's FastAPI app (`create_app`): an OpenAI-compatible HTTP API around the
built-in generation engine (``grail-serve``, `server`, runs it).

It speaks the subset of vLLM's protocol the harness uses (see docs/protocols.md), so one
client path serves the built-in server, vLLM and SGLang:

- ``GET /health``: 200 once the engine runs, 503 if its worker died.
- ``GET /v1/models``: the served model card (with ``max_model_len``, ``weight_version``,
  ``batch_invariant`` and the ``prefix_cache``'s hits, misses and entries).
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
  Extension: ``sampled_spans`` (one list per prompt of ``[start, end)`` pairs): which of a
  prompt's tokens the model sampled (an episode's earlier turns), so that the prefix cache
  continues the sequence that sampled them, bit for bit what computing them again gives
  (``prefix_cache``); malformed spans are a 400 naming ``sampled_spans``.
- ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's chat template;
  ``logprobs: true`` (+ ``top_logprobs: k``) gives ``logprobs.content``.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version"?}`` (SGLang's shape):
  in-place weight reload, ``{"success", "message"}``, HTTP 400 when refused.
- ``POST /update_weights_from_tensor`` ``{"serialized_named_tensors", "weight_version"?,
  "device_uuid"?}`` (SGLang's shape): the same, from the trainer's tensors in shared memory or
  CUDA IPC rather than from disk (``tensor_update.py``).

Security and availability (``Limits``, docs/protocols.md): with a key (``--api-key`` or
``GRAIL_API_KEY``) every route but ``GET /health`` needs ``Authorization: Bearer <key>`` (401
otherwise), the weight reload included; without one, the routes that replace the weights
(``STATE_ROUTES``) answer 403 to any client not on this machine's loopback, whatever the server
listens on. There is no ``/docs``, ``/redoc`` or ``/openapi.json``. A body over
``--max-request-bytes`` gets 413 before it is read; ``n``, the tokens one request may generate and
the sequences waiting in the engine are bounded (400 naming the flag, 503 while the engine's queue
is full). Tokenizer work and the building of large answers run off the event loop, so ``/health``
keeps answering.

Logprobs are log-softmax(logits / T) before top-k/top-p (see ``engine``'s docstring); ``-inf``
is sent as -9999.0 as vLLM does. Errors use the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``. Unsupported features (streaming, echo,
penalties, ``best_of``, ``logit_bias``, ``min_p``, ``min_tokens``, ``prompt_logprobs``, ...) are
refused with a 400 naming the field rather than silently ignored; other unknown fields are
ignored, as vLLM does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from grail.core.http_api import APIError, Gate, describe_validation_errors, error_response
from grail.inference.builtin.admission import (
    Admission,
    Limits,
    check_request_size,
    check_text_length,
    longest_token_chars,
    message_chars,
)
from grail.inference.builtin.answers import chat_answer, completion_answer, encode_by_choice
from grail.inference.builtin.engine import Engine, EngineStopped, SequenceOutput
from grail.inference.builtin.prefix_cache import Span
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.builtin.schema import (
    ChatCompletionRequest,
    CompletionRequest,
    UpdateWeightsRequest,
)
from grail.inference.builtin.tensor_update import ROUTE as TENSOR_ROUTE
from grail.inference.builtin.tensor_update import add_tensor_route
from grail.inference.builtin.validation import (
    check_context,
    check_seeds,
    check_unsupported,
    prompt_ids,
    prompt_items,
    sampled_spans,
    sampling_params,
)
from grail.inference.builtin.weights import WeightUpdateError

logger = logging.getLogger("grail.serve")

# Answers of more generated tokens than this are built off the event loop (tens of ms inline).
INLINE_ANSWER_TOKENS = 16384
#: the routes that change what the server serves (its weights): without a key, loopback only
STATE_ROUTES = ("/update_weights_from_disk", TENSOR_ROUTE)


@dataclass
class ServerState:
    """What the routes share, kept on ``app.state.grail``."""

    engine: Engine
    served_model_name: str
    limits: Limits
    admission: Admission
    #: a text prompt longer than this cannot fit the context, whatever it tokenizes to
    max_prompt_chars: int
    #: the model card's ``created``
    created: int


def _state(request: Request) -> ServerState:
    return request.app.state.grail


def create_app(
    engine: Engine,
    served_model_name: str,
    api_key: str | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The FastAPI app; it starts the engine's worker on startup and stops it on shutdown.

    ``api_key``: every route but ``/health`` needs it as a Bearer token (None: no key, and then
    ``STATE_ROUTES`` answer this machine's loopback only).
    ``limits``: see `Limits` (None: the defaults for this engine)."""
    limits = limits or Limits.for_engine(engine.max_batch_size, engine.max_model_len)
    # No /docs, /redoc or /openapi.json: the protocol is documented in docs/protocols.md, and a
    # server with a key answers nothing but /health without it.
    app = FastAPI(
        title="grail-serve", lifespan=_lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.grail = ServerState(
        engine=engine,
        served_model_name=served_model_name,
        limits=limits,
        admission=Admission(limits.max_queued_seqs),
        max_prompt_chars=engine.max_model_len * longest_token_chars(engine.tokenizer),
        created=int(time.time()),
    )
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_middleware(
        Gate,
        api_key=api_key,
        max_body_bytes=limits.max_request_bytes,
        local_only_paths=STATE_ROUTES,
    )
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.add_api_route("/update_weights_from_disk", update_weights, methods=["POST"])
    add_tensor_route(app, engine, lambda message: logger.info("weights updated: %s", message))
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = app.state.grail.engine
    engine.start()
    try:
        yield
    finally:
        engine.stop()


# --------------------------------------------------------------------------- errors


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.message, exc.status, exc.param)


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


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after answering, so uvicorn still logs the traceback.
    return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(str(exc.detail), exc.status_code)


# --------------------------------------------------------------------------- routes


async def health(request: Request) -> Response:
    return Response(status_code=200 if _state(request).engine.alive else 503)


async def models(request: Request) -> dict[str, Any]:
    state = _state(request)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "grail",
        "root": str(state.engine.model_dir),
        "parent": None,
        "max_model_len": state.engine.max_model_len,
        "weight_version": state.engine.weight_version,
        "batch_invariant": state.engine.batch_invariant,
    }
    cache = state.engine.prefix_cache
    if cache is not None:  # how often a continued prompt found its prefix (`prefix_cache`)
        card["prefix_cache"] = {"hits": cache.hits, "misses": cache.misses, "entries": len(cache)}
    return {"object": "list", "data": [card]}


async def completions(req: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    _check_model(state, req.model)
    check_unsupported(req)
    max_tokens = req.max_tokens if req.max_tokens is not None else 16
    params = sampling_params(req, max_tokens, req.logprobs, engine)
    items = prompt_items(req)
    check_request_size(state.limits, len(items), req.n, max_tokens)
    check_seeds(req, len(items))
    texts = [(p, item) for p, item in enumerate(items) if isinstance(item, str)]
    for p, text in texts:
        check_text_length(len(text), state.max_prompt_chars, f"prompt {p}", "prompt")
    # Tokenizing runs off the event loop (the tokenizer releases the GIL while it works).
    prompts = (
        await asyncio.to_thread(prompt_ids, items, engine) if texts else prompt_ids(items, engine)
    )
    for ids in prompts:
        check_context(ids, max_tokens, engine)
    spans = sampled_spans(req, prompts)
    outs = await _generate(state, prompts, params, req.n, req.seed, req.seeds, spans)
    return await _answer(
        lambda: completion_answer(req, prompts, outs, state.served_model_name, engine.token_text),
        outs,
    )


async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    engine = state.engine
    _check_model(state, req.model)
    check_unsupported(req)
    if not req.messages:
        raise APIError("messages is empty", param="messages")
    for name in ("seeds", "sampled_spans"):
        if (req.model_extra or {}).get(name) is not None:
            raise APIError(f"{name} is only supported on /v1/completions", param=name)
    if req.top_logprobs and not req.logprobs:
        raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
    requested = req.max_completion_tokens or req.max_tokens
    # n first, before any rendering; max_tokens is known once the prompt is.
    check_request_size(state.limits, 1, req.n, max(requested or 1, 1))
    check_text_length(message_chars(req.messages), state.max_prompt_chars, "messages", "messages")
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
    max_tokens = requested if requested is not None else max(1, engine.max_model_len - len(prompt))
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, logprobs, engine)
    check_request_size(state.limits, 1, req.n, max_tokens)
    check_context(prompt, max_tokens, engine)
    outs = await _generate(state, [prompt], params, req.n, req.seed)
    return await _answer(
        lambda: chat_answer(req, prompt, outs, state.served_model_name, engine.token_text), outs
    )


async def update_weights(req: UpdateWeightsRequest, request: Request) -> JSONResponse:
    engine = _state(request).engine
    try:
        message = await asyncio.to_thread(engine.update_weights, req.model_path, req.weight_version)
    except WeightUpdateError as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=400)
    except EngineStopped as exc:
        return JSONResponse({"success": False, "message": str(exc)}, status_code=503)
    logger.info("weights updated: %s", message)
    return JSONResponse({"success": True, "message": message})


# --------------------------------------------------------------------------- helpers


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.served_model_name:
        raise APIError(f"The model `{name}` does not exist.", status=404, param="model")


async def _generate(
    state: ServerState,
    prompts: list[list[int]],
    params: SamplingParams,
    n: int,
    seed: int | None,
    seeds: list[int] | None = None,
    spans: list[list[Span]] | None = None,
) -> list[SequenceOutput]:
    """All samples, prompt-major; the event loop only waits on the engine's futures."""
    count = len(prompts) * n
    state.admission.reserve(count)
    try:
        futures = state.engine.submit_many(
            prompts, params, n=n, seed=seed, seeds=seeds, spans=spans
        )
        await _all_done(futures)
        return [f.result() for f in futures]
    except EngineStopped as exc:
        raise APIError(str(exc), status=503) from exc
    finally:
        state.admission.release(count)


async def _answer(build: Callable[[], dict[str, Any]], outs: list[SequenceOutput]) -> Response:
    """The JSON answer, encoded by orjson (`encode_by_choice`; json, JSONResponse's encoder, took
    ~40 ms for the ~8k tokens of an episode turn's answer, holding the GIL that the engine's
    worker needs between its tensor operations); a large one is built and encoded off the event
    loop, choice by choice, so that ``/health`` and other requests are not held up meanwhile."""
    if sum(len(o.token_ids) for o in outs) <= INLINE_ANSWER_TOKENS:
        return Response(encode_by_choice(build()), media_type="application/json")
    body = await asyncio.to_thread(lambda: encode_by_choice(build()))
    return Response(body, media_type="application/json")


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
