"""Streamed rollouts (NDJSON) and clients that go away, through the real app."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI

from tests.integration.conftest import AppClient
from tests.metrics import value

NDJSON = "application/x-ndjson"
STREAM_REFUSAL = (
    "model 'traveller' cannot stream: streaming needs a Traveller with continuous rollout "
    "scheduling"
)


async def asgi_call(
    app: FastAPI, path: str, body: bytes, gone: asyncio.Event, accept: str = "application/json"
) -> list[dict[str, Any]]:
    """One raw ASGI request whose client disconnects when ``gone`` is set."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if gone.is_set() and sent:
            return  # uvicorn drops what is sent to a client that has gone
        sent.append(message)
        if message["type"] == "http.response.body" and len(sent) == 2 and accept == NDJSON:
            gone.set()  # a streaming client that leaves after its first piece

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"accept", accept.encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("rnnserve", 80),
    }
    await app(scope, receive, send)
    return sent


async def test_a_streamed_rollout_equals_the_whole_answer(app_client: AppClient) -> None:
    rng = np.random.default_rng(5)
    seqs = [rng.standard_normal((n, 6)).astype(np.float32) for n in (19, 3, 40)]
    body = {"inputs": [s.tolist() for s in seqs]}
    async with app_client(rollout_chunk_steps=8) as (_, client):
        whole = (await client.post("/rollout", json=body)).json()["positions"]
        r = await client.post("/rollout", json=body, headers={"accept": NDJSON})
        text = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert r.headers["content-type"].startswith(NDJSON)
    lines = [orjson.loads(line) for line in r.content.splitlines()]
    assert lines[-1] == {"model": "traveller", "done": True}
    got: list[list[list[float]]] = [[] for _ in seqs]
    for line in lines[:-1]:
        i, start, positions = line["sequence"], line["start"], line["positions"]
        assert start == len(got[i])  # pieces arrive in order, without gaps
        assert 1 <= len(positions) <= 8  # one chunk at most
        got[i].extend(positions)
    assert got == whole  # the same float32 values, bit for bit
    assert len(lines) - 1 == sum(-(-len(s) // 8) for s in seqs)
    assert (
        value(text, "rnnserve_request_duration_seconds_count", endpoint="rollout", code="200") == 2
    )
    assert value(text, "rnnserve_requests_in_flight", endpoint="rollout") == 0


async def test_streaming_needs_continuous_scheduling(app_client: AppClient) -> None:
    async with app_client(rollout_scheduling="batch") as (_, client):
        r = await client.post(
            "/rollout", json={"inputs": [[[0.0] * 6]]}, headers={"accept": NDJSON}
        )
    assert r.status_code == 422
    assert r.json() == {"detail": STREAM_REFUSAL, "type": "cannot_stream", "loc": ["model"]}


async def test_a_client_that_goes_away_stops_its_rollout(app_client: AppClient) -> None:
    steps = 50_000
    body = orjson.dumps({"inputs": [[[0.1] * 6] * steps]})
    async with app_client(rollout_chunk_steps=16) as (app, client):
        gone = asyncio.Event()
        call = asyncio.ensure_future(asgi_call(app, "/rollout", body, gone))
        for _ in range(1000):  # until it runs
            text = (await client.get("/metrics")).text
            if value(text, "rnnserve_batch_timesteps_sum", model="traveller") > 0:
                break
            await asyncio.sleep(0.005)
        gone.set()
        sent = await asyncio.wait_for(call, 30)
        # the runtime drops it at the next chunk: afterwards, nothing more runs
        await asyncio.sleep(0.2)
        text = (await client.get("/metrics")).text
        ran = value(text, "rnnserve_batch_timesteps_sum", model="traveller")
        # the model is free again: another request is answered
        assert (
            await client.post("/rollout", json={"inputs": [[[0.1] * 6] * 3]})
        ).status_code == 200
    assert sent[0]["status"] == 499
    assert value(text, "rnnserve_requests_cancelled_total", endpoint="rollout") == 1
    assert 0 < ran < steps / 2


async def test_a_client_that_leaves_a_stream_stops_its_rollout(app_client: AppClient) -> None:
    steps = 50_000
    body = orjson.dumps({"inputs": [[[0.1] * 6] * steps]})
    async with app_client(rollout_chunk_steps=16) as (app, client):
        sent = await asyncio.wait_for(
            asgi_call(app, "/rollout", body, asyncio.Event(), accept=NDJSON), 30
        )
        await asyncio.sleep(0.2)
        text = (await client.get("/metrics")).text
    assert sent[0]["status"] == 200
    first = orjson.loads(sent[1]["body"].splitlines()[0])
    assert first["sequence"] == 0
    assert first["start"] == 0
    assert value(text, "rnnserve_requests_cancelled_total", endpoint="rollout") == 1
    assert value(text, "rnnserve_batch_timesteps_sum", model="traveller") < steps / 2
    assert value(text, "rnnserve_requests_in_flight", endpoint="rollout") == 0
