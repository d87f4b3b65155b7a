"""Load benchmark: rnnserve against the naive FastAPI baseline, closed loop, in one run.

Usage::

    python -m bench.bench_load [--quick] [--seconds S] [--repeats R] [--clients N]
                               [--binary auto|yes|no] [--workers N] [--sweep]
                               [--out docs/BENCHMARKS.md]

Servers on loopback, all up for the whole run: ``rnnserve`` with its default settings (one
process), ``bench/naive_server.py`` (plain FastAPI, pydantic lists, FastAPI's JSON response, the
seeds' model code per request and per sequence, rnnserve's weights) and, with ``--workers N``
(N >= 2; the default is 2 on a machine with 2 CPUs or more, ``--workers 0`` leaves it out),
``rnnserve --workers N``: a supervisor, one engine process running the models and N uvicorn HTTP
worker processes (``service/cli.py``), in the rows labelled ``rnnserve --workers N``.

For each workload of ``bench/load.py`` (``/smooth`` 50-500 steps x 16, ``/rollout`` 50-500 steps
x 6, ``/smooth`` 4,000 steps x 16), 64 clients send requests back to back
(``bench.load.closed_loop``) for ``--seconds`` per cell, with the same request bodies for every
server; runs are interleaved (every cell once, then every cell again) and each cell reports the
median of its runs. When rnnserve answers its binary format (``Content-Type:
application/x-safetensors``), its binary rows are measured too, for each rnnserve configuration.
Each run also reads, per answered request, the CPU time of the server's whole process tree
(``bench.load.process_tree_cpu_seconds``: for ``--workers N`` the supervisor, the engine and the
workers) and of the load generator.

The section of ``docs/BENCHMARKS.md`` between the ``bench_load`` markers holds the figures and the
issue's targets beside them, a row per rnnserve configuration and format; for a target not met,
the ceiling those CPU costs set on this machine: for the single process, the one core its event
loop runs on; for ``--workers N``, whose N event loops share the cores, the CPU of server and load
generator together against the machine's cores.

``--rnnserve-url`` with ``--baseline-url`` loads servers started elsewhere instead (no server CPU
then); ``--rnnserve-workers-url`` adds a running ``rnnserve --workers N``, N given by
``--workers``.

``--sweep`` also runs the open-loop sweep (Poisson arrivals at fractions of each server's measured
capacity; the baseline and the default rnnserve only, not ``--workers``), writes its data to
``docs/img/load_sweep.json`` and, where matplotlib is installed, the plots (``python -m
bench.plot_load`` makes them from that data alone). The load generator runs on the same cores as
the servers.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

import httpx

from bench.load import (
    WORKLOADS,
    Body,
    Format,
    LoadResult,
    Workload,
    closed_loop,
    loopback_url,
    make_bodies,
    open_loop,
    probe_binary,
    process_tree_cpu_seconds,
)
from bench.models_harness import DEFAULT_OUT, cpu_model, write_section
from bench.naive_server import start_naive_server
from rnnserve.service.config import Settings
from tests.e2e.server import Server, start_server, stop

BEGIN = "<!-- bench_load:begin -->"
END = "<!-- bench_load:end -->"
CLIENTS = 64
ORDER = ("smooth", "rollout", "smooth4000")
# The targets: rnnserve's requests/s over the baseline's, and p99 at most 1/15 of its.
TARGET_SPEEDUP = {"smooth": 25.0, "rollout": 30.0, "smooth4000": 100.0}
TARGET_P99_RATIO = 1 / 15
BASELINE: Final = "baseline"
RNNSERVE: Final = "rnnserve"
WORKERS: Final = "workers"  # rnnserve --workers N (N: Report.workers)
ServerName = Literal["baseline", "rnnserve", "workers"]
DEFAULT_WORKERS = 2 if (os.cpu_count() or 1) >= 2 else 0
SWEEP_FRACTIONS = (0.1, 0.25, 0.5, 0.75, 0.9, 1.0, 1.25)
SWEEP_DATA = Path("docs/img/load_sweep.json")
READY_TIMEOUT_S = 180.0  # for rnnserve to load and warm its models (--workers: then the workers)


def _median(values: Iterable[float]) -> float:
    """The median of the values that are not NaN; NaN if none is."""
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


@dataclass
class Cell:
    """One workload against one server in one format, over several runs."""

    workload: str
    server: ServerName
    fmt: Format
    runs: list[LoadResult] = field(default_factory=list)
    # CPU seconds per answered request, one figure per run: the server's process tree (every
    # process and thread; NaN when it was started outside the benchmark) and the load generator
    server_cpu: list[float] = field(default_factory=list)
    client_cpu: list[float] = field(default_factory=list)

    def median(self, f: Callable[[LoadResult], float]) -> float:
        return _median(map(f, self.runs))

    @property
    def rps(self) -> float:
        return self.median(lambda r: r.requests_per_s)

    @property
    def steps_per_s(self) -> float:
        return self.median(lambda r: r.timesteps_per_s)

    def p(self, q: float) -> float:
        return self.median(lambda r: r.p(q))

    @property
    def errors(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for r in self.runs:
            total.update(r.errors)
        return total

    @property
    def server_cpu_s(self) -> float:
        return _median(self.server_cpu)

    @property
    def client_cpu_s(self) -> float:
        return _median(self.client_cpu)

    def per_batch(self, what: Literal["requests", "sequences"]) -> float:
        def one(r: LoadResult) -> float:
            if r.batch is None:
                return math.nan
            return r.batch.requests_per_batch if what == "requests" else r.batch.sequences_per_batch

        return self.median(one)


@dataclass
class Report:
    cells: list[Cell]
    clients: int
    seconds: float
    repeats: int
    quick: bool
    binary: bool  # rnnserve answered the binary format, and its rows were measured
    workers: int = 0  # N of the "rnnserve --workers N" rows; 0: none measured
    baseline_threads: int | None = None
    threads_how: str = "torch's default"
    notes: list[str] = field(default_factory=list)

    def cell(self, workload: str, server: ServerName, fmt: Format = "json") -> Cell | None:
        return next(
            (
                c
                for c in self.cells
                if (c.workload, c.server, c.fmt) == (workload, server, fmt) and c.runs
            ),
            None,
        )


@contextmanager
def servers(
    urls: Mapping[ServerName, str] | None = None,
    baseline_threads: int | None = None,
    pids: dict[ServerName, int] | None = None,
    workers: int = 0,
) -> Iterator[dict[ServerName, str]]:
    """URLs of rnnserve (default settings), of the naive baseline and, when ``workers`` >= 2, of
    rnnserve with ``--workers <workers>`` (the rest default), all up for the whole block.

    They are started here (and stopped at the end) unless ``urls`` names running ones (the
    workers server only where ``urls`` has one); the process ids of those started here go into
    ``pids`` (for ``--workers``: the supervisor's, the root of its process tree).
    """
    if urls is not None:
        yield {name: loopback_url(url) for name, url in urls.items()}
        return
    if workers == 1 or workers < 0:
        raise ValueError("workers: 0 (no such server) or at least 2")
    started: dict[ServerName, Server] = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            # a loaded or niced machine may take more than the tests' minute to warm up
            started[RNNSERVE] = start_server(Path(tmp), ready_timeout_s=READY_TIMEOUT_S)
            if workers:
                started[WORKERS] = start_server(
                    Path(tmp), "--workers", str(workers), ready_timeout_s=READY_TIMEOUT_S
                )
            started[BASELINE] = start_naive_server(Path(tmp), torch_threads=baseline_threads)
            if pids is not None:
                pids.update({name: server.proc.pid for name, server in started.items()})
            yield {name: server.url for name, server in started.items()}
        finally:
            for server in started.values():
                stop(server)


def _configs(binary: bool, workers: bool = False) -> list[tuple[ServerName, Format]]:
    """(server, format) in the order each round of the benchmark measures them."""
    fmts: list[Format] = ["json", "binary"] if binary else ["json"]
    ours: list[ServerName] = [RNNSERVE, WORKERS] if workers else [RNNSERVE]
    return [(BASELINE, "json"), *((s, f) for s in ours for f in fmts)]


def _bodies(workloads: Sequence[Workload], binary: bool) -> dict[tuple[str, Format], list[Body]]:
    fmts: list[Format] = ["json", "binary"] if binary else ["json"]
    return {
        (w.name, f): make_bodies(w, 64, seed=i, fmt=f)
        for i, w in enumerate(workloads)
        for f in fmts
    }


def _detect_binary(url: str, want: str) -> bool:
    if want == "no":
        return False
    ok = all(asyncio.run(probe_binary(url, WORKLOADS[w])) for w in ("smooth", "rollout"))
    if want == "yes" and not ok:
        raise SystemExit("bench_load: --binary yes, but rnnserve does not answer safetensors")
    return ok


def _baseline_threads(url: str) -> int | None:
    threads = httpx.get(f"{url}/readyz", timeout=5).json().get("torch_threads")
    return int(threads) if isinstance(threads, int) else None


def run(
    *,
    quick: bool,
    seconds: float,
    repeats: int,
    clients: int,
    binary: str = "auto",
    workloads: Sequence[str] = ORDER,
    warmup_s: float = 1.0,
    urls: Mapping[ServerName, str] | None = None,
    baseline_threads: int | None = None,
    workers: int = 0,
) -> Report:
    """Measure every (workload, server, format) cell ``repeats`` times, interleaved.

    ``workers`` >= 2 adds the rows of rnnserve started with ``--workers <workers>`` (with
    ``urls``: only where they name its URL under ``"workers"``).
    """
    chosen = [WORKLOADS[w] for w in workloads]
    pids: dict[ServerName, int] = {}
    if urls is not None and WORKERS in urls and workers < 2:
        raise ValueError("a running --workers server needs workers >= 2 (its N, for the rows)")
    with servers(urls, baseline_threads, pids, workers) as up:
        has_binary = _detect_binary(up[RNNSERVE], binary)
        has_workers = WORKERS in up
        bodies = _bodies(chosen, has_binary)
        report = Report([], clients, seconds, repeats, quick, has_binary)
        report.workers = workers if has_workers else 0
        report.baseline_threads = _baseline_threads(up[BASELINE])
        if baseline_threads is not None:
            report.threads_how = "set with `--baseline-torch-threads`"
        elif urls is not None:
            report.threads_how = "a server started outside the benchmark"
        elif "OMP_NUM_THREADS" in os.environ:
            report.threads_how = f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
        configs = _configs(has_binary, has_workers)
        cells = {(w.name, s, f): Cell(w.name, s, f) for w in chosen for s, f in configs}
        report.cells = list(cells.values())
        for rep in range(repeats):
            for w in chosen:
                for server, fmt in configs:
                    url, data = up[server], bodies[w.name, fmt]
                    if rep == 0:  # connections, first calls, allocator: not timed
                        asyncio.run(
                            closed_loop(url, w, data, clients=clients, seconds=warmup_s,
                                        max_requests=clients, fmt=fmt)
                        )  # fmt: skip
                    pid = pids.get(server)  # the whole tree: supervisor, engine and workers
                    server_before = process_tree_cpu_seconds(pid) if pid is not None else None
                    client_before = time.process_time()
                    result = asyncio.run(
                        closed_loop(url, w, data, clients=clients, seconds=seconds,
                                    max_requests=1_000_000, fmt=fmt)
                    )  # fmt: skip
                    client = time.process_time() - client_before
                    server_after = process_tree_cpu_seconds(pid) if pid is not None else None
                    cell = cells[w.name, server, fmt]
                    cell.runs.append(result)
                    answered = max(result.ok, 1)
                    cell.client_cpu.append(client / answered)
                    cell.server_cpu.append(
                        (server_after - server_before) / answered
                        if server_before is not None and server_after is not None
                        else math.nan
                    )
                    print(
                        f"bench_load: {w.name} {_label(server, fmt, report.workers)} run "
                        f"{rep + 1}/{repeats}: "
                        f"{result.requests_per_s:,.1f} requests/s, p99 "
                        f"{result.p(99) * 1e3:,.0f} ms, errors {dict(result.errors) or 0}",
                        file=sys.stderr,
                    )
    return report


# -- the open-loop sweep (data for bench.plot_load) ------------------------------------------------


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


# -- the markdown section --------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return "–" if math.isnan(seconds) else f"{seconds * 1e3:,.1f}"


def _num(x: float, digits: int = 1) -> str:
    return "–" if math.isnan(x) else f"{x:,.{digits}f}"


def _label(server: ServerName, fmt: Format, workers: int = 0) -> str:
    if server == BASELINE:
        return "naive FastAPI (baseline)"
    return f"rnnserve --workers {workers}, {fmt}" if server == WORKERS else f"rnnserve, {fmt}"


def _ours(report: Report) -> list[tuple[ServerName, Format]]:
    """rnnserve's configurations and formats in this report, in the tables' order."""
    fmts: list[Format] = ["json", "binary"] if report.binary else ["json"]
    servers: list[ServerName] = [RNNSERVE, WORKERS] if report.workers else [RNNSERVE]
    return [(s, f) for s in servers for f in fmts]


def _met(report: Report, w: str, fmt: Format, server: ServerName = RNNSERVE) -> bool | None:
    base, ours = report.cell(w, BASELINE), report.cell(w, server, fmt)
    if base is None or ours is None or not base.rps > 0 or not base.p(99) > 0:
        return None
    speed = ours.rps / base.rps >= TARGET_SPEEDUP[w]
    return speed and ours.p(99) / base.p(99) <= TARGET_P99_RATIO


def _ceilings(report: Report, fmt: Format, server: ServerName = RNNSERVE) -> list[str]:
    """For each target not met: the most requests/s the measured CPU costs allow here."""
    lines = []
    for w in ORDER:
        base, ours = report.cell(w, BASELINE), report.cell(w, server, fmt)
        if _met(report, w, fmt, server) is not False or base is None or ours is None:
            continue
        cpu, client = ours.server_cpu_s, ours.client_cpu_s
        if math.isnan(cpu) or cpu <= 0:
            continue
        cores = os.cpu_count() or 1
        shared = cores / (cpu + client) if not math.isnan(client) else math.nan
        if server == WORKERS:
            n = report.workers
            lines.append(
                f"- {WORKLOADS[w].describe()}, `--workers {n}`, {fmt}, not met: rnnserve's "
                f"processes (supervisor, engine and {n} HTTP workers together) used "
                f"{cpu * 1e3:.2f} ms of CPU per request and the load generator "
                f"{client * 1e3:.2f} ms. Each worker runs its own event loop, so one loop's "
                f"core does not cap it; server and load generator together cap it at "
                f"{_num(shared, 0)} requests/s = {_num(shared / base.rps, 0)}× the baseline on "
                f"this {cores}-core machine, against the {TARGET_SPEEDUP[w]:.0f}× target"
                + (
                    ": that CPU would allow the target, so it is not what held this row back."
                    if shared / base.rps >= TARGET_SPEEDUP[w]
                    else "."
                )
            )
            continue
        head = (
            f"- {WORKLOADS[w].describe()}, {fmt}, not met: rnnserve's process used "
            f"{cpu * 1e3:.2f} ms of CPU per request and the load generator {client * 1e3:.2f} "
            "ms. "
        )
        if fmt == "json" and _json_body_bytes(WORKLOADS[w]) >= CODEC_OFFLOAD_BYTES:
            lines.append(
                head + f"Its JSON bodies (about {_json_body_bytes(WORKLOADS[w]) // 1024} KiB) "
                "are read and written on codec threads beside the event loop, so one core does "
                f"not cap it; server and load generator together cap it at {_num(shared, 0)} "
                f"requests/s = {_num(shared / base.rps, 0)}× the baseline on this {cores}-core "
                f"machine, against the {TARGET_SPEEDUP[w]:.0f}× target"
                + (
                    ": that CPU would allow the target, so it is not what held this row back."
                    if shared / base.rps >= TARGET_SPEEDUP[w]
                    else "."
                )
            )
            continue
        one_core = 1 / cpu  # one process: its event loop parses and writes on one core
        lines.append(
            head + "One process runs its event loop (parsing and writing) on one core, which "
            f"caps it at {one_core:,.0f} requests/s = {one_core / base.rps:.0f}× the baseline; "
            "even with the server spread over every core, server and load generator together "
            f"would cap it at {_num(shared, 0)} requests/s = {_num(shared / base.rps, 0)}× on "
            f"this {cores}-core machine, against the {TARGET_SPEEDUP[w]:.0f}× target."
        )
    return lines


def _json_body_bytes(workload: Workload) -> int:
    """About the largest JSON body of ``workload`` (12 bytes a float32 number)."""
    return 12 * workload.max_steps * workload.features


# rnnserve's default: JSON bodies this large are parsed and written on codec threads
CODEC_OFFLOAD_BYTES: Final[int] = Settings.model_fields["codec_offload_bytes"].default


def _target_rows(report: Report, fmt: Format, server: ServerName = RNNSERVE) -> list[str]:
    rows = []
    how = f"`--workers {report.workers}`" if server == WORKERS else "default"
    for w in ORDER:
        base, ours = report.cell(w, BASELINE), report.cell(w, server, fmt)
        if base is None or ours is None:
            continue
        speedup = ours.rps / base.rps if base.rps > 0 else math.nan
        p99_ratio = ours.p(99) / base.p(99) if base.p(99) > 0 else math.nan
        inverse = 1 / p99_ratio if p99_ratio > 0 else math.nan
        met = "yes" if _met(report, w, fmt, server) else "no"
        rows.append(
            f"| {WORKLOADS[w].describe()} | {how} | {fmt} | **{_num(speedup)}×** | "
            f"≥ {TARGET_SPEEDUP[w]:.0f}× | **1/{_num(inverse)}** | ≤ 1/15 | {met} |"
        )
    return rows


def render(report: Report, plots: dict[str, str] | None = None) -> str:
    """The ``bench_load`` section; ``plots`` maps workload -> image path relative to the doc."""
    workers = (
        f"; the rows `rnnserve --workers {report.workers}` are rnnserve started with "
        f"`--workers {report.workers}` (the rest default): a supervisor, one engine process "
        f"that runs the models and {report.workers} uvicorn HTTP worker processes that parse "
        "and answer, each with its own event loop"
        if report.workers
        else ""
    )
    n = report.workers
    tree = f"; for `--workers {n}`: the supervisor, the engine and the {n} workers" if n else ""
    threads = (
        f"{report.baseline_threads} torch threads ({report.threads_how})"
        if report.baseline_threads is not None
        else "torch's default threads"
    )
    lines = [
        BEGIN,
        "## Load: rnnserve against a naive FastAPI endpoint (`python -m bench.bench_load`)",
        "",
        f"Mode: {'quick' if report.quick else 'full'}; {cpu_model()}, {os.cpu_count()} logical "
        f"CPUs; {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC. Closed loop: {report.clients} "
        f"clients send requests back to back for {report.seconds:g} s per cell; cells are run "
        f"interleaved and each figure is the median of {report.repeats} run(s). Request bodies "
        "are built before timing; latencies are of answered (200) requests. **The load "
        "generator (`bench/load.py`: asyncio; requests written whole, answers read by "
        "httptools, as `wrk` does) runs on the same cores as the server.** "
        "rnnserve runs with its default settings (dynamic batching, one torch thread in its "
        f"model worker){workers}. The baseline, `bench/naive_server.py`, is what one writes "
        "without rnnserve: plain FastAPI, a pydantic body of `list[list[list[float]]]`, FastAPI's "
        "default JSON response, and the seeds' model code run per request and per sequence (a "
        "Python loop over steps for the smoother; `nn.LSTM` called once per step for the "
        f"Traveller) with rnnserve's weights, in FastAPI's thread pool with {threads}. Batch "
        "sizes are read from rnnserve's `/metrics` (the baseline has none).",
        "",
        "Server CPU is the server's whole process tree per answered request (every process and "
        f"thread{tree}), read from `/proc` before and after each run; the load generator's is "
        "this benchmark's process.",
        "",
        "| workload | server | requests/s | timesteps/s | p50 ms | p90 ms | p99 ms | errors "
        "| requests/batch | sequences/batch | server CPU ms/request | load generator CPU "
        "ms/request |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report.cells:
        if not c.runs:
            continue
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(c.errors.items())) or "0"
        lines.append(
            f"| {WORKLOADS[c.workload].describe()} | {_label(c.server, c.fmt, report.workers)} | "
            f"{_num(c.rps)} | {_num(c.steps_per_s, 0)} | {_ms(c.p(50))} | {_ms(c.p(90))} | "
            f"{_ms(c.p(99))} | {errors} | {_num(c.per_batch('requests'))} | "
            f"{_num(c.per_batch('sequences'))} | {_num(c.server_cpu_s * 1e3, 2)} | "
            f"{_num(c.client_cpu_s * 1e3, 2)} |"
        )
    lines += [
        "",
        "### Against the targets",
        "",
        "rnnserve's requests/s over the baseline's, and its p99 latency as a fraction of the "
        "baseline's, under the same closed-loop load: a row per rnnserve configuration "
        "(default: one process) and format.",
        "",
        "| workload | rnnserve | format | requests/s × baseline | target | p99 vs baseline | "
        "target | met |",
        "|---|---|---|---|---|---|---|---|",
        *(row for server, fmt in _ours(report) for row in _target_rows(report, fmt, server)),
    ]
    ceilings = [line for server, fmt in _ours(report) for line in _ceilings(report, fmt, server)]
    if ceilings:
        lines += ["", *ceilings]
    if not report.binary:
        lines += [
            "",
            "rnnserve did not answer the binary format (`application/x-safetensors`) in this "
            "run, so only JSON was measured.",
        ]
    lines += ["", "### Latency against offered load", ""]
    if plots:
        lines += [
            "Open loop: Poisson arrivals at fractions of each server's closed-loop capacity "
            "(at most 256 requests in flight; arrivals beyond that are dropped), latency "
            "measured from each request's scheduled arrival. Made by "
            "`python -m bench.plot_load --out docs/img/`.",
            "",
        ]
        for w, path in plots.items():
            lines += [f"![{WORKLOADS[w].describe()}]({path})", ""]
        lines.pop()
    else:
        lines.append(
            "No plots in this run: `python -m bench.plot_load --out docs/img/` measures the "
            "open-loop sweep and draws them (needs matplotlib, the `bench` extra)."
        )
    lines += [*(["", *report.notes] if report.notes else []), END, ""]
    return "\n".join(lines)


def existing_plots(out: Path, img_dir: Path) -> dict[str, str]:
    """Workload -> the plot's path relative to ``out``, for the plots that exist."""
    found = {}
    for w in ORDER:
        png = img_dir / f"load_{w}.png"
        if png.is_file():
            found[w] = Path(os.path.relpath(png, out.parent)).as_posix()
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a few seconds (a smoke test)")
    parser.add_argument("--seconds", type=float, default=None, help="load time per cell and run")
    parser.add_argument("--repeats", type=int, default=None, help="runs per cell (median)")
    parser.add_argument("--clients", type=int, default=None, help="closed-loop clients")
    parser.add_argument("--workloads", nargs="+", choices=ORDER, default=list(ORDER))
    parser.add_argument(
        "--binary", choices=("auto", "yes", "no"), default="auto",
        help="also measure rnnserve's safetensors format (auto: when the server answers it)",
    )  # fmt: skip
    parser.add_argument("--sweep", action="store_true", help="also the open-loop sweep + plots")
    parser.add_argument("--rnnserve-url", help="a running rnnserve to load instead of starting one")
    parser.add_argument("--baseline-url", help="a running naive baseline (with --rnnserve-url)")
    parser.add_argument(
        "--workers", type=int, default=DEFAULT_WORKERS, metavar="N",
        help="also measure rnnserve started with --workers N (N >= 2; 0: not; default: "
        f"{DEFAULT_WORKERS}, i.e. 2 where the machine has 2 CPUs or more)",
    )  # fmt: skip
    parser.add_argument(
        "--rnnserve-workers-url",
        help="a running rnnserve --workers N (N: --workers) for those rows; with --rnnserve-url",
    )
    parser.add_argument(
        "--baseline-torch-threads", type=int, default=None,
        help="torch threads of the baseline it starts (default: torch's own choice)",
    )  # fmt: skip
    parser.add_argument("--img-dir", type=Path, default=SWEEP_DATA.parent, help="plots folder")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    args = parser.parse_args(argv)
    if (args.rnnserve_url is None) != (args.baseline_url is None):
        parser.error("--rnnserve-url and --baseline-url go together")
    if args.workers == 1 or args.workers < 0:
        parser.error("--workers: 0 (no such rows) or at least 2 (the default rows are 1 process)")
    if args.rnnserve_workers_url is not None and (args.rnnserve_url is None or not args.workers):
        parser.error("--rnnserve-workers-url goes with --rnnserve-url and --workers N >= 2")
    urls: dict[ServerName, str] | None = (
        {RNNSERVE: args.rnnserve_url, BASELINE: args.baseline_url} if args.rnnserve_url else None
    )
    if urls is not None and args.rnnserve_workers_url is not None:
        urls[WORKERS] = args.rnnserve_workers_url
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 15.0)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 2)
    clients = args.clients if args.clients is not None else (8 if args.quick else CLIENTS)
    report = run(
        quick=args.quick, seconds=seconds, repeats=repeats, clients=clients,
        binary=args.binary, workloads=args.workloads, warmup_s=0.5 if args.quick else 1.0,
        urls=urls, baseline_threads=args.baseline_torch_threads, workers=args.workers,
    )  # fmt: skip
    if args.sweep:
        data = sweep(seconds=seconds, clients=clients, binary=args.binary,
                     workloads=args.workloads, urls=urls,
                     baseline_threads=args.baseline_torch_threads)  # fmt: skip
        args.img_dir.mkdir(parents=True, exist_ok=True)
        (args.img_dir / "load_sweep.json").write_text(json.dumps(data, indent=1) + "\n")
        from bench.plot_load import plot

        try:
            plot(data, args.img_dir)
        except ImportError as exc:  # matplotlib is in the `bench` extra only
            report.notes.append(f"Sweep measured; plots not drawn ({exc}).")
    section = render(report, existing_plots(args.out, args.img_dir))
    write_section(args.out, section, BEGIN, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
