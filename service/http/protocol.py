"""uvicorn's HTTP/1.1 protocol with what it lacks against slow or too many clients.

uvicorn times out idle kept-alive connections (``timeout_keep_alive``), but not the time a request
head takes to arrive: a client that trickles header bytes (or connects and sends nothing) holds its
connection for ever, and every byte resets the keep-alive timer. :class:`HeaderTimeoutProtocol`
gives each request head ``header_timeout_s`` from its first byte (from the connection's opening for
the first request): a connection whose request line and headers are not complete by then is
answered 408 ``header_timeout`` and closed. The body has its own limit in the routes
(``body_timeout_s``), and a response being written is never timed out.

With ``limit_concurrency`` set, uvicorn answers 503 to a request that arrives while that many
connections or requests are open; this protocol makes that answer rnnserve's JSON error
(``concurrency_limit``, with ``Retry-After: 1``) instead of uvicorn's plain text. (uvicorn's h11
protocol, used only where httptools is missing, keeps its plain-text 503.)

Request heads (httptools protocol): httptools bounds neither the request target nor the headers
(it holds a header's value until the value ends), so a head of any size was read and answered.
This protocol answers 431 ``request_header_too_large`` (and closes the connection) once a head
is over ``max_request_head_bytes``, counted two ways after each read and once the head is
complete: the target and the complete headers parsed so far, and, for a header still coming,
the whole reads since the one the head began in (every byte of those is head). Neither count is
ever more than the head's size, so a head within the limit is never refused; a larger one is
refused at most one read past the limit. (uvicorn's h11 protocol has its own bound,
``h11_max_incomplete_event_size``, which ``rnnserve`` sets to the same limit; it answers 400.)

Answers a client does not read (both protocols): an answer is written to the transport at once,
and a client that does not read it leaves it in the process's memory, uncounted, for as long as
the connection lives. When the transport's buffer is over its high-water mark (asyncio's
``pause_writing``), the unsent bytes are held in the byte budget (so new requests are refused
while such answers pile up), and every ``write_timeout_s`` the client must have taken some of them
(from the transport's buffer or the kernel's send queue): what it read is given back and the wait
starts again; when the buffer drains (``resume_writing``) or the connection is gone, the rest is
given back. A connection whose client read nothing for ``write_timeout_s`` is reset (the kernel
drops its copy too), its unsent bytes dropped, and counted in ``rnnserve_write_timeouts_total``.

The first three limits count in ``rnnserve_requests_rejected_total{endpoint="none"}``: the
request had not reached a route. The settings and the metrics are the app's (``app.state``),
found through the middleware uvicorn wraps around it.

Bodies (httptools protocol): uvicorn stops reading a connection once 64 KiB of its body wait for
the app, and appends each piece to one ``bytearray`` that it copies into ``bytes`` for the app.
A 720 KB body then takes a dozen pauses and wake-ups and three copies. This protocol reads a body
whose ``Content-Length`` is at most ``max_request_bytes`` (a larger one is refused before it is
read) without pausing, and keeps its pieces as they came, joined once when the app reads them
(:class:`_Body`). Every inference route checks that declared length against the byte budget's room
before reading and takes the bytes from the budget as they reach it (``auth.read_body``: a client
that declares a body and sends nothing holds nothing); other routes answer without reading, and
uvicorn drops the body of a request that has been answered. Measured on the
4,000-step ``/smooth`` JSON load (64 clients, three runs each way): 3.36 against 3.49 ms of server
CPU per request (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import http
import itertools
import logging
import socket
import struct
import sys
import termios
from typing import Any

import orjson
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, service_unavailable
from uvicorn.protocols.http.h11_impl import H11Protocol

from rnnserve.service.http import errors
from rnnserve.service.http.auth import byte_budget
from rnnserve.service.interface import quote

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover (httptools comes with uvicorn[standard])
    HttpToolsProtocol = None  # type: ignore[assignment,misc]

log = logging.getLogger(__name__)

NO_ENDPOINT = "none"  # the endpoint label of requests refused before routing
LINGER_S = 1.0  # how long a refused head's connection stays open for its answer to be read


def app_state(app: Any) -> Any:
    """The FastAPI app's ``state`` under uvicorn's middleware (``.app`` links), or None."""
    for _ in range(16):
        state = getattr(app, "state", None)
        if state is not None and hasattr(state, "settings"):
            return state
        app = getattr(app, "app", None)
        if app is None:
            return None
    return None


def _error(kind: str, detail: str, extra: bytes = b"") -> bytes:
    """A whole HTTP response: the JSON error body of ``kind``, with the catalogue's status."""
    body = orjson.dumps({"detail": detail, "type": kind, "loc": []})
    code = errors.status(kind)
    status = f"{code} {http.HTTPStatus(code).phrase}".encode()
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n" + extra + b"connection: close\r\n"
        b"\r\n" + body
    )


async def _concurrency_limit(limit: int | None, scope: Any, receive: Any, send: Any) -> None:
    """The 503 beyond ``limit_concurrency``, as rnnserve's JSON error."""
    body = orjson.dumps({
        "detail": f"the server has its most connections or requests open ({limit}); retry later",
        "type": "concurrency_limit",
        "loc": [],
    })  # fmt: skip
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    code = errors.status("concurrency_limit")
    await send({"type": "http.response.start", "status": code, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def unsent_bytes(transport: asyncio.Transport) -> int:
    """Bytes written to ``transport`` and not yet taken by the client: its buffer and the
    kernel's send queue (which moves first, so a client reading slowly shows progress there)."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(AttributeError, OSError, ValueError):
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
        unsent += struct.unpack("i", queued)[0]
    return unsent


def reset_on_close(transport: asyncio.Transport) -> None:
    """Make closing the socket discard what the kernel still holds for the client and tell it
    with a reset, not keep those bytes for as long as the kernel retries the client."""
    sock = transport.get_extra_info("socket")
    with contextlib.suppress(AttributeError, OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class UnreadAnswers:
    """The mixin of both HTTP protocols and the sessions' WebSocket protocol: answers a client
    does not read (module docstring). While the transport's writes are paused its unsent bytes
    are held in the byte budget, and a client that took none of them within ``write_timeout_s``
    has its connection reset. Needs ``transport``, ``loop`` and ``_state`` (the app's state)."""

    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    _state: Any = None
    _write_timer: asyncio.TimerHandle | None = None
    _unsent_held = 0  # bytes of unsent answers counted in the byte budget

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self._hold_unsent()
        if self._write_timer is None:
            self._arm_write_timer()

    def resume_writing(self) -> None:
        self._writes_flowing()
        super().resume_writing()  # type: ignore[misc]

    def _hold_unsent(self) -> None:
        """Hold exactly the unsent bytes in the budget (fewer once the client has read some)."""
        budget = self._budget()
        if budget is None:
            return
        unsent = self.transport.get_write_buffer_size()
        budget.hold(unsent - self._unsent_held)
        self._unsent_held = unsent

    def _write_timeout_s(self) -> float | None:
        timeout: float | None = getattr(
            getattr(self._state, "settings", None), "write_timeout_s", None
        )
        return timeout

    def _arm_write_timer(self) -> None:
        timeout = self._write_timeout_s()
        if timeout is not None:
            unsent = unsent_bytes(self.transport)
            self._write_timer = self.loop.call_later(timeout, self._write_timed_out, unsent)

    def _writes_flowing(self) -> None:
        """The client has read the answers, or has gone: give back what their bytes held."""
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._unsent_held:
            budget = self._budget()
            if budget is not None:
                budget.give(self._unsent_held)
            self._unsent_held = 0

    def _connection_gone(self) -> bool:
        """Whether the connection has gone already (a protocol that knows says so)."""
        return False

    def _write_timed_out(self, unsent_then: int) -> None:
        # not skipped when the transport is closing: after an answer with `connection: close`
        # uvicorn closes it, and a close waits for the unsent bytes as long as the client
        # stays; connection_lost cancels this timer once the connection has really gone
        self._write_timer = None
        if self._connection_gone():
            return
        if unsent_bytes(self.transport) < unsent_then:  # it read some: wait on
            self._hold_unsent()
            self._arm_write_timer()
            return
        metrics = getattr(self._state, "metrics", None)
        if metrics is not None:
            metrics.write_timeouts.inc()
        log.debug(
            "reset a connection from %s: its client read nothing of its answers for %s s",
            self.transport.get_extra_info("peername"),
            self._write_timeout_s(),
        )
        reset_on_close(self.transport)
        self.transport.abort()  # drops the unsent bytes; connection_lost gives them back

    def _budget(self) -> Any:
        settings = getattr(self._state, "settings", None)
        if getattr(settings, "max_inflight_bytes", None) is None:
            return None  # an app without a budget
        return byte_budget(self._state)


class _HeaderTimeout(UnreadAnswers):
    """The mixin: both uvicorn protocols have ``cycle`` (the request whose head was read last),
    ``transport``, ``loop`` and ``app``, and create a new ``cycle`` when a head is complete."""

    cycle: Any
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    app: Any

    _header_timer: asyncio.TimerHandle | None = None
    _header_timeout_s: float | None = None
    _max_request_bytes: int | None = None
    _max_head_bytes: int | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._state = app_state(self.app)
        settings = getattr(self._state, "settings", None)
        self._header_timeout_s = getattr(settings, "header_timeout_s", None)
        self._max_request_bytes = getattr(settings, "max_request_bytes", None)
        self._max_head_bytes = getattr(settings, "max_request_head_bytes", None)
        self._arm()

    def data_received(self, data: bytes) -> None:
        before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not before:  # a request head is complete
            self._disarm()
        elif self._idle() and self._header_timer is None:
            self._arm()  # the first bytes of the next request on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._writes_flowing()
        super().connection_lost(exc)  # type: ignore[misc]

    def handle_websocket_upgrade(self, *event: Any) -> None:
        """The connection becomes a WebSocket's: no request head is awaited on it any more, so
        the header timer must not fire into the WebSocket's stream (its own idle timeout and
        pings bound it), nor keep this protocol alive after the WebSocket's took over."""
        self._disarm()
        self._header_timeout_s = None  # data_received would arm it again after this returns
        self._writes_flowing()
        super().handle_websocket_upgrade(*event)  # type: ignore[misc]

    def _idle(self) -> bool:
        """No request is being read or answered: bytes now belong to the next request head."""
        return self.cycle is None or bool(self.cycle.response_complete)

    def _arm(self) -> None:
        if self._header_timeout_s is None or self.transport.is_closing():
            return
        self._disarm()
        self._header_timer = self.loop.call_later(
            self._header_timeout_s, self._header_timed_out, self.cycle
        )

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self, armed_with: Any) -> None:
        self._header_timer = None
        if self.cycle is not armed_with or not self._idle() or self.transport.is_closing():
            return  # a head arrived meanwhile (e.g. a pipelined one), or the connection ended
        detail = f"the request line and headers did not arrive within {self._header_timeout_s:g} s"
        self.transport.write(_error("header_timeout", detail))
        self.transport.close()
        self._count_refusal("header_timeout", detail)

    def _count_refusal(self, kind: str, detail: str) -> None:
        metrics = getattr(self._state, "metrics", None)
        if metrics is not None:
            metrics.rejected.labels(NO_ENDPOINT, kind).inc()
        log.debug(
            "closed a connection from %s: %s", self.transport.get_extra_info("peername"), detail
        )


class H11HeaderTimeout(_HeaderTimeout, H11Protocol):
    """uvicorn's h11 protocol with the header timeout."""


class _Body:
    """A request body's pieces as they came; ``bytes()`` joins them once (one piece: no copy).

    It stands in for the ``bytearray`` uvicorn's request cycle keeps (``+=``, ``len``,
    ``bytes()``, then a fresh ``bytearray`` once the app has read it)."""

    __slots__ = ("pieces", "size")

    def __init__(self, held: bytes | bytearray = b"") -> None:
        self.pieces: list[bytes] = [bytes(held)] if held else []
        self.size = len(held)

    def __iadd__(self, piece: bytes) -> _Body:
        self.pieces.append(piece)
        self.size += len(piece)
        return self

    def __len__(self) -> int:
        return self.size

    def __bytes__(self) -> bytes:
        return b"".join(self.pieces)  # one piece is returned as it is, not copied


def read_ahead(headers: list[tuple[bytes, bytes]], max_request_bytes: int | None) -> int:
    """How many body bytes a connection may hold for its app before it stops reading: the
    declared ``Content-Length`` when the body is one the routes accept, else uvicorn's 64 KiB."""
    if max_request_bytes is None:
        return HIGH_WATER_LIMIT
    for name, value in headers:
        if name == b"content-length":
            if value.isdigit() and len(value) <= 19 and int(value) <= max_request_bytes:
                return max(int(value), HIGH_WATER_LIMIT)
            break
    return HIGH_WATER_LIMIT


if HttpToolsProtocol is not None:

    class HttpToolsHeaderTimeout(_HeaderTimeout, HttpToolsProtocol):
        """uvicorn's httptools protocol with the header timeout, the bound on the request head
        and a JSON 503 beyond ``limit_concurrency``."""

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            if app is service_unavailable:
                if self._state is not None:
                    self._state.metrics.rejected.labels(NO_ENDPOINT, "concurrency_limit").inc()
                app = functools.partial(_concurrency_limit, self.limit_concurrency)
            super()._start_asgi_task(cycle, app)

        _read_ahead = HIGH_WATER_LIMIT

        # the request head being read (module docstring)
        _head_open = False  # a head has begun and is not complete
        _head_reads = 0  # bytes of the reads since the one it began in: all of them head
        _head_refused = False  # answered 431; the connection is closing

        def data_received(self, data: bytes) -> None:
            if self._head_refused:
                return  # what the client still sends, until the connection closes
            open_before = self._head_open
            super().data_received(data)
            if self._head_open and open_before:
                self._head_reads += len(data)
            if self._head_refused or (self._head_open and self._head_over()):
                self._refuse_head()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._head_open, self._head_reads = True, 0

        def on_headers_complete(self) -> None:
            self._head_open = False
            if self._head_refused or self._head_over():
                self._head_refused = True  # no request cycle, no app: data_received answers
                return
            super().on_headers_complete()
            self._read_ahead = read_ahead(self.headers, self._max_request_bytes)

        def on_message_complete(self) -> None:
            if not self._head_refused:
                super().on_message_complete()

        def _head_over(self) -> bool:
            limit = self._max_head_bytes
            if limit is None:
                return False
            return self._head_reads > limit or self._head_seen() > limit

        def _head_seen(self) -> int:
            """The head's target and complete headers, in bytes: summed when asked, not as
            each header is parsed (a Python call per header on every request)."""
            return len(self.url) + sum(map(len, itertools.chain.from_iterable(self.headers)))

        def _refuse_head(self) -> None:
            """Answer 431 and close: the answer first, then the connection once the client has
            had time to read it (closing on unread bytes would reset it, answer unread)."""
            self._head_refused = True
            self._disarm()
            if self.transport.is_closing():
                return
            detail = (
                f"the request line and headers are over the limit of {self._max_head_bytes} "
                "bytes (max_request_head_bytes)"
            )
            self.transport.write(_error("request_header_too_large", detail))
            if self.transport.can_write_eof():
                self.transport.write_eof()
                self.loop.call_later(LINGER_S, self.transport.close)
            else:  # pragma: no cover (TCP transports can)
                self.transport.close()
            self._count_refusal("request_header_too_large", detail)

        def send_400_response(self, msg: str) -> None:
            """uvicorn's answer to bytes httptools cannot parse as HTTP/1.1, as rnnserve's JSON
            error with the parser's reason; uvicorn calls it while it handles the parser's
            exception."""
            exc = sys.exc_info()[1]
            reason = str(exc) if exc is not None and str(exc) else "it cannot be parsed"
            detail = f"the request is not valid HTTP/1.1: {quote(reason)}"
            self.transport.write(_error("invalid_http", detail))
            self.transport.close()
            self._count_refusal("invalid_http", detail)

        def on_body(self, body: bytes) -> None:
            # uvicorn's on_body, with the body kept as pieces and read ahead (module docstring)
            if self._head_refused:
                return
            cycle = self.cycle
            if cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
                return
            held = cycle.body
            if type(held) is not _Body:  # a new request, or the app has read what came
                held = cycle.body = _Body(held)
            held += body
            if held.size > self._read_ahead:
                self.flow.pause_reading()
            cycle.message_event.set()

    HeaderTimeoutProtocol: type[asyncio.Protocol] = HttpToolsHeaderTimeout
else:  # pragma: no cover
    HeaderTimeoutProtocol = H11HeaderTimeout
