"""The worker's side of the IPC socket: :class:`RemoteRuntime`, the engine's models as the routes
see a runtime (the frames are :mod:`rnnserve.service.ipc.frames`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from rnnserve.service import tracing
from rnnserve.service.interface import (
    EngineUnavailable,
    FlatSequences,
    Piece,
    ReloadReport,
    RequestContext,
    UnknownModel,
    current_request,
    quote,
)
from rnnserve.service.ipc.frames import (
    LOGGED,
    STREAM_LIMIT,
    Frame,
    FrameError,
    Op,
    frame_error,
    progress_pieces,
    read_frame,
    request_frame,
    result_of,
)


def _result_of(frame: Frame) -> Any:
    """A RESULT frame's output rows (and final state), or a RELOADED frame's report."""
    if frame.op == Op.RELOADED:
        return ReloadReport.from_json(orjson.loads(frame.text))
    return result_of(frame)


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteModel:
    """A model served by the engine, as the routes see it; ``state_shapes``: the parts of one
    sequence's carried state and their shapes (``{}``: it carries none)."""

    name: str
    kind: str
    input_dim: int
    info: dict[str, Any]
    version: str
    loaded_at: float
    state_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @classmethod
    def all_of(cls, served: list[dict[str, Any]]) -> dict[str, RemoteModel]:
        """The models of a HELLO or MODELS frame's list, by name."""
        return {
            m["name"]: cls(
                m["name"],
                m["kind"],
                int(m["input_dim"]),
                m["info"],
                m["version"],
                m["loaded_at"],
                {part: tuple(dims) for part, dims in m.get("state_shapes", {}).items()},
            )
            for m in served
        }


_END = object()


@dataclass(eq=False)
class _Call:
    future: asyncio.Future[Any]  # the result, or (streams) the acceptance
    queue: asyncio.Queue[Any] | None = None  # streams: progress, then _END or an exception
    request: RequestContext | None = field(default_factory=current_request)
    traceparent: str | None = field(default_factory=tracing.current_traceparent)


class _RemoteStream:
    """A streamed rollout's progress as it arrives; closing it early cancels it in the engine."""

    def __init__(self, runtime: RemoteRuntime, call_id: int, call: _Call) -> None:
        assert call.queue is not None
        self._runtime, self._call_id, self._queue = runtime, call_id, call.queue
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
        self._runtime._cancel(self._call_id)  # a no-op once END or ERROR arrived


class RemoteRuntime:
    """The engine's models, reached over its socket; many calls share one connection.

    ``on_lost`` is called once if the connection drops while the runtime is started.
    """

    def __init__(self, path: str, on_lost: Callable[[], None] | None = None) -> None:
        self.path = path
        self.on_lost = on_lost
        self.engine_pid: int | None = None
        self._models: dict[str, RemoteModel] = {}
        # started by a reload, not listed yet: taken by get, so that no request for a model
        # that another worker lists already is refused here
        self._staged: dict[str, RemoteModel] = {}
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count(1)
        self._available = False
        self._stopping = False
        self._listeners: list[Callable[[], None]] = []

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
        self._models = RemoteModel.all_of(served["models"])
        self._staged = RemoteModel.all_of(served.get("staged", []))
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

    def on_models_changed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` each time the engine says a reload changed the served models."""
        self._listeners.append(callback)

    def _models_changed(self, frame: Frame) -> None:
        doc = orjson.loads(frame.text)
        self._models = RemoteModel.all_of(doc["models"])
        self._staged = RemoteModel.all_of(doc.get("staged", []))
        # the engine waits for this before it lists a staged model; requests checked from now
        # on follow it on the connection
        if frame.id and self._writer is not None and not self._writer.is_closing():
            self._writer.writelines(Frame(Op.MODELS, frame.id).buffers())
        for callback in self._listeners:
            try:
                callback()
            except Exception:
                log.exception("a listener of the model list failed")

    def _deliver(self, frame: Frame) -> None:
        if frame.op == Op.MODELS:
            self._models_changed(frame)
            return
        call = self._calls.get(frame.id)
        if call is None:  # a call that was cancelled meanwhile
            return
        if frame.op in (Op.RESULT, Op.RELOADED):
            del self._calls[frame.id]
            if not call.future.done():
                call.future.set_result(_result_of(frame))
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
            if frame.flags & LOGGED and call.request is not None:
                call.request.failure_logged = True  # the engine's log has it, with the id
            if not call.future.done():
                call.future.set_exception(exc)
            elif call.queue is not None:
                call.queue.put_nowait(exc)

    # -- calls ------------------------------------------------------------------------------

    def get(self, name: str) -> RemoteModel:
        try:
            return self._models[name]
        except KeyError:
            staged = self._staged.get(name)
            if staged is not None:
                return staged
            known = ", ".join(sorted(self._models)) or "none"
            raise UnknownModel(f"no model named '{quote(name)}' (served: {known})") from None

    async def infer(self, name: str, sequences: FlatSequences) -> FlatSequences:
        """Run ``sequences`` through model ``name`` in the engine; cancelling cancels it there."""
        self.get(name)
        call_id, call = self._open(Op.INFER, name, sequences, streaming=False)
        try:
            await self._drain()
            result: FlatSequences = await call.future
            return result
        except asyncio.CancelledError:
            self._cancel(call_id)
            raise

    async def open_stream(self, name: str, sequences: FlatSequences) -> AsyncIterator[list[Piece]]:
        """Queue a streamed rollout in the engine; raises its QueueFull etc. before returning."""
        self.get(name)
        call_id, call = self._open(Op.STREAM, name, sequences, streaming=True)
        try:
            await self._drain()
            await call.future  # ACCEPTED, or the engine's error
        except BaseException:
            self._cancel(call_id)
            raise
        return _RemoteStream(self, call_id, call)

    async def reload(self) -> ReloadReport:
        """Have the engine reload the model directory; what it did. The new model list has
        arrived (a MODELS frame) when this returns."""
        call_id, call = self._call()
        assert self._writer is not None
        self._writer.writelines(Frame(Op.RELOAD, call_id).buffers())
        try:
            await self._drain()
            report: ReloadReport = await call.future
            return report
        except asyncio.CancelledError:
            self._calls.pop(call_id, None)  # the engine's reload goes on: nothing to cancel
            raise

    def _call(self) -> tuple[int, _Call]:
        if not self._available or self._writer is None:
            raise EngineUnavailable("the engine process is not available")
        call_id = next(self._ids)
        call = _Call(asyncio.get_running_loop().create_future())
        self._calls[call_id] = call
        return call_id, call

    def _open(
        self, op: Op, name: str, sequences: FlatSequences, *, streaming: bool
    ) -> tuple[int, _Call]:
        call_id, call = self._call()
        assert self._writer is not None
        if streaming:
            call.queue = asyncio.Queue()
        request_id = call.request.request_id if call.request is not None else None
        frame = request_frame(op, call_id, name, sequences, request_id, call.traceparent)
        self._writer.writelines(frame.buffers())
        return call_id, call

    async def _drain(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(ConnectionError):
                await self._writer.drain()

    def _cancel(self, call_id: int) -> None:
        """Forget call ``call_id``; if the engine still runs it, tell the engine to drop it."""
        if self._calls.pop(call_id, None) is None:
            return
        if self._available and self._writer is not None and not self._writer.is_closing():
            self._writer.writelines(Frame(Op.CANCEL, call_id).buffers())
