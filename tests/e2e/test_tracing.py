"""A real ``rnnserve`` traced by the ``OTEL_*`` variables alone: its spans arrive over
OTLP/HTTP at a receiver in the test, continuing the caller's trace, with the request id; with
``--workers N`` the engine process's batch span too, linked to the worker's span."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from tests.e2e.otlp import Received, Receiver, attributes
from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e

SMOOTH = {"sequences": [[[0.5] * 16] * 4]}
TRACE_ID, PARENT_ID = 0x5EED << 64 | 0xC0FFEE, 0xFEED


def tracing_env(receiver: Receiver) -> dict[str, str]:
    # the endpoint alone switches tracing on; the SDK reads the service name itself
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url, "OTEL_SERVICE_NAME": "rnnserve-e2e"}


def children_of(spans: list[Received], parent: Span) -> set[str]:
    return {r.name for r in spans if r.span.parent_span_id == parent.span_id}


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_spans_arrive_over_otlp_with_the_callers_trace_and_the_request_id(
    tmp_path: Path, workers: int
) -> None:
    with Receiver() as receiver:
        srv = start_server(tmp_path, "--workers", str(workers), env=tracing_env(receiver))
        try:
            headers = {
                "X-Request-Id": "e2e-trace-1",
                "traceparent": f"00-{TRACE_ID:032x}-{PARENT_ID:016x}-01",
            }
            r = httpx.post(f"{srv.url}/smooth", json=SMOOTH, headers=headers, timeout=60)
        finally:
            stop(srv)  # the server sends the spans it still holds as it stops
    assert r.status_code == 200
    assert receiver.paths
    assert set(receiver.paths) == {"/v1/traces"}
    spans = receiver.spans
    assert {s.resource["service.name"] for s in spans} == {"rnnserve-e2e"}
    [server] = [s for s in spans if s.attributes.get("rnnserve.request_id") == "e2e-trace-1"
                and s.span.kind == Span.SPAN_KIND_SERVER]  # fmt: skip
    assert server.name == "POST /smooth"
    assert server.span.trace_id == TRACE_ID.to_bytes(16, "big")
    assert server.span.parent_span_id == PARENT_ID.to_bytes(8, "big")
    assert server.attributes["http.response.status_code"] == 200
    steps = children_of(spans, server.span)
    if workers == 1:  # the batcher is in this process: it links to the request's span
        assert steps == {"read body", "decode", "queue wait", "encode"}
        queued_by = [server]
    else:  # the engine process's batcher links to the worker's span of the call to it
        assert steps == {"read body", "decode", "engine call", "encode"}
        queued_by = [s for s in spans if s.name == "engine call"]
        assert [c.span.parent_span_id for c in queued_by] == [server.span.span_id]
        assert children_of(spans, queued_by[0].span) == {"queue wait"}
    [batch] = [s for s in spans if s.name == "batch smoother"]
    [link] = batch.span.links
    linked = queued_by[0].span
    assert (link.trace_id, link.span_id) == (linked.trace_id, linked.span_id)
    assert attributes(link.attributes) == {"rnnserve.request_id": "e2e-trace-1"}
    assert batch.span.trace_id != server.span.trace_id  # a trace of its own
