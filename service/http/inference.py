"""One inference request through the HTTP layer, step by step: admit, read, decode, choose the
model, run, respond; and what each failure is answered with.

The steps without a leading underscore (:class:`Call`, :func:`begin_call`, :func:`admit`,
:func:`read_request_body`, :func:`choose_model`, :func:`limits_of`, :func:`carry_state`,
:func:`refuse`, :func:`internal_error`, :func:`as_request_error`, :func:`account`,
:func:`unless_disconnected`) are shared with the other protocols' routes (``kserve.py``, the
Open Inference Protocol; ``sessions.py``, WebSocket sessions), so every protocol has the same
admission, budget, limits, errors and metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import os
import random
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import Gauge

from rnnserve.service import endpoints
from rnnserve.service.codec import bodies
from rnnserve.service.codec.bodies import StateAsked
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.config import Settings
from rnnserve.service.endpoints import INFER, ROLLOUT, Endpoint
from rnnserve.service.http import defaults, errors, negotiation, precise, tracing
from rnnserve.service.http.auth import Held, byte_budget, read_body
from rnnserve.service.http.outcomes import ClientGone, DeadlineExceeded
from rnnserve.service.http.responses import BuffersResponse, error_response
from rnnserve.service.http.streaming import NDJSON, disconnected, ndjson
from rnnserve.service.http.validation import (
    SCHEMAS,
    FlatNumbers,
    carried_state,
    state_from_json,
    to_arrays,
)
from rnnserve.service.interface import (
    BatcherClosed,
    EngineUnavailable,
    Limits,
    ModelChanged,
    NonFiniteInput,
    QueueFull,
    RequestContext,
    RequestError,
    Runtime,
    ServedInfo,
    StateMismatch,
    StreamingUnavailable,
    UnknownModel,
    is_out_of_memory,
    open_request,
    quote,
    state_shapes,
)
from rnnserve.service.metrics import Metrics

log = logging.getLogger(__name__)
A = TypeVar("A")

REQUEST_ID_HEADER = "X-Request-Id"
TIMEOUT_HEADER = "X-Request-Timeout"
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces


def answer_json_bytes(outputs: Any) -> int:
    """About the size of ``outputs`` written as JSON (12 bytes a number, the usual float32)."""
    data = getattr(outputs, "data", None)
    count = data.size if data is not None else sum(int(a.size) for a in outputs)
    return 12 * int(count)


def _request_id(given: str | None) -> str:
    """The id the client gave (``X-Request-Id``) if it is one, else a new one."""
    if given is not None and _REQUEST_ID.fullmatch(given):
        return given
    return f"{_ID_PREFIX}{_ID_BITS.getrandbits(64):016x}"


# request ids: 64 random bits per process, then 64 more per request from a generator seeded by
# the system (32 hex digits as uuid4().hex; no system call per request, and no counter that
# would tell clients how many requests the server takes). Ids, not secrets.
_ID_PREFIX = os.urandom(8).hex()
_ID_BITS = random.Random()


def _default_model(state: Any, kind: str) -> str:
    """The model a request of ``kind`` without ``model`` gets; resolved once per set of served
    models (a reload replaces the set, and the next request resolves it again)."""
    served = state.runtime.models
    cached = getattr(state, "default_models", None)
    if cached is None or cached[0] is not served:
        cached = state.default_models = (served, {})
    chosen: dict[str, str] = cached[1]
    name = chosen.get(kind)
    if name is None:  # an ambiguous default raises the client's error every time
        name = chosen[kind] = defaults.resolve(served, kind, state.settings)
    return name


def _deadline(given: str | None, started: float, default_s: float) -> float:
    """When the request's answer is due (``time.perf_counter`` clock; ``inf``: never), from the
    client's ``X-Request-Timeout`` if given."""
    timeout = default_s if default_s > 0 else math.inf
    if given is not None:
        try:
            asked = float(given) if "_" not in given else math.nan  # float() takes "1_0"
        except ValueError:
            asked = math.nan
        if not asked > 0:  # also NaN
            raise RequestError(
                "invalid_header",
                f"{TIMEOUT_HEADER} must be a positive number of seconds, not {quote(given, 32)!r}",
            )  # fmt: skip
        timeout = min(timeout, asked)
    return started + timeout


_REQUEST_ID_KEY = REQUEST_ID_HEADER.lower().encode()
_TIMEOUT_KEY = TIMEOUT_HEADER.lower().encode()


def _text(value: bytes | None) -> str | None:
    return value.decode("latin-1") if value is not None else None


class Call:
    """One inference request as it goes through the steps of :func:`serve_request`.

    A plain class rather than a dataclass: what a request starts with is the class's until a
    step sets it, so a call costs one short ``__init__`` (a dataclass's assigns every field)."""

    deadline = math.inf
    code = 500
    where: tuple[str, ...] = ("model",)  # where the request named its model
    running = False  # the model has the request
    streamed = False  # a stream's own finally accounts for it
    sequences: Any = None
    error: str | None = None  # the error type answered, for the trace
    trace: tracing.Trace = tracing.OFF
    # a call's context until begin_call opens the request's own (never current in a task, so
    # nothing marks it)
    context = RequestContext("-")

    def __init__(
        self,
        request: Request,
        endpoint: Endpoint,
        path_model: str | None,
        gauge: Gauge,
    ) -> None:
        self.request = request
        self.endpoint = endpoint
        self.path_model = path_model
        self.gauge = gauge
        # the metrics' model label until the body or path names the model: the endpoint's kind
        self.model_label = endpoint.kind or "unknown"
        self.started = time.perf_counter()
        self.headers: dict[str, str] = {}  # the answer's
        self.held = Held()
        # the app's state, looked up once (request.app is a Python property)
        state = self.state = request.app.state
        self.metrics: Metrics = state.metrics
        self.settings: Settings = state.settings
        # the request headers the steps read, looked up once (each lookup through starlette's
        # Headers scans the whole head again); the first of a repeated header counts, as with
        # request.headers.get
        head = dict(reversed(request.scope["headers"]))
        self.content_type = _text(head.get(b"content-type"))
        self.accept = _text(head.get(b"accept"))
        self.given_id = _text(head.get(_REQUEST_ID_KEY))
        self.given_timeout = _text(head.get(_TIMEOUT_KEY))
        self.safetensors = bodies.is_safetensors(self.content_type)

    @property
    def rid(self) -> str:
        return self.context.request_id


def begin_call(request: Request, endpoint: Endpoint, path_model: str | None) -> Call:
    metrics: Metrics = request.app.state.metrics
    gauge = metrics.child(metrics.in_flight, endpoint.label)
    gauge.inc()
    call = Call(request, endpoint, path_model, gauge)
    # this request's task and those it starts: the batchers log its failure with the id
    call.context = open_request(_request_id(call.given_id))
    call.headers[REQUEST_ID_HEADER] = call.rid
    call.trace = tracing.begin(call.state.tracing, request, endpoint.path, call.rid)
    return call


async def serve_request(
    request: Request, endpoint: Endpoint, *, path_model: str | None = None
) -> Response:
    """Answer one inference request: admit, read, decode, choose the model, run, respond.

    ``path_model``: the model named in the path (``INFER``); the other endpoints serve the
    default model of their kind unless the body names one."""
    call = begin_call(request, endpoint, path_model)
    try:
        admit(call)
        with call.trace.step("read body"):
            body = await read_request_body(call)
        with call.trace.step("decode"):
            parsed = await _decode(call, body)
            name, served = choose_model(call, parsed.model)
            call.sequences = await _arrays(call, body, parsed, name, served)
            call.sequences = carry_state(call.sequences, parsed.state, name, served)
        return await _run(call, name)
    except (ClientGone, DeadlineExceeded, RequestError) as exc:
        return refuse(call, exc)
    except Exception as exc:
        mapped = as_request_error(exc, call)
        return refuse(call, mapped) if mapped is not None else internal_error(call, exc)
    finally:
        account(call)
        if not call.streamed:  # a stream's span ends with the stream
            call.trace.end(call.code, call.error)


def admit(call: Call) -> None:
    if not call.state.ready:
        raise RequestError("not_ready", "the server is starting or shutting down")
    call.deadline = _deadline(call.given_timeout, call.started, call.settings.request_timeout_s)


async def read_request_body(call: Call) -> bytes:
    """The body. The native endpoints' safetensors bodies have their header length checked on
    the first 8 bytes; the Open Inference Protocol's binary extension is a format of its own."""
    settings = call.settings
    safetensors = call.safetensors and call.endpoint in endpoints.INFERENCE
    return await read_body(
        call.request, settings.max_request_bytes, settings.body_timeout_s, call.held, safetensors
    )


@dataclass
class _Parsed:
    """A body read: the model it names, and its sequences still to check against the model
    (``decoded``: the fast path's; else ``flat``, the precise parser's)."""

    model: str | None
    decoded: bodies.Decoded | None
    flat: FlatNumbers | None = None
    state: StateAsked = bodies.NO_STATE


def limits_of(settings: Settings) -> Limits:
    return Limits(
        settings.max_sequences_per_request,
        settings.max_sequence_length,
        settings.max_request_timesteps,
    )


def refuse_compressed(call: Call) -> None:
    """A body is read as sent: one with a ``Content-Encoding`` would be read as garbage."""
    encoding = call.request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise RequestError(
            "invalid_header",
            f"Content-Encoding {quote(encoding, 32)!r}: a compressed body is not taken; send "
            "it as is",
        )  # fmt: skip


async def _decode(call: Call, body: bytes) -> _Parsed:
    refuse_compressed(call)
    codec: CodecPool = call.state.codec  # create_app's, closed by its lifespan
    ctype = call.content_type
    field = call.endpoint.input_field
    # safetensors bodies are read in place, in far less than a hand-off to a thread costs
    json_bytes = 0 if call.safetensors else len(body)
    settings = call.settings
    limits = limits_of(settings)
    if json_bytes and settings.json_reader == "precise":
        decoded = None
    else:
        decoded = await codec.run(json_bytes, bodies.decode, body, ctype, field, limits)
    if decoded is not None:
        state = await precise.read_state(decoded, body, byte_budget(call.state), call.held, codec)
        if state is not None:
            return _Parsed(decoded.model, decoded, state=state)
    # off the JSON fast path: the precise parser (in a child for large bodies, its memory held
    # in the budget) says what is wrong, or reads what the fast one declined
    schema = SCHEMAS[call.endpoint][0]
    name, flat = await precise.read_precisely(call.request, body, schema, field, call.held, codec)
    return _Parsed(name, None, flat, state_from_json(flat.state, flat.return_state))


def choose_model(call: Call, name: str | None) -> tuple[str, ServedInfo]:
    """The model named in the path or the body, else the endpoint's default; of the right
    kind for the endpoint."""
    if call.path_model is not None:
        if name is not None and name != call.path_model:
            raise RequestError(
                "invalid_request",
                f"the body names model '{quote(name)}' but the path names "
                f"'{quote(call.path_model)}'; leave 'model' out of the body",
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


async def _arrays(call: Call, body: bytes, parsed: _Parsed, name: str, served: ServedInfo) -> Any:
    """The sequences, checked against the limits and the model's width."""
    if parsed.decoded is not None:
        return parsed.decoded.sequences(served.input_dim, name)
    codec: CodecPool = call.state.codec
    limits = limits_of(call.settings)
    field = call.endpoint.input_field
    return await codec.run(len(body), to_arrays, parsed.flat, field, served.input_dim, limits, name)


def carry_state(sequences: Any, asked: StateAsked, name: str, served: ServedInfo) -> Any:
    """The sequences with the state they start from and whether to answer the final one,
    checked against the model (its version, its parts and their shapes)."""
    if asked.parts is None and not asked.return_state:
        return sequences
    shapes = state_shapes(served)
    if not shapes:
        raise RequestError(
            "cannot_carry_state",
            f"model '{name}' ({served.kind}) carries no state between requests",
            ("state",) if asked.parts is not None else ("return_state",),
        )  # fmt: skip
    state = carried_state(asked, name, served.version, shapes, len(sequences))
    return dataclasses.replace(sequences, state=state, return_state=asked.return_state)


async def _run(call: Call, name: str) -> Response:
    if time.perf_counter() >= call.deadline:  # reading and parsing took it all: never queued
        raise DeadlineExceeded
    call.running = True
    answer = _answer_type(call)
    if answer == NDJSON:
        if call.sequences.return_state:
            raise RequestError(
                "invalid_request",
                "a streamed answer (Accept: application/x-ndjson) cannot carry the final "
                "state; ask for JSON or safetensors to have it returned",
                ("return_state",),
            )  # fmt: skip
        return await _stream(call, name)
    work = call.state.runtime.infer(name, call.sequences)
    with call.trace.engine_call():  # its task starts inside: the engine call's span is current
        outputs = await unless_disconnected(call.request, work, call.deadline)
    call.code = 200
    with call.trace.step("encode"):
        return await _respond(call, name, outputs, answer)


_STREAMED_OR_BINARY = (NDJSON, bodies.SAFETENSORS)  # a rollout's answers besides JSON
_BINARY = (bodies.SAFETENSORS,)


def _answer_type(call: Call) -> str:
    """The media type the request's ``Accept`` header asks for, of the endpoint's answers."""
    offers = _STREAMED_OR_BINARY if call.endpoint is ROLLOUT else _BINARY
    return negotiation.choose(call.accept, offers, bodies.JSON)


async def _stream(call: Call, name: str) -> Response:
    pieces = await call.state.runtime.open_stream(name, call.sequences)
    call.code = 200
    call.streamed = True  # the stream's own finally accounts for it
    stream = ndjson(
        call.request, name, pieces, call.gauge, call.metrics, call.endpoint.label,
        call.model_label, call.started, call.deadline, call.trace,
    )  # fmt: skip
    return StreamingResponse(stream, media_type=NDJSON, headers=call.headers)


async def _respond(call: Call, name: str, outputs: Any, media_type: str) -> Response:
    out_field = call.endpoint.output_field
    if media_type == bodies.SAFETENSORS:
        parts = bodies.encode_parts(name, out_field, outputs)
        response: Response = BuffersResponse(parts, media_type=bodies.SAFETENSORS)
        response.headers.update(call.headers)
        return response
    answer = await call.state.codec.run(
        answer_json_bytes(outputs), functools.partial(bodies.encode, view=True),
        name, out_field, outputs, False,
    )  # fmt: skip
    return Response(answer, media_type=bodies.JSON, headers=call.headers)


# what the runtime raises, as the client's error type; True: located where the model was named
RUNTIME_ERRORS: dict[type[Exception], tuple[str, bool]] = {
    UnknownModel: ("unknown_model", True),
    StreamingUnavailable: ("cannot_stream", True),
    QueueFull: ("queue_full", False),
    BatcherClosed: ("shutting_down", False),
    EngineUnavailable: ("engine_unavailable", False),  # several workers: the engine has gone
    StateMismatch: ("state_mismatch", False),  # a reload replaced the version since the check
    ModelChanged: ("model_changed", True),  # a reload changed the width since the check
}


def as_request_error(exc: Exception, call: Call) -> RequestError | None:
    """The client's error for what the runtime or the model raised; ``None``: a failure."""
    for cls, (kind, located) in RUNTIME_ERRORS.items():
        if isinstance(exc, cls):
            if kind == "unknown_model":
                call.model_label = "unknown"  # not the client's text: labels stay few
            where = ("state", "version") if kind == "state_mismatch" else ()
            return RequestError(kind, str(exc), call.where if located else where)
    if isinstance(exc, NonFiniteInput):  # found by the engine, which has no body: say where
        return bodies.non_finite_error(call.sequences, call.endpoint.input_field)
    if call.running and is_out_of_memory(exc):
        # it failed alone (the batch was split down to it): the device is too full now
        return RequestError(
            "out_of_memory", f"the model ran out of memory on this request ({call.rid})"
        )
    return None


def refuse(call: Call, exc: ClientGone | DeadlineExceeded | RequestError) -> Response:
    label = call.endpoint.label
    if isinstance(exc, ClientGone):
        call.code = 499  # nginx's "client closed request": nobody reads this answer
        call.error = "client_closed"
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
    call.error = errors.public_type(exc.type)
    return error_response(exc, call.headers)


def internal_error(call: Call, exc: Exception) -> Response:
    if not call.context.failure_logged:  # a batcher logs a model's failure once, with the ids
        log.exception("%s failed (request %s)", call.endpoint.label, call.rid)
    call.code = 500
    call.error = "internal"
    failure = RequestError(
        "internal", f"internal server error; see the server log (request {call.rid})"
    )
    return error_response(failure, call.headers)


def account(call: Call) -> None:
    # a streamed rollout's bytes are given back once it is queued (its copy is the scheduler's)
    byte_budget(call.state).give(call.held.n)
    if not call.streamed:
        call.gauge.dec()
        metrics = call.metrics
        labels = (call.endpoint.label, call.model_label, str(call.code))
        metrics.child(metrics.request_duration, *labels).observe(time.perf_counter() - call.started)


async def unless_disconnected(request: Request, work: Awaitable[A], deadline: float) -> A:
    """Await ``work``; if the client disconnects first, cancel it (it leaves the queue or the
    running batch) and raise :class:`ClientGone`; if the deadline passes first, cancel it
    likewise and raise :class:`DeadlineExceeded`."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected(request))
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
