"""A real server counts a body cut short as the client's doing: a client that sends half its
body and closes the connection, or whose chunked body breaks off, shows in /metrics as 499
(cancelled), not 500, and leaves no traceback in the server's log."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.e2e import rawhttp
from tests.e2e.server import Server, start_server, stop
from tests.metrics import value

pytestmark = pytest.mark.e2e
BODY = orjson.dumps({"sequences": [[[0.5] * 16] * 200]})
COUNT = "rnnserve_request_duration_seconds_count"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("cut-short"))
    yield srv
    stop(srv)


def _counts(server: Server) -> tuple[float, float, float]:
    """The /smooth requests counted 499 and 500, and those cancelled."""
    text = httpx.get(f"{server.url}/metrics").text
    return (
        value(text, COUNT, endpoint="smooth", code="499"),
        value(text, COUNT, endpoint="smooth", code="500"),
        value(text, "rnnserve_requests_cancelled_total", endpoint="smooth"),
    )


def _half_a_body_then_close(server: Server) -> None:
    with rawhttp.connect(server.url) as sock:
        sock.sendall(rawhttp.post_head("/smooth", len(BODY)) + BODY[: len(BODY) // 2])
        time.sleep(0.2)  # the route is reading the body when the client goes


def _chunked_body_that_breaks_off(server: Server) -> None:
    head = (
        b"POST /smooth HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        b"transfer-encoding: chunked\r\n\r\n"
    )
    first = BODY[:100]
    with rawhttp.connect(server.url) as sock:
        sock.sendall(head + f"{len(first):x}\r\n".encode() + first + b"\r\n")
        time.sleep(0.2)
        sock.sendall(b"not a chunk size\r\n")  # the parser refuses the body here
        rawhttp.closed_by_peer(sock)


@pytest.mark.parametrize("cut", [_half_a_body_then_close, _chunked_body_that_breaks_off])
def test_a_body_cut_short_shows_as_499_not_500(
    server: Server, cut: Callable[[Server], None]
) -> None:
    s499, s500, cancelled = _counts(server)
    cut(server)
    deadline = time.monotonic() + 30
    while sum(_counts(server)[:2]) == s499 + s500:  # until it is counted, one way or the other
        assert time.monotonic() < deadline, "the request was never counted"
        time.sleep(0.02)
    assert _counts(server) == (s499 + 1, s500, cancelled + 1)
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "ClientDisconnect" not in log
