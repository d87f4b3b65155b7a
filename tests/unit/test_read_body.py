"""How the routes read a body that arrives in pieces: assembled exactly, whatever the pieces."""

from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Gauge
from starlette.requests import Request

from service import routes
from service.validation import RequestError


def _request(pieces: list[bytes], declared: int | None, limit: int = 1 << 30) -> Request:
    messages = [
        {"type": "http.request", "body": p, "more_body": i < len(pieces) - 1}
        for i, p in enumerate(pieces)
    ] or [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    gauge = Gauge("inflight", "bytes", registry=CollectorRegistry())
    app = SimpleNamespace(state=SimpleNamespace(byte_budget=routes.ByteBudget(limit, gauge)))
    headers = [] if declared is None else [(b"content-length", str(declared).encode())]
    scope = {"type": "http", "method": "POST", "path": "/", "headers": headers, "app": app}
    return Request(scope, receive)


def _read(pieces: list[bytes], declared: int | None, limit: int = 1 << 20) -> bytes:
    request = _request(pieces, declared)
    return asyncio.run(routes._read_body(request, limit, 5.0, routes._Held()))


BODY = bytes(range(256)) * 40  # 10,240 bytes


@pytest.mark.parametrize(
    "cuts",
    [[], [1], [5000], [1, 2, 3], [256, 512, 4096, 10_000], list(range(100, 10_240, 100))],
)
@pytest.mark.parametrize("declared", [True, False])
def test_pieces_are_assembled_into_the_body(cuts: list[int], declared: bool) -> None:
    edges = [0, *cuts, len(BODY)]
    pieces = [BODY[a:b] for a, b in itertools.pairwise(edges)]
    got = _read([*pieces[:1], b"", *pieces[1:]], len(BODY) if declared else None)
    assert got == BODY
    if len(pieces) == 1:
        assert got is pieces[0]  # one piece: no copy


@pytest.mark.parametrize("declared", [len(BODY) - 100, len(BODY) + 100])
def test_a_body_not_of_its_declared_length_is_kept_as_it_came(declared: int) -> None:
    # the HTTP parsers enforce Content-Length; the route keeps what came, never pads or cuts
    pieces = [BODY[:3000], BODY[3000:7000], BODY[7000:]]
    assert _read(pieces, declared) == BODY


def test_a_body_over_the_limit_is_refused_as_it_arrives() -> None:
    pieces = [BODY[:3000], BODY[3000:7000], BODY[7000:]]
    with pytest.raises(RequestError) as err:
        _read(pieces, None, limit=5000)
    assert (err.value.status, err.value.type) == (413, "body_too_large")
