"""The load benchmark's figures (a cell per workload, server and format; the report) and its
section of docs/BENCHMARKS.md, with the targets and, for a target not met, the CPU ceiling."""

from __future__ import annotations

import datetime as dt
import math
import os
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal

from bench.bench_load_servers import BASELINE, RNNSERVE, WORKERS, ServerName
from bench.load_results import LoadResult
from bench.load_workloads import WORKLOADS, Format, Workload
from bench.models_harness import cpu_model
from rnnserve.service.config import Settings

BEGIN = "<!-- bench_load:begin -->"
END = "<!-- bench_load:end -->"
ORDER = ("smooth", "rollout", "smooth4000")
# The targets: rnnserve's requests/s over the baseline's, and p99 at most 1/15 of its.
TARGET_SPEEDUP = {"smooth": 25.0, "rollout": 30.0, "smooth4000": 100.0}
TARGET_P99_RATIO = 1 / 15


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
        "default JSON response, and the models as plain per-step loops run per request and per "
        "sequence (a "
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
