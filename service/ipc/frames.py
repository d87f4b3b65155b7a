"""The frames of ``rnnserve --workers N``'s process boundary: HTTP workers <-> the engine process.

The engine process owns the models (a :class:`~rnnserve.service.engine.runtime.ModelRuntime`:
batchers, scheduler, worker threads) and serves them on a Unix domain socket with
:class:`EngineServer`. Each HTTP worker holds one connection to it, a :class:`RemoteRuntime` that
has the surface the routes use of ``ModelRuntime`` (``get``, ``infer``, ``open_stream``, ``models``,
``available``) and raises the same errors. Parsing and serialising stay in the workers: only
flat float32 rows and their lengths cross the boundary, never JSON.

A frame is a little-endian ``u32`` byte count, a fixed header (op, error code, flags, call
id, byte counts) and four sections: a UTF-8 text (the model name, the HTTP request's
``X-Request-Id`` and the W3C ``traceparent`` of the worker's span, an error message, a JSON
hello), an int64 array, a float32 ``[rows, width]`` array and a flat float32 array of a
carried state's parts, sent as raw bytes. Many requests share one connection, told apart by
their call id. The engine logs a model's failure with the HTTP request ids (as a
single-process server does) and flags the ERROR frame :data:`LOGGED`, so the worker does not
log it a second time:

=========== ============== =============================================================
op          direction      sections
=========== ============== =============================================================
HELLO       both           worker: nothing; engine: JSON ``{"pid", "models": [...],
                           "staged": [...]}``, each model with its ``state_shapes``
                           ``{part: [dims]}``
MODELS      both           engine: JSON ``{"models": [...], "staged": [...]}``, a reload
                           changed them (call id: the list's number); worker: nothing, it
                           has list number ``call id`` (the engine lists a staged model
                           once every worker has it)
RELOAD      worker->engine nothing: reload the model directory (``POST /admin/reload``)
RELOADED    engine->worker JSON: what the reload did (``ReloadReport.as_json``)
INFER       worker->engine ``model\\0request id\\0traceparent``, lengths ``[N]``,
                           rows ``[sum T_i, F]``; flag :data:`RETURN_STATE`; with a start
                           state (flag :data:`HAS_STATE`) the text goes on
                           ``\\0state model\\0state version\\0{part: [dims]}`` and the
                           state section holds each part ``[N, *dims]`` in that order
STREAM      worker->engine the same; answered ACCEPTED, PROGRESS..., END (or ERROR)
CANCEL      worker->engine nothing: the caller went away, drop the request's work
RESULT      engine->worker lengths, output rows; with a final state (:data:`HAS_STATE`)
                           the text ``model\\0version\\0{part: [dims]}`` and its parts
ACCEPTED    engine->worker nothing: the stream is queued
PROGRESS    engine->worker ``(index, first step, steps)`` per piece, the pieces' rows
END         engine->worker nothing: the stream is complete
ERROR       engine->worker error code (which exception), flags, its message
=========== ============== =============================================================

The rows are copied once each way (into the socket and out of it); a measured cost per MB is in
docs/BENCHMARKS.md. A lost connection fails every call waiting on it with
:class:`EngineUnavailable`, and the worker stops reporting ready.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import struct
from dataclasses import dataclass, field

import numpy as np
import orjson

from rnnserve.service.interface import (
    BatcherClosed,
    CarriedState,
    FlatSequences,
    ModelChanged,
    NonFiniteInput,
    Piece,
    QueueFull,
    StateMismatch,
    StreamingUnavailable,
    UnknownModel,
)

log = logging.getLogger(__name__)

PREFIX = struct.Struct("<I")  # bytes of the frame after the prefix
# op, code, flags, call id, text bytes, ints, rows, width, state floats
HEADER = struct.Struct("<BBBxQIIIII")
LOGGED = 1  # flags of an ERROR frame: the engine logged the failure with the request ids
RETURN_STATE = 2  # flags of an INFER or STREAM frame: answer the sequences' final state
HAS_STATE = 4  # flags of an INFER, STREAM or RESULT frame: it carries a state
MAX_FRAME = 2**32 - 1
STREAM_LIMIT = 16 * 2**20  # asyncio stream buffer: big frames arrive in few reads


class Op(enum.IntEnum):
    HELLO = 1
    INFER = 2
    STREAM = 3
    CANCEL = 4
    RESULT = 5
    ACCEPTED = 6
    PROGRESS = 7
    END = 8
    ERROR = 9
    RELOAD = 10
    RELOADED = 11
    MODELS = 12


class Code(enum.IntEnum):
    """Which exception an ERROR frame stands for."""

    INTERNAL = 1
    UNKNOWN_MODEL = 2
    QUEUE_FULL = 3
    CLOSED = 4
    STREAMING_UNAVAILABLE = 5
    BAD_FRAME = 6
    NON_FINITE = 7
    STATE_MISMATCH = 8
    MODEL_CHANGED = 9


class EngineError(RuntimeError):
    """The engine failed a request (the model raised); its log has the traceback."""


class FrameError(ValueError):
    """A frame whose sizes do not add up."""


_CODES: dict[type[Exception], Code] = {
    UnknownModel: Code.UNKNOWN_MODEL,
    QueueFull: Code.QUEUE_FULL,
    BatcherClosed: Code.CLOSED,
    StreamingUnavailable: Code.STREAMING_UNAVAILABLE,
    NonFiniteInput: Code.NON_FINITE,
    StateMismatch: Code.STATE_MISMATCH,
    ModelChanged: Code.MODEL_CHANGED,
    FrameError: Code.BAD_FRAME,
}
_EXCEPTIONS: dict[Code, type[Exception]] = {
    Code.UNKNOWN_MODEL: UnknownModel,
    Code.QUEUE_FULL: QueueFull,
    Code.CLOSED: BatcherClosed,
    Code.STREAMING_UNAVAILABLE: StreamingUnavailable,
    Code.NON_FINITE: NonFiniteInput,
    Code.STATE_MISMATCH: StateMismatch,
    Code.MODEL_CHANGED: ModelChanged,
}

_NO_INTS = np.empty(0, np.int64)
_NO_ROWS = np.empty((0, 0), np.float32)
_NO_STATE = np.empty(0, np.float32)


# -- frames --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Frame:
    """One message: ``ints`` int64 ``[n]``, ``rows`` float32 ``[rows, width]``, ``state`` the
    float32 arrays of a state's parts (decoded: one flat array of them all)."""

    op: Op
    id: int = 0
    code: int = 0
    text: bytes = b""
    ints: np.ndarray = field(default_factory=lambda: _NO_INTS)
    rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    flags: int = 0
    state: tuple[np.ndarray, ...] = ()

    def buffers(self) -> list[bytes | memoryview]:
        """The encoded frame as buffers to write one after another (the arrays not copied)."""
        ints = np.ascontiguousarray(self.ints, dtype="<i8")
        rows = np.ascontiguousarray(self.rows, dtype="<f4")
        if rows.ndim != 2:
            raise FrameError(f"rows must be [rows, width], got shape {rows.shape}")
        parts = [np.ascontiguousarray(p, dtype="<f4") for p in self.state] if self.state else []
        state_floats = sum(p.size for p in parts)
        size = HEADER.size + len(self.text) + ints.nbytes + rows.nbytes + 4 * state_floats
        if size > MAX_FRAME:
            raise FrameError(f"frame of {size} bytes is over the {MAX_FRAME} limit")
        head = PREFIX.pack(size) + HEADER.pack(
            self.op,
            self.code,
            self.flags,
            self.id,
            len(self.text),
            len(ints),
            rows.shape[0],
            rows.shape[1],
            state_floats,
        )
        out: list[bytes | memoryview] = [head]
        if self.text:
            out.append(self.text)
        if ints.nbytes:
            out.append(ints.data.cast("B"))
        if rows.nbytes:
            out.append(rows.data.cast("B"))
        out.extend(p.reshape(-1).data.cast("B") for p in parts if p.size)
        return out

    def encode(self) -> bytes:
        return b"".join(self.buffers())


def decode(body: bytes) -> Frame:
    """A frame from its bytes after the length prefix; the arrays are views of ``body``."""
    if len(body) < HEADER.size:
        raise FrameError(f"frame of {len(body)} bytes is shorter than its header")
    op, code, flags, call_id, n_text, n_ints, n_rows, width, n_state = HEADER.unpack_from(body)
    ints_at = HEADER.size + n_text
    rows_at = ints_at + 8 * n_ints
    state_at = rows_at + 4 * n_rows * width
    if state_at + 4 * n_state != len(body):
        raise FrameError(
            f"frame of {len(body)} bytes does not hold {n_text} text bytes, {n_ints} ints, "
            f"{n_rows}x{width} floats and {n_state} state floats"
        )
    try:
        kind = Op(op)
    except ValueError:
        raise FrameError(f"unknown op {op}") from None
    text = body[HEADER.size : ints_at]
    ints = np.frombuffer(body, "<i8", n_ints, ints_at) if n_ints else _NO_INTS
    count = n_rows * width
    flat = np.frombuffer(body, "<f4", count, rows_at) if count else np.empty(0, np.float32)
    state = (np.frombuffer(body, "<f4", n_state, state_at),) if n_state else ()
    return Frame(kind, call_id, code, text, ints, flat.reshape(n_rows, width), flags, state)


async def read_frame(reader: asyncio.StreamReader) -> Frame | None:
    """The next frame, or None at a clean end of the stream."""
    try:
        prefix = await reader.readexactly(PREFIX.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("the stream ended inside a frame's length") from None
        return None
    (size,) = PREFIX.unpack(prefix)
    return decode(await reader.readexactly(size))


def error_frame(call_id: int, exc: BaseException, logged: bool) -> Frame:
    """The ERROR frame for ``exc``; ``logged``: the engine logged it with the request's id."""
    code = next((c for t, c in _CODES.items() if isinstance(exc, t)), Code.INTERNAL)
    text = str(exc) if code != Code.INTERNAL else f"{type(exc).__name__}: {exc}"
    return Frame(Op.ERROR, call_id, code, text.encode(), flags=LOGGED if logged else 0)


def frame_error(frame: Frame) -> Exception:
    """The exception an ERROR frame stands for, of the class the engine raised (whether the
    engine logged it is the frame's :data:`LOGGED` flag)."""
    message = frame.text.decode(errors="replace")
    try:
        cls = _EXCEPTIONS.get(Code(frame.code), EngineError)
    except ValueError:
        cls = EngineError
    return cls(message)


def request_frame(
    op: Op,
    call_id: int,
    model: str,
    sequences: FlatSequences,
    request_id: str | None = None,
    traceparent: str | None = None,
) -> Frame:
    """An INFER or STREAM frame; ``request_id``: the HTTP request's id, for the engine's log;
    ``traceparent``: the worker's current span, ``None`` when it does not trace. The
    sequences' start state and ``return_state`` go with them."""
    text = f"{model}\0{request_id or ''}\0{traceparent or ''}"
    flags = RETURN_STATE if sequences.return_state else 0
    if sequences.state is None:
        return Frame(op, call_id, text=text.encode(), ints=sequences.lengths,
                     rows=sequences.data, flags=flags)  # fmt: skip
    state = sequences.state
    text += f"\0{_state_text(state)}"
    return Frame(
        op, call_id, text=text.encode(), ints=sequences.lengths, rows=sequences.data,
        flags=flags | HAS_STATE, state=tuple(state.tensors.values()),
    )  # fmt: skip


def request_of(frame: Frame) -> tuple[str, str | None, str | None, FlatSequences]:
    """The model name, the HTTP request id (for the engine's log), the traceparent of the
    worker's span (the batch links to it; each ``None`` if the worker sent none) and the rows
    of an INFER or STREAM frame, with their start state and ``return_state``."""
    try:
        fields = frame.text.decode().split("\0", 3)
        if len(fields) < 3:  # the model alone, or no traceparent: the missing ones are empty
            fields += [""] * (3 - len(fields))
        name, request_id, traceparent = fields[:3]
        state = None
        if frame.flags & HAS_STATE:
            if len(fields) < 4:
                raise FrameError("a frame flagged with a state names none")
            state = _state_of(fields[3], frame, len(frame.ints))
        return_state = bool(frame.flags & RETURN_STATE)
        sequences = FlatSequences(frame.rows, frame.ints, state, return_state)
    except ValueError as exc:  # FrameError too: its message, as a FrameError
        raise FrameError(str(exc)) from None
    return name, request_id or None, traceparent or None, sequences


def result_frame(call_id: int, out: FlatSequences) -> Frame:
    """A RESULT frame: the output rows and, when the request asked for it, the final state."""
    if out.state is None:
        return Frame(Op.RESULT, call_id, ints=out.lengths, rows=out.data)
    state = out.state
    return Frame(
        Op.RESULT, call_id, text=_state_text(state).encode(), ints=out.lengths, rows=out.data,
        flags=HAS_STATE, state=tuple(state.tensors.values()),
    )  # fmt: skip


def result_of(frame: Frame) -> FlatSequences:
    """The output rows of a RESULT frame, and the final state if it carries one."""
    if not frame.flags & HAS_STATE:
        return FlatSequences(frame.rows, frame.ints)
    try:
        state = _state_of(frame.text.decode(), frame, len(frame.ints))
        return FlatSequences(frame.rows, frame.ints, state)
    except ValueError as exc:
        raise FrameError(str(exc)) from None


def _state_text(state: CarriedState) -> str:
    """``model\\0version\\0{part: [dims]}``: whose state and how its parts are laid out (the
    dims of one sequence, in the order the parts follow one another)."""
    shapes = {part: list(t.shape[1:]) for part, t in state.tensors.items()}
    return f"{state.model}\0{state.version}\0{orjson.dumps(shapes).decode()}"


def _state_of(text: str, frame: Frame, sequences: int) -> CarriedState:
    """The state that ``text`` (:func:`_state_text`) describes, its parts views of the
    frame's state section, each ``[sequences, *dims]``."""
    fields = text.split("\0")
    if len(fields) != 3:
        raise FrameError("a state must be named by its model, version and parts")
    model, version, layout = fields
    try:
        shapes = orjson.loads(layout)
    except orjson.JSONDecodeError:
        raise FrameError("a state's parts are not JSON") from None
    if not isinstance(shapes, dict):
        raise FrameError("a state's parts must be an object of part names to dims")
    flat = frame.state[0] if frame.state else _NO_STATE
    tensors: dict[str, np.ndarray] = {}
    at = 0
    for part, dims in shapes.items():
        if not isinstance(dims, list) or not all(isinstance(d, int) and d >= 0 for d in dims):
            raise FrameError(f"state part {part!r} has no list of dims")
        shape = (sequences, *dims)
        size = math.prod(shape)
        if at + size > len(flat):
            raise FrameError(f"the state section ends inside part {part!r}")
        tensors[part] = flat[at : at + size].reshape(shape)
        at += size
    if at != len(flat):
        raise FrameError(f"the state section holds {len(flat) - at} floats after its parts")
    return CarriedState(model, version, tensors)


def progress_frame(call_id: int, pieces: list[Piece]) -> Frame:
    """A chunk of a streamed rollout: the pieces' (index, start, steps), then their rows."""
    where = np.array([(i, start, len(y)) for i, start, y in pieces], np.int64).reshape(-1)
    rows = np.concatenate([y for _, _, y in pieces]) if pieces else np.empty((0, 2), np.float32)
    return Frame(Op.PROGRESS, call_id, ints=where, rows=rows)


def progress_pieces(frame: Frame) -> list[Piece]:
    where = frame.ints.reshape(-1, 3)
    ends = np.cumsum(where[:, 2])
    starts = ends - where[:, 2]
    return [
        (int(i), int(t), frame.rows[a:b])
        for (i, t, _), a, b in zip(where.tolist(), starts.tolist(), ends.tolist(), strict=True)
    ]
