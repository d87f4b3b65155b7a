"""``--log-format json``: the formatter's fields, and the logging set-up uvicorn is handed."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer
from pydantic import ValidationError

from rnnserve.service import tracing
from rnnserve.service.config import Settings
from rnnserve.service.interface import open_request
from rnnserve.service.logs import JsonLineFormatter, uvicorn_log_config


def record(
    msg: str = "%s failed after %d tries",
    args: tuple[Any, ...] = ("smooth", 3),
    exc_info: Any = None,
    **extra: Any,
) -> logging.LogRecord:
    made = logging.LogRecord(
        "rnnserve.service.http.inference", logging.ERROR, __file__, 1, msg, args, exc_info
    )
    made.__dict__.update(extra)
    return made


def formatted(rec: logging.LogRecord, request_id: str | None = None) -> dict[str, Any]:
    """``rec`` as the formatter writes it, parsed; logged while serving ``request_id``."""

    def fmt() -> str:
        if request_id is not None:
            open_request(request_id)
        return JsonLineFormatter().format(rec)

    line = contextvars.copy_context().run(fmt)  # the request context stays in that copy
    assert "\n" not in line  # one record, one line
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def test_a_record_outside_a_request_has_the_fields_and_no_request_id() -> None:
    rec = record()
    out = formatted(rec)
    assert next(iter(out)) == "time"
    assert datetime.fromisoformat(out["time"]) == datetime.fromtimestamp(rec.created, tz=UTC)
    assert out["time"].endswith("+00:00")
    assert out["level"] == "ERROR"
    assert out["logger"] == "rnnserve.service.http.inference"
    assert out["message"] == "smooth failed after 3 tries"
    assert out["process"] == os.getpid()
    assert "request_id" not in out
    assert "traceback" not in out


def test_a_record_logged_while_serving_a_request_names_it() -> None:
    assert formatted(record(), request_id="req-42")["request_id"] == "req-42"


def test_the_placeholder_request_id_is_left_out() -> None:
    assert "request_id" not in formatted(record(), request_id="-")


def test_an_exception_comes_as_its_traceback_in_one_string() -> None:
    try:
        raise ValueError("simulated kernel fault")
    except ValueError:
        exc_info = sys.exc_info()
    out = formatted(record(exc_info=exc_info), request_id="req-7")
    trace = out["traceback"]
    assert isinstance(trace, str)
    assert trace.startswith("Traceback (most recent call last):")
    assert trace.endswith("ValueError: simulated kernel fault")
    assert "test_an_exception_comes_as_its_traceback_in_one_string" in trace
    assert out["message"] == "smooth failed after 3 tries"
    assert out["request_id"] == "req-7"


def test_extra_fields_stay_but_uvicorns_coloured_copy_goes() -> None:
    out = formatted(record(model="smoother", color_message="\x1b[1msmooth\x1b[0m"))
    assert out["model"] == "smoother"
    assert "color_message" not in out


@pytest.fixture
def tracer() -> Iterator[Tracer]:
    """This process traced (as a traced app sets it), for the test only."""
    made = TracerProvider().get_tracer("test")
    tracing.use(made)
    yield made
    tracing.use(None)


def test_a_record_logged_in_a_span_carries_its_trace_and_span_ids(tracer: Tracer) -> None:
    with tracer.start_as_current_span("request") as span:
        out = formatted(record(), request_id="req-9")
    ids = span.get_span_context()
    assert out["trace_id"] == f"{ids.trace_id:032x}"
    assert out["span_id"] == f"{ids.span_id:016x}"
    assert out["request_id"] == "req-9"


def test_a_record_outside_any_span_has_no_trace_ids(tracer: Tracer) -> None:
    out = formatted(record(), request_id="req-9")
    assert "trace_id" not in out
    assert "span_id" not in out


def test_with_tracing_off_a_record_has_no_trace_ids() -> None:
    assert tracing.tracer() is None
    with TracerProvider().get_tracer("other").start_as_current_span("not rnnserve's"):
        out = formatted(record())
    assert "trace_id" not in out


def test_log_format_is_text_by_default_and_json_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RNNSERVE_LOG_FORMAT", raising=False)
    assert Settings().log_format == "text"
    monkeypatch.setenv("RNNSERVE_LOG_FORMAT", "json")
    assert Settings().log_format == "json"
    monkeypatch.setenv("RNNSERVE_LOG_FORMAT", "yaml")
    with pytest.raises(ValidationError):
        Settings()


def test_text_format_leaves_uvicorn_its_own_logging() -> None:
    from uvicorn.config import LOGGING_CONFIG

    assert uvicorn_log_config(Settings(log_format="text")) == LOGGING_CONFIG


# what uvicorn does with its log_config in each of its processes, then a line from each logger
APPLY_AND_LOG = """
import logging, logging.config, sys, warnings
from rnnserve.service.config import Settings
from rnnserve.service.logs import uvicorn_log_config
logging.config.dictConfig(uvicorn_log_config(Settings(log_format="json", log_level="info")))
logging.getLogger("uvicorn.error").info("Started server process [%d]", 1)
access = ("127.0.0.1:1", "GET", "/", "1.1", 200)
logging.getLogger("uvicorn.access").info('%s - "%s %s HTTP/%s" %d', *access)
logging.getLogger("rnnserve.service.http.app").info("worker line")
logging.getLogger("numba.core").info("held at warning")
warnings.warn("a library's warning")
"""


def test_json_format_makes_every_logger_of_a_uvicorn_process_write_json() -> None:
    done = subprocess.run(
        [sys.executable, "-c", APPLY_AND_LOG], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    errs = [json.loads(line) for line in done.stderr.splitlines()]
    outs = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(e["logger"], e["message"]) for e in errs] == [
        ("uvicorn.error", "Started server process [1]"),
        ("rnnserve.service.http.app", "worker line"),
        ("py.warnings", errs[2]["message"]),
    ]
    assert "a library's warning" in errs[2]["message"]
    assert [(o["logger"], o["message"]) for o in outs] == [
        ("uvicorn.access", '127.0.0.1:1 - "GET / HTTP/1.1" 200')
    ]
