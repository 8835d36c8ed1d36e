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
  in-place weight reload, ``{"success", "message"}``, HTTP 400 when refused. Unauthenticated like
  SGLang's and vLLM's admin routes: bind to 127.0.0.1.

Logprobs are log-softmax(logits / T) before top-k/top-p (see ``engine``'s docstring); ``-inf``
is sent as -9999.0 as vLLM does. Errors use the OpenAI shape
``{"error": {"message", "type", "param", "code"}}``; ``--api-key`` guards ``/v1/...`` only.
Unsupported features (streaming, echo, penalties, ``best_of``, ``logit_bias``, ``min_p``,
``min_tokens``, ``prompt_logprobs``, ...) are refused with a 400 naming the field rather than
silently ignored; other unknown fields are ignored, as vLLM does.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import itertools
import logging
import math
import secrets
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from grail.inference.builtin.engine import Engine, EngineStopped, SequenceOutput
from grail.inference.builtin.sampling import SamplingParams
from grail.inference.builtin.weights import WeightUpdateError

logger = logging.getLogger("grail.serve")

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
LOGPROB_FLOOR = -9999.0  # what vLLM sends instead of -inf
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered in the OpenAI shape with HTTP ``status``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error_response(message: str, status: int, param: str | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }
    return JSONResponse(body, status_code=status)


# --------------------------------------------------------------------------- request models


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
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    # Accepted only at their neutral value: the engine does not implement them.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    seeds: list[int] | None = None  # extension: one seed per prompt (see the module docstring)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
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


def _completion_prompts(req: CompletionRequest, engine: Engine) -> list[list[int]]:
    """The request's prompts as token-id lists, checked against the vocabulary."""
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
    prompts = []
    for p, item in enumerate(items):
        ids = engine.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise APIError(f"prompt {p} is empty", param="prompt")
        bad = [t for t in ids if not (0 <= t < engine.vocab_size)]
        if bad:
            raise APIError(
                f"prompt {p}: token id {bad[0]} is outside the vocabulary [0, {engine.vocab_size})",
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


def create_app(engine: Engine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app; it starts the engine's worker on startup and stops it on shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    app = FastAPI(title="grail-serve", lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.status, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            loc = []
        elif loc[:1] == ["prompt"]:
            message = (
                "prompt must be a string, a list of token ids, a list of strings or a list of "
                "token-id lists"
            )
            loc = ["prompt"]
        else:
            message = "; ".join(
                f"{'.'.join(str(x) for x in e.get('loc', ()) if x != 'body') or 'body'}: "
                f"{e.get('msg')}"
                for e in errors[:5]
            )
        if request.url.path == "/update_weights_from_disk":
            return JSONResponse({"success": False, "message": message}, status_code=400)
        return error_response(message, 400, ".".join(loc) or None)

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn still logs the traceback.
        return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(str(exc.detail), exc.status_code)

    if api_key is not None:
        app.add_middleware(_BearerAuth, api_key=api_key)

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
        try:
            futures = engine.submit_many(prompts, params, n=n, seed=seed, seeds=seeds)
            await _all_done(futures)
            return [f.result() for f in futures]
        except EngineStopped as exc:
            raise APIError(str(exc), status=503) from exc

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
    async def completions(req: CompletionRequest) -> JSONResponse:
        check_model(req.model)
        _check_unsupported(req)
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        params = _sampling_params(req, max_tokens, req.logprobs, engine)
        prompts = _completion_prompts(req, engine)
        _check_seeds(req, len(prompts))
        for p in prompts:
            _check_context(p, max_tokens, engine)
        outs = await run(prompts, params, req.n, req.seed, req.seeds)
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
        # A JSONResponse is sent as is; a dict would first be walked by jsonable_encoder.
        return JSONResponse(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": served_model_name,
                "choices": choices,
                "usage": usage(prompts, outs),
            }
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest) -> JSONResponse:
        check_model(req.model)
        _check_unsupported(req)
        if not req.messages:
            raise APIError("messages is empty", param="messages")
        if (req.model_extra or {}).get("seeds") is not None:
            raise APIError("seeds is only supported on /v1/completions; use seed", param="seeds")
        if req.top_logprobs and not req.logprobs:
            raise APIError("top_logprobs requires logprobs=true", param="top_logprobs")
        try:
            prompt = engine.render_chat(
                req.messages, req.add_generation_prompt, req.chat_template_kwargs
            )
        except Exception as exc:  # template errors name the problem in the message
            raise APIError(f"cannot render messages: {exc}", param="messages") from exc
        if not prompt:
            raise APIError("the rendered prompt is empty", param="messages")
        requested = req.max_completion_tokens or req.max_tokens
        # Unset: the rest of the context, as vLLM (a prompt that fills it fails the check below).
        max_tokens = (
            requested if requested is not None else max(1, engine.max_model_len - len(prompt))
        )
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(req, max_tokens, logprobs, engine)
        _check_context(prompt, max_tokens, engine)
        outs = await run([prompt], params, req.n, req.seed)
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
        return JSONResponse(response)

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

    return app


class _BearerAuth:
    """ASGI middleware: ``/v1/...`` routes need ``Authorization: Bearer <api_key>``. Plain ASGI
    rather than ``@app.middleware("http")``, whose per-request task group and streams cost more
    than the rest of a small request's handling."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                await error_response("invalid or missing API key", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="grail-serve", description="OpenAI-compatible server for an HF causal LM directory."
    )
    parser.add_argument("--model", required=True, help="HF model directory")
    parser.add_argument("--served-model-name", help="name clients send (default: dir name)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--threads", type=int, help="torch CPU threads")
    parser.add_argument("--api-key", help="Bearer key required on /v1/... routes")
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
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
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
    model_dir = Path(args.model).resolve()
    name = args.served_model_name or model_dir.name
    try:
        engine = Engine(
            model_dir,
            device=args.device,
            dtype=args.dtype,
            max_batch_size=args.max_batch_size,
            batch_invariant=args.batch_invariant,
            max_model_len=args.max_model_len,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"grail-serve: cannot load {model_dir}: {exc}", file=sys.stderr, flush=True)
        return 1
    app = create_app(engine, name, args.api_key)
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
