"""Load benchmark: rnnserve against the naive FastAPI baseline, closed loop, in one run.

Usage::

    python -m bench.bench_load [--quick] [--seconds S] [--repeats R] [--clients N]
                               [--binary auto|yes|no] [--workers N] [--sweep]
                               [--out docs/BENCHMARKS.md]

Servers on loopback, all up for the whole run: ``rnnserve`` with its default settings (one
process), ``bench/naive_server.py`` (plain FastAPI, pydantic lists, FastAPI's JSON response, the
models as plain per-step loops per request and per sequence, rnnserve's weights) and, with
``--workers N``
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
(``bench.load_cpu.process_tree_cpu_seconds``: for ``--workers N`` the supervisor, the engine and
the workers) and of the load generator.

The section of ``docs/BENCHMARKS.md`` between the ``bench_load`` markers holds the figures and the
targets beside them (``TARGET_SPEEDUP`` and ``TARGET_P99_RATIO`` in ``bench.bench_load_report``),
a row per rnnserve configuration and format; for a target not met, the ceiling those CPU costs
set on this machine: for the single process, the one core its event loop runs on; for
``--workers N``, whose N event loops share the cores, the CPU of server and load generator
together against the machine's cores.

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
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from bench.bench_load_report import (
    BEGIN,
    END,
    ORDER,
    Cell,
    Report,
    _label,
    existing_plots,
    render,
)
from bench.bench_load_servers import (
    BASELINE,
    RNNSERVE,
    WORKERS,
    ServerName,
    _baseline_threads,
    _bodies,
    _configs,
    _detect_binary,
    servers,
)
from bench.bench_load_sweep import sweep
from bench.load import closed_loop
from bench.load_cpu import process_tree_cpu_seconds
from bench.load_workloads import WORKLOADS
from bench.models_harness import DEFAULT_OUT, write_section

CLIENTS = 64
DEFAULT_WORKERS = 2 if (os.cpu_count() or 1) >= 2 else 0
SWEEP_DATA = Path("docs/img/load_sweep.json")


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
