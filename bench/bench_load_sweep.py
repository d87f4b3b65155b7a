"""The load benchmark's open-loop sweep: latency against offered load, the data for
bench.plot_load."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from bench.bench_load_report import ORDER
from bench.bench_load_servers import (
    RNNSERVE,
    ServerName,
    _bodies,
    _configs,
    _detect_binary,
    servers,
)
from bench.load import closed_loop, open_loop
from bench.load_workloads import WORKLOADS, Body, Format, Workload
from bench.models_harness import cpu_model

SWEEP_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25)


def sweep_points(
    url: str,
    w: Workload,
    data: Sequence[Body],
    fmt: Format,
    *,
    clients: int,
    seconds: float,
    fractions: Sequence[float],
    max_outstanding: int = 256,
) -> tuple[float, list[dict[str, Any]]]:
    """Capacity (closed loop, ``clients``), then open loops at ``fractions`` of it."""
    asyncio.run(
        closed_loop(url, w, data, clients=clients, seconds=1.0, max_requests=clients, fmt=fmt)
    )
    capacity = asyncio.run(
        closed_loop(url, w, data, clients=clients, seconds=seconds, fmt=fmt)
    ).requests_per_s
    points = []
    for i, frac in enumerate(fractions):
        rate = max(frac * capacity, 0.1)
        # enough arrivals at low rates to read a p99 from, within 4x the time
        span = min(max(seconds, 30.0 / rate), 4 * seconds)
        r = asyncio.run(
            open_loop(url, w, data, rate=rate, seconds=span, max_outstanding=max_outstanding,
                      seed=i, fmt=fmt)
        )  # fmt: skip
        points.append({**r.summary(), "fraction": frac, "offered_per_s": rate})
    return capacity, points


def sweep(
    *,
    seconds: float,
    clients: int,
    binary: str = "auto",
    workloads: Sequence[str] = ORDER,
    fractions: Sequence[float] = SWEEP_FRACTIONS,
    urls: Mapping[ServerName, str] | None = None,
    baseline_threads: int | None = None,
) -> dict[str, Any]:
    """p50/p99 against offered load for every (workload, server, format); JSON-able."""
    chosen = [WORKLOADS[w] for w in workloads]
    series = []
    with servers(urls, baseline_threads) as up:
        has_binary = _detect_binary(up[RNNSERVE], binary)
        bodies = _bodies(chosen, has_binary)
        for w in chosen:
            for server, fmt in _configs(has_binary):
                capacity, points = sweep_points(
                    up[server], w, bodies[w.name, fmt], fmt,
                    clients=clients, seconds=seconds, fractions=fractions,
                )  # fmt: skip
                series.append(
                    {"workload": w.name, "title": w.describe(), "server": server, "format": fmt,
                     "capacity_per_s": capacity, "points": points}
                )  # fmt: skip
                print(f"bench_load: swept {w.name} {server} {fmt}", file=sys.stderr)
    return {
        "machine": f"{cpu_model()}, {os.cpu_count()} logical CPUs",
        "date": f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC",
        "seconds_per_point": seconds,
        "series": series,
    }
