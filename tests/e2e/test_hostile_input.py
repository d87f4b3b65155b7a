"""Hostile requests to real ``rnnserve`` processes, one process and ``--workers 2``: a long model
name (in the path or the body) gets a small 404 that quotes a prefix of it; a request head over
``max_request_head_bytes`` gets 431 on any path."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from rnnserve.service.interface import QUOTE_CHARS
from tests.e2e import rawhttp
from tests.e2e.server import Server, start_server, stop

pytestmark = pytest.mark.e2e
PATH_NAME = "z" * 60_000  # under the head limit: the name reaches the route
BODY_NAME = "z" * 1_000_000


@pytest.fixture(scope="module", params=[(), ("--workers", "2")], ids=["single", "workers"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("hostile"), *request.param)
    yield srv
    stop(srv)


def assert_small_and_unechoed(r: httpx.Response, status: int, kind: str) -> None:
    assert (r.status_code, r.json()["type"]) == (status, kind), r.text[:300]
    assert len(r.content) < 1024
    assert "z" * (QUOTE_CHARS + 1) not in r.text


def test_a_long_model_name_gets_a_small_404(server: Server) -> None:
    step = [[[0.0] * 16]]
    with httpx.Client(base_url=server.url, timeout=30) as client:
        r = client.post(f"/models/{PATH_NAME}/infer", json={"inputs": step})
        assert_small_and_unechoed(r, 404, "unknown_model")
        assert r.json()["loc"] == ["path", "name"]
        r = client.post("/smooth", json={"sequences": step, "model": BODY_NAME})
        assert_small_and_unechoed(r, 404, "unknown_model")


@pytest.mark.parametrize("path", ["/smooth", "/healthz"])
def test_a_huge_request_head_gets_431(server: Server, path: str) -> None:
    sock = rawhttp.connect(server.url)
    head = f"GET {path} HTTP/1.1\r\nhost: x\r\nx-big: ".encode() + b"a" * 24_000_000
    try:
        for start in range(0, len(head), 1 << 20):
            sock.sendall(head[start : start + (1 << 20)])
    except (BrokenPipeError, ConnectionResetError):
        pass  # closed once the answer was read
    status, _, body = rawhttp.read_response(sock)
    assert (status, orjson.loads(body)["type"]) == (431, "request_header_too_large")
    assert rawhttp.closed_by_peer(sock)
