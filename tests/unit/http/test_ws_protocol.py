"""The WebSocket layer's frame limit: a message over ``max_chunk_bytes`` is refused from its
header with the session's close code and JSON reason, and the client is left to read the close.
And its answers a client does not read: held in the budget, then the connection reset after
``write_timeout_s`` without progress."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import struct
from types import SimpleNamespace
from typing import Any

import pytest
from uvicorn.config import Config
from uvicorn.server import ServerState
from websockets.frames import Close
from websockets.protocol import State

from rnnserve.service.cli import uvicorn_options
from rnnserve.service.config import Settings
from rnnserve.service.http.auth import byte_budget
from rnnserve.service.http.sessions import CONNECTION_LOST, too_large_detail
from rnnserve.service.http.ws_protocol import SessionWebSocketProtocol, _FrameLimitServerProtocol
from rnnserve.service.metrics import Metrics

MIB = 1024 * 1024


def frame_head(length: int, opcode: int = 0x1) -> bytes:
    """A client's (masked) final frame header declaring ``length`` payload bytes."""
    if length < 126:
        size = bytes([0x80 | length])
    elif length < 1 << 16:
        size = bytes([0x80 | 126]) + struct.pack("!H", length)
    else:
        size = bytes([0x80 | 127]) + struct.pack("!Q", length)
    return bytes([0x80 | opcode]) + size + b"\0\0\0\0"  # a zero mask: the payload as it is


@pytest.mark.parametrize("limit", [1000, 17 * MIB])
def test_both_process_modes_tell_uvicorn_the_frame_limit_and_the_protocol(limit: int) -> None:
    options = uvicorn_options(Settings(max_request_bytes=32 * MIB, max_chunk_bytes=limit))
    assert options["ws"] is SessionWebSocketProtocol
    assert options["ws_max_size"] == limit  # a session's frame is held to max_chunk_bytes


@pytest.mark.parametrize("limit", [1, 20_000, 17 * MIB, 2**62])
def test_a_frame_declared_over_the_limit_is_refused_with_the_sessions_reason(limit: int) -> None:
    conn = _FrameLimitServerProtocol(state=State.OPEN, max_size=limit)
    conn.receive_data(frame_head(limit + 1))  # the header alone: no payload is needed
    assert conn.close_sent is not None
    assert conn.close_sent.code == 1009
    reason = conn.close_sent.reason
    assert len(reason.encode()) <= 123  # what a close frame may hold
    assert json.loads(reason) == {"type": "body_too_large", "detail": too_large_detail(limit)}


def test_a_frame_of_the_limit_is_taken() -> None:
    conn = _FrameLimitServerProtocol(state=State.OPEN, max_size=100)
    conn.receive_data(frame_head(100) + b" " * 100)
    assert conn.close_sent is None
    assert [len(event.data) for event in conn.events_received()] == [100]


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.eof_written = self.closed = self.reading = False

    def write(self, data: Any) -> None:
        self.written += data

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof_written = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 9) if name in ("peername", "sockname") else default


def handshake() -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        "GET /models/traveller/stream HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
    ).encode()


def close_frame_in(written: bytes) -> Close:
    """The close frame the server sent after its handshake answer (unmasked, short)."""
    frame = written[written.index(b"\r\n\r\n") + 4 :]
    assert frame[0] == 0x88  # FIN | CLOSE
    return Close.parse(frame[2 : 2 + frame[1]])


async def test_the_refusal_lets_the_client_read_the_close_then_ends_the_connection() -> None:
    received: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        await send({"type": "websocket.accept"})
        received.append(await receive())

    config = Config(app, ws=SessionWebSocketProtocol, ws_max_size=20_000, lifespan="off")
    config.load()
    protocol = SessionWebSocketProtocol(config, ServerState(), {})
    assert isinstance(protocol.conn, _FrameLimitServerProtocol)
    assert protocol.conn.available_extensions  # uvicorn's permessage-deflate is still offered
    transport = FakeTransport()
    protocol.connection_made(transport)
    protocol.data_received(handshake())
    await asyncio.sleep(0.01)  # the app accepts
    protocol.data_received(frame_head(20_001) + b" " * 1000)
    await asyncio.sleep(0.01)  # the app sees the disconnect
    close = close_frame_in(bytes(transport.written))
    assert close.code == 1009
    assert json.loads(close.reason)["type"] == "body_too_large"
    assert received == [{"type": "websocket.disconnect", "code": 1009, "reason": close.reason}]
    # the server's side is shut, the socket still open: the rest of the frame is read and
    # dropped, and a reset cannot take the close frame from the client
    assert transport.eof_written
    assert not transport.closed
    sent = len(transport.written)
    protocol.data_received(b" " * 100_000)
    assert len(transport.written) == sent
    assert protocol.close_timer is not None  # the connection ends on the client's EOF or this
    protocol.connection_lost(None)
    assert protocol.close_timer is None


async def test_the_session_is_told_at_once_when_the_connection_is_lost() -> None:
    woken: list[bool] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        lost = scope["extensions"][CONNECTION_LOST]
        woken.append(lost.is_set())
        await lost.wait()  # a session busy with a chunk, reading nothing
        woken.append(lost.is_set())

    config = Config(app, ws=SessionWebSocketProtocol, lifespan="off")
    config.load()
    protocol = SessionWebSocketProtocol(config, ServerState(), {})
    protocol.connection_made(FakeTransport())
    protocol.data_received(handshake())
    await asyncio.sleep(0.01)  # the app accepts and waits
    assert woken == [False]
    protocol.connection_lost(None)  # the client vanished; nothing read its disconnect
    await asyncio.sleep(0.01)
    assert woken == [False, True]


# -- answers a client does not read --

WRITE_TIMEOUT = 0.05


class StalledTransport(FakeTransport):
    """A transport whose unsent bytes the test sets (what a client that reads nothing leaves)."""

    def __init__(self) -> None:
        super().__init__()
        self.buffered = 0
        self.aborted = False

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def abort(self) -> None:
        self.aborted = self.closed = True


class SessionApp:
    """An app with the settings, metrics and budget the protocol finds through ``state``."""

    def __init__(self) -> None:
        settings = SimpleNamespace(write_timeout_s=WRITE_TIMEOUT, max_inflight_bytes=1 << 30)
        self.state = SimpleNamespace(settings=settings, metrics=Metrics())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await receive()
        await send({"type": "websocket.accept"})
        await scope["extensions"][CONNECTION_LOST].wait()

    def held(self) -> int:
        return byte_budget(self.state).used

    def timeouts(self) -> float:
        return self.state.metrics.registry.get_sample_value("rnnserve_write_timeouts_total") or 0


async def open_session() -> tuple[SessionApp, SessionWebSocketProtocol, StalledTransport]:
    app = SessionApp()
    config = Config(app, ws=SessionWebSocketProtocol, lifespan="off")
    config.load()
    protocol = SessionWebSocketProtocol(config, ServerState(), {})
    transport = StalledTransport()
    protocol.connection_made(transport)
    protocol.data_received(handshake())
    await asyncio.sleep(0.01)  # the app accepts and waits
    return app, protocol, transport


async def lose(protocol: SessionWebSocketProtocol) -> None:
    """The connection ends (as after an abort); the app sees it and returns."""
    protocol.connection_lost(None)
    await asyncio.sleep(0.01)


async def test_unsent_answers_are_held_in_the_budget_then_an_unread_session_is_reset() -> None:
    app, protocol, transport = await open_session()
    transport.buffered = 300_000
    protocol.pause_writing()
    assert app.held() == 300_000
    transport.buffered = 200_000  # the client read some: it may wait on, holding the rest
    await asyncio.sleep(WRITE_TIMEOUT * 1.5)  # the timer fired once (timers run in time order)
    assert not transport.aborted
    assert app.held() == 200_000
    await asyncio.sleep(WRITE_TIMEOUT * 3)  # and then the client read nothing more
    assert transport.aborted
    assert app.timeouts() == 1
    await lose(protocol)
    assert app.held() == 0


async def test_a_session_closing_with_unread_answers_is_still_reset() -> None:
    app, protocol, transport = await open_session()
    transport.buffered = 100_000
    protocol.pause_writing()
    transport.close()  # a close waits for the buffer to drain: for ever, were it not reset
    await asyncio.sleep(WRITE_TIMEOUT * 3)
    assert transport.aborted
    assert app.timeouts() == 1
    await lose(protocol)
    assert app.held() == 0


async def test_answers_the_client_reads_are_given_back_and_never_reset() -> None:
    app, protocol, transport = await open_session()
    transport.buffered = 100_000
    protocol.pause_writing()
    assert app.held() == 100_000
    transport.buffered = 0
    protocol.resume_writing()
    assert app.held() == 0
    await asyncio.sleep(WRITE_TIMEOUT * 3)
    assert not transport.aborted
    assert app.timeouts() == 0
    await lose(protocol)


def ping(payload: bytes = b"p" * 100) -> bytes:
    return frame_head(len(payload), opcode=0x9) + payload


async def test_nothing_is_read_from_a_client_while_it_reads_nothing() -> None:
    """Each ping read would queue a pong unsent, outside the budget: reads stop with the writes
    and start again with them, and a message the app takes meanwhile does not start them."""
    app, protocol, transport = await open_session()
    transport.reading = True
    protocol.data_received(ping())
    assert transport.written.endswith(b"\x8a\x64" + b"p" * 100)  # answered while it reads
    protocol.pause_writing()
    assert not transport.reading
    protocol.queue.put_nowait({"type": "websocket.receive", "text": "x"})
    protocol.read_paused = True  # uvicorn's own pause, for that message
    await protocol.receive()  # the app takes it: uvicorn would resume reading here
    assert not transport.reading
    protocol.read_paused = True  # another message waits: uvicorn resumes once it is taken
    protocol.resume_writing()
    assert not transport.reading
    protocol.read_paused = False
    protocol.pause_writing()
    protocol.resume_writing()
    assert transport.reading
    await lose(protocol)
    assert app.held() == 0
