"""service/http/protocol.py under a real uvicorn (httptools) on a thread: a request head (line and
headers) over ``max_request_head_bytes`` is answered 431 ``request_header_too_large`` and its
connection closed, however it comes (one huge header, many small ones, a long target, on a
kept-alive connection); a head within the limit, pipelined after a large body, is served."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import orjson
import pytest

from rnnserve.service.http.protocol import HttpToolsHeaderTimeout
from rnnserve.service.metrics import Metrics
from tests.e2e import rawhttp
from tests.integration.test_protocol import EchoApp, serving

LIMIT = 8 * 1024


class HeadLimitApp(EchoApp):
    def __init__(self) -> None:
        super().__init__(max_request_bytes=1 << 20, wait=0.0)
        self.state = SimpleNamespace(
            settings=SimpleNamespace(
                header_timeout_s=30.0,
                limit_concurrency=None,
                max_request_bytes=1 << 20,
                max_request_head_bytes=LIMIT,
            ),
            metrics=Metrics(),
        )


@pytest.fixture
def served() -> Iterator[tuple[str, HeadLimitApp]]:
    app = HeadLimitApp()
    with serving(app, HttpToolsHeaderTimeout, timeout_keep_alive=30) as url:
        yield url, app


def refused(app: HeadLimitApp) -> float:
    value = app.state.metrics.registry.get_sample_value(
        "rnnserve_requests_rejected_total",
        {"endpoint": "none", "reason": "request_header_too_large"},
    )
    return value or 0.0


def send_until_cut_off(sock: socket.socket, data: bytes, piece: int = 64 * 1024) -> None:
    """Send ``data`` in pieces; stop quietly where the server closes the connection."""
    try:
        for start in range(0, len(data), piece):
            sock.sendall(data[start : start + piece])
    except (BrokenPipeError, ConnectionResetError):
        pass


def answer_then_closed(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    response = rawhttp.read_response(sock)
    assert rawhttp.closed_by_peer(sock)
    return response


HEADS = {
    # a header of 2 MB that never ends: refused while it is still coming
    "one-huge-header": b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2_000_000,
    # many small headers, all of them sent at once and complete
    "many-headers": b"GET / HTTP/1.1\r\nhost: x\r\n"
    + b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 90) for i in range(200))
    + b"\r\n",
    "long-target": b"GET /" + b"p" * (2 * LIMIT) + b" HTTP/1.1\r\nhost: x\r\n\r\n",
}


@pytest.mark.parametrize("head", list(HEADS))
def test_a_head_over_the_limit_gets_431_and_the_connection_closes(
    served: tuple[str, HeadLimitApp], head: str
) -> None:
    url, app = served
    sock = rawhttp.connect(url)
    send_until_cut_off(sock, HEADS[head])
    status, headers, body = answer_then_closed(sock)
    error = orjson.loads(body)
    assert (status, error["type"]) == (431, "request_header_too_large")
    assert str(LIMIT) in error["detail"]
    assert len(body) < 1024
    assert headers["connection"] == "close"
    assert refused(app) == 1


def test_a_head_within_the_limit_is_served(served: tuple[str, HeadLimitApp]) -> None:
    url, app = served
    sock = rawhttp.connect(url)
    filler = b"v" * (LIMIT - 200)
    sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + filler + b"\r\n\r\n")
    assert rawhttp.read_response(sock)[0] == 200
    assert refused(app) == 0
    sock.close()


def test_a_small_head_that_begins_in_a_read_after_a_large_body_is_served(
    served: tuple[str, HeadLimitApp],
) -> None:
    """The read a head begins in holds the end of the body before it too: that read does not
    count as head."""
    url, app = served
    sock = rawhttp.connect(url)
    body = b"b" * (4 * LIMIT)
    first = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    sock.sendall(first + b"GET / HTTP/1.1\r\nhost: x")  # the second head, incomplete
    time.sleep(0.05)  # (a pause, not a measurement: the rest comes in a later read)
    sock.sendall(b"\r\n\r\n")
    assert rawhttp.read_response(sock)[2].startswith(b"%d " % len(body))
    assert rawhttp.read_response(sock)[0] == 200
    assert refused(app) == 0
    sock.close()


def test_a_request_pipelined_in_the_read_of_the_body_before_it_is_answered(
    served: tuple[str, HeadLimitApp],
) -> None:
    """Both requests in one write, so the server reads the second head with the first body and
    both answers may reach the client in one read."""
    url, app = served
    sock = rawhttp.connect(url)
    body = b"b" * (4 * LIMIT)
    first = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    sock.sendall(first + b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    assert rawhttp.read_response(sock)[2].startswith(b"%d " % len(body))
    assert rawhttp.read_response(sock)[0] == 200
    assert refused(app) == 0
    sock.close()


def test_the_next_head_on_a_kept_alive_connection_is_bounded_too(
    served: tuple[str, HeadLimitApp],
) -> None:
    url, app = served
    sock = rawhttp.connect(url)
    assert rawhttp.get(sock, "/")[0] == 200
    send_until_cut_off(sock, HEADS["one-huge-header"])
    assert answer_then_closed(sock)[0] == 431
    assert refused(app) == 1


@pytest.mark.parametrize(
    "head",
    [
        b"POST /smooth HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
        b"POST /smooth HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n",
        b"GET /a b HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\nBad Header: 1\r\n\r\n",
    ],
    ids=["negative length", "two lengths", "space in the target", "space in a name"],
)
def test_a_request_that_is_not_http_gets_a_json_400_naming_why(
    served: tuple[str, HeadLimitApp], head: bytes
) -> None:
    url, app = served
    with rawhttp.connect(url, 10.0) as sock:
        sock.sendall(head)
        status, headers, body = rawhttp.read_response(sock)
    assert status == 400
    assert headers["content-type"] == "application/json"
    answer = orjson.loads(body)
    assert answer["type"] == "invalid_http"
    reason = answer["detail"].removeprefix("the request is not valid HTTP/1.1: ")
    assert reason != answer["detail"]
    assert reason  # the parser's own words
    assert b"Bad Header" not in body
    value = app.state.metrics.registry.get_sample_value(
        "rnnserve_requests_rejected_total", {"endpoint": "none", "reason": "invalid_http"}
    )
    assert value == 1.0
