"""The HTTP endpoints: health, the model list, metrics and the inference routes (whose steps
are :mod:`rnnserve.service.http.inference`)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from fastapi.types import DecoratedCallable
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from rnnserve.service import endpoints
from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH, STREAM, Endpoint
from rnnserve.service.http import defaults, errors, kserve
from rnnserve.service.http.auth import AUTH, bearer, check_token, server_token
from rnnserve.service.http.inference import serve_request
from rnnserve.service.http.responses import ErrorBody, error_response, json_response
from rnnserve.service.http.sessions import serve_session
from rnnserve.service.http.validation import SCHEMAS
from rnnserve.service.interface import EngineUnavailable, RequestError, Runtime, ServedInfo
from rnnserve.service.metrics import CONTENT_TYPE

router = APIRouter()


def _body_spec(schema: type[BaseModel]) -> dict[str, Any]:
    # the body is parsed by hand (raw bytes straight into pydantic), so document it here
    return {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": schema.model_json_schema()},
                # the binary format (docs/WIRE.md): tensors <field> and lengths, metadata model
                bodies.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


_INFER_ERRORS = errors.openapi_responses(errors.INFERENCE_STATUSES, ErrorBody)
_TOKEN_ERRORS = errors.openapi_responses((401,), ErrorBody)


@router.get("/", include_in_schema=False)
async def index() -> dict[str, str]:
    """Where to start: a bare 404 here told a new user nothing."""
    return {
        "service": "rnnserve",
        "docs": "/docs",
        "models": "/models",
        "openapi": "/openapi.json",
    }


@router.get("/healthz", summary="Liveness: 200 while the process runs")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: 200 once models are warm, 503 before and while draining")
async def readyz(request: Request) -> Response:
    if request.app.state.ready and request.app.state.runtime.available:
        return json_response({"status": "ready"})
    return json_response({"status": "not ready"}, 503)


@router.get(
    "/models",
    summary="The served models: name, kind, shapes, parameters",
    dependencies=AUTH,
    responses=_TOKEN_ERRORS,
)
async def list_models(request: Request) -> dict[str, Any]:
    runtime: Runtime = request.app.state.runtime
    settings: Settings = request.app.state.settings
    return {
        "models": [listing(m) for m in runtime.models.values()],
        # which model a request without "model" gets, per endpoint (null: it must name one)
        "defaults": {
            path: defaults.default_model(runtime.models, kind, settings)
            for kind, path in defaults.ENDPOINT.items()
        },
        "settings": settings.public(),  # the effective settings; secrets never shown
    }


def listing(m: ServedInfo) -> dict[str, Any]:
    """One model in ``GET /models``: its name, the version served and when it was loaded, then
    what the runtime describes of it."""
    loaded = datetime.fromtimestamp(m.loaded_at, UTC).isoformat(timespec="seconds")
    return {"name": m.name, "version": m.version, "loaded_at": loaded, **m.info}


class ReloadFailure(BaseModel):
    model: str | None  # None: the model directory itself failed the checks; nothing changed
    error: str


class ReloadAnswer(BaseModel):
    """What a reload did, by model name, and the version of each model served after it."""

    loaded: list[str]
    changed: list[str]
    removed: list[str]
    unchanged: list[str]
    failed: list[ReloadFailure]
    models: dict[str, str]


@router.post(
    "/admin/reload",
    summary="Reload the model directory: new and changed models swapped in, removed ones "
    "stopped, without downtime",
    dependencies=AUTH,
    responses={200: {"model": ReloadAnswer}, **errors.openapi_responses((401, 503), ErrorBody)},
)
async def reload_models(request: Request) -> Response:
    runtime: Runtime = request.app.state.runtime
    try:
        report = await runtime.reload()
    except EngineUnavailable as exc:
        return error_response(RequestError("engine_unavailable", str(exc)))
    served = {m.name: m.version for m in runtime.models.values()}
    return json_response({**report.as_json(), "models": served})


@router.get(
    "/metrics",
    summary="Prometheus text exposition",
    dependencies=AUTH,
    responses=_TOKEN_ERRORS,
)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


def _route(endpoint: Endpoint) -> Callable[[DecoratedCallable], DecoratedCallable]:
    request_schema, answer = SCHEMAS[endpoint]
    return router.post(
        endpoint.path,
        summary=endpoint.summary,
        openapi_extra=_body_spec(request_schema),
        responses={200: {"model": answer}, **_INFER_ERRORS},
        dependencies=AUTH,
    )


@_route(SMOOTH)
async def smooth(request: Request) -> Response:
    return await serve_request(request, SMOOTH)


@_route(ROLLOUT)
async def rollout(request: Request) -> Response:
    return await serve_request(request, ROLLOUT)


@_route(INFER)
async def infer(request: Request, name: str) -> Response:
    return await serve_request(request, INFER, path_model=name)


async def serve_inference(scope: Scope, receive: Receive, send: Send) -> bool:
    """Serve the inference endpoints (:data:`rnnserve.service.endpoints.INFERENCE`) straight
    from the ASGI call, without FastAPI's routing, dependency solving and middleware, which
    cost as much CPU per request as parsing the body; ``False``: not one of them, let FastAPI
    route it.

    The routes above stay the documented ones (OpenAPI) and serve what this declines (a
    ``root_path`` set by a proxy); both run the same token check and
    :func:`~rnnserve.service.http.inference.serve_request`.
    """
    if scope["method"] != "POST" or scope.get("root_path"):
        return False
    found = endpoints.by_path(scope["path"])
    if found is None:
        return False
    endpoint, name = found
    request = Request(scope, receive)
    try:
        if server_token(request) is not None:  # else there is nothing to check or to read
            check_token(request, await bearer(request), endpoint.label)
    except RequestError as exc:
        response = error_response(exc)
    else:
        response = await serve_request(request, endpoint, path_model=name)
    await response(scope, receive, send)
    return True


# the Open Inference Protocol (KServe v2): its own routes, through the same runtime
router.include_router(kserve.router)

# streaming sessions (docs/SESSIONS.md): a WebSocket per client stream, through the same runtime
router.add_api_websocket_route(STREAM.path, serve_session)
