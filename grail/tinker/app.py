"""The Tinker REST routes, as the official ``tinker`` SDK calls them (docs/tinker.md lists each
body). JSON everywhere except ``forward_backward`` (a protobuf body) and the results of
forward/backward and sampling (protobuf answers to ``retrieve_future``): grail/tinker/wire.py.

Every route but ``/api/v1/healthz`` needs the API key, as the SDK sends it (``X-API-Key``) or as
``Authorization: Bearer``; bodies over ``--max-request-bytes`` get 413. A request refused on
arrival gets a 4xx in the shape grail's other APIs use; the SDK raises it. Nothing is answered
5xx for a client's mistake: the SDK retries 5xx for minutes.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from grail.core.http_api import Gate, error_response
from grail.tinker import wire
from grail.tinker.core import TinkerCore
from grail.tinker.errors import UserFault

log = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"


def create_app(core: TinkerCore, api_key: str, max_body_bytes: int) -> FastAPI:
    app = FastAPI(
        title="grail-tinker", lifespan=_lifespan, docs_url=None, redoc_url=None,
        openapi_url=None,
    )  # fmt: skip
    app.state.core = core
    app.add_exception_handler(UserFault, _user_fault)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected)
    app.add_middleware(
        Gate, api_key=api_key, max_body_bytes=max_body_bytes, open_paths=("/api/v1/healthz",),
        key_header="X-API-Key",
    )  # fmt: skip
    app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    core: TinkerCore = app.state.core
    core.start()
    try:
        yield
    finally:
        core.close()


def _core(request: Request) -> TinkerCore:
    return request.app.state.core


Core = Annotated[TinkerCore, Depends(_core)]


async def _user_fault(_: Request, exc: UserFault) -> JSONResponse:
    return error_response(str(exc), exc.status)


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(str(exc.detail), exc.status_code)


async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # 400, not 500: the SDK retries a 5xx for five minutes, which looks like a hang. A body
    # missing a field or of the wrong type lands here too (KeyError, TypeError, ValueError).
    if isinstance(exc, KeyError):
        return error_response(f"the request body lacks the field {exc}", 400)
    log.error("request failed", exc_info=exc)
    return error_response(
        f"grail-tinker could not serve this request: {type(exc).__name__}: {exc}", 400
    )


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as exc:
        raise UserFault(f"the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise UserFault("the body must be a JSON object")
    return body


def _future(request_id: str, model_id: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id, **extra}


router = APIRouter(prefix="/api/v1")


# ---- service ------------------------------------------------------------------------------------


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config() -> dict[str, Any]:
    # Feature flags the SDK reads before anything else. No JWT exchange (the API key is the
    # credential); forward_backward chunks sent one after another (the job thread runs requests
    # in arrival order, so arrival must be seq_id order) and uncompressed. The pyqwest transport
    # stays on, as the SDK defaults: 64 sample requests took a median 0.37-0.39 s with it, 0.64-
    # 0.75 s with plain httpx (benchmarks/tinker_overhead.py's rl shape, sampling alone).
    return {
        "pjwt_auth_enabled": False,
        "use_pyqwest_transport": True,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
        "sample_join_sampling_session": False,
    }


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 3600, "sample_cancel_enabled": False}


@router.post("/telemetry")
async def telemetry() -> dict[str, str]:
    return {"status": "accepted"}  # accepted and dropped: nothing leaves this machine


@router.get("/get_server_capabilities")
async def capabilities(core: Core) -> dict[str, Any]:
    return core.capabilities()


@router.post("/create_session")
async def create_session(core: Core) -> dict[str, Any]:
    return {"type": "create_session", "session_id": core.create_session()}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request, core: Core) -> Response:
    if not core.heartbeat((await _body(request))["session_id"]):
        return error_response("this session has finished", 410)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, core: Core) -> Response:
    core.finish_session(session_id)
    return Response(status_code=204)


# ---- training -----------------------------------------------------------------------------------


@router.post("/create_model")
async def create_model(request: Request, core: Core) -> dict[str, Any]:
    return _future(core.create_model(await _body(request)))


@router.post("/get_info")
async def get_info(request: Request, core: Core) -> dict[str, Any]:
    return core.get_info((await _body(request))["model_id"])


@router.post("/unload_model")
async def unload_model(request: Request, core: Core) -> dict[str, Any]:
    model_id = (await _body(request))["model_id"]
    return _future(core.unload(model_id), model_id)


@router.post("/forward_backward")
async def forward_backward(request: Request, core: Core) -> dict[str, Any]:
    if request.headers.get("content-encoding", "identity") != "identity":
        raise UserFault(
            f"Content-Encoding {request.headers['content-encoding']!r}: this server takes "
            "uncompressed bodies (its client config says proto_compress_fwdbwd=false)"
        )
    if request.headers.get("content-type", "").split(";")[0] != PROTOBUF:
        raise UserFault(f"forward_backward takes a protobuf body ({PROTOBUF})")
    try:
        req = wire.read_forward_backward(await request.body())
    except wire.WireError as exc:
        raise UserFault(
            f"the forward_backward body is not a ForwardBackwardRequest: {exc}"
        ) from exc
    return _future(core.forward_backward(req), req.model_id)


@router.post("/optim_step")
async def optim_step(request: Request, core: Core) -> dict[str, Any]:
    body = await _body(request)
    return _future(core.optim_step(body), body["model_id"])


@router.post("/save_weights")
async def save_weights(request: Request, core: Core) -> dict[str, Any]:
    body = await _body(request)
    return _future(core.save_state(body), body["model_id"])


@router.post("/load_weights")
async def load_weights(request: Request, core: Core) -> dict[str, Any]:
    return _future(core.load_state(await _body(request)))


@router.post("/save_weights_for_sampler")
async def save_for_sampler(request: Request, core: Core) -> dict[str, Any]:
    body = await _body(request)
    return _future(core.save_for_sampler(body), body["model_id"])


# ---- sampling -----------------------------------------------------------------------------------


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request, core: Core) -> dict[str, Any]:
    session_id = core.create_sampling_session(await _body(request))
    return {"type": "create_sampling_session", "sampling_session_id": session_id}


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, core: Core) -> dict[str, Any]:
    return core.get_sampler(sampler_id)


@router.post("/asample")
async def asample(request: Request, core: Core) -> dict[str, Any]:
    request_id, n = core.sample(await _body(request))
    return _future(request_id, sample_sequence_ids=[f"{request_id}-{i}" for i in range(n)])


# ---- futures ------------------------------------------------------------------------------------


@router.post("/retrieve_future")
async def retrieve_future(request: Request, core: Core) -> Response:
    body = await _body(request)
    request_id = body["request_id"]
    # The SDK sends the request_id alone; a client that names its model or session has it checked.
    result = await core.jobs.retrieve(request_id, body.get("model_id"), body.get("session_id"))
    if result is None:
        body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        return JSONResponse(body)
    if result.error is not None:
        return JSONResponse({"error": result.error, "category": result.category})
    if result.proto is not None:
        return Response(result.proto, media_type=PROTOBUF)
    return JSONResponse(result.json)


# ---- checkpoints (RestClient) ---------------------------------------------------------------


@router.get("/training_runs")
async def training_runs(core: Core, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    return core.training_runs(limit, offset)


@router.get("/training_runs/{model_id}")
async def training_run(model_id: str, core: Core) -> dict[str, Any]:
    return core.training_run(model_id)


@router.post("/weights_info")
async def weights_info(request: Request, core: Core) -> dict[str, Any]:
    return core.weights_info((await _body(request))["tinker_path"])


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, core: Core) -> dict[str, Any]:
    return {"checkpoints": core.checkpoints.list(model_id)}


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(model_id: str, checkpoint_id: str, core: Core) -> Response:
    core.checkpoints.delete(model_id, checkpoint_id)
    return Response(status_code=204)
