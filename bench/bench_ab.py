"""Two rnnserve builds under the same closed-loop load, rounds interleaved: did a change regress?

Each side is a command that starts rnnserve (``--port`` is added) with an optional ``PYTHONPATH``
(another checkout's folder); both run on this machine, one at a time, in alternating rounds so
that drift in the machine's speed falls on both. Per workload: each side's median requests/s,
p99 and server CPU time per answered request over the rounds, and B's over A's. The CPU time
(the server process's user + system time, from ``/proc``) moves much less than throughput when
other work shares the machine, so it tells a small regression from noise where requests/s
cannot.

Run: ``.venv/bin/python -m bench.bench_ab --a-command "rnnserve-old" --a-path /tmp/old
--b-command .venv/bin/rnnserve`` (workloads and formats as ``bench/load.py`` names them).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.load import closed_loop
from bench.load_workloads import WORKLOADS, make_bodies
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


def one_round(
    side: Side, workloads: list[str], clients: int, seconds: float
) -> dict[str, tuple[float, float, float]]:
    """Start ``side``, warm it, load each workload; requests/s, p99 (ms) and server CPU ms per
    answered request, per workload."""
    proc, url = start(side)
    try:
        out = {}
        for name in workloads:
            workload = WORKLOADS[name]
            bodies = make_bodies(workload, 64)
            asyncio.run(closed_loop(url, workload, bodies, clients=clients, seconds=1.0))
            cpu = cpu_seconds(proc.pid)
            r = asyncio.run(closed_loop(url, workload, bodies, clients=clients, seconds=seconds))
            cpu = cpu_seconds(proc.pid) - cpu
            if r.errors:
                raise RuntimeError(f"{side.name} answered errors on {name}: {r.errors}")
            out[name] = (r.requests_per_s, r.p(99) * 1e3, 1e3 * cpu / max(r.ok, 1))
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a-command", required=True)
    ap.add_argument("--a-path", help="PYTHONPATH for side A")
    ap.add_argument("--b-command", required=True)
    ap.add_argument("--b-path", help="PYTHONPATH for side B")
    ap.add_argument("--workloads", nargs="+", default=["smooth", "rollout", "smooth4000"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", type=int, default=64)
    args = ap.parse_args(argv)
    sides = [
        Side("A", absolute(args.a_command.split()), args.a_path),
        Side("B", absolute(args.b_command.split()), args.b_path),
    ]
    runs: dict[str, dict[str, list[tuple[float, float, float]]]] = {s.name: {} for s in sides}
    for i in range(args.rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:
            for name, value in one_round(side, args.workloads, args.clients, args.seconds).items():
                runs[side.name].setdefault(name, []).append(value)
    print("| workload | A requests/s | B requests/s | B/A | A p99 ms | B p99 ms "
          "| A CPU ms/req | B CPU ms/req | B/A CPU |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.workloads:
        ra, a99, ca = (statistics.median(col) for col in zip(*runs["A"][name], strict=True))
        rb, b99, cb = (statistics.median(col) for col in zip(*runs["B"][name], strict=True))
        print(f"| {name} | {ra:,.1f} | {rb:,.1f} | {rb / ra:.3f} | {a99:.1f} | {b99:.1f} "
              f"| {ca:.3f} | {cb:.3f} | {cb / ca:.3f} |")  # fmt: skip
    a_side = f"{args.a_command} {args.a_path or ''}"
    b_side = f"{args.b_command} {args.b_path or ''}"
    print(f"\n{args.rounds} rounds of {args.seconds:g} s, {args.clients} clients; A: {a_side}; "
          f"B: {b_side}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
