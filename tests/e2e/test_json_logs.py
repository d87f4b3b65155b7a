"""``rnnserve --log-format json``: every line every process writes is one JSON object."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.otlp import Receiver
from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e

# the HTTP process's answer writer fails for requests whose id begins with "fail-": a failure
# no batcher logged, so the HTTP layer logs it while serving the request
FAILING_ENCODER_SITE = """
from rnnserve.service.codec import bodies
from rnnserve.service.interface import current_request

_real = bodies.encode


def _failing(*args, **kwargs):
    context = current_request()
    if context is not None and context.request_id.startswith("fail-"):
        raise RuntimeError("simulated encoder fault")
    return _real(*args, **kwargs)


bodies.encode = _failing
"""

SMOOTH = {"sequences": [[[0.5] * 16] * 4]}


def failing_encoder_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAILING_ENCODER_SITE)
    return {
        "PYTHONPATH": os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    }


def send_requests(url: str) -> list[int]:
    """A health check, a good request, a client's mistake and a failing one; their statuses."""
    with httpx.Client(base_url=url, timeout=60) as client:
        return [
            client.get("/healthz").status_code,
            client.post("/smooth", json=SMOOTH, headers={"X-Request-Id": "good-1"}).status_code,
            client.post("/smooth", content=b"{", headers={"X-Request-Id": "bad-1"}).status_code,
            client.post("/smooth", json=SMOOTH, headers={"X-Request-Id": "fail-1"}).status_code,
        ]


def parse_every_line(log: str) -> list[dict[str, Any]]:
    records = []
    for number, line in enumerate(log.splitlines(), 1):
        try:
            parsed = json.loads(line)
        except json.JSONDecodeError:
            pytest.fail(f"line {number} is not JSON: {line!r}\n{log}")
        assert isinstance(parsed, dict), line
        records.append(parsed)
    return records


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_every_line_is_json_and_a_failure_carries_its_request_id(
    tmp_path: Path, workers: int
) -> None:
    flags = ("--log-format", "json", "--access-log", "--workers", str(workers))
    srv = start_server(tmp_path, *flags, env=failing_encoder_env(tmp_path))
    try:
        statuses = send_requests(srv.url)
    finally:
        stop(srv)
    assert statuses == [200, 200, 400, 500]
    records = parse_every_line(srv.log.read_text())
    assert all({"time", "level", "logger", "message", "process"} <= r.keys() for r in records)

    failed = [r for r in records if r.get("request_id") == "fail-1" and "traceback" in r]
    assert len(failed) == 1, records
    assert failed[0]["level"] == "ERROR"
    assert failed[0]["message"] == "smooth failed (request fail-1)"
    assert failed[0]["traceback"].endswith("RuntimeError: simulated encoder fault")
    # the failing request's line is the only one with a traceback
    assert not any("traceback" in r for r in records if r.get("request_id") != "fail-1")

    # uvicorn's access line is written while the request is served: it names the request too
    access = {r.get("request_id"): r["message"] for r in records if r["logger"] == "uvicorn.access"}
    assert access["fail-1"].endswith('"POST /smooth HTTP/1.1" 500'), access
    assert access["bad-1"].endswith('"POST /smooth HTTP/1.1" 400'), access
    assert access["good-1"].endswith('"POST /smooth HTTP/1.1" 200'), access
    assert any("Application shutdown complete" in r["message"] for r in records)
    if workers > 1:
        assert_every_process_logged_json(records, workers)


def assert_every_process_logged_json(records: list[dict[str, Any]], workers: int) -> None:
    """The supervisor, the engine process and each HTTP worker wrote JSON lines."""
    ready = next(r for r in records if "ready; starting" in r["message"])
    found = re.search(r"engine process (\d+) ready", ready["message"])
    assert found is not None, ready
    engine_pid = int(found.group(1))
    started = [r["process"] for r in records if r["message"].startswith("Started server process")]
    assert len(set(started)) == workers, started
    pids = {r["process"] for r in records}
    assert {ready["process"], engine_pid, *started} <= pids
    assert len({ready["process"], engine_pid, *started}) == workers + 2
    engine_lines = [r for r in records if r["process"] == engine_pid]
    assert any(r["logger"].startswith("rnnserve.engine") for r in engine_lines), engine_lines


def test_with_tracing_on_every_line_is_json_and_a_requests_lines_carry_its_trace_id(
    tmp_path: Path,
) -> None:
    trace_ids = {"good-1": f"{0xA11CE:032x}", "fail-1": f"{0xB0B:032x}"}
    flags = ("--log-format", "json", "--access-log")
    with Receiver() as receiver:
        env = {**failing_encoder_env(tmp_path), "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.url}
        srv = start_server(tmp_path, *flags, env=env)
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as client:
                statuses = [
                    client.post(
                        "/smooth",
                        json=SMOOTH,
                        headers={"X-Request-Id": rid, "traceparent": f"00-{tid}-{1:016x}-01"},
                    ).status_code
                    for rid, tid in trace_ids.items()
                ]
        finally:
            stop(srv)
    assert statuses == [200, 500]
    records = parse_every_line(srv.log.read_text())
    server_spans = {
        s.attributes["rnnserve.request_id"]: s.span
        for s in receiver.spans
        if s.name == "POST /smooth"
    }
    for rid, tid in trace_ids.items():
        lines = [r for r in records if r.get("request_id") == rid]
        assert lines, records
        assert {r.get("trace_id") for r in lines} == {tid}, lines
        # the request's span is current as its lines are written: its id, as exported
        assert {r.get("span_id") for r in lines} == {server_spans[rid].span_id.hex()}, lines
    [failed] = [r for r in records if "traceback" in r]
    assert failed["trace_id"] == trace_ids["fail-1"]
    assert any(r["logger"] == "uvicorn.access" and r.get("trace_id") == trace_ids["good-1"]
               for r in records)  # fmt: skip
    # lines written outside a request (start-up, shutdown) have no trace
    assert not any("trace_id" in r for r in records if "request_id" not in r)
