"""The batchers' spans: one per batch (or chunk of a continuous batch), linked to the span of
every request in it, and each request's wait in the queue, a child of its own span.

A batch serves many requests, each in a trace of its own, so its span starts a trace of its own
and links to theirs; each request's ``queue wait`` span links back to the batch it waited for.
With ``--workers N`` a request's span in the engine process is its HTTP worker's
``engine call``, continued from the request frame's ``traceparent``
(:func:`~rnnserve.service.tracing.continue_trace`).
With tracing off (:func:`rnnserve.service.tracing.tracer` is ``None``) nothing here imports or
calls OpenTelemetry: :func:`waiting` returns ``None`` and :func:`batch_span` a shared no-op.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from rnnserve.service import tracing
from rnnserve.service.interface import current_request

if TYPE_CHECKING:
    from opentelemetry.trace import Span, SpanContext, Tracer


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued item's request, as tracing sees it: its span, when it was queued, its id."""

    span: SpanContext
    since_ns: int
    request_id: str


def enabled() -> bool:
    """Whether this process traces (so that the spans' attributes are worth making)."""
    return tracing.tracer() is not None


def waiting() -> Waiting | None:
    """The current request's span, read when an item is queued; ``None``: tracing is off, or
    the item was queued outside a traced request."""
    if tracing.tracer() is None:
        return None
    from opentelemetry import trace

    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return None
    request = current_request()
    return Waiting(span, time.time_ns(), request.request_id if request is not None else "-")


class _NoSpan:
    """The batch span with tracing off."""

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def failed(self, exc: BaseException) -> None:
        return None


NO_SPAN = _NoSpan()


class _BatchSpan:
    """One batch's span, current while the batch runs (its failure logs carry its ids)."""

    def __init__(self, span: Span) -> None:
        self._span = span
        self._token: Any = None

    def __enter__(self) -> _BatchSpan:
        from opentelemetry import context, trace

        self._token = context.attach(trace.set_span_in_context(self._span))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        from opentelemetry import context

        if exc is not None:
            self.failed(exc)
        context.detach(self._token)
        self._span.end()

    def failed(self, exc: BaseException) -> None:
        from opentelemetry.trace import StatusCode

        self._span.record_exception(exc)
        self._span.set_status(StatusCode.ERROR, type(exc).__name__)


def batch_span(
    name: str,
    members: Iterable[Waiting | None],
    joined: Iterable[Waiting | None],
    attributes: Mapping[str, int | str],
) -> _BatchSpan | _NoSpan:
    """The span of batcher ``name``'s batch of ``members``, linked to each one's request;
    ``joined``: those whose wait in the queue ends now (their ``queue wait`` spans)."""
    tracer = tracing.tracer()
    if tracer is None:
        return NO_SPAN
    from opentelemetry import trace
    from opentelemetry.context import Context

    links = [
        trace.Link(m.span, {tracing.REQUEST_ID: m.request_id}) for m in members if m is not None
    ]
    span = tracer.start_span(f"batch {name}", Context(), links=links, attributes=attributes)
    _end_queue_waits(tracer, joined, span)
    return _BatchSpan(span)


def _end_queue_waits(tracer: Tracer, joined: Iterable[Waiting | None], batch: Span) -> None:
    from opentelemetry import trace

    now = time.time_ns()
    to_batch = [trace.Link(batch.get_span_context())]
    for w in joined:
        if w is None:
            continue
        parent = trace.set_span_in_context(trace.NonRecordingSpan(w.span))
        queued = tracer.start_span(
            "queue wait", parent, links=to_batch, start_time=w.since_ns,
            attributes={tracing.REQUEST_ID: w.request_id},
        )  # fmt: skip
        queued.end(now)
