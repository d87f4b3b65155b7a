"""Two rnnserve builds or settings under the same load, rounds interleaved: did a change regress?

Each side is a command that starts rnnserve (``--port`` is added) with an optional ``PYTHONPATH``
(another checkout's folder); both run on this machine, one at a time, in alternating rounds so
that drift in the machine's speed falls on both. The load is closed (``--clients N``, each
sending its next request when its last is answered) or open (``--rate R``: Poisson arrivals at
R per second, latency from each arrival's scheduled time, as ``bench/load.py`` does). Per
workload: each side's median requests/s, p50, p99, requests per batch, server CPU time per
answered request and (open loop) arrivals dropped at ``open_loop``'s in-flight bound, over the
rounds, and B's over A's. The CPU time (the server process's user + system time, from
``/proc``) moves much less than throughput when other work shares the machine, so it tells a
small regression from noise where requests/s cannot.

Run: ``.venv/bin/python -m bench.bench_ab --a-command "rnnserve-old" --a-path /tmp/old
--b-command .venv/bin/rnnserve`` (workloads and formats as ``bench/load.py`` names them); a
setting against the default: ``--a-command .venv/bin/rnnserve --b-command ".venv/bin/rnnserve
--max-delay-ms 0"``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.load import closed_loop, open_loop
from bench.load_results import LoadResult
from bench.load_workloads import WORKLOADS, Body, make_bodies
from tests.e2e.server import free_port


@dataclass
class Side:
    name: str
    command: list[str]
    pythonpath: str | None


def absolute(command: list[str]) -> list[str]:
    """The servers run from ``/`` (no checkout on their path): a relative program made absolute."""
    program = command[0]
    # not Path.resolve: a virtual environment's python is a symlink, and only its own path
    # finds the environment's packages
    return [os.path.abspath(program) if "/" in program else program, *command[1:]]


def start(side: Side, timeout_s: float = 120.0) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    if side.pythonpath:
        env["PYTHONPATH"] = side.pythonpath
    proc = subprocess.Popen(
        [*side.command, "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd="/",
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{side.name} did not become ready")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Load:
    """Closed loop of ``clients`` or, with ``rate`` set, open loop at ``rate`` requests/s."""

    clients: int
    rate: float | None = None

    def run(
        self, url: str, workload_name: str, bodies: Sequence[Body], seconds: float
    ) -> LoadResult:
        workload = WORKLOADS[workload_name]
        run: Coroutine[None, None, LoadResult]
        if self.rate is None:
            run = closed_loop(url, workload, bodies, clients=self.clients, seconds=seconds)
        else:
            run = open_loop(url, workload, bodies, rate=self.rate, seconds=seconds)
        return asyncio.run(run)

    def __str__(self) -> str:
        return f"{self.clients} clients" if self.rate is None else f"open loop at {self.rate:g}/s"


@dataclass(frozen=True)
class Figures:
    """One side's run of one workload."""

    requests_per_s: float
    p50_ms: float
    p99_ms: float
    requests_per_batch: float
    cpu_ms_per_request: float
    dropped: float = 0.0  # open loop: arrivals not sent, its in-flight bound reached


def one_round(side: Side, workloads: list[str], load: Load, seconds: float) -> dict[str, Figures]:
    """Start ``side``, warm it, load each workload; its figures per workload."""
    proc, url = start(side)
    try:
        out = {}
        for name in workloads:
            bodies = make_bodies(WORKLOADS[name], 64)
            load.run(url, name, bodies, 1.0)
            cpu = cpu_seconds(proc.pid)
            r = load.run(url, name, bodies, seconds)
            cpu = cpu_seconds(proc.pid) - cpu
            if r.errors:
                raise RuntimeError(f"{side.name} answered errors on {name}: {dict(r.errors)}")
            per_batch = r.batch.requests_per_batch if r.batch else float("nan")
            out[name] = Figures(
                r.requests_per_s,
                r.p(50) * 1e3,
                r.p(99) * 1e3,
                per_batch,
                1e3 * cpu / max(r.ok, 1),
                r.dropped,
            )
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def medians(runs: list[Figures]) -> Figures:
    """Each figure's median over the rounds."""
    return Figures(
        *(statistics.median(getattr(r, f) for r in runs) for f in Figures.__dataclass_fields__)
    )


def table(runs: dict[str, dict[str, list[Figures]]], workloads: list[str]) -> list[str]:
    """The markdown table of each workload's medians, A's and B's side by side."""
    lines = [
        "| workload | A requests/s | B requests/s | B/A | A p50 ms | B p50 ms | A p99 ms "
        "| B p99 ms | A requests/batch | B requests/batch | A CPU ms/req | B CPU ms/req "
        "| B/A CPU | A dropped | B dropped |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in workloads:
        a, b = medians(runs["A"][name]), medians(runs["B"][name])
        lines.append(
            f"| {name} | {a.requests_per_s:,.1f} | {b.requests_per_s:,.1f} "
            f"| {b.requests_per_s / a.requests_per_s:.3f} | {a.p50_ms:.1f} | {b.p50_ms:.1f} "
            f"| {a.p99_ms:.1f} | {b.p99_ms:.1f} | {a.requests_per_batch:.1f} "
            f"| {b.requests_per_batch:.1f} | {a.cpu_ms_per_request:.3f} "
            f"| {b.cpu_ms_per_request:.3f} | {b.cpu_ms_per_request / a.cpu_ms_per_request:.3f} "
            f"| {a.dropped:,.0f} | {b.dropped:,.0f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a-command", required=True)
    ap.add_argument("--a-path", help="PYTHONPATH for side A")
    ap.add_argument("--b-command", required=True)
    ap.add_argument("--b-path", help="PYTHONPATH for side B")
    ap.add_argument("--workloads", nargs="+", default=["smooth", "rollout", "smooth4000"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=64, help="closed loop: concurrent clients")
    ap.add_argument("--rate", type=float, help="open loop: requests per second (not --clients)")
    args = ap.parse_args(argv)
    load = Load(args.clients, args.rate)
    sides = [
        Side("A", absolute(args.a_command.split()), args.a_path),
        Side("B", absolute(args.b_command.split()), args.b_path),
    ]
    runs: dict[str, dict[str, list[Figures]]] = {s.name: {} for s in sides}
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:
            for name, figures in one_round(side, args.workloads, load, args.seconds).items():
                runs[side.name].setdefault(name, []).append(figures)
    print("\n".join(table(runs, args.workloads)))
    a_side = f"{args.a_command} {args.a_path or ''}"
    b_side = f"{args.b_command} {args.b_path or ''}"
    print(f"\n{args.rounds} rounds of {args.seconds:g} s, {load}; A: {a_side}; B: {b_side}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
