"""End-to-end HTTP benchmark: rnnserve's batching against serving one request per model call.

Usage::

    python -m bench.bench_http [--quick] [--out docs/BENCHMARKS.md]

Two real ``rnnserve`` processes: the default settings (dynamic batching), and the same server
with ``--max-batch-size 1`` -- every request runs the model alone, which is what a plain FastAPI
endpoint calling the model per request does, with the same JSON and threading costs. 64
concurrent clients (asyncio + aiohttp, in this process) each send requests back to back; every
request holds one sequence. Reported: throughput, latency percentiles, and mean requests per
batch read back from ``/metrics``. The load generator shares the machine's cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from bench.models_harness import DEFAULT_OUT, cpu_model, write_section
from tests.e2e.server import start_server, stop
from tests.metrics import value

BEGIN = "<!-- bench_http:begin -->"
END = "<!-- bench_http:end -->"
CLIENTS = 64
CONFIGS = (
    ("rnnserve (dynamic batching)", ()),
    ("one request per model call", ("--max-batch-size", "1")),
)
ENDPOINTS = (("/smooth", "sequences", 16, 100), ("/rollout", "inputs", 6, 100))


async def _load(url: str, path: str, bodies: list[bytes], per_client: int) -> list[float]:
    latencies: list[float] = []
    headers = {"content-type": "application/json"}
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def one_client(i: int) -> None:
            for k in range(per_client):
                t0 = time.perf_counter()
                body = bodies[(i + k) % len(bodies)]
                async with session.post(path, data=body, headers=headers) as r:
                    text = await r.read()
                latencies.append(time.perf_counter() - t0)
                if r.status != 200:
                    raise RuntimeError(f"{path}: {r.status} {text[:200]!r}")

        await asyncio.gather(*(one_client(i) for i in range(CLIENTS)))
    return latencies


def _requests_per_batch(url: str, model: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    batches = value(text, "rnnserve_batch_requests_count", model=model)
    return (
        value(text, "rnnserve_batch_requests_sum", model=model) / batches if batches else math.nan
    )


def run(quick: bool) -> list[tuple[str, str, float, float, float, float]]:
    per_client = 3 if quick else 20
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, args in CONFIGS:
            server = start_server(Path(tmp), *args)
            try:
                for path, field, width, steps in ENDPOINTS:
                    bodies = [
                        f'{{"{field}": [{rng.standard_normal((steps, width)).round(4).tolist()}]}}'
                        .encode()
                        for _ in range(16)
                    ]  # fmt: skip
                    asyncio.run(_load(server.url, path, bodies, 1))  # warm connections
                    t0 = time.perf_counter()
                    lat = asyncio.run(_load(server.url, path, bodies, per_client))
                    wall = time.perf_counter() - t0
                    model = "smoother" if path == "/smooth" else "traveller"
                    q = statistics.quantiles(lat, n=100)
                    rows.append((label, path, len(lat) / wall, q[49], q[98],
                                 _requests_per_batch(server.url, model)))  # fmt: skip
            finally:
                stop(server)
    return rows


def render(rows: Sequence[tuple[str, str, float, float, float, float]], quick: bool) -> str:
    base = {path: rps for label, path, rps, *_ in rows if label == CONFIGS[1][0]}
    lines = [
        BEGIN,
        "## HTTP end to end (`python -m bench.bench_http`)",
        "",
        f"Mode: {'quick' if quick else 'full'}; {cpu_model()}, {os.cpu_count()} logical CPUs; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC. {CLIENTS} concurrent clients, each "
        "sending requests back to back, one sequence of 100 steps per request (JSON); the "
        "load generator runs on the same 2 cores as the server. Baseline: the same server with "
        "`--max-batch-size 1`, i.e. one model call per request.",
        "",
        "| endpoint | server | requests/s | × baseline | p50 ms | p99 ms | requests per batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, path, rps, p50, p99, per_batch in rows:
        lines.append(
            f"| `{path}` | {label} | {rps:,.0f} | {rps / base[path]:.2f}× | {p50 * 1e3:.1f} | "
            f"{p99 * 1e3:.1f} | {per_batch:.1f} |"
        )
    lines += [END, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="few requests (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    args = parser.parse_args(argv)
    section = render(run(args.quick), args.quick)
    write_section(args.out, section, BEGIN, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
