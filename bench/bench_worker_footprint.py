"""What one HTTP worker of ``rnnserve --workers N`` costs: its memory and its start-up time.

- Memory: ``rnnserve --workers 2`` is started; once ``/readyz`` answers, every process of its
  tree is listed with its resident memory (``VmRSS``) and whether it has torch's library mapped
  (the engine process and the supervisor, which checks the models before it starts
  anything, should; an HTTP worker, known by its ``X-Rnnserve-Worker`` header, should not).
- Start-up: a fresh interpreter imports the worker app and builds it
  (``create_worker_app``, as uvicorn does in each worker), timed from the interpreter's start
  to the app built; the median of ``--runs``.

``--import-root``/``--app`` measure another tree (for example an older checkout, on
``PYTHONPATH``) the same way. Run: ``.venv/bin/python -m bench.bench_worker_footprint``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.e2e.server import free_port

WORKER_APP = "rnnserve.service.http.app"
ENGINE_SOCKET_ENV = "_RNNSERVE_ENGINE_SOCKET"


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == parent:
                found.append(int(entry.name))
                todo.append(int(entry.name))
    return found


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def worker_pids(url: str, tries: int = 200) -> set[int]:
    """The HTTP workers' pids, from the ``X-Rnnserve-Worker`` header of their answers."""
    pids: set[int] = set()
    with httpx.Client(timeout=5) as client:
        for _ in range(tries):
            # a new connection each time, so that the kernel hands it to either worker
            client.headers["connection"] = "close"
            pids.add(int(client.get(f"{url}/healthz").headers["x-rnnserve-worker"]))
            if len(pids) == 2:
                break
    return pids


def process_memory(
    command: list[str], env: dict[str, str], timeout_s: float
) -> list[dict[str, object]]:
    """Start ``command`` (an rnnserve with --workers 2), wait for ready, list its processes."""
    port = free_port()
    proc = subprocess.Popen(
        [*command, "--port", str(port), "--workers", "2"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("the server did not become ready")
        workers = worker_pids(f"http://127.0.0.1:{port}")
        rows: list[dict[str, object]] = []
        for pid in [proc.pid, *descendants(proc.pid)]:
            role = "supervisor" if pid == proc.pid else "http worker" if pid in workers else "other"
            rows.append({"pid": pid, "role": role, "rss_mib": round(rss_mib(pid), 1),
                         "torch": maps_torch(pid)})  # fmt: skip
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def start_seconds(app_module: str, env: dict[str, str], runs: int) -> dict[str, float]:
    """Median seconds to a built worker app: of the imports and build alone (``import_s``) and
    from the interpreter's start (``process_s``)."""
    script = (
        "import time, sys\n"
        "t0 = time.perf_counter()\n"
        f"from {app_module} import create_worker_app\n"
        "create_worker_app()\n"
        "print(time.perf_counter() - t0)\n"
    )
    times, imports = [], []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", script],
            env={**env, ENGINE_SOCKET_ENV: "/nonexistent/engine.sock"},
            capture_output=True,
            text=True,
            check=True,
            cwd="/",
        )
        imports.append(float(done.stdout.strip()))
        times.append(time.perf_counter() - started)
    return {"import_s": statistics.median(imports), "process_s": statistics.median(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--app", default=WORKER_APP, help="module holding create_worker_app")
    p.add_argument("--import-root", help="put this folder first on PYTHONPATH (another tree)")
    p.add_argument("--command", default=str(Path(sys.executable).with_name("rnnserve")),
                   help="the server command (space-separated)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=120.0)
    args = p.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    if args.import_root:
        env["PYTHONPATH"] = args.import_root
    rows = process_memory(args.command.split(), env, args.timeout_s)
    result = {"processes": rows, "worker_start_s": start_seconds(args.app, env, args.runs)}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
