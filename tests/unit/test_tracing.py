"""What switches tracing on, and the SDK's provider as the ``OTEL_*`` variables make it."""

from __future__ import annotations

import sys

import pytest

from rnnserve.service import tracing
from rnnserve.service.interface import StartupError

ENDPOINT = "http://collector:4318"


def test_tracing_is_on_with_an_exporter_named_or_an_endpoint_alone() -> None:
    asked = tracing.exporters_asked
    assert asked({}) == []
    assert asked({"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) == []
    assert asked({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}) == ["otlp"]
    assert asked({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{ENDPOINT}/v1/traces"}) == ["otlp"]
    assert asked({"OTEL_TRACES_EXPORTER": "otlp"}) == ["otlp"]
    assert asked({"OTEL_TRACES_EXPORTER": " OTLP, console"}) == ["otlp", "console"]


def test_none_or_a_disabled_sdk_keeps_it_off_whatever_else_is_set() -> None:
    asked = tracing.exporters_asked
    assert asked({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT}) == []
    assert asked({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "True"}) == []
    assert asked({"OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT, "OTEL_SDK_DISABLED": "true"}) == []


def test_an_exporter_rnnserve_does_not_ship_stops_the_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,zipkin")
    with pytest.raises(StartupError, match=r"OTEL_TRACES_EXPORTER=otlp,zipkin.*not zipkin"):
        tracing.check_environment()


def test_otlp_over_grpc_stops_the_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", ENDPOINT)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    with pytest.raises(StartupError, match=r"protocol grpc.*http/protobuf only"):
        tracing.check_environment()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")  # the traces' own
    assert tracing.check_environment() == ["otlp"]


def test_tracing_asked_for_without_the_extra_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(StartupError, match=r"rnnserve\[tracing\]"):
        tracing.check_environment()


def test_off_makes_no_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert tracing.provider_from_environment("1.0") is None


@pytest.mark.parametrize(
    ("env", "service"),
    [({}, "rnnserve"), ({"OTEL_SERVICE_NAME": "smoother-eu"}, "smoother-eu")],
    ids=["default-name", "OTEL_SERVICE_NAME"],
)
def test_the_provider_names_the_service_and_its_version(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], service: str
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    provider = tracing.provider_from_environment("1.2.3")
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == service
        assert provider.resource.attributes["service.version"] == "1.2.3"
    finally:
        provider.shutdown()


def test_resource_attributes_from_the_environment_win_over_rnnserves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=edge,service.version=9")
    provider = tracing.provider_from_environment("1.2.3")
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "edge"
        assert provider.resource.attributes["service.version"] == "9"
    finally:
        provider.shutdown()


def test_a_traceparent_sent_to_another_process_continues_its_trace_in_the_batcher() -> None:
    import contextvars

    from opentelemetry.sdk.trace import TracerProvider

    from rnnserve.service.engine.tracing import waiting
    from rnnserve.service.interface import open_request

    tracer = TracerProvider().get_tracer("test")
    tracing.use(tracer)
    try:
        with tracer.start_as_current_span("engine call") as span:
            sent = tracing.current_traceparent()
        ids = span.get_span_context()
        assert sent is not None
        assert sent.startswith(f"00-{ids.trace_id:032x}-{ids.span_id:016x}-")  # then its flags

        def engine_side() -> object:  # a task of its own, in the engine process
            open_request("req-5")
            tracing.continue_trace(sent)
            return waiting()

        queued = contextvars.copy_context().run(engine_side)
    finally:
        tracing.use(None)
    assert queued is not None
    assert (queued.span.trace_id, queued.span.span_id) == (ids.trace_id, ids.span_id)
    assert queued.request_id == "req-5"


def test_with_tracing_off_no_traceparent_is_sent() -> None:
    assert tracing.tracer() is None
    assert tracing.current_traceparent() is None
    tracing.continue_trace("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")  # no-op
