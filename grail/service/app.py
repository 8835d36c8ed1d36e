"""The trainer's HTTP API (`mode=service`): clients ask for completions and send rewards back;
environments push groups they sampled and scored themselves. docs/service.md has every route.

- ``POST /v1/completions`` ``{"prompt": text | token ids}`` or ``{"messages": [...]}``, ``n``
  (= ``data.rollouts_per_problem``), ``model`` (optional): the OpenAI completions answer, plus
  ``policy_version``, ``group_id`` and per choice ``id`` and ``token_ids``.
- ``POST /v1/rewards`` ``{"rewards": [{"id", "reward", "success"?}, ...]}`` -> ``{"accepted"}``.
- ``POST /v1/turns`` ``{"prompt": token ids | text}`` or ``{"messages": [...]}``, ``n`` (1 to
  ``data.rollouts_per_problem``, default 1): turns for the client's own groups or episodes,
  ``policy_version``, ``prompt_token_ids`` and per choice ``token_ids`` and ``logprobs``.
- ``POST /v1/groups`` ``{"groups": [{"prompt_ids", "policy_version", "completions": [{"token_ids",
  "logprobs", "reward", "success"?, "finish_reason"?, "text"?, "sampled_mask"?}]}]}`` ->
  ``{"accepted", "group_ids"}``; with ``service.check_spans`` each sampled span must be a turn.
- ``GET /v1/status``, ``GET /v1/info``; ``GET /health`` (no key).

Every route but /health needs ``Authorization: Bearer <service.api_key>`` (401). Errors use the
OpenAI shape; a request that is refused changes nothing.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from grail.core.http_api import APIError, Gate, describe_validation_errors, error_response
from grail.service.core import ServiceCore
from grail.service.ledger import PushedGroup, RewardEntry, new_sample

TokenId = Annotated[int, Field(ge=0)]
# What a client may not choose: sampling comes from the run's config (see `CompletionsRequest`).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "logprobs", "best_of",
    "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "stream", "echo", "suffix",
)  # fmt: skip


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str


class CompletionsRequest(BaseModel):
    """A prompt, as text (tokenized as is, no chat template), token ids, or chat messages
    (rendered with the model's chat template, as the loop renders the environment's prompts).

    The sampling settings are the run's (`generation.*`), not the client's: the trainer's
    importance-sampling correction and clipping compare its policy with the one that sampled,
    and a client's temperature would make the behaviour log-probabilities those of another
    policy. Fields that would set them get a 400 naming them."""

    model_config = ConfigDict(extra="allow")
    prompt: str | list[TokenId] | None = None
    messages: list[Message] | None = None
    n: int | None = None
    model: str | None = None
    user: str | None = None  # the OpenAI SDK's optional end-user tag: accepted, unused


class TurnsRequest(CompletionsRequest):
    """As `CompletionsRequest`, with `n` from 1 (the default) to data.rollouts_per_problem."""


class RewardItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    reward: float
    success: bool | None = None


class RewardsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rewards: list[RewardItem]


class PushedCompletion(BaseModel):
    model_config = ConfigDict(extra="forbid")
    token_ids: list[TokenId] = Field(min_length=1)
    logprobs: list[float]
    reward: float
    success: bool | None = None
    finish_reason: Literal["stop", "length"] = "stop"
    text: str | None = None
    # An episode (Atropos' masks): 1 for each token the policy sampled, 0 for the environment's
    # and the template's tokens between turns (context the loss never covers). Absent: all 1.
    sampled_mask: list[Literal[0, 1]] | None = None


class PushedGroupItem(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[TokenId] = Field(min_length=1)
    policy_version: int = Field(ge=0)
    completions: list[PushedCompletion]


class GroupsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    groups: list[PushedGroupItem]


def create_app(core: ServiceCore, api_key: str, max_body_bytes: int) -> FastAPI:
    """The service's app around `core` (which owns the ledger and the inference client): the
    routes of `router`, errors in the OpenAI shape, and the key and body-size gate."""
    app = FastAPI(
        title="grail-train service", lifespan=_lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )  # fmt: skip
    app.state.core = core
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _internal_error)
    app.add_middleware(
        Gate, api_key=api_key, max_body_bytes=max_body_bytes,
        limit_name="(service.max_body_bytes)",
    )  # fmt: skip
    app.include_router(router)
    return app


def _service_core(request: Request) -> ServiceCore:
    """The core of the app serving `request` (`create_app` puts it in the app's state)."""
    return request.app.state.core


# What each route gets to serve the request with.
Core = Annotated[ServiceCore, Depends(_service_core)]


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    core: ServiceCore = app.state.core
    core.started()
    try:
        yield
    finally:
        await core.stopped()


# ---- errors, in the OpenAI shape -----------------------------------------------------------------


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.message, exc.status, exc.param)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = describe_validation_errors(exc.errors())
    return error_response(message, 400, param)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(str(exc.detail), exc.status_code)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    # A route's bug fails that request only: the trainer runs on its own thread.
    return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)


# ---- the routes ---------------------------------------------------------------------------------

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


def _prompt_ids(req: CompletionsRequest, core: ServiceCore, route: str) -> list[int]:
    """The request's prompt as token ids, once its fields are checked (APIError naming the
    first bad one): no sampling settings, the served model, exactly one of prompt and
    messages."""
    extra = sorted(req.model_extra or {})
    sampling = [k for k in extra if k in SAMPLING_FIELDS]
    if sampling:
        raise APIError(
            f"{', '.join(sampling)}: sampling settings come from the run's config "
            f"({core.sampling_summary()}), so that the behaviour log-probabilities are the "
            "trained policy's",
            400,
            sampling[0],
        )
    if extra:
        raise APIError(
            f"unknown field(s) {', '.join(extra)}; {route} takes prompt or messages, n, model",
            400,
            extra[0],
        )
    if req.model is not None and req.model != core.model_name:
        raise APIError(f"The model `{req.model}` does not exist.", 404, "model")
    if (req.prompt is None) == (req.messages is None):
        raise APIError("send exactly one of prompt and messages", 400, "prompt")
    if req.messages is not None:
        return core.render_messages([m.model_dump() for m in req.messages])
    if isinstance(req.prompt, str):
        return core.tokenize(req.prompt)
    return core.check_token_ids(list(req.prompt or []), "prompt")


@router.post("/v1/completions")
async def completions(req: CompletionsRequest, core: Core) -> dict[str, Any]:
    prompt_ids = _prompt_ids(req, core, "this route")
    if req.n is not None and req.n != core.group_size:
        raise APIError(
            f"n={req.n}, but a group here is data.rollouts_per_problem={core.group_size} "
            "samples (leave n out, or send that)",
            400,
            "n",
        )
    group = await core.complete(prompt_ids)
    completion_tokens = sum(len(s.completion_ids) for s in group.samples)
    return {
        "id": f"cmpl-{group.id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": core.model_name,
        "policy_version": group.policy_version,
        "group_id": group.id,
        "choices": [
            {
                "index": i,
                "id": group.sample_id(i),
                "text": s.text,
                "token_ids": s.completion_ids,
                "finish_reason": s.finish_reason,
                "logprobs": None,
            }
            for i, s in enumerate(group.samples)
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) * len(group.samples) + completion_tokens,
        },
    }


@router.post("/v1/turns")
async def turns(req: TurnsRequest, core: Core) -> dict[str, Any]:
    prompt_ids = _prompt_ids(req, core, "/v1/turns")
    n = 1 if req.n is None else req.n
    if not 1 <= n <= core.group_size:
        raise APIError(
            f"n={n}: a turns request samples 1 to data.rollouts_per_problem={core.group_size} "
            "turns (a group's first turns at once, or one episode's next)",
            400,
            "n",
        )
    version, samples = await core.turns(prompt_ids, n)
    completion_tokens = sum(len(c.token_ids) for c in samples)
    return {
        "object": "turns",
        "created": int(time.time()),
        "model": core.model_name,
        "policy_version": version,
        "prompt_token_ids": prompt_ids,
        "choices": [
            {
                "index": i,
                "token_ids": c.token_ids,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "text": c.text,
            }
            for i, c in enumerate(samples)
        ],
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(prompt_ids) * n + completion_tokens,
        },
    }


@router.post("/v1/rewards")
async def rewards(req: RewardsRequest, core: Core) -> dict[str, int]:
    entries = [RewardEntry(r.id, r.reward, r.success) for r in req.rewards]
    return {"accepted": await core.add_rewards(entries)}


@router.post("/v1/groups")
async def groups(req: GroupsRequest, core: Core) -> dict[str, Any]:
    pushed = []
    for k, g in enumerate(req.groups):
        prompt_ids = core.check_token_ids(g.prompt_ids, f"groups.{k}.prompt_ids")
        samples = [
            new_sample(
                core.check_token_ids(c.token_ids, f"groups.{k}.completions.{i}"),
                c.logprobs,
                c.finish_reason,
                c.text if c.text is not None else core.decode(c.token_ids),
                reward=c.reward,
                # The client's verdict; absent: reward > 0.
                success=c.success if c.success is not None else c.reward > 0,
                sampled_mask=None if c.sampled_mask is None else [int(b) for b in c.sampled_mask],
            )
            for i, c in enumerate(g.completions)
        ]
        pushed.append(PushedGroup(prompt_ids, g.policy_version, samples))
    added = await core.add_groups(pushed)
    return {"accepted": len(added), "group_ids": [g.id for g in added]}


@router.get("/v1/status")
async def status(core: Core) -> dict[str, Any]:
    return core.status()


@router.get("/v1/info")
async def info(core: Core) -> dict[str, Any]:
    return core.info()
