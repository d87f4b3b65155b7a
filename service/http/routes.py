"""HTTP endpoints. Only this layer knows about status codes."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.types import DecoratedCallable
from prometheus_client import Gauge
from pydantic import BaseModel, ConfigDict, Field
from starlette.types import Receive, Scope, Send

from rnnserve.service import endpoints
from rnnserve.service.codec import bodies
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.config import Settings
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH, Endpoint
from rnnserve.service.http import defaults, errors
from rnnserve.service.http.auth import AUTH, Held, bearer, budget_of, check_token, read_body
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
    ServedInfo,
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


ERROR_TYPES = errors.ERROR_TYPES  # the catalogue's, for the tests that import it here


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class DeadlineExceeded(Exception):
    """The request's deadline passed before its answer was ready."""


class ErrorBody(BaseModel):
    detail: str
    type: str = Field(
        description="machine-readable kind of error; docs/API.md lists each",
        json_schema_extra={"enum": list(errors.CATALOGUE)},
    )
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


_INFER_ERRORS = errors.openapi_responses(errors.INFERENCE_STATUSES, ErrorBody)
_TOKEN_ERRORS = errors.openapi_responses((401,), ErrorBody)


# -- answers -------------------------------------------------------------------------------------


def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> Response:
    """The JSON answer to ``exc``, with the status the catalogue gives its type; 401 asks for
    the token, 503 says when to try again."""
    code = errors.status(exc.type)
    headers = dict(headers or {})
    if code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif code == 503:
        headers["Retry-After"] = "1"
    return json_response(errors.body(exc), code, headers or None)


# -- JSON off the event loop ---------------------------------------------------------------------


def _json_bytes(outputs: Any) -> int:
    """About the size of ``outputs`` written as JSON (12 bytes a number, the usual float32)."""
    data = getattr(outputs, "data", None)
    count = data.size if data is not None else sum(int(a.size) for a in outputs)
    return 12 * int(count)


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
    dependencies=AUTH,
    responses=_TOKEN_ERRORS,
)
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


class InferRequest(BaseModel):
    """``POST /models/{name}/infer``: N sequences of T_i steps of the model's input features."""

    model_config = ConfigDict(extra="forbid")
    inputs: Sequences = Field(description="N sequences, each [T_i][input features] numbers")
    model: str | None = Field(None, description="optional; if given, must equal the path's name")


class InferResponse(BaseModel):
    model: str
    outputs: list[list[list[float]]] = Field(description="N sequences, each [T_i][outputs]")


# each inference endpoint's request and answer schemas
_SCHEMAS: dict[Endpoint, tuple[type[BaseModel], type[BaseModel]]] = {
    SMOOTH: (SmoothRequest, SmoothResponse),
    ROLLOUT: (RolloutRequest, RolloutResponse),
    INFER: (InferRequest, InferResponse),
}


def _route(endpoint: Endpoint) -> Callable[[DecoratedCallable], DecoratedCallable]:
    request_schema, answer = _SCHEMAS[endpoint]
    return router.post(
        endpoint.path,
        summary=endpoint.summary,
        openapi_extra=_body_spec(request_schema),
        responses={200: {"model": answer}, **_INFER_ERRORS},
        dependencies=AUTH,
    )


@_route(SMOOTH)
async def smooth(request: Request) -> Response:
    return await _infer(request, SMOOTH)


@_route(ROLLOUT)
async def rollout(request: Request) -> Response:
    return await _infer(request, ROLLOUT)


@_route(INFER)
async def infer(request: Request, name: str) -> Response:
    return await _infer(request, INFER, path_model=name)


async def serve_inference(scope: Scope, receive: Receive, send: Send) -> bool:
    """Serve the inference endpoints (:data:`rnnserve.service.endpoints.INFERENCE`) straight
    from the ASGI call, without FastAPI's routing, dependency solving and middleware, which
    cost as much CPU per request as parsing the body; ``False``: not one of them, let FastAPI
    route it.

    The routes above stay the documented ones (OpenAPI) and serve what this declines (a
    ``root_path`` set by a proxy); both run the same token check and :func:`_infer`.
    """
    if scope["method"] != "POST" or scope.get("root_path"):
        return False
    found = endpoints.by_path(scope["path"])
    if found is None:
        return False
    endpoint, name = found
    request = Request(scope, receive)
    try:
        check_token(request, await bearer(request), endpoint.label)
    except RequestError as exc:
        response = error_response(exc)
    else:
        response = await _infer(request, endpoint, path_model=name)
    await response(scope, receive, send)
    return True


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
                "invalid_header",
                f"{TIMEOUT_HEADER} must be a positive number of seconds, not {given[:32]!r}",
            )  # fmt: skip
        timeout = min(timeout, asked)
    return started + timeout


@dataclass
class _Call:
    """One inference request as it goes through the steps of :func:`_infer`."""

    request: Request
    endpoint: Endpoint
    path_model: str | None
    gauge: Gauge
    started: float = field(default_factory=time.perf_counter)
    rid: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    held: Held = field(default_factory=Held)
    deadline: float = math.inf
    model_label: str = "unknown"  # the default model, until the body or path names one
    code: int = 500
    where: tuple[str, ...] = ("model",)  # where the request named its model
    running: bool = False  # the model has the request
    streamed: bool = False  # a stream's own finally accounts for it
    sequences: Any = None

    @property
    def state(self) -> Any:
        return self.request.app.state

    @property
    def metrics(self) -> Metrics:
        metrics: Metrics = self.state.metrics
        return metrics


def _begin(request: Request, endpoint: Endpoint, path_model: str | None) -> _Call:
    metrics: Metrics = request.app.state.metrics
    gauge = metrics.child(metrics.in_flight, endpoint.label)
    gauge.inc()
    call = _Call(request, endpoint, path_model, gauge, model_label=endpoint.kind or "unknown")
    call.rid = _request_id(request)
    REQUEST_ID.set(call.rid)  # this request's task only: the batcher logs failures with it
    call.headers[REQUEST_ID_HEADER] = call.rid
    return call


async def _infer(
    request: Request, endpoint: Endpoint, *, path_model: str | None = None
) -> Response:
    """One inference request: admit, read, decode, choose the model, run, respond.

    ``path_model``: the model named in the path (``INFER``); the other endpoints serve the
    default model of their kind unless the body names one."""
    call = _begin(request, endpoint, path_model)
    try:
        _admit(call)
        body = await _read(call)
        parsed = await _decode(call, body)
        name, served = _choose_model(call, parsed.model)
        call.sequences = await _arrays(call, body, parsed, name, served)
        return await _run(call, name)
    except (ClientGone, DeadlineExceeded, RequestError) as exc:
        return _refuse(call, exc)
    except Exception as exc:
        mapped = _as_request_error(exc, call)
        return _refuse(call, mapped) if mapped is not None else _internal(call, exc)
    finally:
        _account(call)


def _admit(call: _Call) -> None:
    if not call.state.ready:
        raise RequestError("not_ready", "the server is starting or shutting down")
    call.deadline = _deadline(call.request, call.started, call.state.settings.request_timeout_s)


async def _read(call: _Call) -> bytes:
    settings: Settings = call.state.settings
    return await read_body(
        call.request, settings.max_request_bytes, settings.body_timeout_s, call.held
    )


@dataclass
class _Parsed:
    """A body read: the model it names, and its sequences still to check against the model
    (``decoded``: the fast path's; else ``lists``, the precise parser's)."""

    model: str | None
    decoded: bodies.Decoded | None
    lists: Any = None


def _limits(settings: Settings) -> Limits:
    return Limits(
        settings.max_sequences_per_request,
        settings.max_sequence_length,
        settings.max_request_timesteps,
    )


async def _decode(call: _Call, body: bytes) -> _Parsed:
    codec: CodecPool = call.state.codec  # create_app's, closed by its lifespan
    ctype = call.request.headers.get("content-type")
    field = call.endpoint.input_field
    # safetensors bodies are read in place, in far less than a hand-off to a thread costs
    json_bytes = 0 if bodies.is_safetensors(ctype) else len(body)
    settings: Settings = call.state.settings
    limits = _limits(settings)
    if json_bytes and settings.json_reader == "precise":
        decoded = None
    else:
        decoded = await codec.run(json_bytes, bodies.decode, body, ctype, field, limits)
    if decoded is not None:
        return _Parsed(decoded.model, decoded)
    # off the JSON fast path: the precise parser says what is wrong
    schema = _SCHEMAS[call.endpoint][0]
    name, lists = await codec.run(len(body), parse_body, body, schema, field)
    return _Parsed(name, None, lists)


def _choose_model(call: _Call, name: str | None) -> tuple[str, ServedInfo]:
    """The model named in the path or the body, else the endpoint's default; of the right
    kind for the endpoint."""
    if call.path_model is not None:
        if name is not None and name != call.path_model:
            raise RequestError(
                "invalid_request",
                f"the body names model '{name[:64]}' but the path names "
                f"'{call.path_model[:64]}'; leave 'model' out of the body",
                ("model",),
            )
        name, call.where = call.path_model, ("path", "name")
    kind = call.endpoint.kind
    if not name and kind is not None:  # the only one of its kind, or the configured one
        name = _default_model(call.state, kind)
    name = name or ""
    runtime: Runtime = call.state.runtime
    served = runtime.get(name)
    call.model_label = name
    if kind is not None and served.kind != kind:
        native = endpoints.native(served.kind)
        other = native.path if native is not None else INFER.path.replace("{name}", name)
        raise RequestError(
            "wrong_model_kind",
            f"model '{name}' is a {served.kind} model; send it to POST {other}",
            ("model",),
        )
    return name, served


async def _arrays(call: _Call, body: bytes, parsed: _Parsed, name: str, served: ServedInfo) -> Any:
    """The sequences, checked against the limits and the model's width."""
    if parsed.decoded is not None:
        # a model that checks its inputs as it runs spares the body a second pass
        return parsed.decoded.sequences(served.input_dim, name, not served.checks_finite)
    codec: CodecPool = call.state.codec
    limits = _limits(call.state.settings)
    field = call.endpoint.input_field
    return await codec.run(
        len(body), to_arrays, parsed.lists, field, served.input_dim, limits, name
    )


async def _run(call: _Call, name: str) -> Response:
    if time.perf_counter() >= call.deadline:  # reading and parsing took it all: never queued
        raise DeadlineExceeded
    runtime: Runtime = call.state.runtime
    call.running = True
    if call.endpoint is ROLLOUT and NDJSON in call.request.headers.get("accept", ""):
        return await _stream(call, name)
    work = runtime.infer(name, call.sequences)
    outputs = await _unless_disconnected(call.request, work, call.deadline)
    call.code = 200
    return await _respond(call, name, outputs)


async def _stream(call: _Call, name: str) -> Response:
    runtime: Runtime = call.state.runtime
    pieces = await runtime.open_stream(name, call.sequences)
    call.code = 200
    call.streamed = True  # the stream's own finally accounts for it
    stream = _ndjson(
        call.request, name, pieces, call.gauge, call.metrics, call.endpoint.label,
        call.model_label, call.started, call.deadline,
    )  # fmt: skip
    return StreamingResponse(stream, media_type=NDJSON, headers=call.headers)


async def _respond(call: _Call, name: str, outputs: Any) -> Response:
    out_field = call.endpoint.output_field
    if bodies.wants_safetensors(call.request.headers.get("accept")):
        parts = bodies.encode_parts(name, out_field, outputs)
        response: Response = BuffersResponse(parts, media_type=bodies.SAFETENSORS)
        response.headers.update(call.headers)
        return response
    codec: CodecPool = call.state.codec
    answer = await codec.run(
        _json_bytes(outputs), functools.partial(bodies.encode, view=True),
        name, out_field, outputs, False,
    )  # fmt: skip
    return Response(answer, media_type=bodies.JSON, headers=call.headers)


# what the runtime raises, as the client's error type; True: located where the model was named
_RUNTIME_ERRORS: dict[type[Exception], tuple[str, bool]] = {
    UnknownModel: ("unknown_model", True),
    StreamingUnavailable: ("cannot_stream", True),
    QueueFull: ("queue_full", False),
    BatcherClosed: ("shutting_down", False),
    EngineUnavailable: ("engine_unavailable", False),  # several workers: the engine has gone
}


def _as_request_error(exc: Exception, call: _Call) -> RequestError | None:
    """The client's error for what the runtime or the model raised; ``None``: a failure."""
    for cls, (kind, located) in _RUNTIME_ERRORS.items():
        if isinstance(exc, cls):
            if kind == "unknown_model":
                call.model_label = "unknown"  # not the client's text: labels stay few
            return RequestError(kind, str(exc), call.where if located else ())
    if isinstance(exc, NonFiniteInput):  # found by the model in its own pass; say where
        return bodies.non_finite_error(call.sequences, call.endpoint.input_field)
    if call.running and is_out_of_memory(exc):
        # it failed alone (the batch was split down to it): the device is too full now
        return RequestError(
            "out_of_memory", f"the model ran out of memory on this request ({call.rid})"
        )
    return None


def _refuse(call: _Call, exc: ClientGone | DeadlineExceeded | RequestError) -> Response:
    label = call.endpoint.label
    if isinstance(exc, ClientGone):
        call.code = 499  # nginx's "client closed request": nobody reads this answer
        call.metrics.cancelled.labels(label).inc()
        return Response(status_code=call.code, headers=call.headers)
    if isinstance(exc, DeadlineExceeded):
        call.metrics.expired.labels(label).inc()
        waited = time.perf_counter() - call.started
        exc = RequestError(
            "deadline_exceeded",
            f"the request's deadline passed after {waited:.3f} s; it was dropped",
        )
    else:
        call.metrics.rejected.labels(label, errors.public_type(exc.type)).inc()
    call.code = errors.status(exc.type)
    return error_response(exc, call.headers)


def _internal(call: _Call, exc: Exception) -> Response:
    if not was_logged(exc):  # the batcher logs a model's failure once, with the ids
        log.exception("%s failed (request %s)", call.endpoint.label, call.rid)
    call.code = 500
    failure = RequestError(
        "internal", f"internal server error; see the server log (request {call.rid})"
    )
    return error_response(failure, call.headers)


def _account(call: _Call) -> None:
    # a streamed rollout's bytes are given back once it is queued (its copy is the scheduler's)
    budget_of(call.request).give(call.held.n)
    if not call.streamed:
        call.gauge.dec()
        metrics = call.metrics
        labels = (call.endpoint.label, call.model_label, str(call.code))
        metrics.child(metrics.request_duration, *labels).observe(time.perf_counter() - call.started)


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
