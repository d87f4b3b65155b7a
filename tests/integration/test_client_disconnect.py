"""A client whose body stops short (it hung up mid-body, or its chunked body broke off) is the
client's doing: answered and counted 499 with the cancelled requests, never a 500 with a
traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import MutableMapping
from typing import Any

import orjson
import pytest

from tests.integration.conftest import AppClient
from tests.metrics import value

BODY = orjson.dumps({"sequences": [[[0.5] * 16] * 40]})
COUNT = "rnnserve_request_duration_seconds_count"


def _scope(headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/smooth", "raw_path": b"/smooth", "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000), "server": ("rnnserve", 80),
    }  # fmt: skip


async def _cut_short(app: Any, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
    """One ASGI request that sends the first half of its body, then the server sees the
    connection go (what uvicorn tells the app of a hang-up or of a chunked body that broke
    off); what the app sent."""
    half = len(BODY) // 2
    messages = [
        {"type": "http.request", "body": BODY[:100], "more_body": True},
        {"type": "http.request", "body": BODY[100:half], "more_body": True},
    ]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await asyncio.wait_for(app(_scope(headers), receive, send), 30)
    return sent


@pytest.mark.parametrize(
    "headers",
    [
        [(b"content-length", str(len(BODY)).encode())],  # hung up mid-body
        [(b"transfer-encoding", b"chunked")],  # a chunked body that broke off
    ],
    ids=["content-length", "chunked"],
)
async def test_a_body_cut_short_is_counted_499_cancelled_without_an_error_log(
    app_client: AppClient,
    caplog: pytest.LogCaptureFixture,
    headers: list[tuple[bytes, bytes]],
) -> None:
    async with app_client() as (app, client):
        caplog.clear()
        with caplog.at_level(logging.INFO):
            sent = await _cut_short(app, [*headers, (b"x-request-id", b"cut-1")])
        text = (await client.get("/metrics")).text
        assert app.state.byte_budget.used == 0  # the bytes it held are given back
    assert sent[0]["status"] == 499
    assert dict(sent[0]["headers"])[b"x-request-id"] == b"cut-1"
    assert value(text, "rnnserve_requests_cancelled_total", endpoint="smooth") == 1
    assert value(text, COUNT, endpoint="smooth", code="499") == 1
    assert value(text, COUNT, endpoint="smooth", code="500") == 0
    assert value(text, "rnnserve_requests_in_flight", endpoint="smooth") == 0
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]
    assert not any(r.exc_info for r in caplog.records)


async def test_a_whole_body_after_the_cut_short_one_is_served(app_client: AppClient) -> None:
    async with app_client() as (app, client):
        await _cut_short(app, [(b"content-length", str(len(BODY)).encode())])
        r = await client.post("/smooth", content=BODY, headers={"content-type": "application/json"})
    assert r.status_code == 200
    assert len(r.json()["sequences"][0]) == 40
