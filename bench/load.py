"""Load generator for a running rnnserve (or any server with its API), on loopback only.

Usage::

    python -m bench.load --url http://127.0.0.1:8000 --workload smooth --clients 64 --seconds 20
    python -m bench.load --url http://127.0.0.1:8000 --workload rollout --rate 200 --seconds 20

Two ways to load a server, both bounded in requests and in time, both stopping by themselves:

- **closed loop** (``--clients N``): N clients, each sending its next request as soon as its last
  one is answered. New requests start until ``--seconds`` have passed (or ``--max-requests`` were
  sent); the ones in flight then finish (each within ``--timeout``).
- **open loop** (``--rate R``): requests arrive as a Poisson process of R per second (seeded),
  whether or not earlier ones were answered. At most ``--max-outstanding`` are in flight; an
  arrival beyond that is *dropped* (counted, never sent). An arrival that the generator could
  only send more than 10 ms after its scheduled time is counted *late*. Latency is measured from
  the scheduled arrival, so a slow server is not hidden by a generator that waits for it.

Workloads (request bodies are built, seeded, before the clock starts): ``smooth`` -- ``/smooth``
with one sequence of 50-500 steps x 16 features (lengths uniform per request); ``rollout`` --
``/rollout`` with one sequence of 50-500 steps x 6 inputs; ``smooth4000`` -- ``/smooth`` with one
sequence of 4,000 steps x 16. ``--binary`` sends rnnserve's safetensors format instead of JSON.

Reported: requests/s, timesteps/s, p50/p90/p99 latency of the answered requests, errors by status,
and -- where the server exposes ``rnnserve_batch_requests_*`` and ``rnnserve_batch_sequences_*``
on ``/metrics`` -- the mean requests and sequences per batch during the run.

The client is kept cheap, since it shares the machine with the server it measures: each
connection (HTTP/1.1, kept alive) writes a request built once (head and body) in one call
and reads the answer with httptools (llhttp, uvicorn's parser), which finds its end by its
length without keeping the body -- as ``wrk`` does. It spends less CPU per request than
aiohttp's client, which leaves more of the shared cores to the server; the naive baseline's
figures are the same with either (docs/BENCHMARKS.md has both clients' costs). ``/metrics`` is
read with aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence

import aiohttp
import numpy as np
from safetensors.numpy import load as st_load

from bench.load_client import _Client, _session, loopback_url
from bench.load_results import BatchStats, LoadResult, format_result, read_batch_counters
from bench.load_workloads import BINARY_TYPE, WORKLOADS, Body, Format, Workload, encode, make_bodies

LATE_AFTER_S = 0.010  # an open-loop arrival sent later than this after its time is "late"


# -- the two loops -------------------------------------------------------------------------------


async def _send(
    client: _Client, path: str, body: Body, started: float, result: LoadResult, timeout_s: float
) -> float:
    """POST one body; record its outcome in ``result``; return when it ended."""
    result.sent += 1
    outcome: str
    try:
        outcome = await client.post(path, body, timeout_s)
    except Exception as exc:  # a load generator counts failures; it does not stop
        outcome = type(exc).__name__
    ended = time.perf_counter()
    if outcome == "200":
        result.ok += 1
        result.timesteps += body.steps
        result.latencies.append(ended - started)
    else:
        result.errors[outcome] += 1
    return ended


async def closed_loop(
    url: str,
    workload: Workload,
    bodies: Sequence[Body],
    *,
    clients: int,
    seconds: float,
    max_requests: int | None = None,
    timeout_s: float = 120.0,
    fmt: Format = "json",
) -> LoadResult:
    """``clients`` clients back to back until ``seconds`` pass or ``max_requests`` were sent."""
    if clients < 1 or not bodies:
        raise ValueError("need at least one client and one body")
    result = LoadResult(workload.name, "closed", fmt, clients=clients)
    client = _Client(url)
    async with _session(url, timeout_s) as session:  # /metrics only
        before = await read_batch_counters(session, workload.model)
        start = time.perf_counter()
        stop_at = start + seconds
        issued = 0
        last_end = start

        async def one() -> None:
            nonlocal issued, last_end
            while time.perf_counter() < stop_at and (max_requests is None or issued < max_requests):
                body = bodies[issued % len(bodies)]
                issued += 1
                ended = await _send(
                    client, workload.path, body, time.perf_counter(), result, timeout_s
                )
                last_end = max(last_end, ended)

        try:
            await asyncio.gather(*(one() for _ in range(clients)))
        finally:
            client.close()
        result.seconds = last_end - start
        result.batch = BatchStats.between(
            before, await read_batch_counters(session, workload.model)
        )
    return result


def poisson_arrivals(rate: float, seconds: float, limit: int | None, seed: int) -> list[float]:
    """Arrival times in [0, seconds) of a Poisson process of ``rate`` per second (seeded)."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = np.random.default_rng(seed)
    times: list[float] = []
    t = 0.0
    while limit is None or len(times) < limit:
        t += float(rng.exponential(1.0 / rate))
        if t >= seconds:
            break
        times.append(t)
    return times


async def open_loop(
    url: str,
    workload: Workload,
    bodies: Sequence[Body],
    *,
    rate: float,
    seconds: float,
    max_requests: int | None = None,
    max_outstanding: int = 256,
    timeout_s: float = 120.0,
    seed: int = 0,
    fmt: Format = "json",
) -> LoadResult:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (at most ``max_requests``).

    Arrivals beyond ``max_outstanding`` in flight are dropped. After the last arrival, requests
    still in flight get ``timeout_s`` to finish.
    """
    if max_outstanding < 1 or not bodies:
        raise ValueError("need max_outstanding >= 1 and at least one body")
    arrivals = poisson_arrivals(rate, seconds, max_requests, seed)
    result = LoadResult(workload.name, "open", fmt, rate=rate)
    client = _Client(url)
    async with _session(url, timeout_s) as session:  # /metrics only
        before = await read_batch_counters(session, workload.model)
        tasks: set[asyncio.Task[float]] = set()
        ends: list[float] = []

        def done(task: asyncio.Task[float]) -> None:
            tasks.discard(task)
            if not task.cancelled():
                ends.append(task.result())

        start = time.perf_counter()
        for i, at in enumerate(arrivals):
            due = start + at
            delay = due - time.perf_counter()
            await asyncio.sleep(max(delay, 0.0))  # sleep(0) still lets replies be read
            if time.perf_counter() - due > LATE_AFTER_S:
                result.late += 1
            if len(tasks) >= max_outstanding:
                result.dropped += 1
                continue
            task = asyncio.create_task(
                _send(client, workload.path, bodies[i % len(bodies)], due, result, timeout_s)
            )
            tasks.add(task)
            task.add_done_callback(done)
        if tasks:
            await asyncio.wait(set(tasks))  # each ends within timeout_s
        client.close()
        result.seconds = (max(ends) if ends else time.perf_counter()) - start
        result.batch = BatchStats.between(
            before, await read_batch_counters(session, workload.model)
        )
    return result


async def probe_binary(url: str, workload: Workload) -> bool:
    """Whether the server answers the safetensors format: one request, checked in full."""
    x = np.linspace(-1, 1, 3 * workload.features, dtype=np.float32).reshape(3, -1)
    body = encode(workload, [x, x[:2]], "binary")
    async with _session(url, 30.0) as session:
        try:
            async with session.post(workload.path, data=body.data, headers=body.headers) as r:
                data = await r.read()
                if r.status != 200 or not r.content_type.startswith(BINARY_TYPE):
                    return False
        except (aiohttp.ClientError, TimeoutError):
            return False
    try:
        tensors = st_load(data)
    except Exception:  # anything unreadable means "not supported"
        return False
    # the output rows, whatever the server names them: [3 + 2 steps, out_features]
    return any(t.shape == (5, workload.out_features) for t in tensors.values())


# -- command line --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="loopback server URL")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="smooth")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--clients", type=int, default=64, help="closed loop: concurrent clients")
    loop.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to send requests")
    parser.add_argument("--max-requests", type=int, default=100_000, help="most requests sent")
    parser.add_argument("--max-outstanding", type=int, default=256, help="open loop: in flight")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--binary", action="store_true", help="send safetensors, not JSON")
    parser.add_argument("--bodies", type=int, default=64, help="distinct pre-built bodies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        url = loopback_url(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    workload = WORKLOADS[args.workload]
    fmt: Format = "binary" if args.binary else "json"
    bodies = make_bodies(workload, args.bodies, seed=args.seed, fmt=fmt)
    if args.rate is not None:
        result = asyncio.run(
            open_loop(
                url, workload, bodies, rate=args.rate, seconds=args.seconds,
                max_requests=args.max_requests, max_outstanding=args.max_outstanding,
                timeout_s=args.timeout, seed=args.seed, fmt=fmt,
            )
        )  # fmt: skip
    else:
        result = asyncio.run(
            closed_loop(
                url, workload, bodies, clients=args.clients, seconds=args.seconds,
                max_requests=args.max_requests, timeout_s=args.timeout, fmt=fmt,
            )
        )  # fmt: skip
    print(json.dumps(result.summary()) if args.json else format_result(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
