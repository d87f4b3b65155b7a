"""The process boundary of ``rnnserve --workers N``: HTTP workers <-> the engine process.

The engine process owns the models (a :class:`~service.runtime.ModelRuntime`: batchers,
scheduler, worker threads) and serves them on a Unix domain socket with :class:`EngineServer`.
Each HTTP worker holds one connection to it, a :class:`RemoteRuntime` that has the surface the
routes use of ``ModelRuntime`` (``get``, ``infer``, ``open_stream``, ``models``,
``available``) and raises the same errors. Parsing and serialising stay in the workers: only
flat float32 rows and their lengths cross the boundary, never JSON.

A frame is a little-endian ``u32`` byte count, a fixed header (op, error code, flags, call
id, byte counts) and three sections: a UTF-8 text (the model name and the HTTP request's
``X-Request-Id``, an error message, a JSON hello), an int64 array and a float32 ``[rows,
width]`` array, sent as raw bytes. Many requests share one connection, told apart by their call
id. The engine logs a model's failure with the HTTP request ids (as a single-process server
does) and flags the ERROR frame :data:`LOGGED`, so the worker does not log it a second time:

=========== ============== =============================================================
op          direction      sections
=========== ============== =============================================================
HELLO       both           worker: nothing; engine: JSON ``{"pid", "models": [...]}``
INFER       worker->engine ``model\\0request id``, lengths ``[N]``, rows ``[sum T_i, F]``
STREAM      worker->engine the same; answered ACCEPTED, PROGRESS..., END (or ERROR)
CANCEL      worker->engine nothing: the caller went away, drop the request's work
RESULT      engine->worker lengths, output rows
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
import contextlib
import enum
import functools
import itertools
import logging
import os
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from models.packing import FlatSequences
from service.batching import REQUEST_ID, BatcherClosed, QueueFull, mark_logged, was_logged
from service.runtime import Runtime, StreamingUnavailable, UnknownModel
from service.stepping import Piece

log = logging.getLogger(__name__)

PREFIX = struct.Struct("<I")  # bytes of the frame after the prefix
HEADER = struct.Struct("<BBBxQIIII")  # op, code, flags, call id, text bytes, ints, rows, width
LOGGED = 1  # flags of an ERROR frame: the engine logged the failure with the request ids
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


class Code(enum.IntEnum):
    """Which exception an ERROR frame stands for."""

    INTERNAL = 1
    UNKNOWN_MODEL = 2
    QUEUE_FULL = 3
    CLOSED = 4
    STREAMING_UNAVAILABLE = 5
    BAD_FRAME = 6


class EngineUnavailable(ConnectionError):
    """The engine process is not reachable (it died, or the worker is shutting down)."""


class EngineError(RuntimeError):
    """The engine failed a request (the model raised); its log has the traceback."""


class FrameError(ValueError):
    """A frame whose sizes do not add up."""


_CODES: dict[type[Exception], Code] = {
    UnknownModel: Code.UNKNOWN_MODEL,
    QueueFull: Code.QUEUE_FULL,
    BatcherClosed: Code.CLOSED,
    StreamingUnavailable: Code.STREAMING_UNAVAILABLE,
    FrameError: Code.BAD_FRAME,
}
_EXCEPTIONS: dict[Code, type[Exception]] = {
    Code.UNKNOWN_MODEL: UnknownModel,
    Code.QUEUE_FULL: QueueFull,
    Code.CLOSED: BatcherClosed,
    Code.STREAMING_UNAVAILABLE: StreamingUnavailable,
}

_NO_INTS = np.empty(0, np.int64)
_NO_ROWS = np.empty((0, 0), np.float32)


# -- frames --------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Frame:
    """One message: ``ints`` int64 ``[n]``, ``rows`` float32 ``[rows, width]``."""

    op: Op
    id: int = 0
    code: int = 0
    text: bytes = b""
    ints: np.ndarray = field(default_factory=lambda: _NO_INTS)
    rows: np.ndarray = field(default_factory=lambda: _NO_ROWS)
    flags: int = 0

    def buffers(self) -> list[bytes | memoryview]:
        """The encoded frame as buffers to write one after another (the arrays not copied)."""
        ints = np.ascontiguousarray(self.ints, dtype="<i8")
        rows = np.ascontiguousarray(self.rows, dtype="<f4")
        if rows.ndim != 2:
            raise FrameError(f"rows must be [rows, width], got shape {rows.shape}")
        size = HEADER.size + len(self.text) + ints.nbytes + rows.nbytes
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
        )
        out: list[bytes | memoryview] = [head]
        if self.text:
            out.append(self.text)
        if ints.nbytes:
            out.append(ints.data.cast("B"))
        if rows.nbytes:
            out.append(rows.data.cast("B"))
        return out

    def encode(self) -> bytes:
        return b"".join(self.buffers())


def decode(body: bytes) -> Frame:
    """A frame from its bytes after the length prefix; the arrays are views of ``body``."""
    if len(body) < HEADER.size:
        raise FrameError(f"frame of {len(body)} bytes is shorter than its header")
    op, code, flags, rid, n_text, n_ints, n_rows, width = HEADER.unpack_from(body)
    ints_at = HEADER.size + n_text
    rows_at = ints_at + 8 * n_ints
    if rows_at + 4 * n_rows * width != len(body):
        raise FrameError(
            f"frame of {len(body)} bytes does not hold {n_text} text bytes, {n_ints} ints and "
            f"{n_rows}x{width} floats"
        )
    try:
        kind = Op(op)
    except ValueError:
        raise FrameError(f"unknown op {op}") from None
    text = body[HEADER.size : ints_at]
    ints = np.frombuffer(body, "<i8", n_ints, ints_at) if n_ints else _NO_INTS
    count = n_rows * width
    flat = np.frombuffer(body, "<f4", count, rows_at) if count else np.empty(0, np.float32)
    return Frame(kind, rid, code, text, ints, flat.reshape(n_rows, width), flags)


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


def error_frame(rid: int, exc: BaseException) -> Frame:
    code = next((c for t, c in _CODES.items() if isinstance(exc, t)), Code.INTERNAL)
    text = str(exc) if code != Code.INTERNAL else f"{type(exc).__name__}: {exc}"
    return Frame(Op.ERROR, rid, code, text.encode(), flags=LOGGED if was_logged(exc) else 0)


def frame_error(frame: Frame) -> Exception:
    """The exception an ERROR frame stands for, of the class the engine raised (marked as
    logged when the engine logged it)."""
    message = frame.text.decode(errors="replace")
    try:
        cls = _EXCEPTIONS.get(Code(frame.code), EngineError)
    except ValueError:
        cls = EngineError
    exc = cls(message)
    if frame.flags & LOGGED:
        mark_logged(exc)
    return exc


def request_frame(
    op: Op, rid: int, model: str, sequences: FlatSequences, request_id: str | None = None
) -> Frame:
    """An INFER or STREAM frame; ``request_id``: the HTTP request's id, for the engine's log."""
    text = model if request_id is None else f"{model}\0{request_id}"
    return Frame(op, rid, text=text.encode(), ints=sequences.lengths, rows=sequences.data)


def request_of(frame: Frame) -> tuple[str, str | None, FlatSequences]:
    """The model name, the HTTP request id (None if the worker sent none) and the rows of an
    INFER or STREAM frame."""
    try:
        name, _, request_id = frame.text.decode().partition("\0")
        return name, request_id or None, FlatSequences(frame.rows, frame.ints)
    except ValueError as exc:
        raise FrameError(str(exc)) from None


def progress_frame(rid: int, pieces: list[Piece]) -> Frame:
    """A chunk of a streamed rollout: the pieces' (index, start, steps), then their rows."""
    where = np.array([(i, start, len(y)) for i, start, y in pieces], np.int64).reshape(-1)
    rows = np.concatenate([y for _, _, y in pieces]) if pieces else np.empty((0, 2), np.float32)
    return Frame(Op.PROGRESS, rid, ints=where, rows=rows)


def progress_pieces(frame: Frame) -> list[Piece]:
    where = frame.ints.reshape(-1, 3)
    ends = np.cumsum(where[:, 2])
    starts = ends - where[:, 2]
    return [
        (int(i), int(t), frame.rows[a:b])
        for (i, t, _), a, b in zip(where.tolist(), starts.tolist(), ends.tolist(), strict=True)
    ]


# -- the engine's side -------------------------------------------------------------------------


class _Connection:
    """One worker's connection: its requests run as tasks, keyed by request id."""

    def __init__(
        self, runtime: Runtime, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.runtime, self.reader, self.writer = runtime, reader, writer
        self.tasks: dict[int, asyncio.Task[None]] = {}

    async def serve(self) -> None:
        try:
            while (frame := await read_frame(self.reader)) is not None:
                self._dispatch(frame)
        except (FrameError, ConnectionError) as exc:
            log.warning("dropping a worker connection: %s", exc)
        finally:
            for task in list(self.tasks.values()):
                task.cancel()  # its requests leave the queue or the running batch
            if self.tasks:
                await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            self.writer.close()
            with contextlib.suppress(ConnectionError):
                await self.writer.wait_closed()

    def _dispatch(self, frame: Frame) -> None:
        if frame.op == Op.HELLO:
            self._send(Frame(Op.HELLO, frame.id, text=self._hello()))
        elif frame.op in (Op.INFER, Op.STREAM):
            run = self._infer if frame.op == Op.INFER else self._stream
            task = asyncio.ensure_future(run(frame))
            self.tasks[frame.id] = task
            task.add_done_callback(functools.partial(self._forget, frame.id))
        elif frame.op == Op.CANCEL:
            running = self.tasks.get(frame.id)
            if running is not None:
                running.cancel()
        else:
            self._send(error_frame(frame.id, FrameError(f"{frame.op.name} is not a request")))

    def _forget(self, rid: int, _: object) -> None:
        self.tasks.pop(rid, None)

    def _hello(self) -> bytes:
        served = [
            {"name": m.name, "kind": m.kind, "input_dim": m.input_dim, "info": m.info}
            for m in self.runtime.models.values()
        ]
        return orjson.dumps({"pid": os.getpid(), "models": served})

    async def _infer(self, frame: Frame) -> None:
        try:
            name, request_id, sequences = request_of(frame)
            REQUEST_ID.set(request_id)  # this task's own context: the batcher logs with it
            out = await self.runtime.infer(name, sequences)
            reply = Frame(Op.RESULT, frame.id, ints=out.lengths, rows=out.data)
        except asyncio.CancelledError:
            raise  # the worker forgot this id: nothing to answer
        except Exception as exc:  # the same exception, raised again in the worker
            reply = error_frame(frame.id, exc)
        await self._reply(reply)

    async def _stream(self, frame: Frame) -> None:
        try:
            name, request_id, sequences = request_of(frame)
            REQUEST_ID.set(request_id)
            pieces = await self.runtime.open_stream(name, sequences)
        except Exception as exc:
            await self._reply(error_frame(frame.id, exc))
            return
        try:
            await self._reply(Frame(Op.ACCEPTED, frame.id))
            async for chunk in pieces:
                await self._reply(progress_frame(frame.id, chunk))
            await self._reply(Frame(Op.END, frame.id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._reply(error_frame(frame.id, exc))
        finally:
            with contextlib.suppress(RuntimeError):
                await pieces.aclose()  # type: ignore[attr-defined]

    def _send(self, frame: Frame) -> None:
        if not self.writer.is_closing():
            self.writer.writelines(frame.buffers())

    async def _reply(self, frame: Frame) -> None:
        self._send(frame)
        with contextlib.suppress(ConnectionError):
            await self.writer.drain()


class EngineServer:
    """Serves a runtime's models to HTTP workers on a Unix domain socket."""

    def __init__(self, runtime: Runtime, path: str) -> None:
        self.runtime = runtime
        self.path = path
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[_Connection, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def connections(self) -> int:
        return len(self._connections)

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, self.path, limit=STREAM_LIMIT)
        os.chmod(self.path, 0o600)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        connection = _Connection(self.runtime, reader, writer)
        self._connections[connection] = task
        self._idle.clear()
        try:
            await connection.serve()
        finally:
            del self._connections[connection]
            if not self._connections:
                self._idle.set()

    async def wait_idle(self, timeout_s: float | None) -> bool:
        """Wait until no worker is connected (they are draining); False on timeout."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        """Stop listening and drop every connection (their requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        # closing the socket ends each connection's read loop, which cancels its requests
        for connection in self._connections:
            connection.writer.close()
        if self._connections:
            await asyncio.gather(*self._connections.values(), return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


# -- the worker's side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteModel:
    """A model served by the engine, as the routes see it."""

    name: str
    kind: str
    input_dim: int
    info: dict[str, Any]
    checks_finite: bool = False  # the HTTP worker checks: the engine's finding is not relayed


_END = object()


@dataclass(eq=False)
class _Call:
    future: asyncio.Future[Any]  # the result, or (streams) the acceptance
    queue: asyncio.Queue[Any] | None = None  # streams: progress, then _END or an exception


class _RemoteStream:
    """A streamed rollout's progress as it arrives; closing it early cancels it in the engine."""

    def __init__(self, runtime: RemoteRuntime, rid: int, call: _Call) -> None:
        assert call.queue is not None
        self._runtime, self._rid, self._queue = runtime, rid, call.queue
        self._done = False

    def __aiter__(self) -> _RemoteStream:
        return self

    async def __anext__(self) -> list[Piece]:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if item is _END:
            self._done = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._done = True
            raise item
        pieces: list[Piece] = item
        return pieces

    async def aclose(self) -> None:
        self._done = True
        self._runtime._cancel(self._rid)  # a no-op once END or ERROR arrived


class RemoteRuntime:
    """The engine's models, reached over its socket; many calls share one connection.

    ``on_lost`` is called once if the connection drops while the runtime is started.
    """

    def __init__(self, path: str, on_lost: Callable[[], None] | None = None) -> None:
        self.path = path
        self.on_lost = on_lost
        self.engine_pid: int | None = None
        self._models: dict[str, RemoteModel] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._available = False
        self._stopping = False

    @property
    def models(self) -> Mapping[str, RemoteModel]:
        return self._models

    @property
    def available(self) -> bool:
        return self._available

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout_s: float = 30.0) -> None:
        """Connect (retrying while the socket is not there yet) and learn the served models."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.path, limit=STREAM_LIMIT)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if asyncio.get_running_loop().time() > deadline:
                    raise EngineUnavailable(f"no engine listening on {self.path}") from None
                await asyncio.sleep(0.05)
        writer.writelines(Frame(Op.HELLO).buffers())
        hello = await read_frame(reader)
        if hello is None or hello.op != Op.HELLO:
            writer.close()
            raise EngineUnavailable("the engine did not say hello")
        served = orjson.loads(hello.text)
        self.engine_pid = int(served["pid"])
        self._models = {
            m["name"]: RemoteModel(m["name"], m["kind"], int(m["input_dim"]), m["info"])
            for m in served["models"]
        }
        self._reader, self._writer = reader, writer
        self._available = True
        self._reading = asyncio.ensure_future(self._read())

    async def stop(self) -> None:
        self._stopping = True
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(ConnectionError):
                await self._writer.wait_closed()
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        self._lost(EngineUnavailable("the worker is shutting down"))

    async def _read(self) -> None:
        assert self._reader is not None
        why: Exception = EngineUnavailable("the engine closed the connection")
        try:
            while (frame := await read_frame(self._reader)) is not None:
                self._deliver(frame)
        except (FrameError, ConnectionError, asyncio.IncompleteReadError) as exc:
            why = EngineUnavailable(f"lost the engine: {exc}")
        finally:
            self._lost(why)

    def _lost(self, exc: Exception) -> None:
        was_available, self._available = self._available, False
        calls, self._calls = self._calls, {}
        for call in calls.values():
            if not call.future.done():
                call.future.set_exception(exc)
            elif call.queue is not None:
                call.queue.put_nowait(exc)
        if was_available and not self._stopping:
            log.error("%s; answering 503 engine_unavailable", exc)
            if self.on_lost is not None:
                self.on_lost()

    def _deliver(self, frame: Frame) -> None:
        call = self._calls.get(frame.id)
        if call is None:  # a call that was cancelled meanwhile
            return
        if frame.op == Op.RESULT:
            del self._calls[frame.id]
            if not call.future.done():
                call.future.set_result(FlatSequences(frame.rows, frame.ints))
        elif frame.op == Op.ACCEPTED:
            if not call.future.done():
                call.future.set_result(None)
        elif frame.op == Op.PROGRESS and call.queue is not None:
            call.queue.put_nowait(progress_pieces(frame))
        elif frame.op == Op.END and call.queue is not None:
            del self._calls[frame.id]
            call.queue.put_nowait(_END)
        elif frame.op == Op.ERROR:
            del self._calls[frame.id]
            exc = frame_error(frame)
            if not call.future.done():
                call.future.set_exception(exc)
            elif call.queue is not None:
                call.queue.put_nowait(exc)

    # -- calls ------------------------------------------------------------------------------

    def get(self, name: str) -> RemoteModel:
        try:
            return self._models[name]
        except KeyError:
            known = ", ".join(sorted(self._models)) or "none"
            raise UnknownModel(f"no model named '{name}' (served: {known})") from None

    async def infer(self, name: str, sequences: FlatSequences) -> FlatSequences:
        """Run ``sequences`` through model ``name`` in the engine; cancelling cancels it there."""
        self.get(name)
        rid, call = self._open(Op.INFER, name, sequences, streaming=False)
        try:
            await self._drain()
            result: FlatSequences = await call.future
            return result
        except asyncio.CancelledError:
            self._cancel(rid)
            raise

    async def open_stream(self, name: str, sequences: FlatSequences) -> AsyncIterator[list[Piece]]:
        """Queue a streamed rollout in the engine; raises its QueueFull etc. before returning."""
        self.get(name)
        rid, call = self._open(Op.STREAM, name, sequences, streaming=True)
        try:
            await self._drain()
            await call.future  # ACCEPTED, or the engine's error
        except BaseException:
            self._cancel(rid)
            raise
        return _RemoteStream(self, rid, call)

    def _open(
        self, op: Op, name: str, sequences: FlatSequences, *, streaming: bool
    ) -> tuple[int, _Call]:
        if not self._available or self._writer is None:
            raise EngineUnavailable("the engine process is not available")
        rid = next(self._ids)
        call = _Call(asyncio.get_running_loop().create_future())
        if streaming:
            call.queue = asyncio.Queue()
        self._calls[rid] = call
        frame = request_frame(op, rid, name, sequences, REQUEST_ID.get())
        self._writer.writelines(frame.buffers())
        return rid, call

    async def _drain(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()

    def _cancel(self, rid: int) -> None:
        """Forget call ``rid``; if the engine still runs it, tell the engine to drop it."""
        if self._calls.pop(rid, None) is None:
            return
        if self._available and self._writer is not None and not self._writer.is_closing():
            self._writer.writelines(Frame(Op.CANCEL, rid).buffers())
