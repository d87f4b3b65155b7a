"""uvicorn's WebSocket protocol with the sessions' frame limit (docs/SESSIONS.md).

uvicorn reads each WebSocket message whole before the app sees it, up to its ``ws_max_size``
(16 MiB unless told), and closes the connection on a larger one itself. ``rnnserve`` sets
``ws_max_size`` to ``max_chunk_bytes`` (:func:`rnnserve.service.cli.uvicorn_options`), so a
session's frame is held to the sessions' own limit, and refused from its header
(``websockets`` compares the frame's declared length with the limit before it reads the
payload; a compressed frame is refused as soon as its inflated bytes pass the limit), never
buffered whole. This protocol makes that close the session's own: 1009 with the JSON reason
``{"type": "body_too_large", "detail": ...}`` where ``websockets`` would give 1009 with its
plain-text reason.

And it lets the client read that close: uvicorn closes the socket at once, with the rest of the
refused frame unread, so the kernel resets the connection and the client, still sending, often
loses the close frame with it (the tests saw it). Here the server shuts its side down after the
close frame (the client reads it, then the end of the stream) and discards what still comes
until the client closes too, or for uvicorn's close timeout (10 s) at most.

And it tells the session at once when the connection is lost (the scope's extension
``CONNECTION_LOST``, an :class:`asyncio.Event`): a session that has a frame waiting behind its
running chunk reads no further, so it would see the disconnect only after that chunk.

And it bounds what a client that does not read its answers holds, as rnnserve's HTTP protocol
does (:mod:`rnnserve.service.http.protocol`): uvicorn writes each answer to the transport and
waits, with no timeout, for the transport's buffer to drain before the next, so a session whose
client never reads would hold its slot and that answer for ever. While the buffer is over its
high-water mark (``pause_writing``) its bytes are held in the byte budget, and every
``write_timeout_s`` the client must have taken some of them (from the transport's buffer or the
kernel's send queue): what it read is given back and the wait starts again. A connection whose
client read nothing for ``write_timeout_s`` is reset (``SO_LINGER`` 0: the kernel drops its
copy too; a close frame could not reach a client that does not read), counted in
``rnnserve_write_timeouts_total``; the session hears of it at once (``CONNECTION_LOST``), so its
slot, its frames' bytes and its running chunk are freed then. The timer runs on while the
connection is closing: a close with unsent bytes would otherwise wait on the client for ever.

And while the client does not read (writes paused), nothing more is read from it: each ping
it sends would queue a pong unsent (``websockets`` answers every one), beyond the budget and
without bound, a few hundred MB in seconds from a client that sends pings and reads nothing.
Reading resumes with the writes, unless uvicorn holds it for a message the app has not taken.

It subclasses the protocol uvicorn's ``ws="auto"`` picks when ``websockets`` is installed (it
is a dependency of rnnserve): the Sans-I/O one.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.config import Config
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from uvicorn.server import ServerState
from websockets.exceptions import PayloadTooBig
from websockets.frames import CloseCode
from websockets.http11 import Request
from websockets.server import ServerProtocol

from rnnserve.service.http.protocol import UnreadAnswers, app_state
from rnnserve.service.http.sessions import (
    CONNECTION_LOST,
    TOO_LARGE,
    close_reason,
    too_large_detail,
)

log = logging.getLogger(__name__)


class _FrameLimitServerProtocol(ServerProtocol):
    """``websockets``' server side, its close on an oversized message given rnnserve's reason."""

    def fail(self, code: CloseCode | int, reason: str = "") -> None:
        # websockets fails the connection with MESSAGE_TOO_BIG only when a message passes
        # max_size (PayloadTooBig, from the frame's header or while inflating it)
        if code == CloseCode.MESSAGE_TOO_BIG and self.max_message_size is not None:
            reason = close_reason(TOO_LARGE, too_large_detail(self.max_message_size))
        super().fail(code, reason)


class SessionWebSocketProtocol(UnreadAnswers, WebSocketsSansIOProtocol):
    """uvicorn's Sans-I/O WebSocket protocol whose over-``ws_max_size`` close carries the
    session's JSON reason, which tells the session of a lost connection at once, and which
    counts answers the client does not read in the budget and resets it after
    ``write_timeout_s`` (module docstring)."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        built = self.conn  # what uvicorn made of its settings (max_size, extensions, logger)
        self.conn = _FrameLimitServerProtocol(
            origins=built.origins,
            extensions=built.available_extensions,
            subprotocols=built.available_subprotocols,
            max_size=(built.max_message_size, built.max_fragment_size),
            logger=built.logger,
        )
        self._lost = asyncio.Event()  # set when the connection is lost, for the session

    _refused = False  # a message over the limit was refused: the rest is discarded

    def handle_connect(self, event: Request) -> None:
        super().handle_connect(event)
        scope: dict[str, Any] | None = getattr(self, "scope", None)  # none: the handshake failed
        if scope is not None:
            scope["extensions"][CONNECTION_LOST] = self._lost

    def connection_lost(self, exc: Exception | None) -> None:
        self._writes_flowing()
        super().connection_lost(exc)
        self._lost.set()

    # -- answers a client does not read: UnreadAnswers (service/http/protocol.py) --

    _reads_held = False  # reads paused while writes are: the client reads nothing

    def pause_writing(self) -> None:
        super().pause_writing()
        self._reads_held = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._reads_held = False
        if not self.read_paused:  # else uvicorn resumes once the app takes its message
            self.transport.resume_reading()

    async def receive(self) -> Any:
        message = await super().receive()  # may resume reading: the app took its message
        if self._reads_held:
            self.transport.pause_reading()  # before any read: no await in between
        return message

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._state = app_state(self.app)

    def _connection_gone(self) -> bool:
        return bool(self.disconnected)

    def handle_parser_exception(self) -> None:
        if not isinstance(self.conn.parser_exc, PayloadTooBig):
            super().handle_parser_exception()
            return
        if self._refused:  # more of the refused frame, dropped by websockets as it comes
            return
        self._refused = True
        close = self.conn.close_sent  # the close fail() sent, or the app's before it
        if close is not None:
            code, reason = close.code, close.reason
            self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the client reads the close, then the end of the stream
        if self.read_paused:  # a message the app has not read yet paused the reads
            self.read_paused = False
            self.transport.resume_reading()
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)
