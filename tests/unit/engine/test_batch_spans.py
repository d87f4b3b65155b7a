"""The batchers' spans with tracing on (the OpenTelemetry SDK's in-memory exporter): one span per
batch or chunk, linked to each request in it, with the batch's sizes as attributes; each
request's queue wait ends once, in the batch it first joined, not again in a retry."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from rnnserve.service import tracing
from rnnserve.service.engine.batcher import DynamicBatcher
from rnnserve.service.engine.continuous import ContinuousBatcher
from rnnserve.service.interface import open_request
from tests.unit.engine.test_continuous_batcher import FakeEngine


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    found = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(found))
    tracing.use(provider.get_tracer("test"))
    yield found
    tracing.use(None)


def named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def in_request(request_id: str, work: Any) -> Any:
    """``work()`` awaited inside a request's span, as the HTTP layer runs it."""
    tracer = tracing.tracer()
    assert tracer is not None
    with tracer.start_as_current_span(f"request {request_id}"):
        open_request(request_id)  # this task's request (gather runs each in a task of its own)
        return await work()


def request_span(exporter: InMemorySpanExporter, request_id: str) -> ReadableSpan:
    (span,) = named(exporter, f"request {request_id}")
    return span


def linked_requests(batch: ReadableSpan) -> dict[int, str]:
    """The span ids the batch links to, with the request id each link carries."""
    return {link.context.span_id: link.attributes[tracing.REQUEST_ID] for link in batch.links}


def queue_waits(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    waits = named(exporter, "queue wait")
    by_request = {str(s.attributes[tracing.REQUEST_ID]): s for s in waits}
    assert len(by_request) == len(waits), "a request's queue wait ended twice"
    return by_request


async def test_a_batch_span_links_its_requests_and_counts_their_sizes(
    exporter: InMemorySpanExporter,
) -> None:
    async def handler(items: list[int]) -> list[int]:
        return [i * 10 for i in items]

    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=8, max_delay_s=0.05, name="smoother"
    )
    b.start()
    try:
        got = await asyncio.gather(
            in_request("r1", lambda: b.submit(1, size=2, cost=30)),
            in_request("r2", lambda: b.submit(2, size=3, cost=40)),
        )
    finally:
        await b.close()
    assert got == [10, 20]
    (batch,) = named(exporter, "batch smoother")
    assert dict(batch.attributes or {}) == {
        "rnnserve.batch.requests": 2,
        "rnnserve.batch.sequences": 5,
        "rnnserve.batch.timesteps": 70,
        "rnnserve.batch.split_depth": 0,
    }
    r1, r2 = request_span(exporter, "r1"), request_span(exporter, "r2")
    assert linked_requests(batch) == {r1.context.span_id: "r1", r2.context.span_id: "r2"}
    waits = queue_waits(exporter)
    assert set(waits) == {"r1", "r2"}
    for rid, parent in (("r1", r1), ("r2", r2)):
        assert waits[rid].parent is not None
        assert waits[rid].parent.span_id == parent.context.span_id
        assert [link.context.span_id for link in waits[rid].links] == [batch.context.span_id]


async def test_a_split_batchs_retries_have_their_depth_and_end_no_queue_wait_again(
    exporter: InMemorySpanExporter,
) -> None:
    async def handler(items: list[int]) -> list[int]:
        if len(items) > 1:
            raise RuntimeError("the batch fails together")
        return [i * 10 for i in items]

    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=8, max_delay_s=0.05, name="smoother", max_split_depth=1
    )
    b.start()
    try:
        got = await asyncio.gather(
            in_request("r1", lambda: b.submit(1)), in_request("r2", lambda: b.submit(2))
        )
    finally:
        await b.close()
    assert got == [10, 20]
    batches = named(exporter, "batch smoother")
    depths = sorted(int(s.attributes["rnnserve.batch.split_depth"]) for s in batches)  # type: ignore[index,arg-type]
    assert depths == [0, 1, 1]
    first = next(s for s in batches if s.attributes["rnnserve.batch.split_depth"] == 0)  # type: ignore[index]
    assert first.attributes["rnnserve.batch.requests"] == 2  # type: ignore[index]
    retries = [s for s in batches if s is not first]
    assert sorted(len(s.links) for s in retries) == [1, 1]  # each retry links its one request
    waits = queue_waits(exporter)  # once each, ended by the first batch
    assert set(waits) == {"r1", "r2"}
    for wait in waits.values():
        assert [link.context.span_id for link in wait.links] == [first.context.span_id]


async def test_a_chunk_span_links_the_running_items_and_counts_those_that_joined(
    exporter: InMemorySpanExporter,
) -> None:
    engine = FakeEngine()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8, name="rollout")
    b.start()
    try:
        long = asyncio.ensure_future(in_request("long", lambda: b.submit(6, size=2)))
        await asyncio.wait_for(engine.entered.wait(), 5)
        short = await in_request("short", lambda: b.submit(2, size=3))
        assert short == "done 2"
        assert await asyncio.wait_for(long, 5) == "done 6"
    finally:
        await b.close()
    chunks = named(exporter, "batch rollout")
    assert len(chunks) == 6  # the long item's six steps, one a chunk
    long_span, short_span = request_span(exporter, "long"), request_span(exporter, "short")
    both = {long_span.context.span_id: "long", short_span.context.span_id: "short"}
    shapes = [
        (
            s.attributes["rnnserve.batch.requests"],  # type: ignore[index]
            s.attributes["rnnserve.batch.sequences"],  # type: ignore[index]
            s.attributes["rnnserve.batch.joined"],  # type: ignore[index]
        )
        for s in chunks
    ]
    assert shapes[0] == (1, 2, 1)  # the long item alone, joining
    joined_at = next(i for i, s in enumerate(chunks) if linked_requests(s) == both)
    assert shapes[joined_at] == (2, 5, 1)  # the short one joins the running long one
    assert linked_requests(chunks[0]) == {long_span.context.span_id: "long"}
    assert sum(1 for s in shapes if s[2] == 1) == 2  # each item joined once
    waits = queue_waits(exporter)
    assert [link.context.span_id for link in waits["short"].links] == [
        chunks[joined_at].context.span_id
    ]
    assert [link.context.span_id for link in waits["long"].links] == [chunks[0].context.span_id]


async def test_a_failed_chunks_retried_items_end_no_queue_wait_again(
    exporter: InMemorySpanExporter,
) -> None:
    engine = FakeEngine()
    engine.fail_once = RuntimeError("the chunk fails together")
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(
        engine, max_active=8, name="rollout", max_split_depth=1
    )
    b.start()
    try:
        first = asyncio.ensure_future(in_request("a", lambda: b.submit(2)))
        second = asyncio.ensure_future(in_request("b", lambda: b.submit(2)))
        await asyncio.sleep(0.05)  # both queued before the first chunk runs
        engine.release.set()
        assert await asyncio.wait_for(asyncio.gather(first, second), 5) == ["done 2"] * 2
    finally:
        await b.close()
    waits = queue_waits(exporter)  # one each, though both items ran again after the failure
    assert set(waits) == {"a", "b"}
    chunks = named(exporter, "batch rollout")
    assert len(chunks) > 1
    assert chunks[0].attributes["rnnserve.batch.joined"] == 2  # type: ignore[index]
