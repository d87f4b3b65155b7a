"""service/http/protocol.py under a real uvicorn server on a thread of this process, for both of
uvicorn's HTTP/1.1 parsers: the header timeout cuts off slow request heads only, never a slow
answer or a slow body, on a connection's first request and on a kept-alive one. With httptools,
a body the routes accept is read ahead without pausing, kept as the pieces that came and given
to the app whole, byte for byte."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import uvicorn
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT, FlowControl

from rnnserve.service.http.protocol import (
    H11HeaderTimeout,
    HttpToolsHeaderTimeout,
    _Body,
    app_state,
    read_ahead,
)
from rnnserve.service.metrics import Metrics
from tests.e2e import rawhttp
from tests.e2e.server import free_port

TIMEOUT = 0.4


class SlowApp:
    """Answers ``ok`` after reading the body; ``/slow`` after 3 header timeouts."""

    def __init__(self) -> None:
        self.state = SimpleNamespace(
            settings=SimpleNamespace(header_timeout_s=TIMEOUT, limit_concurrency=None),
            metrics=Metrics(),
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
        if scope["path"] == "/slow":
            await asyncio.sleep(3 * TIMEOUT)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})


@contextlib.contextmanager
def serving(app: Any, http: Any, **options: Any) -> Iterator[str]:
    """``app`` under a real uvicorn with the protocol ``http``, on a thread; its URL."""
    port = free_port()
    config = uvicorn.Config(
        app, port=port, http=http, lifespan="off", log_level="warning", **options
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(params=[HttpToolsHeaderTimeout, H11HeaderTimeout], ids=["httptools", "h11"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, SlowApp]]:
    app = SlowApp()
    # keep-alive longer than anything here: only the header timeout acts
    with serving(app, request.param, timeout_keep_alive=30) as url:
        yield url, app


def rejected(app: SlowApp) -> float:
    value = app.state.metrics.registry.get_sample_value(
        "rnnserve_requests_rejected_total", {"endpoint": "none", "reason": "header_timeout"}
    )
    return value or 0.0


def cut_off_after(sock: socket.socket) -> tuple[float, bytes]:
    """Seconds until the server closes ``sock``, and what it sent before."""
    started = time.monotonic()
    sock.settimeout(20 * TIMEOUT)
    answer = b""
    try:
        while got := sock.recv(65536):
            answer += got
    except ConnectionResetError:
        pass
    return time.monotonic() - started, answer


def test_a_head_that_never_ends_gets_408(served: tuple[str, SlowApp]) -> None:
    url, app = served
    sock = rawhttp.connect(url)
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n")  # no blank line: the head never ends
    elapsed, answer = cut_off_after(sock)
    assert 0.9 <= elapsed / TIMEOUT <= 5
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert answer.endswith(b'"type":"header_timeout","loc":[]}')
    assert rejected(app) == 1


def test_a_connection_that_sends_nothing_is_closed(served: tuple[str, SlowApp]) -> None:
    elapsed, _ = cut_off_after(rawhttp.connect(served[0]))
    assert 0.9 <= elapsed / TIMEOUT <= 5


def test_a_slow_answer_and_a_slow_body_are_not_cut_off(served: tuple[str, SlowApp]) -> None:
    url, app = served
    sock = rawhttp.connect(url)
    assert rawhttp.get(sock, "/slow")[:3:2] == (200, b"ok")  # 3 timeouts to answer
    sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nab")
    time.sleep(2 * TIMEOUT)  # the body is the routes' business (body_timeout_s)
    sock.sendall(b"cd")
    assert rawhttp.read_response(sock)[0] == 200
    assert rejected(app) == 0
    sock.close()


def test_the_next_head_on_a_kept_alive_connection_is_timed_too(
    served: tuple[str, SlowApp],
) -> None:
    url, app = served
    sock = rawhttp.connect(url)
    assert rawhttp.get(sock, "/")[0] == 200
    time.sleep(2 * TIMEOUT)  # idle between requests: uvicorn's keep-alive timer, not this one
    assert rawhttp.get(sock, "/")[0] == 200
    sock.sendall(b"GET / HT")
    elapsed, answer = cut_off_after(sock)
    assert 0.9 <= elapsed / TIMEOUT <= 5
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert rejected(app) == 1


def test_app_state_is_found_under_uvicorns_middleware() -> None:
    app = SlowApp()
    wrapped = SimpleNamespace(app=SimpleNamespace(app=app))  # e.g. proxy headers, logging
    assert app_state(wrapped) is app.state
    assert app_state(SimpleNamespace(app=None)) is None
    assert app_state(object()) is None


# -- bodies read ahead (httptools) ---------------------------------------------------------------


def test_read_ahead_is_the_declared_length_of_a_body_the_routes_accept() -> None:
    limit = 1 << 20
    assert read_ahead([(b"host", b"x"), (b"content-length", b"720346")], limit) == 720346
    assert read_ahead([(b"content-length", str(limit).encode())], limit) == limit
    # over the limit (refused before it is read), small, absent, malformed: uvicorn's 64 KiB
    assert read_ahead([(b"content-length", str(limit + 1).encode())], limit) == HIGH_WATER_LIMIT
    assert read_ahead([(b"content-length", b"10")], limit) == HIGH_WATER_LIMIT
    assert read_ahead([(b"transfer-encoding", b"chunked")], limit) == HIGH_WATER_LIMIT
    assert read_ahead([(b"content-length", b"-5")], limit) == HIGH_WATER_LIMIT
    # at most 19 digits (int64's) are read as a length; a longer one is not turned into an int
    assert read_ahead([(b"content-length", b"9" * 19)], 10**40) == 10**19 - 1
    assert read_ahead([(b"content-length", b"1" + b"0" * 19)], 10**40) == HIGH_WATER_LIMIT
    assert read_ahead([(b"content-length", b"9" * 30)], 10**40) == HIGH_WATER_LIMIT
    # the first Content-Length counts; no settings (another app): uvicorn's
    two = [(b"content-length", b"100000"), (b"content-length", b"200000")]
    assert read_ahead(two, limit) == 100000
    assert read_ahead([(b"content-length", b"720346")], None) == HIGH_WATER_LIMIT


def test_a_body_is_its_pieces_joined_once() -> None:
    body = _Body(bytearray(b"ab"))  # what uvicorn's cycle held before
    body += b"cde"
    body += b"f"
    assert len(body) == 6
    assert bytes(body) == b"abcdef"
    one = b"x" * 100
    alone = _Body()
    alone += one
    assert bytes(alone) is one  # one piece: given as it came, not copied
    assert bytes(_Body()) == b""
    assert len(_Body()) == 0


class EchoApp:
    """Reads the whole body (after ``wait`` seconds), answers its length and SHA-256 and how many
    messages it came in."""

    def __init__(self, max_request_bytes: int | None, wait: float) -> None:
        self.wait = wait
        self.state = SimpleNamespace(
            settings=SimpleNamespace(
                header_timeout_s=30.0, limit_concurrency=None, max_request_bytes=max_request_bytes
            ),
            metrics=Metrics(),
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await asyncio.sleep(self.wait)
        digest = hashlib.sha256()
        size = messages = 0
        more = True
        while more:
            message = await receive()
            more = message.get("more_body", False)
            digest.update(message.get("body", b""))
            size += len(message.get("body", b""))
            messages += 1
        body = f"{size} {digest.hexdigest()} {messages}".encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
def pauses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every time a connection stops reading (uvicorn's flow control), counted."""
    counted: list[int] = []
    pause = FlowControl.pause_reading

    def counting(self: FlowControl) -> None:
        counted.append(1)
        pause(self)

    monkeypatch.setattr(FlowControl, "pause_reading", counting)
    return counted


@pytest.mark.parametrize(
    ("max_request_bytes", "read_ahead_expected"),
    [(4 << 20, True), (1 << 20, False), (None, False)],
    ids=["accepted", "over-the-limit", "no-settings"],
)
def test_a_body_is_read_ahead_only_when_the_routes_accept_its_length(
    pauses: list[int], max_request_bytes: int | None, read_ahead_expected: bool
) -> None:
    body = np.random.default_rng(0).integers(0, 256, (3 << 20) // 2, np.uint8).tobytes()
    with serving(EchoApp(max_request_bytes, wait=0.3), HttpToolsHeaderTimeout) as url:
        sock = rawhttp.connect(url)
        for _ in range(2):  # the second on the kept-alive connection
            head = f"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
            sock.sendall(head.encode() + body)
            status, _, answer = rawhttp.read_response(sock)
            size, digest, messages = answer.decode().split()
            assert (status, int(size), digest) == (200, len(body), hashlib.sha256(body).hexdigest())
            assert int(messages) >= 1
        sock.close()
    # read ahead: the connection never stopped reading; else it stopped at 64 KiB held while
    # the app waited (0.3 s: the 1.5 MB body had long come over loopback)
    assert (len(pauses) == 0) == read_ahead_expected, len(pauses)
