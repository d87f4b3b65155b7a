"""Answers a client does not read, under a real uvicorn with rnnserve's protocols: their unsent
bytes count in the byte budget until they are sent, and a connection whose client stops reading
is closed after ``write_timeout_s``; a client that reads, however slowly, gets all of it."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from rnnserve.service.http.auth import byte_budget
from rnnserve.service.http.protocol import H11HeaderTimeout, HttpToolsHeaderTimeout
from rnnserve.service.metrics import Metrics
from tests.e2e import rawhttp
from tests.integration.test_protocol import serving

ANSWER = bytes(range(256)) * (32 * 4096)  # 32 MiB: far more than the kernel's socket buffers
WRITE_TIMEOUT = 0.5


class BigAnswerApp:
    """Answers every request with :data:`ANSWER`."""

    def __init__(self) -> None:
        settings = SimpleNamespace(
            header_timeout_s=30.0,
            limit_concurrency=None,
            max_inflight_bytes=1 << 40,
            write_timeout_s=WRITE_TIMEOUT,
        )
        self.state = SimpleNamespace(settings=settings, metrics=Metrics())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(ANSWER)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": ANSWER})

    def held(self) -> int:
        return byte_budget(self.state).used

    def timeouts(self) -> float:
        return self.state.metrics.registry.get_sample_value("rnnserve_write_timeouts_total") or 0


@pytest.fixture(params=[HttpToolsHeaderTimeout, H11HeaderTimeout], ids=["httptools", "h11"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, BigAnswerApp]]:
    app = BigAnswerApp()
    with serving(app, request.param, timeout_keep_alive=30) as url:
        yield url, app


def _small_buffer_connection(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sticks
    sock.connect((host, int(port)))
    return sock


def _wait_for(check: Any, what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# with ``connection: close`` uvicorn closes the transport once the answer is written: the
# unsent bytes must still be timed out, not left held for as long as the client stays
@pytest.mark.parametrize("close", [b"", b"connection: close\r\n"], ids=["keep-alive", "close"])
def test_an_unread_answer_is_held_in_the_budget_then_its_connection_is_closed(
    served: tuple[str, BigAnswerApp], close: bytes
) -> None:
    url, app = served
    sock = _small_buffer_connection(url)
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n" + close + b"\r\n")
    # the kernel takes a few MiB at most; the rest waits in the server's memory, counted
    _wait_for(lambda: app.held() > len(ANSWER) // 2, "the unsent answer was not counted")
    _wait_for(lambda: app.timeouts() == 1, "the stalled connection was never closed")
    assert app.held() == 0  # aborted: its bytes dropped and given back
    sock.settimeout(10)
    got = 0
    try:
        while chunk := sock.recv(1 << 20):
            got += len(chunk)
    except ConnectionResetError:
        pass
    assert got < len(ANSWER)  # the answer was cut off, not delivered
    sock.close()


def test_a_client_that_reads_slowly_gets_the_whole_answer(
    served: tuple[str, BigAnswerApp],
) -> None:
    url, app = served
    sock = _small_buffer_connection(url)
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    sock.settimeout(10)
    received = bytearray()
    pauses = 0
    while (end := received.find(b"\r\n\r\n")) < 0 or len(received) < end + 4 + len(ANSWER):
        chunk = sock.recv(1 << 20)
        assert chunk, "the connection closed before the whole answer came"
        received += chunk
        if pauses < 3 and len(received) > (pauses + 1) * len(ANSWER) // 4:
            pauses += 1
            time.sleep(WRITE_TIMEOUT / 3)  # slow, but within the timeout each time
    head, _, body = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert body == ANSWER
    assert pauses == 3
    _wait_for(lambda: app.held() == 0, "the sent answer's bytes were not given back")
    assert app.timeouts() == 0
    # the connection is still good for another request
    assert rawhttp.get(rawhttp.connect(url), "/")[0] == 200
    sock.close()
