"""The servers the load benchmark measures: rnnserve (one process, and ``--workers N``) and the
naive FastAPI baseline, started for the run or named by URL; the request bodies they get."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final, Literal

import httpx

from bench.load import probe_binary
from bench.load_client import loopback_url
from bench.load_workloads import WORKLOADS, Body, Format, Workload, make_bodies
from bench.naive_server import start_naive_server
from tests.e2e.server import Server, start_server, stop

BASELINE: Final = "baseline"
RNNSERVE: Final = "rnnserve"
WORKERS: Final = "workers"  # rnnserve --workers N (N: Report.workers)
ServerName = Literal["baseline", "rnnserve", "workers"]
READY_TIMEOUT_S = 180.0  # for rnnserve to load and warm its models (--workers: then the workers)


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
