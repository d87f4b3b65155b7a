"""Soak test (not in CI): minutes of load at half capacity against one rnnserve server.

Usage::

    python -m bench.soak --minutes 5 --workload smooth
    python -m bench.soak --minutes 5 --workers 2
    python -m bench.soak --url http://127.0.0.1:8000 --pid 1234 --minutes 30

Starts ``rnnserve`` (with ``--workers N`` if given) on a free loopback port (or uses ``--url``
and ``--pid``), measures its capacity with a short closed loop (``bench.load``), then offers
half of it as Poisson arrivals in windows of ``--window-s`` seconds for ``--minutes`` minutes.
After each window it reads the RSS (``/proc/<pid>/status`` VmRSS) and open file descriptors
(``/proc/<pid>/fd``) of the server's process and every process under it (with workers: the
supervisor, the engine and the HTTP workers), summed. Reported: per window p50/p99 and errors,
and over the run RSS growth, fd growth, p99 drift (last window over first) and requests lost
(sent but not answered 200).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from bench.load import closed_loop, open_loop
from bench.load_workloads import WORKLOADS, make_bodies


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (Linux ``/proc/<pid>/task/<tid>/children``)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):  # the task or the process ended meanwhile
                todo += [int(c) for c in (task / "children").read_text().split()]
    return tree


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


def _summed(pid: int, read: Callable[[int], int]) -> int:
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError, KeyError):  # gone meanwhile
            total += read(p)
    return total


def rss_bytes(pid: int) -> int:
    """Resident bytes of ``pid`` and the processes under it (shared pages count in each)."""
    return _summed(pid, _rss)


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` and the processes under it."""
    return _summed(pid, lambda p: len(os.listdir(f"/proc/{p}/fd")))


def _start(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("rnnserve")
    proc = subprocess.Popen(
        [str(exe), "--port", str(port), "--log-level", "warning", "--workers", str(args.workers)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("rnnserve did not become ready")


async def soak(url: str, pid: int, args: argparse.Namespace) -> int:
    workload = WORKLOADS[args.workload]
    bodies = make_bodies(workload, 64, seed=0)
    probe = await closed_loop(url, workload, bodies, clients=args.clients, seconds=10)
    rate = probe.requests_per_s * args.load
    print(f"capacity {probe.requests_per_s:.0f} requests/s; offering {rate:.0f}/s", flush=True)
    processes = len(process_tree(pid))
    print(f"server: {processes} processes under pid {pid}", flush=True)
    rss0, fds0 = rss_bytes(pid), open_fds(pid)
    windows = max(1, round(args.minutes * 60 / args.window_s))
    sent = ok = 0
    p99s = []
    for i in range(windows):
        r = await open_loop(url, workload, bodies, rate=rate, seconds=args.window_s, seed=i)
        sent, ok = sent + r.sent, ok + r.ok
        p99s.append(r.p(99))
        print(
            f"window {i + 1}/{windows}: {r.ok}/{r.sent} ok, p50 {r.p(50) * 1e3:.1f} ms, "
            f"p99 {r.p(99) * 1e3:.1f} ms, errors {dict(r.errors) or 'none'}, "
            f"RSS {rss_bytes(pid) / 2**20:.0f} MiB, fds {open_fds(pid)}",
            flush=True,
        )
    rss1, fds1 = rss_bytes(pid), open_fds(pid)
    print(
        f"\n{args.minutes:g} min at {args.load:.0%} of capacity: {ok}/{sent} answered 200 "
        f"({sent - ok} lost); RSS {rss0 / 2**20:.0f} -> {rss1 / 2**20:.0f} MiB "
        f"({(rss1 - rss0) / 2**20:+.0f} MiB); fds {fds0} -> {fds1}; p99 {p99s[0] * 1e3:.1f} -> "
        f"{p99s[-1] * 1e3:.1f} ms (drift x{p99s[-1] / p99s[0]:.2f})"
    )
    return 0 if ok == sent else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    parser.add_argument("--url", help="a running server (default: start one)")
    parser.add_argument("--pid", type=int, help="its process id (with --url)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="smooth")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--load", type=float, default=0.5, help="share of measured capacity")
    parser.add_argument("--clients", type=int, default=32, help="for the capacity probe")
    parser.add_argument("--workers", type=int, default=1, help="rnnserve --workers (when started)")
    args = parser.parse_args(argv)
    if args.url:
        if args.pid is None:
            parser.error("--url needs --pid (to read the server's RSS and fds)")
        if args.workers != 1:
            parser.error("--workers is for a server this starts; with --url, give the top pid")
        return asyncio.run(soak(args.url, args.pid, args))
    proc, url = _start(args)
    try:
        return asyncio.run(soak(url, proc.pid, args))
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    sys.exit(main())
