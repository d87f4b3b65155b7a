"""service/protocol.py under a real uvicorn server on a thread of this process, for both of
uvicorn's HTTP/1.1 parsers: the header timeout cuts off slow request heads only, never a slow
answer or a slow body, on a connection's first request and on a kept-alive one."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import uvicorn

from service.metrics import Metrics
from service.protocol import H11HeaderTimeout, HttpToolsHeaderTimeout, app_state
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


@pytest.fixture(params=[HttpToolsHeaderTimeout, H11HeaderTimeout], ids=["httptools", "h11"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, SlowApp]]:
    app = SlowApp()
    port = free_port()
    config = uvicorn.Config(
        app, port=port, http=request.param, lifespan="off", log_level="warning",
        timeout_keep_alive=30,  # longer than anything here: only the header timeout acts
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(10)


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
