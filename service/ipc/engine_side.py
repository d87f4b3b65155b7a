"""The engine's side of the IPC socket: :class:`EngineServer` serves a runtime's models to the
HTTP workers, one task per call (the frames are :mod:`rnnserve.service.ipc.frames`)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
from collections.abc import Mapping
from typing import Any

import orjson

from rnnserve.service import tracing
from rnnserve.service.config import Settings
from rnnserve.service.interface import (
    RequestContext,
    Runtime,
    ServedInfo,
    open_request,
    state_shapes,
)
from rnnserve.service.ipc.frames import (
    STREAM_LIMIT,
    Frame,
    FrameError,
    Op,
    error_frame,
    progress_frame,
    read_frame,
    request_of,
    result_frame,
)

log = logging.getLogger(__name__)

# a worker acknowledges a MODELS frame as soon as its read loop reaches it; one that has not
# within ``models_ack_timeout_s`` is stuck (or going: its connection's end counts as its
# answer), and the reload goes on without it rather than hold every other model's swap
DEFAULT_MODELS_ACK_TIMEOUT_S: float = Settings.model_fields["models_ack_timeout_s"].default


def _logged(request: RequestContext | None) -> bool:
    return request is not None and request.failure_logged


class _Connection:
    """One worker's connection: its requests run as tasks, keyed by request id."""

    def __init__(
        self, runtime: Runtime, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.runtime, self.reader, self.writer = runtime, reader, writer
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.greeted = False  # it has the model list: later changes are sent to it
        self.acks: dict[int, asyncio.Future[None]] = {}  # MODELS frames sent, not yet acked

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
            self._acked(max(self.acks, default=0))  # a worker gone waits for no list
            self.writer.close()
            with contextlib.suppress(ConnectionError):
                await self.writer.wait_closed()

    def _dispatch(self, frame: Frame) -> None:
        if frame.op == Op.HELLO:
            self._send(Frame(Op.HELLO, frame.id, text=self._hello()))
            self.greeted = True
        elif frame.op in (Op.INFER, Op.STREAM, Op.RELOAD):
            run = {Op.INFER: self._infer, Op.STREAM: self._stream, Op.RELOAD: self._reload}
            task = asyncio.ensure_future(run[frame.op](frame))
            self.tasks[frame.id] = task
            task.add_done_callback(functools.partial(self._forget, frame.id))
        elif frame.op == Op.CANCEL:
            running = self.tasks.get(frame.id)
            if running is not None:
                running.cancel()
        elif frame.op == Op.MODELS:
            self._acked(frame.id)
        else:
            wrong = FrameError(f"{frame.op.name} is not a request")
            self._send(error_frame(frame.id, wrong, logged=False))

    def _forget(self, call_id: int, _: object) -> None:
        self.tasks.pop(call_id, None)

    def announce(self, frame: Frame) -> asyncio.Future[None]:
        """Send a MODELS frame; done once the worker has acknowledged it (or has gone)."""
        done = self.acks[frame.id] = asyncio.get_running_loop().create_future()
        self._send(frame)
        return done

    def _acked(self, announced: int) -> None:
        """The worker has the model lists of every MODELS frame up to ``announced``."""
        for number in [n for n in self.acks if n <= announced]:
            done = self.acks.pop(number)
            if not done.done():
                done.set_result(None)

    def _hello(self) -> bytes:
        return orjson.dumps(
            {
                "pid": os.getpid(),
                "models": served_models(self.runtime),
                "staged": staged_models(self.runtime),
            }
        )

    async def _reload(self, frame: Frame) -> None:
        try:
            # shielded: a worker that goes away leaves the reload to finish for the others
            report = await asyncio.shield(self.runtime.reload())
            # the MODELS frame of a change went to every worker before this answer
            reply = Frame(Op.RELOADED, frame.id, text=orjson.dumps(report.as_json()))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("the reload failed")
            reply = error_frame(frame.id, exc, logged=True)
        await self._reply(reply)

    async def _infer(self, frame: Frame) -> None:
        request: RequestContext | None = None
        try:
            name, request_id, traceparent, sequences = request_of(frame)
            request = open_request(request_id or "-")  # this task's own: the batcher logs with it
            if traceparent:  # the worker's span: the batch links to it, as to a local request's
                tracing.continue_trace(traceparent)
            out = await self.runtime.infer(name, sequences)
            reply = result_frame(frame.id, out)
        except asyncio.CancelledError:
            raise  # the worker forgot this id: nothing to answer
        except Exception as exc:  # the same exception, raised again in the worker
            reply = error_frame(frame.id, exc, _logged(request))
        await self._reply(reply)

    async def _stream(self, frame: Frame) -> None:
        request: RequestContext | None = None
        try:
            name, request_id, traceparent, sequences = request_of(frame)
            request = open_request(request_id or "-")
            if traceparent:
                tracing.continue_trace(traceparent)
            pieces = await self.runtime.open_stream(name, sequences)
        except Exception as exc:
            await self._reply(error_frame(frame.id, exc, _logged(request)))
            return
        try:
            await self._reply(Frame(Op.ACCEPTED, frame.id))
            async for chunk in pieces:
                await self._reply(progress_frame(frame.id, chunk))
            await self._reply(Frame(Op.END, frame.id))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._reply(error_frame(frame.id, exc, _logged(request)))
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


def served_models(runtime: Runtime) -> list[dict[str, Any]]:
    """The served models as the workers learn them (HELLO, MODELS)."""
    return describe(runtime.models)


def staged_models(runtime: Runtime) -> list[dict[str, Any]]:
    """The models a reload has started but not listed yet (``ModelRuntime.staged``): a worker
    takes requests for them, and lists them once a MODELS frame lists them."""
    staged: Mapping[str, ServedInfo] = getattr(runtime, "staged", {})
    return describe(staged)


def describe(served: Mapping[str, ServedInfo]) -> list[dict[str, Any]]:
    return [
        {
            "name": m.name,
            "kind": m.kind,
            "input_dim": m.input_dim,
            "info": m.info,
            "version": m.version,
            "loaded_at": m.loaded_at,
            "state_shapes": {part: list(dims) for part, dims in (state_shapes(m) or {}).items()},
        }
        for m in served.values()
    ]


async def _all_acknowledged(
    acks: list[asyncio.Future[None]], announced: int, timeout_s: float
) -> None:
    if not acks:
        return
    _, late = await asyncio.wait(acks, timeout=timeout_s)
    if late:
        log.warning(
            "model list %d: %d worker(s) did not acknowledge it in %g s; going on",
            announced, len(late), timeout_s,
        )  # fmt: skip


class EngineServer:
    """Serves a runtime's models to HTTP workers on a Unix domain socket;
    :meth:`announce_models` tells every connected worker the new model list and waits up to
    ``models_ack_timeout_s`` (the setting of that name) for each to acknowledge it."""

    def __init__(
        self,
        runtime: Runtime,
        path: str,
        models_ack_timeout_s: float = DEFAULT_MODELS_ACK_TIMEOUT_S,
    ) -> None:
        self.runtime = runtime
        self.path = path
        self.models_ack_timeout_s = models_ack_timeout_s
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[_Connection, asyncio.Task[None]] = {}
        self._idle = asyncio.Event()
        self._idle.set()
        self._announcements = itertools.count(1)

    def announce_models(self) -> asyncio.Future[None]:
        """Send the served and the staged models to every worker: call it each time a reload
        changes them. Done once every worker has acknowledged the list (or has gone), or after
        ``models_ack_timeout_s``."""
        doc = {"models": served_models(self.runtime), "staged": staged_models(self.runtime)}
        frame = Frame(Op.MODELS, next(self._announcements), text=orjson.dumps(doc))
        acks = [c.announce(frame) for c in self._connections if c.greeted]
        waiting = _all_acknowledged(acks, frame.id, self.models_ack_timeout_s)
        return asyncio.ensure_future(waiting)

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
