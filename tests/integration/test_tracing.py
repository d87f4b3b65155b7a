"""Tracing in one process: the span tree of batched requests, read from the SDK's in-memory
exporter; and, with tracing off, no OpenTelemetry code run per request."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from types import FrameType
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from rnnserve.service import tracing
from rnnserve.service.config import Settings
from rnnserve.service.http.app import create_app
from rnnserve.service.http.streaming import NDJSON

SMOOTH = {"sequences": [[[0.25] * 16] * 5]}
ROLLOUT = {"inputs": [[[0.1] * 6] * 20, [[0.2] * 6] * 3]}


def traceparent(trace_id: int, parent_id: int) -> str:
    return f"00-{trace_id:032x}-{parent_id:016x}-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()
    tracing.use(None)  # the next test's app sets its own


@asynccontextmanager
async def traced_app(
    exporter: InMemorySpanExporter | None, **overrides: Any
) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    provider = None
    if exporter is not None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(Settings(**overrides), tracer_provider=provider)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rnnserve") as client:
            yield app, client


def named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    """The spans whose parent is ``parent``, by name (each name once)."""
    span_id = parent.context.span_id
    found = [s for s in spans if s.parent is not None and s.parent.span_id == span_id]
    by_name = {s.name: s for s in found}
    assert len(by_name) == len(found), [s.name for s in found]
    return by_name


async def test_two_batched_requests_continue_their_traces_and_share_one_linked_batch_span(
    exporter: InMemorySpanExporter,
) -> None:
    sent = {"req-a": (0xA1 << 64 | 1, 0xA2), "req-b": (0xB1 << 64 | 2, 0xB2)}
    # two sequences fill a batch: both requests run in one, long before the delay
    async with traced_app(exporter, max_batch_size=2, max_delay_ms=10_000) as (_, client):
        answers = await asyncio.gather(
            *(
                client.post(
                    "/smooth",
                    json=SMOOTH,
                    headers={"X-Request-Id": rid, "traceparent": traceparent(*ids)},
                )
                for rid, ids in sent.items()
            )
        )
    assert [a.status_code for a in answers] == [200, 200]
    spans = exporter.get_finished_spans()

    [batch] = named(spans, "batch smoother")
    assert batch.parent is None  # a trace of its own, linked to the requests' traces
    assert batch.attributes is not None
    assert batch.attributes["rnnserve.batch.requests"] == 2
    assert batch.attributes["rnnserve.batch.timesteps"] == 10
    servers = {s.attributes["rnnserve.request_id"]: s for s in named(spans, "POST /smooth")}
    assert set(servers) == set(sent)
    linked = {
        (link.context.trace_id, link.context.span_id): link.attributes["rnnserve.request_id"]
        for link in batch.links
    }
    assert linked == {(s.context.trace_id, s.context.span_id): rid for rid, s in servers.items()}

    for rid, (trace_id, parent_id) in sent.items():
        server = servers[rid]
        assert server.kind is SpanKind.SERVER
        assert server.context.trace_id == trace_id  # the caller's traceparent, continued
        assert server.parent is not None
        assert server.parent.span_id == parent_id
        assert server.attributes is not None
        assert server.attributes["http.request.method"] == "POST"
        assert server.attributes["http.route"] == "/smooth"
        assert server.attributes["http.response.status_code"] == 200
        steps = children(spans, server)
        assert set(steps) == {"read body", "decode", "queue wait", "encode"}
        assert all(s.context.trace_id == trace_id for s in steps.values())
        waited = steps["queue wait"]
        assert [link.context.span_id for link in waited.links] == [batch.context.span_id]
        # the steps in order, each within the request's span
        assert server.start_time <= steps["read body"].start_time
        assert steps["read body"].end_time <= steps["decode"].start_time
        assert steps["decode"].end_time <= waited.start_time
        assert waited.end_time <= batch.start_time + 1_000_000  # ends as the batch starts
        assert batch.end_time <= steps["encode"].start_time
        assert steps["encode"].end_time <= server.end_time


async def test_a_request_without_traceparent_starts_a_trace_and_a_refusal_says_why(
    exporter: InMemorySpanExporter,
) -> None:
    async with traced_app(exporter) as (_, client):
        r = await client.post("/smooth", content=b"{", headers={"X-Request-Id": "bad-1"})
    assert r.status_code == 400
    spans = exporter.get_finished_spans()
    [server] = named(spans, "POST /smooth")
    assert server.parent is None
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 400
    assert server.attributes["error.type"] == r.json()["type"]
    assert server.status.status_code is StatusCode.UNSET  # the client's error, not the server's
    steps = children(spans, server)
    assert set(steps) == {"read body", "decode"}  # refused while decoding: never queued
    assert steps["decode"].status.status_code is StatusCode.ERROR
    assert not named(spans, "batch smoother")


async def test_a_streamed_rollout_span_ends_with_the_stream_and_each_chunk_links_to_it(
    exporter: InMemorySpanExporter,
) -> None:
    async with traced_app(exporter, rollout_chunk_steps=8) as (_, client):
        r = await client.post(
            "/rollout", json=ROLLOUT, headers={"accept": NDJSON, "X-Request-Id": "stream-1"}
        )
    assert r.status_code == 200
    assert r.content.splitlines()[-1] == b'{"model":"traveller","done":true}'
    spans = exporter.get_finished_spans()
    [server] = named(spans, "POST /rollout")
    chunks = named(spans, "batch traveller")
    assert len(chunks) == 3  # 20 steps in chunks of 8
    for chunk in chunks:
        assert [link.context.span_id for link in chunk.links] == [server.context.span_id]
    assert max(c.end_time for c in chunks) <= server.end_time  # the span lasts the stream
    assert set(children(spans, server)) == {"read body", "decode", "queue wait"}


async def test_with_tracing_off_a_request_runs_no_opentelemetry_code() -> None:
    called: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("opentelemetry"):
            called.add(f"{module}.{frame.f_code.co_name}")

    async with traced_app(None) as (app, client):
        assert app.state.tracing is None
        assert tracing.tracer() is None
        sys.setprofile(profile)
        try:
            r = await client.post("/smooth", json=SMOOTH)
        finally:
            sys.setprofile(None)
    assert r.status_code == 200
    assert called == set()
