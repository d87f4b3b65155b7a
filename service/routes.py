"""HTTP endpoints. Only this layer knows about status codes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Gauge
from pydantic import BaseModel

from service import wire
from service.batching import BatcherClosed, QueueFull
from service.metrics import CONTENT_TYPE, Metrics
from service.runtime import Runtime, StreamingUnavailable, UnknownModel
from service.stepping import Piece
from service.transport import EngineUnavailable
from service.validation import (
    Limits,
    RequestError,
    RolloutRequest,
    RolloutResponse,
    SmoothRequest,
    SmoothResponse,
    parse_body,
    to_arrays,
)

log = logging.getLogger(__name__)
router = APIRouter()
NDJSON = "application/x-ndjson"
A = TypeVar("A")


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


class ErrorBody(BaseModel):
    detail: str
    type: str
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
                wire.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in (
        (400, "body is not JSON"),
        (404, "no such model"),
        (413, "request over a configured limit"),
        (422, "input of the wrong shape or values"),
        (503, "not ready, queue full, shutting down or engine unavailable"),
    )
}


@router.get("/healthz", summary="Liveness: 200 while the process runs")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: 200 once models are warm, 503 before and while draining")
async def readyz(request: Request) -> Response:
    if request.app.state.ready and request.app.state.runtime.available:
        return json_response({"status": "ready"})
    return json_response({"status": "not ready"}, 503)


@router.get("/models", summary="The served models: name, kind, shapes, parameters")
async def list_models(request: Request) -> dict[str, Any]:
    runtime: Runtime = request.app.state.runtime
    return {"models": [{"name": m.name, **m.info} for m in runtime.models.values()]}


@router.get("/metrics", summary="Prometheus text exposition")
async def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.exposition(), media_type=CONTENT_TYPE)


@router.post(
    "/smooth",
    summary="Smooth N sequences of F features",
    openapi_extra=_body_spec(SmoothRequest),
    responses={200: {"model": SmoothResponse}, **_ERRORS},
)
async def smooth(request: Request) -> Response:
    return await _infer(request, "smooth", "smoother", SmoothRequest, "sequences", "sequences")


@router.post(
    "/rollout",
    summary="Roll the Traveller out over N sequences of exogenous inputs",
    openapi_extra=_body_spec(RolloutRequest),
    responses={200: {"model": RolloutResponse}, **_ERRORS},
)
async def rollout(request: Request) -> Response:
    return await _infer(request, "rollout", "traveller", RolloutRequest, "inputs", "positions")


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = RequestError(413, "body_too_large", f"request body is over {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


async def _infer(
    request: Request,
    endpoint: str,
    kind: str,
    schema: type[BaseModel],
    field: str,
    out_field: str,
) -> Response:
    state = request.app.state
    metrics: Metrics = state.metrics
    runtime: Runtime = state.runtime
    settings = state.settings
    started = time.perf_counter()
    gauge = metrics.in_flight.labels(endpoint)
    gauge.inc()
    in_flight: Gauge | None = gauge  # None once a stream has taken over the accounting
    model_label = "unknown"
    code = 500
    try:
        if not state.ready:
            raise RequestError(503, "not_ready", "the server is starting or shutting down")
        body = await _read_body(request, settings.max_request_bytes)
        limits = Limits(
            settings.max_sequences_per_request,
            settings.max_sequence_length,
            settings.max_request_timesteps,
        )
        decoded = wire.decode(body, request.headers.get("content-type"), field, limits)
        if decoded is None:  # off the JSON fast path: the precise parser says what is wrong
            name, sequences = parse_body(body, schema, field)
        else:
            name = decoded.model
        name = name or kind
        try:
            served = runtime.get(name)
        except UnknownModel as exc:
            raise RequestError(404, "unknown_model", str(exc), ("model",)) from None
        model_label = name
        if served.kind != kind:
            other = "/smooth" if served.kind == "smoother" else "/rollout"
            raise RequestError(
                422, "wrong_model_kind",
                f"model '{name}' is a {served.kind} model; send it to POST {other}", ("model",),
            )  # fmt: skip
        if decoded is None:
            sequences = to_arrays(sequences, field, served.input_dim, limits, name)
        else:
            sequences = decoded.sequences(served.input_dim, name)
        streaming = endpoint == "rollout" and NDJSON in request.headers.get("accept", "")
        try:
            if streaming:
                try:
                    pieces = await runtime.open_stream(name, sequences)
                except StreamingUnavailable as exc:
                    raise RequestError(422, "cannot_stream", str(exc), ("model",)) from None
                code = 200
                finish = (gauge, metrics, endpoint, model_label, started)
                in_flight = None  # the stream's own finally accounts for it
                stream = _ndjson(request, name, pieces, *finish)
                return StreamingResponse(stream, media_type=NDJSON)
            outputs = await _unless_disconnected(request, runtime.infer(name, sequences))
        except QueueFull as exc:
            raise RequestError(503, "queue_full", str(exc)) from None
        except BatcherClosed as exc:
            raise RequestError(503, "shutting_down", str(exc)) from None
        except EngineUnavailable as exc:  # several workers: the model process has gone
            raise RequestError(503, "engine_unavailable", str(exc)) from None
        code = 200
        if wire.wants_safetensors(request.headers.get("accept")):
            parts = wire.encode_parts(name, out_field, outputs)
            return BuffersResponse(parts, media_type=wire.SAFETENSORS)
        return Response(wire.encode(name, out_field, outputs, False), media_type=wire.JSON)
    except ClientGone:
        code = 499  # nginx's "client closed request": nobody reads this answer
        metrics.cancelled.labels(endpoint).inc()
        return Response(status_code=code)
    except RequestError as exc:
        code = exc.status
        metrics.rejected.labels(endpoint, exc.type).inc()
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return json_response(exc.body(), exc.status, headers)
    except Exception:
        log.exception("%s failed", endpoint)
        return json_response(
            {"detail": "internal server error; see the server log", "type": "internal",
             "loc": []},
            500,
        )  # fmt: skip
    finally:
        if in_flight is not None:
            in_flight.dec()
            elapsed = time.perf_counter() - started
            metrics.request_duration.labels(endpoint, model_label, str(code)).observe(elapsed)


async def _unless_disconnected(request: Request, work: Awaitable[A]) -> A:
    """Await ``work``; if the client disconnects first, cancel it (it leaves the queue or the
    running batch) and raise :class:`ClientGone`."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientGone


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
) -> AsyncIterator[bytes]:
    """The streamed rollout: one line per sequence per chunk, then a closing line.

    ``{"sequence": i, "start": t, "positions": [[x, y], ...]}`` for steps ``t..``; the last
    line is ``{"model": ..., "done": true}``, or ``{"error": {...}}`` if the rollout failed.
    A client that goes away while a chunk runs, or whose stream is closed, has its rollout
    dropped at the next chunk.
    """
    code = "499"  # until the stream ends one way or another
    watcher = asyncio.ensure_future(_disconnected(request))
    step: asyncio.Future[list[Piece]] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(pieces))
            await asyncio.wait({step, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if watcher.done():  # the client went away
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
    except Exception:
        code = "500"
        log.exception("%s stream failed", endpoint)
        error = {"detail": "internal server error; see the server log", "type": "internal"}
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
