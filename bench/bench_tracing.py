"""What tracing costs per request: off, on, and with the OpenTelemetry SDK not installed.

Usage::

    python -m bench.bench_tracing [--requests 2000] [--rounds 5]

Each mode runs in a fresh process of its own: the real app (``create_app``, its lifespan, the
bundled smoother on the CPU) called straight through ASGI, one ``POST /smooth`` of one 16-wide
sequence of 8 steps at a time, each with a ``traceparent`` header, so that no HTTP parsing or
socket sits between the requests and the measurement. Reported per request: the wall time and
the process's CPU time (every thread), the median over the rounds, modes interleaved.

- ``off``: no ``OTEL_*`` variable, the SDK installed (the default deployment with the extra).
- ``on``: traced by the SDK with a batch span processor whose exporter drops the spans: the cost
  of making and batching them, not of sending them (that runs on the processor's thread).
- ``not installed``: the SDK made unimportable, as without the ``tracing`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

MODES = ("off", "on", "not installed")
BODY = json.dumps({"sequences": [[[0.25] * 16] * 8]}).encode()
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/smooth",
        "raw_path": b"/smooth",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
            (b"traceparent", TRACEPARENT),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("rnnserve", 80),
    }


async def _post(app: Any) -> int:
    """One request through the app's ASGI call; its status."""
    delivered = False
    status = 0
    never = asyncio.Event()  # the client stays

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(_scope(), receive, send)
    return status


def _provider(mode: str) -> Any:
    if mode != "on":
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    return provider


async def _measure(mode: str, requests: int) -> dict[str, float]:
    from rnnserve.service.config import Settings
    from rnnserve.service.http.app import create_app

    app = create_app(Settings(max_delay_ms=0.0), tracer_provider=_provider(mode))
    assert (app.state.tracing is not None) == (mode == "on"), mode  # measures what it says
    async with app.router.lifespan_context(app):
        for _ in range(200):  # warm: the first requests pay one-off costs
            assert await _post(app) == 200
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(requests):
            await _post(app)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return {"wall_us": wall / requests * 1e6, "cpu_us": cpu / requests * 1e6}


def _child(mode: str, requests: int) -> None:
    if mode == "not installed":
        sys.modules["opentelemetry.sdk"] = None  # type: ignore[assignment]  # unimportable
        try:
            import opentelemetry.sdk.trace  # noqa: F401
        except ImportError:
            pass
        else:
            raise AssertionError("the SDK is still importable")
    for name in [n for n in os.environ if n.startswith("OTEL_")]:
        del os.environ[name]
    print(json.dumps(asyncio.run(_measure(mode, requests))))


def run_mode(mode: str, requests: int) -> dict[str, float]:
    """One mode's figures, measured in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.bench_tracing", "--child", mode, "--requests", str(requests)],
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return figures


def report(results: dict[str, list[dict[str, float]]]) -> str:
    """The markdown table: median wall and CPU time per request, and the difference to off."""
    rows = [
        "| tracing | wall per request | CPU per request | CPU vs off |",
        "| --- | ---: | ---: | ---: |",
    ]
    base = statistics.median(r["cpu_us"] for r in results["off"])
    for mode, runs in results.items():
        wall = statistics.median(r["wall_us"] for r in runs)
        cpu = statistics.median(r["cpu_us"] for r in runs)
        rows.append(f"| {mode} | {wall:.0f} µs | {cpu:.0f} µs | {cpu - base:+.0f} µs |")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        _child(args.child, args.requests)
        return
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            results[mode].append(run_mode(mode, args.requests))
    print(report(results))
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
