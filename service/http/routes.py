"""HTTP endpoints. Only this layer knows about status codes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import logging
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal, TypeVar, get_args

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send

from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings
from rnnserve.service.http import defaults
from rnnserve.service.http.validation import (
    RolloutRequest,
    RolloutResponse,
    Sequences,
    SmoothRequest,
    SmoothResponse,
    parse_body,
    to_arrays,
)
from rnnserve.service.interface import (
    REQUEST_ID,
    BatcherClosed,
    EngineUnavailable,
    Limits,
    NonFiniteInput,
    Piece,
    QueueFull,
    RequestError,
    Runtime,
    StreamingUnavailable,
    UnknownModel,
    is_out_of_memory,
    was_logged,
)
from rnnserve.service.metrics import CONTENT_TYPE, Metrics

log = logging.getLogger(__name__)
router = APIRouter()
NDJSON = "application/x-ndjson"
A = TypeVar("A")


REQUEST_ID_HEADER = "X-Request-Id"
TIMEOUT_HEADER = "X-Request-Timeout"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces

# Every ``type`` of an error body a client can receive (README lists them with their status).
ErrorType = Literal[
    # 400: the body cannot be read
    "invalid_json", "invalid_safetensors", "invalid_header",
    # 401, 404, 408, 413
    "unauthorized", "unknown_model", "body_timeout", "header_timeout",
    "body_too_large", "too_many_sequences", "sequence_too_long", "too_many_timesteps",
    # 422: input of the wrong shape or values
    "invalid_request", "empty", "missing", "unknown_field", "wrong_shape", "wrong_dtype",
    "model_type", "string_type",  # pydantic's: the body is not an object; 'model' not a string
    "wrong_lengths", "wrong_feature_count", "not_a_number", "non_finite", "wrong_model_kind",
    "cannot_stream",
    # 503: try again later (Retry-After)
    "not_ready", "queue_full", "overloaded", "shutting_down", "engine_unavailable",
    "out_of_memory", "concurrency_limit",
    # 504, 500, other HTTP errors (405, 404 of a path that does not exist)
    "deadline_exceeded", "internal", "http_error",
]  # fmt: skip
ERROR_TYPES: frozenset[str] = frozenset(get_args(ErrorType))


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its answer was ready."""


class ErrorBody(BaseModel):
    detail: str
    type: ErrorType = Field(description="machine-readable kind of error; README lists each")
    loc: list[str | int]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON via orjson; numpy arrays are written straight from their buffers."""
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class BuffersResponse(Response):
    """A body sent as several buffers one after another (no copy into one ``bytes``)."""

    def __init__(self, parts: list[Any], media_type: str) -> None:
        super().__init__(b"", media_type=media_type)
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.headers["content-length"] = str(sum(p.nbytes for p in self.parts))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        for i, part in enumerate(self.parts):
            more = i < len(self.parts) - 1
            await send({"type": "http.response.body", "body": part, "more_body": more})


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


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "body is not JSON or safetensors, or a bad X-Request-Timeout header"),
        (401, "a bearer token is required (when the server has one) and was missing or wrong"),
        (404, "no such model"),
        (
            408,
            "the body (or the request head) did not arrive within body_timeout_s "
            "(header_timeout_s)",
        ),
        (413, "request over a configured limit"),
        (422, "input of the wrong shape or values"),
        (
            503,
            "not ready, queue full, overloaded (memory budget), shutting down, engine "
            "unavailable, out of memory or at limit_concurrency; try again after Retry-After",
        ),
        (504, "the request's deadline passed before its answer was ready"),
    )
}
_INFER_ERRORS = {
    **_ERRORS,
    500: {"model": ErrorBody, "description": "internal error; see the server log"},
}


# -- authentication ------------------------------------------------------------------------------

_bearer = HTTPBearer(
    auto_error=False,
    description="Needed when the server has a token (RNNSERVE_API_TOKEN or api_token_file).",
)


def _server_token(request: Request) -> bytes | None:
    state = request.app.state
    try:
        token: bytes | None = state.api_token
    except AttributeError:  # read once per app
        text = state.settings.bearer_token()
        token = state.api_token = text.encode() if text is not None else None
    return token


# the ``endpoint`` label of each route that needs the token (never the client's path: a model
# name in it, or a proxy's prefix, would make a label series per client string)
_ENDPOINT = {"/smooth": "smooth", "/rollout": "rollout", "/models/{name}/infer": "infer",
             "/models": "models", "/metrics": "metrics"}  # fmt: skip


async def authorize(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> None:
    """Require ``Authorization: Bearer <token>`` when the server has a token."""
    route = request.scope.get("route")
    check_token(request, credentials, _ENDPOINT.get(getattr(route, "path", ""), "none"))


def check_token(
    request: Request, credentials: HTTPAuthorizationCredentials | None, endpoint: str
) -> None:
    """Raise 401 ``unauthorized`` unless the server has no token or ``credentials`` hold it."""
    token = _server_token(request)
    if token is None:
        return
    given = credentials.credentials.encode() if credentials is not None else b""
    if hmac.compare_digest(given, token):  # constant time: no timing oracle on the token
        return
    metrics: Metrics = request.app.state.metrics
    metrics.rejected.labels(endpoint, "unauthorized").inc()
    why = "a wrong bearer token" if credentials is not None else "no bearer token"
    raise RequestError(401, "unauthorized", f"this endpoint needs a bearer token; got {why}")


_AUTH = [Depends(authorize)]


def error_response(exc: RequestError) -> Response:
    """A :class:`RequestError` raised outside a route's own handling (the token check)."""
    auth = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return json_response(exc.body(), exc.status, auth)


# -- memory budget -------------------------------------------------------------------------------


class ByteBudget:
    """Request bytes being read, parsed, queued and run at once (one event loop: no lock)."""

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit = limit
        self.used = 0
        self._gauge = gauge

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self.used += n
        self._gauge.set(self.used)
        return True

    def give(self, n: int) -> None:
        self.used -= n
        self._gauge.set(self.used)


def _budget(request: Request) -> ByteBudget:
    state = request.app.state
    try:
        budget: ByteBudget = state.byte_budget
    except AttributeError:  # one per app
        metrics: Metrics = state.metrics
        budget = state.byte_budget = ByteBudget(
            state.settings.max_inflight_bytes, metrics.inflight_bytes
        )
    return budget


# -- JSON off the event loop ---------------------------------------------------------------------


class CodecPool:
    """Threads that read large JSON bodies and write large JSON answers off the event loop.

    The JSON scanner and writer are numba functions that release the GIL, so on a thread they
    run beside the event loop (which goes on reading, routing and answering other requests) and
    beside each other. Measured on 2 cores, 64 clients sending 4,000-step /smooth bodies
    (720 KB): the event loop was at 99 % of a core and 315 requests/s; with two codec threads
    477 requests/s (docs/BENCHMARKS.md). Below ``min_bytes`` the work stays on the loop: the
    hand-off (a future, a wake-up, the GIL changing hands) costs more than a small parse.
    """

    def __init__(self, threads: int, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rnnserve-codec")
            if threads > 0
            else None
        )

    async def run(self, size: int, fn: Callable[..., A], *args: Any) -> A:
        """``fn(*args)``: on a codec thread when ``size`` bytes are at least ``min_bytes``."""
        if self._pool is None or size < self.min_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _json_bytes(outputs: Any) -> int:
    """About the size of ``outputs`` written as JSON (12 bytes a number, the usual float32)."""
    data = getattr(outputs, "data", None)
    count = data.size if data is not None else sum(int(a.size) for a in outputs)
    return 12 * int(count)


def _overloaded(budget: ByteBudget) -> RequestError:
    return RequestError(
        503, "overloaded",
        f"the server holds {budget.used} bytes of requests (its budget is {budget.limit}); "
        "try again later",
    )  # fmt: skip


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
    dependencies=_AUTH,
    responses={401: _ERRORS[401]},
)
async def list_models(request: Request) -> dict[str, Any]:
    runtime: Runtime = request.app.state.runtime
    settings: Settings = request.app.state.settings
    return {
        "models": [{"name": m.name, **m.info} for m in runtime.models.values()],
        # which model a request without "model" gets, per endpoint (null: it must name one)
        "defaults": {
            path: defaults.default_model(runtime.models, kind, settings)
            for kind, path in defaults.ENDPOINT.items()
        },
        "settings": settings.public(),  # the effective settings; secrets never shown
    }


@router.get(
    "/metrics",
    summary="Prometheus text exposition",
    dependencies=_AUTH,
    responses={401: _ERRORS[401]},
)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


@router.post(
    "/smooth",
    summary="Smooth N sequences of F features",
    openapi_extra=_body_spec(SmoothRequest),
    responses={200: {"model": SmoothResponse}, **_INFER_ERRORS},
    dependencies=_AUTH,
)
async def smooth(request: Request) -> Response:
    return await _infer(request, "smooth", "smoother", SmoothRequest, "sequences", "sequences")


@router.post(
    "/rollout",
    summary="Roll the Traveller out over N sequences of exogenous inputs",
    openapi_extra=_body_spec(RolloutRequest),
    responses={200: {"model": RolloutResponse}, **_INFER_ERRORS},
    dependencies=_AUTH,
)
async def rollout(request: Request) -> Response:
    return await _infer(request, "rollout", "traveller", RolloutRequest, "inputs", "positions")


class InferRequest(BaseModel):
    """``POST /models/{name}/infer``: N sequences of T_i steps of the model's input features."""

    model_config = ConfigDict(extra="forbid")
    inputs: Sequences = Field(description="N sequences, each [T_i][input features] numbers")
    model: str | None = Field(None, description="optional; if given, must equal the path's name")


class InferResponse(BaseModel):
    model: str
    outputs: list[list[list[float]]] = Field(description="N sequences, each [T_i][outputs]")


@router.post(
    "/models/{name}/infer",
    summary="Run served model {name} (any kind, your own recurrent models too) over N sequences",
    openapi_extra=_body_spec(InferRequest),
    responses={200: {"model": InferResponse}, **_INFER_ERRORS},
    dependencies=_AUTH,
)
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, "infer", None, InferRequest, "inputs", "outputs", path_model=name)


async def serve_inference(scope: Scope, receive: Receive, send: Send) -> bool:
    """Serve ``POST /smooth``, ``/rollout`` and ``/models/{name}/infer`` straight from the ASGI
    call, without FastAPI's routing, dependency solving and middleware, which cost as much CPU
    per request as parsing the body; ``False``: not one of them, let FastAPI route it.

    The routes above stay the documented ones (OpenAPI) and serve what this declines (a
    ``root_path`` set by a proxy); both run the same token check and :func:`_infer`.
    """
    path = scope["path"]
    if scope["method"] != "POST" or scope.get("root_path"):
        return False
    name = None
    if path == "/smooth":
        args: tuple[Any, ...] = ("smooth", "smoother", SmoothRequest, "sequences", "sequences")
    elif path == "/rollout":
        args = ("rollout", "traveller", RolloutRequest, "inputs", "positions")
    elif path.startswith("/models/") and path.endswith("/infer") and len(path) > 14:
        name = path[8:-6]
        if "/" in name:
            return False
        args = ("infer", None, InferRequest, "inputs", "outputs")
    else:
        return False
    request = Request(scope, receive)
    try:
        check_token(request, await _bearer(request), args[0])
    except RequestError as exc:
        response = error_response(exc)
    else:
        response = await _infer(request, *args, path_model=name)
    await response(scope, receive, send)
    return True


# where each kind of model is served natively; every kind answers at /models/{name}/infer
_NATIVE = {"smoother": "/smooth", "traveller": "/rollout"}


class _Held:
    """The bytes one request holds of the budget."""

    n = 0


async def _read_body(request: Request, limit: int, timeout_s: float, held: _Held) -> bytes:
    """The body, within ``limit`` bytes and ``timeout_s`` seconds, counted against the budget:
    the declared length up front (so a client is refused before it sends), the rest as it
    arrives."""
    too_big = RequestError(413, "body_too_large", f"request body is over {limit} bytes")
    budget = _budget(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        if int(declared) > limit:
            raise too_big
        if not budget.take(int(declared)):
            raise _overloaded(budget)
        held.n = int(declared)
    chunks = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_big
                if size > held.n:
                    if not budget.take(size - held.n):
                        raise _overloaded(budget)
                    held.n = size
                if chunk:  # starlette ends with b"": a body in one piece is then not copied
                    chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            408, "body_timeout",
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
        ) from None  # fmt: skip
    return b"".join(chunks)


def _request_id(request: Request) -> str:
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return f"{_ID_PREFIX}{_ID_BITS.getrandbits(64):016x}"


# request ids: 64 random bits per process, then 64 more per request from a generator seeded by
# the system (32 hex digits as uuid4().hex; no system call per request, and no counter that
# would tell clients how many requests the server takes). Ids, not secrets.
_ID_PREFIX = os.urandom(8).hex()
_ID_BITS = random.Random()


def _default_model(state: Any, kind: str) -> str:
    """The model a request of ``kind`` without ``model`` gets; resolved once per app (the
    served models and settings do not change once it is ready)."""
    try:
        chosen: dict[str, str] = state.default_models
    except AttributeError:
        chosen = state.default_models = {}
    name = chosen.get(kind)
    if name is None:  # an ambiguous default raises the client's error every time
        name = chosen[kind] = defaults.resolve(state.runtime.models, kind, state.settings)
    return name


def _deadline(request: Request, started: float, default_s: float) -> float:
    """When the request's answer is due (``time.perf_counter`` clock; ``inf``: never)."""
    timeout = default_s if default_s > 0 else math.inf
    given = request.headers.get(TIMEOUT_HEADER)
    if given is not None:
        try:
            asked = float(given)
        except ValueError:
            asked = math.nan
        if not asked > 0:  # also NaN
            raise RequestError(
                400, "invalid_header",
                f"{TIMEOUT_HEADER} must be a positive number of seconds, not {given[:32]!r}",
            )  # fmt: skip
        timeout = min(timeout, asked)
    return started + timeout


async def _infer(
    request: Request,
    endpoint: str,
    kind: str | None,
    schema: type[BaseModel],
    field: str,
    out_field: str,
    *,
    path_model: str | None = None,
) -> Response:
    """One inference request. ``kind``: the kind of model the endpoint serves (its default
    model's name too); ``None`` with ``path_model``, the model named in the path, of any kind."""
    state = request.app.state
    metrics: Metrics = state.metrics
    runtime: Runtime = state.runtime
    settings = state.settings
    started = time.perf_counter()
    gauge = metrics.child(metrics.in_flight, endpoint)
    gauge.inc()
    in_flight: Gauge | None = gauge  # None once a stream has taken over the accounting
    model_label = kind or "unknown"  # the default model, until the body or path names one
    code = 500
    rid = _request_id(request)
    REQUEST_ID.set(rid)  # this request's task only: the batcher logs failures with it
    headers = {REQUEST_ID_HEADER: rid}
    held = _Held()
    try:
        if not state.ready:
            raise RequestError(503, "not_ready", "the server is starting or shutting down")
        deadline = _deadline(request, started, settings.request_timeout_s)
        body = await _read_body(request, settings.max_request_bytes, settings.body_timeout_s, held)
        limits = Limits(
            settings.max_sequences_per_request,
            settings.max_sequence_length,
            settings.max_request_timesteps,
        )
        codec: CodecPool = state.codec  # create_app's, closed by its lifespan
        ctype = request.headers.get("content-type")
        # safetensors bodies are read in place, in far less than a hand-off to a thread costs
        json_bytes = 0 if bodies.is_safetensors(ctype) else len(body)
        decoded = await codec.run(json_bytes, bodies.decode, body, ctype, field, limits)
        if decoded is None:  # off the JSON fast path: the precise parser says what is wrong
            name, sequences = await codec.run(len(body), parse_body, body, schema, field)
        else:
            name = decoded.model
        where: tuple[str, ...] = ("model",)
        if path_model is not None:
            if name is not None and name != path_model:
                raise RequestError(
                    422, "invalid_request",
                    f"the body names model '{name[:64]}' but the path names '{path_model[:64]}'; "
                    "leave 'model' out of the body",
                    ("model",),
                )  # fmt: skip
            name, where = path_model, ("path", "name")
        if not name and kind is not None:  # the only one of its kind, or the configured one
            name = _default_model(state, kind)
        name = name or ""
        try:
            served = runtime.get(name)
        except UnknownModel as exc:
            model_label = "unknown"  # not the client's text: labels stay few
            raise RequestError(404, "unknown_model", str(exc), where) from None
        model_label = name
        if kind is not None and served.kind != kind:
            other = _NATIVE.get(served.kind, f"/models/{name}/infer")
            raise RequestError(
                422, "wrong_model_kind",
                f"model '{name}' is a {served.kind} model; send it to POST {other}", ("model",),
            )  # fmt: skip
        if decoded is None:
            sequences = await codec.run(
                len(body), to_arrays, sequences, field, served.input_dim, limits, name
            )
        else:
            # a model that checks its inputs as it runs spares the body a second pass
            sequences = decoded.sequences(served.input_dim, name, not served.checks_finite)
        streaming = endpoint == "rollout" and NDJSON in request.headers.get("accept", "")
        if time.perf_counter() >= deadline:  # reading and parsing took it all: never queued
            raise DeadlineExceeded
        try:
            if streaming:
                try:
                    pieces = await runtime.open_stream(name, sequences)
                except StreamingUnavailable as exc:
                    raise RequestError(422, "cannot_stream", str(exc), ("model",)) from None
                code = 200
                finish = (gauge, metrics, endpoint, model_label, started, deadline)
                in_flight = None  # the stream's own finally accounts for it
                stream = _ndjson(request, name, pieces, *finish)
                return StreamingResponse(stream, media_type=NDJSON, headers=headers)
            outputs = await _unless_disconnected(request, runtime.infer(name, sequences), deadline)
        except QueueFull as exc:
            raise RequestError(503, "queue_full", str(exc)) from None
        except BatcherClosed as exc:
            raise RequestError(503, "shutting_down", str(exc)) from None
        except EngineUnavailable as exc:  # several workers: the model process has gone
            raise RequestError(503, "engine_unavailable", str(exc)) from None
        except NonFiniteInput:  # found by the model in its own pass; say where
            raise bodies.non_finite_error(sequences, field) from None
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            # it failed alone (the batch was split down to it): the device is too full now
            raise RequestError(
                503, "out_of_memory", f"the model ran out of memory on this request ({rid})"
            ) from None
        code = 200
        if bodies.wants_safetensors(request.headers.get("accept")):
            parts = bodies.encode_parts(name, out_field, outputs)
            response: Response = BuffersResponse(parts, media_type=bodies.SAFETENSORS)
            response.headers.update(headers)
            return response
        answer = await codec.run(
            _json_bytes(outputs), functools.partial(bodies.encode, view=True),
            name, out_field, outputs, False,
        )  # fmt: skip
        return Response(answer, media_type=bodies.JSON, headers=headers)
    except ClientGone:
        code = 499  # nginx's "client closed request": nobody reads this answer
        metrics.cancelled.labels(endpoint).inc()
        return Response(status_code=code, headers=headers)
    except DeadlineExceeded:
        code = 504
        metrics.expired.labels(endpoint).inc()
        waited = time.perf_counter() - started
        err = {"detail": f"the request's deadline passed after {waited:.3f} s; it was dropped",
               "type": "deadline_exceeded", "loc": []}  # fmt: skip
        return json_response(err, code, headers)
    except RequestError as exc:
        code = exc.status
        err = exc.body()
        if exc.type not in ERROR_TYPES:  # a parser's own kind: keep the documented few
            err["type"] = "invalid_request" if exc.status == 422 else "http_error"
        metrics.rejected.labels(endpoint, err["type"]).inc()
        if exc.status == 503:
            headers["Retry-After"] = "1"
        return json_response(err, exc.status, headers)
    except Exception as exc:
        if not was_logged(exc):  # the batcher logs a model's failure once, with the ids
            log.exception("%s failed (request %s)", endpoint, rid)
        return json_response(
            {"detail": f"internal server error; see the server log (request {rid})",
             "type": "internal", "loc": []},
            500, headers,
        )  # fmt: skip
    finally:
        # a streamed rollout's bytes are given back once it is queued (its copy is the
        # scheduler's)
        _budget(request).give(held.n)
        if in_flight is not None:
            in_flight.dec()
            elapsed = time.perf_counter() - started
            duration = metrics.child(metrics.request_duration, endpoint, model_label, str(code))
            duration.observe(elapsed)


async def _unless_disconnected(request: Request, work: Awaitable[A], deadline: float) -> A:
    """Await ``work``; if the client disconnects first, cancel it (it leaves the queue or the
    running batch) and raise :class:`ClientGone`; if the deadline passes first, cancel it
    likewise and raise :class:`DeadlineExceeded`."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    woken = loop.create_future()  # asyncio.wait's job, without its sets and bookkeeping

    def wake(_: object = None) -> None:
        if not woken.done():
            woken.set_result(None)

    task.add_done_callback(wake)
    watcher.add_done_callback(wake)
    left = deadline - time.perf_counter()
    timer = None if math.isinf(left) else loop.call_later(max(left, 0.0), wake)
    try:
        await woken
    finally:
        watcher.cancel()
        task.remove_done_callback(wake)
        if timer is not None:
            timer.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone if watcher.done() and not watcher.cancelled() else DeadlineExceeded


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body has been read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _ndjson(
    request: Request,
    model: str,
    pieces: AsyncIterator[list[Piece]],
    in_flight: Gauge,
    metrics: Metrics,
    endpoint: str,
    model_label: str,
    started: float,
    deadline: float,
) -> AsyncIterator[bytes]:
    """The streamed rollout: one line per sequence per chunk, then a closing line.

    ``{"sequence": i, "start": t, "positions": [[x, y], ...]}`` for steps ``t..``; the last
    line is ``{"model": ..., "done": true}``, or ``{"error": {...}}`` if the rollout failed or
    its deadline passed (``"type": "deadline_exceeded"``; counted with code 504). A client
    that goes away while a chunk runs, or whose stream is closed, has its rollout dropped at
    the next chunk; so has a stream whose deadline passed.
    """
    code = "499"  # until the stream ends one way or another
    watcher = asyncio.ensure_future(_disconnected(request))
    step: asyncio.Future[list[Piece]] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(pieces))
            left = deadline - time.perf_counter()
            await asyncio.wait(
                {step, watcher},
                timeout=None if math.isinf(left) else max(left, 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if watcher.done():  # the client went away
                return
            if not step.done():  # the deadline passed
                code = "504"
                metrics.expired.labels(endpoint).inc()
                error = {"detail": "the request's deadline passed; the rollout was dropped",
                         "type": "deadline_exceeded"}  # fmt: skip
                yield orjson.dumps({"error": error}, option=orjson.OPT_APPEND_NEWLINE)
                return
            try:
                chunk = step.result()
            except StopAsyncIteration:
                break
            yield b"".join(
                orjson.dumps(
                    {"sequence": i, "start": start, "positions": y},
                    option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE,
                )
                for i, start, y in chunk
            )
        code = "200"
        yield orjson.dumps({"model": model, "done": True}, option=orjson.OPT_APPEND_NEWLINE)
    except Exception as exc:
        code = "500"
        rid = REQUEST_ID.get()
        if not was_logged(exc):  # the scheduler logs a model's failure once, with the ids
            log.exception("%s stream failed (request %s)", endpoint, rid)
        error = {"detail": f"internal server error; see the server log (request {rid})",
                 "type": "internal"}  # fmt: skip
        yield orjson.dumps({"error": error}, option=orjson.OPT_APPEND_NEWLINE)
    finally:
        # also when the server cancels us (the client went away): account first, then make
        # sure the rollout is dropped, i.e. the progress iterator is closed
        in_flight.dec()
        if code == "499":
            metrics.cancelled.labels(endpoint).inc()
        elapsed = time.perf_counter() - started
        metrics.request_duration.labels(endpoint, model_label, code).observe(elapsed)
        watcher.cancel()
        if step is not None and not step.done():
            step.cancel()  # its iterator's own cleanup cancels the rollout
            with contextlib.suppress(BaseException):
                await step
        with contextlib.suppress(RuntimeError):
            await pieces.aclose()  # type: ignore[attr-defined]
