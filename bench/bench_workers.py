"""Several HTTP workers: what each stage of a request costs, and ``--workers 1`` vs ``2``.

Usage::

    python -m bench.bench_workers [--quick] [--out docs/BENCHMARKS.md]

1. **Stage costs**, in this process, CPU time (``time.process_time``) per request, for the load
   generator's workloads (one sequence of 50–500 steps; ``bench/load.py``): *parse* (JSON bytes
   -> float32 rows, the worker), *transport* (request frame there and result frame back over a
   real Unix socket, both sides' CPU: the echo engine here runs in this process), *model* (pack,
   run, unpack in batches of 64 requests, per request; the engine's worker thread) and
   *serialise* (rows -> JSON bytes, the worker). The transport is also timed per MB.
2. **Measured**: real ``rnnserve --workers 1`` and ``--workers 2`` servers under 64 closed-loop
   clients (``bench.load.closed_loop``), with the CPU seconds each process (and the engine's
   model threads) used during the run, read from ``/proc``. The load generator runs on the same
   two cores, so this shows that two workers lose nothing, not how they scale.
3. **Prediction** for a 16-core host from the measured CPU per request of each process.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from bench.load import closed_loop
from bench.load_workloads import WORKLOADS, Workload, make_bodies
from bench.models_harness import DEFAULT_OUT, cpu_model, write_section
from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.interface import FlatSequences, Limits, Piece, ReloadReport
from rnnserve.service.ipc.engine_side import EngineServer
from rnnserve.service.ipc.worker_side import RemoteRuntime
from tests.e2e.server import Server, start_server, stop

BEGIN = "<!-- bench_workers:begin -->"
END = "<!-- bench_workers:end -->"
CLIENTS = 64
HOST_CORES = 16
LIMITS = Limits(256, 100_000, 1_000_000)


# -- 1. stage costs -------------------------------------------------------------------------------


def cpu_per_call(fn: Callable[[], Any], calls: int, repeats: int) -> float:
    """Median over ``repeats`` of CPU seconds per call of ``fn``."""
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        runs.append((time.process_time() - t0) / calls)
    return statistics.median(runs)


class _Echo:
    """An engine runtime that answers every request with its own rows."""

    def __init__(self) -> None:
        self.models: dict[str, Any] = {}
        self.available = True

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def get(self, name: str) -> Any: ...

    async def infer(self, name: str, sequences: FlatSequences) -> FlatSequences:
        return sequences

    async def open_stream(self, name: str, sequences: FlatSequences) -> AsyncIterator[list[Piece]]:
        raise NotImplementedError("the transport benchmark sends no streams")

    async def reload(self) -> ReloadReport:
        raise NotImplementedError("the transport benchmark reloads nothing")

    def on_models_changed(self, callback: Callable[[], None]) -> None: ...


async def _transport_cost(payloads: list[FlatSequences], calls: int, repeats: int) -> float:
    """CPU seconds per round trip (both sides) over a real socket, one call at a time."""
    with tempfile.TemporaryDirectory() as tmp:
        server = EngineServer(_Echo(), os.path.join(tmp, "engine.sock"))
        await server.start()
        remote = RemoteRuntime(server.path)
        await remote.start()
        remote._models = {"m": None}  # type: ignore[dict-item]  # the echo serves any name
        try:
            runs = []
            for _ in range(repeats + 1):
                t0 = time.process_time()
                for k in range(calls):
                    await remote.infer("m", payloads[k % len(payloads)])
                runs.append((time.process_time() - t0) / calls)
            return statistics.median(runs[1:])
        finally:
            await remote.stop()
            await server.close()


@dataclass
class Stages:
    workload: str
    parse: float
    transport: float
    model: float
    serialise: float
    mb_per_request: float  # float32 payload, request + answer


def stage_costs(workload: Workload, runtime: ModelRuntime, quick: bool) -> Stages:
    calls, repeats = (20, 3) if quick else (200, 7)
    payloads = [b.data for b in make_bodies(workload, 64)]
    served = runtime.get(workload.model)
    decoded = [bodies.decode(b, bodies.JSON, workload.field, LIMITS) for b in payloads]
    assert all(d is not None for d in decoded)
    flats = [d.sequences(served.input_dim, workload.model) for d in decoded if d is not None]
    it = iter(range(10**9))

    def parse() -> None:
        body = payloads[next(it) % len(payloads)]
        d = bodies.decode(body, bodies.JSON, workload.field, LIMITS)
        assert d is not None
        d.sequences(served.input_dim, workload.model)

    module = runtime.models[workload.model].module
    batch_calls = max(2, calls // 20)
    model = cpu_per_call(
        lambda: runtime._compute(workload.model, module, flats, record=False), batch_calls, repeats
    ) / len(flats)
    outputs = [
        o
        for o in runtime._compute(workload.model, module, flats, record=False)
        if isinstance(o, FlatSequences)  # every input is finite: no ItemError
    ]

    def serialise() -> None:
        out = outputs[next(it) % len(outputs)]
        bodies.encode(workload.model, workload.out_field, out, False)

    transport = asyncio.run(_transport_cost(flats, calls, repeats))
    mb = sum(f.data.nbytes + o.data.nbytes for f, o in zip(flats, outputs, strict=True))
    return Stages(
        workload.name,
        cpu_per_call(parse, calls, repeats),
        transport,
        model,
        cpu_per_call(serialise, calls, repeats),
        mb / len(flats) / 2**20,
    )


def transport_per_mb(quick: bool) -> float:
    """CPU seconds per MB moved (request + echo) with 4 MB requests."""
    x = FlatSequences.from_arrays([np.ones((65_536, 16), np.float32)])  # 4 MiB
    per_call = asyncio.run(_transport_cost([x], 5 if quick else 30, 3 if quick else 5))
    return per_call / (2 * x.data.nbytes / 2**20)


# -- 2. measured ----------------------------------------------------------------------------------


def _cpu_seconds(pid: int, tid: int | None = None) -> float:
    where = f"/proc/{pid}/task/{tid}/stat" if tid is not None else f"/proc/{pid}/stat"
    with open(where, encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    own = int(fields[11]) + int(fields[12])  # utime + stime
    if tid is None:
        own += int(fields[13]) + int(fields[14])  # children's, once they are waited for
    return own / ticks


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children", encoding="ascii") as f:
            out += [int(p) for p in f.read().split()]
    return out


def _threads(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def _processes(server: Server) -> dict[str, list[tuple[int, int | None]]]:
    """CPU accounts by role: HTTP (workers, or the single process's main thread), the engine's
    event loop (its main thread) and the model (every other thread of the engine or the single
    process: the models' worker threads and whatever threads they start)."""
    root = server.proc.pid
    found = re.search(r"engine process (\d+) ready", server.log.read_text())
    if found is None:  # one process does everything
        return {
            "http": [(root, root)],
            "engine": [],
            "model": [(root, t) for t in _threads(root) if t != root],
        }
    engine = int(found.group(1))
    return {
        "http": [(p, None) for p in _children(root) if p != engine and _is_spawned(p)],
        "engine": [(engine, engine)],
        "model": [(engine, t) for t in _threads(engine) if t != engine],
    }


def _is_spawned(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"spawn_main" in f.read()  # the engine and the workers, not the tracker


def _cpu_by_role(roles: dict[str, list[tuple[int, int | None]]]) -> dict[str, float]:
    return {role: sum(_cpu_seconds(p, t) for p, t in items) for role, items in roles.items()}


@dataclass
class Measured:
    workers: int
    workload: str
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests_per_batch: float
    cpu_ms: dict[str, float]  # per request: http (all workers), engine (its loop), model


def measure(workers: int, quick: bool) -> list[Measured]:
    seconds = 3.0 if quick else 20.0
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), "--workers", str(workers))
        try:
            for name in ("smooth", "rollout"):
                workload = WORKLOADS[name]
                bodies = make_bodies(workload, 64)
                asyncio.run(closed_loop(server.url, workload, bodies, clients=CLIENTS, seconds=1))
                roles = _processes(server)
                before = _cpu_by_role(roles)
                result = asyncio.run(
                    closed_loop(server.url, workload, bodies, clients=CLIENTS, seconds=seconds)
                )
                after = _cpu_by_role(roles)
                ms = {k: (after[k] - before[k]) / max(result.ok, 1) * 1e3 for k in after}
                batch = result.batch.requests_per_batch if result.batch else float("nan")
                rows.append(
                    Measured(workers, name, result.requests_per_s, result.p(50) * 1e3,
                             result.p(99) * 1e3, batch, ms)
                )  # fmt: skip
        finally:
            stop(server)
    return rows


# -- 3. report ------------------------------------------------------------------------------------


def predict(m: Measured) -> tuple[float, str]:
    """Requests/s on HOST_CORES cores: the tightest of the engine loop, the model thread and
    the workers on the cores left over."""
    http, loop, model = m.cpu_ms["http"], m.cpu_ms["engine"], m.cpu_ms["model"]
    left = HOST_CORES - 2  # one core for the engine's event loop, one for the model thread
    caps = {
        f"workers: {left} cores / {http:.3f} ms": left / http * 1e3,
        f"engine loop: 1 core / {loop:.3f} ms": 1e3 / loop if loop > 0 else float("inf"),
        f"model thread: 1 core / {model:.3f} ms": 1e3 / model if model > 0 else float("inf"),
    }
    limit = min(caps, key=lambda k: caps[k])
    text = "; ".join(f"{k} = {v:,.0f}/s" for k, v in caps.items())
    return caps[limit], f"{text} → bound by the {limit.split(':')[0]}"


def _two_against_one(measured: Sequence[Measured]) -> list[str]:
    """One line per workload: requests/s with two workers over one, and why when it is less."""
    by = {(m.workload, m.workers): m for m in measured}
    lines = []
    for workload in dict.fromkeys(m.workload for m in measured):
        one, two = by.get((workload, 1)), by.get((workload, 2))
        if one is None or two is None or not one.requests_per_s:
            continue
        ratio = two.requests_per_s / one.requests_per_s
        cpu_one = sum(one.cpu_ms.values())
        cpu_two = sum(two.cpu_ms.values())
        line = f"- {workload}: two workers {ratio:.2f}x one's requests/s"
        if ratio < 0.97:
            line += (
                f"; they lose here: each request costs {cpu_two:.3f} ms of server CPU against "
                f"{cpu_one:.3f} (the copy to the engine and back, the engine's loop), and the "
                "cores they would add are the load generator's"
            )
        lines.append(line + ".")
    return lines


def render(
    stages: Sequence[Stages], per_mb: float, measured: Sequence[Measured], quick: bool
) -> str:
    lines = [
        BEGIN,
        "## Several HTTP workers (`python -m bench.bench_workers`)",
        "",
        f"Mode: {'quick' if quick else 'full'}; {cpu_model()}, {os.cpu_count()} logical CPUs; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC. Workloads of `bench/load.py`: one "
        "sequence of 50–500 steps per request (JSON).",
        "",
        "### CPU per request, by stage (in-process, `time.process_time`)",
        "",
        "| workload | parse (worker) | transport (both sides) | model (engine, batches of 64) "
        "| serialise (worker) | float32 moved |",
        "|---|---|---|---|---|---|",
    ]
    for s in stages:
        lines.append(
            f"| {s.workload} | {s.parse * 1e6:,.0f} µs | {s.transport * 1e6:,.0f} µs | "
            f"{s.model * 1e6:,.0f} µs | {s.serialise * 1e6:,.0f} µs | "
            f"{s.mb_per_request * 1024:,.0f} KiB |"
        )
    lines += [
        "",
        f"The transport is a copy into a Unix socket and out of it, each way: {per_mb * 1e3:.2f} "
        "ms of CPU per MB moved (4 MiB requests echoed back, both processes' CPU), next to "
        "parsing the same rows from JSON in the worker; shared memory would save that copy, "
        "and at these sizes it is not worth its bookkeeping.",
        "",
        f"### Measured: `--workers 1` vs `--workers 2`, {CLIENTS} closed-loop clients",
        "",
        "The load generator (`bench.load.closed_loop`) runs on the same "
        f"{os.cpu_count()} cores as the server, so these rows compare two workers with one "
        "on cores that are not free, not how throughput grows with cores. CPU per request is read "
        "from `/proc` for each process and thread over the run: *HTTP* is the workers (with "
        "one process: its main thread, which also runs the batcher), *engine loop* the engine's "
        "main thread (transport, batcher), *model threads* every other thread.",
        "",
        "| workload | workers | requests/s | p50 ms | p99 ms | requests per batch "
        "| CPU ms/request: HTTP | engine loop | model threads |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in measured:
        loop = m.cpu_ms["engine"]
        lines.append(
            f"| {m.workload} | {m.workers} | {m.requests_per_s:,.0f} | {m.p50_ms:.1f} | "
            f"{m.p99_ms:.1f} | {m.requests_per_batch:.1f} | {m.cpu_ms['http']:.3f} | "
            f"{loop:.3f} | {m.cpu_ms['model']:.3f} |"
        )
    lines += ["", *_two_against_one(measured)]
    lines += [
        "",
        f"### Predicted for a {HOST_CORES}-core host",
        "",
        "From the `--workers 2` rows: each HTTP worker is single-threaded, the engine's event "
        "loop and each model's worker thread take one core each, and the workers share the "
        f"other {HOST_CORES - 2} cores (`--workers {HOST_CORES - 2}`). Throughput is the "
        "tightest of the three; on a GPU host the model thread's share shrinks, the rest does "
        "not.",
        "",
    ]
    for m in measured:
        if m.workers == 2:
            rps, arithmetic = predict(m)
            lines.append(f"- {m.workload}: **{rps:,.0f} requests/s** ({arithmetic}).")
    lines += [END, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="short runs (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    args = parser.parse_args(argv)

    async def load() -> ModelRuntime:
        runtime = ModelRuntime(Settings())
        await runtime.start()
        return runtime

    runtime = asyncio.run(load())  # its batchers are never used: _compute runs directly
    bodies.warm_up()
    stages = [stage_costs(WORKLOADS[w], runtime, args.quick) for w in ("smooth", "rollout")]
    per_mb = transport_per_mb(args.quick)
    measured = [m for workers in (1, 2) for m in measure(workers, args.quick)]
    section = render(stages, per_mb, measured, args.quick)
    write_section(args.out, section, BEGIN, END)
    print(section)
    print(orjson.dumps([m.__dict__ for m in measured]).decode(), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
