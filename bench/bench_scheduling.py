"""Continuous against whole-batch scheduling of rollouts, under a mixed load, in one run.

Usage::

    python -m bench.bench_scheduling [--quick] [--seconds S] [--out docs/BENCHMARKS.md]

Two real ``rnnserve`` processes, the same but for ``--rollout-scheduling``. 32 clients
(asyncio + aiohttp, in this process) send ``/rollout`` requests back to back for a fixed time:
90 % of them one sequence of 50 steps, 10 % one of 2,000 steps (a seeded draw per request).
Reported per scheduler: requests/s, timesteps/s, and p50/p90/p99 latency of the short and of the
long requests. Then a probe of head-of-line blocking: one 100,000-step rollout, and once it runs
a 5-step ``/smooth`` and a 5-step ``/rollout``, timed. The load generator shares the machine's
cores with the server.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import orjson

from bench.models_harness import DEFAULT_OUT, cpu_model, write_section
from tests.e2e.server import start_server, stop
from tests.metrics import value

BEGIN = "<!-- bench_scheduling:begin -->"
END = "<!-- bench_scheduling:end -->"
CLIENTS = 32
SHORT, LONG, LONG_SHARE = 50, 2_000, 0.10
SCHEDULERS = ("continuous", "batch")
JSON = {"content-type": "application/json"}


@dataclass
class Result:
    scheduler: str
    seconds: float
    latencies: dict[int, list[float]] = field(default_factory=lambda: {SHORT: [], LONG: []})
    errors: int = 0
    probe: dict[str, float] = field(default_factory=dict)

    def steps(self) -> int:
        return sum(n * len(v) for n, v in self.latencies.items())


def _body(steps: int, seed: int) -> bytes:
    rng = random.Random(seed)
    return orjson.dumps({"inputs": [[[rng.uniform(-1, 1) for _ in range(6)]] * steps]})


async def _mixed_load(url: str, seconds: float, result: Result) -> None:
    bodies = {SHORT: [_body(SHORT, i) for i in range(8)], LONG: [_body(LONG, i) for i in range(4)]}
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as session:
        stop_at = time.perf_counter() + seconds

        async def client(i: int) -> None:
            rng = random.Random(i)
            k = 0
            while time.perf_counter() < stop_at:
                steps = LONG if rng.random() < LONG_SHARE else SHORT
                body = bodies[steps][k % len(bodies[steps])]
                k += 1
                t0 = time.perf_counter()
                async with session.post("/rollout", data=body, headers=JSON) as r:
                    await r.read()
                if r.status == 200:
                    result.latencies[steps].append(time.perf_counter() - t0)
                else:
                    result.errors += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client(i) for i in range(CLIENTS)))
        result.seconds = time.perf_counter() - t0


async def _probe(url: str, result: Result) -> None:
    """A 100,000-step rollout, then a 5-step /smooth and /rollout while it runs."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        long = asyncio.ensure_future(
            client.post("/rollout", content=_body(100_000, 0), headers=JSON)
        )
        for _ in range(3000):  # until it has left the queue and is running
            text = (await client.get("/metrics")).text
            running = value(text, "rnnserve_requests_in_flight", endpoint="rollout") == 1
            if running and value(text, "rnnserve_queue_depth", model="traveller") == 0:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        for name, path, body in (
            ("/smooth, 5 steps", "/smooth", {"sequences": [[[0.1] * 16] * 5]}),
            ("/rollout, 5 steps", "/rollout", {"inputs": [[[0.1] * 6] * 5]}),
        ):
            t0 = time.perf_counter()
            r = await client.post(path, json=body)
            result.probe[name] = time.perf_counter() - t0 if r.status_code == 200 else float("nan")
        t0 = time.perf_counter()
        r = await long
        result.probe["the 100,000-step rollout, after the probes"] = time.perf_counter() - t0
        if r.status_code != 200:
            result.errors += 1


def run(quick: bool, seconds: float) -> list[Result]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for scheduler in SCHEDULERS:
            server = start_server(Path(tmp), "--rollout-scheduling", scheduler)
            try:
                result = Result(scheduler, 0.0)
                asyncio.run(_mixed_load(server.url, 1.0, Result(scheduler, 0.0)))  # warm up
                asyncio.run(_mixed_load(server.url, seconds, result))
                if not quick:
                    asyncio.run(_probe(server.url, result))
                results.append(result)
            finally:
                stop(server)
    return results


def _q(latencies: list[float], p: int) -> float:
    if len(latencies) < 2:
        return latencies[0] * 1e3 if latencies else float("nan")
    return statistics.quantiles(latencies, n=100)[p - 1] * 1e3


def render(results: Sequence[Result], quick: bool, seconds: float) -> str:
    lines = [
        BEGIN,
        "## Continuous against whole-batch scheduling (`python -m bench.bench_scheduling`)",
        "",
        f"Mode: {'quick' if quick else 'full'}; {cpu_model()}, {os.cpu_count()} logical CPUs; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC. {CLIENTS} clients send `/rollout` "
        f"requests back to back for {seconds:.0f} s: {100 - LONG_SHARE * 100:.0f} % one "
        f"sequence of {SHORT} steps, {LONG_SHARE * 100:.0f} % one of {LONG:,} steps. Default "
        "settings otherwise (chunks of 64 steps; max 64 sequences running). The load generator "
        "shares the 2 cores with the server.",
        "",
        "| scheduler | requests/s | timesteps/s | short p50 ms | short p90 ms | short p99 ms "
        "| long p50 ms | long p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n = sum(len(v) for v in r.latencies.values())
        s, g = r.latencies[SHORT], r.latencies[LONG]
        lines.append(
            f"| {r.scheduler} | {n / r.seconds:,.0f} | {r.steps() / r.seconds:,.0f} | "
            f"{_q(s, 50):.0f} | {_q(s, 90):.0f} | {_q(s, 99):.0f} | {_q(g, 50):.0f} | "
            f"{_q(g, 99):.0f} | {r.errors} |"
        )
    by = {r.scheduler: r for r in results}
    if set(by) == set(SCHEDULERS):
        c, b = by["continuous"], by["batch"]
        ratio = _q(c.latencies[SHORT], 99) / _q(b.latencies[SHORT], 99)
        steps_ratio = (c.steps() / c.seconds) / (b.steps() / b.seconds)
        lines += [
            "",
            f"Short rollouts' p99, continuous / batch: **{ratio:.2f}** (target ≤ 0.25); "
            f"timesteps/s, continuous / batch: **{steps_ratio:.2f}** (target ≥ 1).",
        ]
    if any(r.probe for r in results):
        lines += [
            "",
            "Head-of-line probe: one 100,000-step `/rollout`; once it runs, one short request "
            "of each kind, sent one after the other (target: the `/smooth` within 50 ms).",
            "",
            "| scheduler | " + " | ".join(f"{k} ms" for k in results[0].probe) + " |",
            "|---|" + "---|" * len(results[0].probe),
        ]
        for r in results:
            lines.append(
                f"| {r.scheduler} | "
                + " | ".join(f"{v * 1e3:,.0f}" for v in r.probe.values())
                + " |"
            )
    lines += [END, ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="a few seconds, no probe (smoke)")
    parser.add_argument("--seconds", type=float, default=None, help="load time per scheduler")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    args = parser.parse_args(argv)
    seconds = args.seconds if args.seconds is not None else (2.0 if args.quick else 30.0)
    section = render(run(args.quick, seconds), args.quick, seconds)
    write_section(args.out, section, BEGIN, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
