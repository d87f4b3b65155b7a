"""OpenTelemetry tracing: what switches it on, and the SDK set up from the ``OTEL_*`` variables.

Off unless the environment asks for it (docs/CONFIGURATION.md, "Tracing"): tracing is on when
``OTEL_TRACES_EXPORTER`` names ``otlp`` or ``console``, or when it is unset and
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set (then ``otlp``);
``OTEL_SDK_DISABLED=true`` or ``OTEL_TRACES_EXPORTER=none`` keeps it off. Everything else (the
endpoint, headers, timeout, compression, sampler, batch sizes, service name, resource
attributes, propagators) the SDK reads itself, as its documentation says.

Nothing of OpenTelemetry is imported unless tracing is on: the SDK and the OTLP exporter are the
``rnnserve[tracing]`` extra, and this module imports them inside :func:`provider_from_environment`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rnnserve.service.interface import StartupError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Tracer

EXPORTERS = ("otlp", "console")
INSTRUMENTATION = "rnnserve"  # the tracer's name, on every span rnnserve makes
EXTRA = "pip install 'rnnserve[tracing]'"
REQUEST_ID = "rnnserve.request_id"  # the span attribute of the request's X-Request-Id

_tracer: Tracer | None = None


def use(tracer: Tracer | None) -> None:
    """Trace this process with ``tracer`` (``None``: off): the batchers' spans and the ids in
    the log lines read it, as they have no app to ask."""
    global _tracer
    _tracer = tracer


def tracer() -> Tracer | None:
    """This process's tracer; ``None``: tracing is off."""
    return _tracer


def current_ids() -> tuple[str, str] | None:
    """The trace id and span id of the current span, in hex; ``None``: none is current."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def current_traceparent() -> str | None:
    """The current span as a W3C ``traceparent``, for a call to another process; ``None``:
    tracing is off or no span is current."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


def continue_trace(traceparent: str) -> None:
    """Make the span ``traceparent`` names the current one in this task (the other side of a
    call :func:`current_traceparent` named), so that the batchers link to it; for the rest of
    the task, as :func:`~rnnserve.service.interface.open_request` does. A no-op when off."""
    if _tracer is None:
        return
    from opentelemetry import context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context.attach(TraceContextTextMapPropagator().extract({"traceparent": traceparent}))


def exporters_asked(env: Mapping[str, str]) -> list[str]:
    """The span exporters the ``OTEL_*`` variables ask for; empty: tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    named = env.get("OTEL_TRACES_EXPORTER")
    if named is None or not named.strip():
        endpoints = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        return ["otlp"] if any(env.get(v, "").strip() for v in endpoints) else []
    names = [n.strip().lower() for n in named.split(",") if n.strip()]
    if names == ["none"]:
        return []
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise StartupError(
            f"OTEL_TRACES_EXPORTER={named}: rnnserve exports spans with "
            f"{' or '.join(EXPORTERS)} (or none), not {', '.join(unknown)}"
        )
    return names


def check_environment() -> list[str]:
    """The span exporters the ``OTEL_*`` variables ask for (empty: tracing is off), checked:
    raises :class:`StartupError` for an exporter or protocol rnnserve does not ship, or when
    the ``tracing`` extra is not installed. For the command to call before the port opens."""
    names = exporters_asked(os.environ)
    if not names:
        return []
    env = os.environ
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL"))
    if "otlp" in names and protocol not in (None, "", "http/protobuf"):
        raise StartupError(
            f"OTLP protocol {protocol}: rnnserve exports OTLP over http/protobuf only "
            "(set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf or leave it unset)"
        )
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise StartupError(
            f"the OTEL_* variables ask for tracing ({', '.join(names)}) but the OpenTelemetry "
            f"SDK is not installed: {EXTRA}"
        ) from exc
    return names


def provider_from_environment(version: str = "") -> TracerProvider | None:
    """A tracer provider exporting as the ``OTEL_*`` variables say; ``None``: tracing is off.
    Raises :class:`StartupError` as :func:`check_environment` does."""
    names = check_environment()
    if not names:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, read by the SDK, win over these defaults
    resource = Resource.create()
    ours = {} if SERVICE_VERSION in resource.attributes else {SERVICE_VERSION: version}
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        ours[SERVICE_NAME] = INSTRUMENTATION
    resource = resource.merge(Resource({k: v for k, v in ours.items() if v}))
    provider = TracerProvider(resource=resource)  # the sampler from OTEL_TRACES_SAMPLER
    if "otlp" in names:
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    if "console" in names:  # for a look at the spans: each as JSON on stdout, as it ends
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    return provider
