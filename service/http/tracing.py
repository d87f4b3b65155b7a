"""One inference request's spans in the HTTP layer: a server span that continues the caller's
W3C ``traceparent``, with a child span per step (``read body``, ``decode``, ``encode``, and with
``--workers N`` ``engine call`` around the call to the engine process).

With tracing off the app has no :class:`Tracing` and every request gets :data:`OFF`, whose
methods do nothing: no OpenTelemetry code runs per request. The batch spans are the engine's
(:mod:`rnnserve.service.engine.tracing`); the switch and the SDK's set-up are
:mod:`rnnserve.service.tracing`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from rnnserve.service.tracing import REQUEST_ID

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

_NOTHING = contextlib.nullcontext()  # reusable: it holds no state


@dataclass(frozen=True)
class Tracing:
    """An app's tracing: its tracer, and whether its models are another process's."""

    tracer: Tracer
    remote_engine: bool = False


class Trace:
    """A request's trace; this base class, every request's with tracing off, does nothing."""

    def step(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return _NOTHING

    def engine_call(self) -> contextlib.AbstractContextManager[Any]:
        return _NOTHING

    def end(self, status: int, error: str | None = None) -> None:
        return None


OFF = Trace()


class RequestTrace(Trace):
    """A traced request: its server span, current in the request's task from its start to the
    task's end, as the request's context is (:func:`~rnnserve.service.interface.open_request`):
    the batchers link to it, and every line logged for the request carries its ids, uvicorn's
    access line too, written once the answer is sent."""

    def __init__(self, tracing: Tracing, request: Request, route: str, request_id: str) -> None:
        from opentelemetry import context, propagate, trace

        self._tracer = tracing.tracer
        self._remote = tracing.remote_engine
        parent = propagate.extract(request.headers)  # traceparent (OTEL_PROPAGATORS)
        method = request.method
        attributes = {
            "http.request.method": method,
            "http.route": route,
            "url.path": request.url.path,
            "url.scheme": request.url.scheme,
            REQUEST_ID: request_id,
        }
        self._span = self._tracer.start_span(
            f"{method} {route}", parent, kind=trace.SpanKind.SERVER, attributes=attributes
        )
        # never detached: the request's task ends with the request
        context.attach(trace.set_span_in_context(self._span, parent))

    def step(self, name: str) -> contextlib.AbstractContextManager[Any]:
        """A child span around one step; an exception out of it marks it failed."""
        return self._tracer.start_as_current_span(name)

    def engine_call(self) -> contextlib.AbstractContextManager[Any]:
        """With ``--workers N``: a span around the call to the engine process."""
        return self.step("engine call") if self._remote else _NOTHING

    def end(self, status: int, error: str | None = None) -> None:
        """End the server span with the status the metrics count (a stream's: how it ended),
        once the answer is ready; ``error``: the answer's error type. A 5xx marks it failed."""
        from opentelemetry.trace import StatusCode

        self._span.set_attribute("http.response.status_code", status)
        if error is not None:
            self._span.set_attribute("error.type", error)
        if status >= 500:
            self._span.set_status(StatusCode.ERROR, error)
        self._span.end()


def begin(tracing: Tracing | None, request: Request, route: str, request_id: str) -> Trace:
    """The trace of a request to ``route`` (:data:`OFF` when the app does not trace)."""
    if tracing is None:
        return OFF
    return RequestTrace(tracing, request, route, request_id)
