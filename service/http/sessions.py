"""Streaming sessions (docs/SESSIONS.md): one WebSocket per client stream, at
``/models/{name}/stream``. Each chunk of steps the client sends is read as a body of
``/models/{name}/infer`` (JSON text frames, safetensors binary frames), run by the same runtime
and batchers as every request, starting from the state the session carries, and answered with
its outputs; the session keeps the final state for the next chunk and gives it on request.

The engine continues the state (it runs items from an initial state), so a session holds only
the state between chunks, in the HTTP process that serves its connection (with ``--workers N``,
the state crosses to the engine process with each chunk, as an HTTP request's does).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import orjson
from fastapi import Request, WebSocket, WebSocketDisconnect
from fastapi.security import HTTPAuthorizationCredentials

from rnnserve.service.codec import bodies
from rnnserve.service.codec.bodies import StateAsked
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.config import Settings
from rnnserve.service.endpoints import INFER, STREAM
from rnnserve.service.http import errors, inference, precise
from rnnserve.service.http.auth import ByteBudget, Held, byte_budget, check_token, overloaded
from rnnserve.service.http.validation import SCHEMAS, state_from_json, to_arrays
from rnnserve.service.interface import (
    CarriedState,
    FlatSequences,
    NonFiniteInput,
    RequestError,
    Runtime,
    ServedInfo,
    UnknownModel,
    quote,
    state_shapes,
)
from rnnserve.service.metrics import Metrics

log = logging.getLogger(__name__)
A = TypeVar("A")

# close codes (RFC 6455 and the application's 4000-4999: 4000 + the HTTP status of the error)
NORMAL = 1000
POLICY_VIOLATION = 1008  # no bearer token, or a wrong one
MESSAGE_TOO_BIG = 1009  # a frame over max_chunk_bytes (TOO_LARGE)
TRY_AGAIN_LATER = 1013  # max_sessions open already, or the server is not ready
IDLE_TIMEOUT = 4408  # nothing came within session_idle_timeout_s
_REASON_BYTES = 123  # the most a close frame's reason may hold (RFC 6455)

TOO_LARGE = "body_too_large"  # the error type of a frame over max_chunk_bytes

# the scope extension, an asyncio.Event, by which rnnserve's WebSocket protocol says the
# connection is lost (ws_protocol); other servers have none
CONNECTION_LOST = "rnnserve.connection_lost"

# a text frame this short may be a control message: read whole before it is taken as a chunk
_CONTROL_BYTES = 256


def close_code(error_type: str) -> int:
    """The close code of a session refused or ended by ``error_type``."""
    if error_type == "unauthorized":
        return POLICY_VIOLATION
    if error_type == TOO_LARGE:
        return MESSAGE_TOO_BIG
    if error_type in ("not_ready", "too_many_sessions"):
        return TRY_AGAIN_LATER
    if error_type == "idle_timeout":
        return IDLE_TIMEOUT
    return 4000 + int(errors.status(error_type))


def too_large_detail(limit: int) -> str:
    """The detail of the close of a frame over ``limit`` bytes: the same whether the session
    or the WebSocket layer (:mod:`rnnserve.service.http.ws_protocol`) refuses it."""
    return f"a frame is over {limit} bytes (max_chunk_bytes)"


def close_reason(error_type: str, detail: str) -> str:
    """The close frame's reason: ``{"type": ..., "detail": ...}``, the detail shortened to fit
    the frame: the most of its characters that fit (a character may take up to 4 bytes)."""

    def reason(limit: int) -> str:
        return orjson.dumps({"type": error_type, "detail": quote(detail, limit)}).decode()

    fits, over = 0, len(detail) + 1  # quote(detail, 0) fits: the type is short
    while over - fits > 1:
        middle = (fits + over) // 2
        if len(reason(middle).encode()) <= _REASON_BYTES:
            fits = middle
        else:
            over = middle
    return reason(fits)


class Sessions:
    """The sessions open in this HTTP process (one event loop: no lock)."""

    def __init__(self) -> None:
        self.open = 0


def sessions_of(state: Any) -> Sessions:
    try:
        sessions: Sessions = state.sessions
    except AttributeError:  # one per app
        sessions = state.sessions = Sessions()
    return sessions


class _Ended(Exception):
    """The session ends with this close code and reason."""

    def __init__(self, error_type: str, detail: str) -> None:
        super().__init__(detail)
        self.type, self.detail = error_type, detail


class _Gone(Exception):
    """The client closed the connection or vanished."""


async def serve_session(websocket: WebSocket, name: str) -> None:
    """One streaming session, from the handshake to its close."""
    await websocket.accept()
    app_state = websocket.app.state
    try:
        served = _admit(websocket, name)
    except RequestError as exc:
        await _close(websocket, exc.type, exc.message)
        return
    sessions = sessions_of(app_state)
    settings: Settings = app_state.settings
    if sessions.open >= settings.max_sessions:
        await _close(
            websocket,
            "too_many_sessions",
            f"{sessions.open} sessions are open (max_sessions); try again later",
        )
        return
    metrics: Metrics = app_state.metrics
    gauge = metrics.child(metrics.sessions_open, name)
    sessions.open += 1
    gauge.inc()
    session = _Session(websocket, name, served, settings, metrics)
    try:
        await session.run()
    except _Ended as end:
        await _close(websocket, end.type, end.detail)
    except _Gone:
        pass
    finally:
        sessions.open -= 1
        gauge.dec()


def _admit(websocket: WebSocket, name: str) -> ServedInfo:
    """The served model the session streams to, once the handshake passes the token, the
    server's readiness and the model's ability to carry state."""
    check_token(cast(Request, websocket), _credentials(websocket), STREAM.label)
    if not websocket.app.state.ready:
        raise RequestError("not_ready", "the server is starting or shutting down")
    runtime: Runtime = websocket.app.state.runtime
    try:
        served = runtime.get(name)
    except UnknownModel as exc:
        raise RequestError("unknown_model", str(exc), ("path", "name")) from None
    if not state_shapes(served):
        raise RequestError("cannot_carry_state", f"model '{name}' ({served.kind}) carries no state")
    return served


def _credentials(websocket: WebSocket) -> HTTPAuthorizationCredentials | None:
    scheme, _, token = websocket.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return None
    return HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip())


async def _close(websocket: WebSocket, error_type: str, detail: str) -> None:
    with contextlib.suppress(RuntimeError):  # closed already (the client went first)
        await websocket.close(close_code(error_type), close_reason(error_type, detail))


@dataclass(frozen=True)
class _Taken:
    """A frame the session has taken from the connection: its bytes, held in the budget from
    then until its chunk is answered; or what answers it instead."""

    frame: bytes = b""
    binary: bool = False
    held: int = 0  # bytes of the budget the frame holds
    refused: RequestError | None = None  # the budget could not take it: answered with this
    too_large: bool = False  # over max_chunk_bytes: the session ends
    gone: bool = False  # the client closed the connection or vanished


_GONE = _Taken(gone=True)


@dataclass
class _Session:
    websocket: WebSocket
    name: str
    served: ServedInfo
    settings: Settings
    metrics: Metrics
    state: CarriedState | None = None

    async def run(self) -> None:
        """Answer each frame in turn until the client closes, vanishes or idles too long.

        A reader task takes the frames as they come, so that a client that vanishes while its
        chunk runs is seen at once: the chunk leaves the queue or the running batch, and the
        session its slot. It takes one frame ahead of the running chunk at most, each counted
        in the byte budget from then on, and reads no more until the session takes it: the
        WebSocket layer then stops reading the connection too."""
        frames: asyncio.Queue[_Taken] = asyncio.Queue(maxsize=1)
        gone = asyncio.Event()
        reader = asyncio.ensure_future(self._read(frames, gone))
        lost = self.websocket.scope.get("extensions", {}).get(CONNECTION_LOST)
        # the reader reads nothing while a frame waits: the protocol's word comes sooner
        relay = asyncio.ensure_future(_set_when(lost, gone)) if lost is not None else None
        budget = byte_budget(self.websocket.app.state)
        try:
            while True:
                try:
                    async with asyncio.timeout(self.settings.session_idle_timeout_s):
                        taken = await frames.get()
                except TimeoutError:
                    raise _Ended(
                        "idle_timeout",
                        f"nothing came within {self.settings.session_idle_timeout_s:g} s "
                        "(session_idle_timeout_s)",
                    ) from None
                frames.task_done()  # the waiting place is free: the reader takes the next
                try:
                    await self._answer(taken, gone)
                finally:
                    budget.give(taken.held)
                    del taken  # its frame goes with its bytes in the budget
        finally:
            reader.cancel()
            if relay is not None:
                relay.cancel()
            while not frames.empty():  # a frame the session ended before it took
                budget.give(frames.get_nowait().held)

    async def _read(self, frames: asyncio.Queue[_Taken], gone: asyncio.Event) -> None:
        while True:
            await frames.join()  # the frame taken before is the session's now
            message = await self.websocket.receive()
            if message["type"] == "websocket.disconnect":
                gone.set()
                frames.put_nowait(_GONE)
                return
            taken = self._take(message)
            frames.put_nowait(taken)  # never full: the session took the one before
            if taken.too_large:
                return

    def _take(self, message: MutableMapping[str, Any]) -> _Taken:
        """The frame of ``message``, its bytes taken from the budget; ``message`` keeps none
        of it (a text frame's text would be a second copy)."""
        data: bytes | None = message.pop("bytes", None)
        binary = data is not None
        frame = data if data is not None else (message.pop("text", None) or "").encode()
        # under rnnserve's uvicorn options the WebSocket layer refuses such a frame first
        # (ws_protocol); this check holds the limit under any other ASGI server
        if len(frame) > self.settings.max_chunk_bytes:
            return _Taken(too_large=True)
        budget = byte_budget(self.websocket.app.state)
        if not budget.take(len(frame)):
            return _Taken(refused=overloaded(budget))
        return _Taken(frame, binary, held=len(frame))

    async def _answer(self, taken: _Taken, gone: asyncio.Event) -> None:
        if taken.gone or gone.is_set():
            raise _Gone
        if taken.too_large:
            raise _Ended(TOO_LARGE, too_large_detail(self.settings.max_chunk_bytes))
        if taken.refused is not None:
            await self._refuse(taken.refused)
            return
        await self._frame(taken.frame, taken.binary, gone)

    async def _frame(self, frame: bytes, binary: bool, gone: asyncio.Event) -> None:
        started = time.perf_counter()
        if not binary and _asks_state(frame):
            await self._send_state()
            return
        budget = byte_budget(self.websocket.app.state)
        held = Held()  # what the chunk takes beyond its frame (a precise parse)
        try:
            sequences = await self._decode(frame, binary, budget, held)
            outputs = await self._until_gone(self._infer(sequences), gone)
        except RequestError as exc:
            await self._refuse(exc)
            return
        finally:
            budget.give(held.n)
        self.state = outputs.state
        await self._send_outputs(dataclasses.replace(outputs, state=None), binary)
        self.metrics.child(self.metrics.session_chunks, self.name, "ok").inc()
        duration = self.metrics.child(self.metrics.session_chunk_duration, self.name)
        duration.observe(time.perf_counter() - started)

    async def _decode(
        self, frame: bytes, binary: bool, budget: ByteBudget, held: Held
    ) -> FlatSequences:
        """The chunk's sequences, read as a body of ``INFER`` and checked as one, with the
        state they start from: the session's, or the one its first chunk sends."""
        codec: CodecPool = self.websocket.app.state.codec
        field = STREAM.input_field
        limits = inference.limits_of(self.settings)
        ctype = bodies.SAFETENSORS if binary else bodies.JSON
        decoded = None
        if binary or self.settings.json_reader == "fast":
            size = 0 if binary else len(frame)
            decoded = await codec.run(size, bodies.decode, frame, ctype, field, limits)
        state = None
        if decoded is not None:
            state = await precise.read_state(decoded, frame, budget, held, codec)
        if decoded is not None and state is not None:
            model, asked = decoded.model, state
            sequences = decoded.sequences(self.served.input_dim, self.name)
        else:
            await precise.hold_cost(frame, budget, held, codec)
            schema = SCHEMAS[INFER][0]
            model, flat = await precise.READER.read(frame, schema, field, codec)
            asked = state_from_json(flat.state, flat.return_state)
            width = self.served.input_dim
            sequences = await codec.run(
                len(frame), to_arrays, flat, field, width, limits, self.name
            )  # fmt: skip
        if model is not None and model != self.name:
            raise RequestError(
                "invalid_request",
                f"the chunk names model '{quote(model)}' but the session streams to "
                f"'{self.name}'; leave 'model' out",
                ("model",),
            )  # fmt: skip
        return self._with_state(sequences, asked)

    def _with_state(self, sequences: FlatSequences, asked: StateAsked) -> FlatSequences:
        if asked.parts is not None:
            if self.state is not None:
                raise RequestError(
                    "invalid_request",
                    "only a session's first chunk may send a state; later chunks continue "
                    "the state the session carries",
                    ("state",),
                )  # fmt: skip
            carried = StateAsked(True, asked.model, asked.version, asked.parts, asked.binary)
            with_state: FlatSequences = inference.carry_state(
                sequences, carried, self.name, self.served
            )
            return with_state
        if self.state is None:
            return dataclasses.replace(sequences, return_state=True)
        carried_rows = len(next(iter(self.state.tensors.values())))
        if len(sequences) != carried_rows:
            raise RequestError(
                "wrong_shape",
                f"the chunk has {len(sequences)} sequences; the session carries "
                f"{carried_rows} (every chunk continues the same sequences)",
                (STREAM.input_field,),
            )  # fmt: skip
        return dataclasses.replace(sequences, state=self.state, return_state=True)

    async def _infer(self, sequences: FlatSequences) -> FlatSequences:
        runtime: Runtime = self.websocket.app.state.runtime
        timeout = self.settings.request_timeout_s or None
        try:
            async with asyncio.timeout(timeout):
                return await runtime.infer(self.name, sequences)
        except TimeoutError:
            raise RequestError(
                "deadline_exceeded", f"the chunk took over {timeout:g} s (request_timeout_s)"
            ) from None
        except NonFiniteInput:
            raise bodies.non_finite_error(sequences, STREAM.input_field) from None
        except RequestError:
            raise
        except Exception as exc:
            mapped = _runtime_error(exc)
            if mapped is not None:
                raise mapped from None
            log.exception("a chunk of a session to model %s failed", self.name)
            raise RequestError("internal", "internal server error; see the server log") from None

    async def _until_gone(self, work: Awaitable[A], gone: asyncio.Event) -> A:
        """Await ``work``; if the client vanishes first, cancel it and raise :class:`_Gone`."""
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # the session itself is cancelled (the server's shutdown, a test client's exit):
            # its chunk, a task of its own, would otherwise run on in the batcher. Not awaited:
            # a cancel scope would cancel that await too
            task.cancel()
            raise
        finally:
            watcher.cancel()
        if task.done():
            return task.result()
        task.cancel()  # awaited: the chunk has left the batcher before the slot is free
        await asyncio.wait((task,))  # never raises: the session's own cancel still does
        raise _Gone

    async def _refuse(self, exc: RequestError) -> None:
        error_type = errors.public_type(exc.type)
        self.metrics.child(self.metrics.session_chunks, self.name, error_type).inc()
        if error_type == "state_mismatch" and self.state is not None:
            # a reload changed the model: the state the session carries can never continue
            raise _Ended(error_type, exc.message)
        answer = {"error": errors.body(exc), "status": errors.status(exc.type)}
        await self._send(orjson.dumps(answer))

    async def _send_state(self) -> None:
        state = bodies.state_json(self.state) if self.state is not None else None
        await self._send(orjson.dumps({"state": state}, option=orjson.OPT_SERIALIZE_NUMPY))

    async def _send_outputs(self, outputs: FlatSequences, binary: bool) -> None:
        field = STREAM.output_field
        if binary:
            parts = bodies.encode_parts(self.name, field, outputs)
            await self._send_bytes(b"".join(bytes(memoryview(p).cast("B")) for p in parts))
            return
        codec: CodecPool = self.websocket.app.state.codec
        answer = await codec.run(
            inference.answer_json_bytes(outputs), bodies.encode, self.name, field, outputs, False
        )
        await self._send(bytes(answer))

    async def _send(self, text: bytes) -> None:
        try:
            await self.websocket.send_text(text.decode())
        except _SEND_FAILED:
            raise _Gone from None

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await self.websocket.send_bytes(data)
        except _SEND_FAILED:
            raise _Gone from None


# what a send to a closed or lost connection raises: Starlette's WebSocketDisconnect for the
# server's ClientDisconnected (an OSError), e.g. once ws_protocol resets a client that does not
# read; RuntimeError after a close
_SEND_FAILED = (RuntimeError, OSError, WebSocketDisconnect)


async def _set_when(lost: asyncio.Event, gone: asyncio.Event) -> None:
    await lost.wait()
    gone.set()


def _asks_state(frame: bytes) -> bool:
    """Whether a text frame is the control message ``{"get_state": true}``."""
    if len(frame) > _CONTROL_BYTES or b"get_state" not in frame:
        return False
    try:
        doc = orjson.loads(frame)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and len(doc) == 1 and doc.get("get_state") is True  # not 1


def _runtime_error(exc: Exception) -> RequestError | None:
    for cls, (kind, _) in inference.RUNTIME_ERRORS.items():
        if isinstance(exc, cls):
            return RequestError(kind, str(exc))
    return None
