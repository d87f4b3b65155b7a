"""End to end on one host: the service with ``--device cuda`` against ``--device cpu``.

Usage::

    python -m bench.bench_gpu_e2e [--devices cuda cpu] [--quick] [--out docs/BENCHMARKS.md]
        [--json FILE]

For each device a real ``rnnserve`` process (default settings but ``--device``) serves three
workloads in turn, each driven by 64 concurrent clients (``bench.bench_http``'s aiohttp load
generator, in this process, on the same host) sending JSON requests of one sequence back to back:

- ``/smooth``, sequences of 50-500 steps (16 features);
- ``/rollout``, sequences of 50-500 steps (6 inputs);
- ``/smooth``, sequences of 4000 steps.

Reported per workload and device: requests/s, the ratio to the last device listed (the CPU by
default), p50 and p99 latency, mean requests per batch and batch compute time (read back from
``/metrics`` before and after the timed phase), and the largest difference between the devices'
answers to the same requests. ``bench.gpu_decide`` runs this on a GPU host (``--json``: the
same figures as one JSON row per workload and device, for its rules); with
``--devices cpu --quick`` it is a smoke test that runs anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.bench_http import CLIENTS
from bench.bench_http import _load as load_clients
from bench.models_harness import DEFAULT_OUT, cpu_model, write_section
from tests.metrics import value

BEGIN = "<!-- bench_gpu_e2e:begin -->"
END = "<!-- bench_gpu_e2e:end -->"
ROOT = Path(__file__).resolve().parents[1]
CHECK_BODIES = 4  # requests sent to every device to compare the answers
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class Workload:
    label: str
    path: str
    field: str  # request field holding the sequences
    result: str  # response field holding the outputs
    model: str
    width: int
    shortest: int
    longest: int
    per_client: int  # timed requests per client (full mode)


SMOOTH = ("/smooth", "sequences", "sequences", "smoother", 16)
ROLLOUT = ("/rollout", "inputs", "positions", "traveller", 6)
WORKLOADS = (
    Workload("/smooth, 50–500 steps", *SMOOTH, shortest=50, longest=500, per_client=20),
    Workload("/rollout, 50–500 steps", *ROLLOUT, shortest=50, longest=500, per_client=20),
    Workload("/smooth, 4000 steps", *SMOOTH, shortest=4000, longest=4000, per_client=4),
)


@dataclass
class Result:
    workload: Workload
    device: str
    rps: float
    p50: float
    p99: float
    requests_per_batch: float
    compute_ms: float  # mean batch compute time
    answers: list[list[list[float]]] = field(default_factory=list)


def bodies_for(w: Workload, count: int, seed: int) -> list[bytes]:
    """``count`` JSON bodies of one random sequence each, lengths uniform in the range."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        steps = int(rng.integers(w.shortest, w.longest + 1))
        seq = rng.standard_normal((steps, w.width)).round(4).tolist()
        out.append(json.dumps({w.field: [seq]}).encode())
    return out


# --------------------------------------------------------------------------- server


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(tmp: Path, device: str, extra: Sequence[str], timeout_s: float = 180.0) -> Server:
    """``rnnserve --device <device>`` on a free port, once ``/readyz`` answers 200."""
    port = _free_port()
    exe = Path(sys.executable).with_name("rnnserve")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "service"]
    log = tmp / f"rnnserve-{device}-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.Popen(
        [*cmd, "--port", str(port), "--device", device, *extra],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rnnserve --device {device} exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return Server(proc, url, log)
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(
        f"rnnserve --device {device} was not ready in {timeout_s:g} s:\n{log.read_text()}"
    )


def stop(server: Server) -> None:
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait()


def _batch_stats(url: str, model: str) -> tuple[float, float, float]:
    """(batches, requests in them, compute seconds) so far."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return (
        value(text, "rnnserve_batch_requests_count", model=model),
        value(text, "rnnserve_batch_requests_sum", model=model),
        value(text, "rnnserve_batch_compute_seconds_sum", model=model),
    )


# --------------------------------------------------------------------------- run


def run_device(
    device: str, quick: bool, extra: Sequence[str], tmp: Path, seed: int = 0
) -> list[Result]:
    results = []
    server = start(tmp, device, extra)
    try:
        with httpx.Client(base_url=server.url, timeout=300) as client:
            for k, w in enumerate(WORKLOADS):
                per_client = 1 if quick else w.per_client
                bodies = bodies_for(w, 4 if quick else 16, seed + k)
                check = bodies_for(w, CHECK_BODIES, seed + 100 + k)
                answers = []
                for body in check:  # also warms the model for these lengths
                    r = client.post(w.path, content=body, headers=JSON)
                    r.raise_for_status()
                    answers.append(r.json()[w.result][0])
                asyncio.run(load_clients(server.url, w.path, bodies, 1))  # warm connections
                before = _batch_stats(server.url, w.model)
                t0 = time.perf_counter()
                lat = asyncio.run(load_clients(server.url, w.path, bodies, per_client))
                wall = time.perf_counter() - t0
                after = _batch_stats(server.url, w.model)
                batches = after[0] - before[0]
                q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [lat[0]] * 99
                res = Result(
                    w,
                    device,
                    len(lat) / wall,
                    q[49],
                    q[98],
                    (after[1] - before[1]) / batches if batches else math.nan,
                    (after[2] - before[2]) / batches * 1e3 if batches else math.nan,
                    answers,
                )
                _log(f"{device} {w.label}: {res.rps:,.0f} requests/s")
                results.append(res)
    finally:
        stop(server)
    return results


def max_difference(a: Result, b: Result) -> float:
    return max(
        float(np.abs(np.asarray(x, dtype=np.float64) - np.asarray(y, dtype=np.float64)).max())
        for x, y in zip(a.answers, b.answers, strict=True)
    )


# --------------------------------------------------------------------------- report


def gpu_name() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "no NVIDIA GPU visible (nvidia-smi absent or failing)"
    return "; ".join(f"{line.strip()} (name, driver, memory)" for line in out.splitlines())


def render(
    results: Sequence[Result], devices: Sequence[str], quick: bool, extra: Sequence[str]
) -> str:
    base = devices[-1]
    base_rps = {r.workload.label: r.rps for r in results if r.device == base}
    by_key = {(r.workload.label, r.device): r for r in results}
    settings = " ".join(extra) if extra else "none beyond `--device`"
    lines = [
        BEGIN,
        f"## Service end to end: {' against '.join(f'`--device {d}`' for d in devices)} "
        "(`python -m bench.bench_gpu_e2e`)",
        "",
        f"Mode: {'quick (smoke test)' if quick else 'full'}; date "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC. GPU: {gpu_name()}. Host: {cpu_model()}, "
        f"{os.cpu_count()} logical CPUs. {CLIENTS} concurrent clients (aiohttp, in the "
        "benchmark's process on the same host as the server), each sending JSON requests of one "
        "sequence back to back; the servers run one after the other with default settings "
        f"(extra flags: {settings}). Requests per batch and compute time per batch come from "
        "the server's `/metrics` over the timed phase.",
        "",
        f"| workload | device | requests/s | × {base} | p50 ms | p99 ms | requests per batch | "
        "compute ms per batch |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = r.rps / base_rps[r.workload.label] if r.workload.label in base_rps else math.nan
        lines.append(
            f"| `{r.workload.label}` | {r.device} | {r.rps:,.0f} | {ratio:.2f}× | "
            f"{r.p50 * 1e3:.1f} | {r.p99 * 1e3:.1f} | {r.requests_per_batch:.1f} | "
            f"{r.compute_ms:.2f} |"
        )
    lines.append("")
    for w in WORKLOADS:
        for d in devices[:-1]:
            a, b = by_key.get((w.label, d)), by_key.get((w.label, base))
            if a is not None and b is not None and d != base:
                lines.append(
                    f"- `{w.label}`: answers of `--device {d}` and `--device {base}` to the same "
                    f"{CHECK_BODIES} requests differ by at most {max_difference(a, b):.1e}."
                )
    lines += [END, ""]
    return "\n".join(lines)


def json_rows(results: Sequence[Result]) -> list[dict[str, object]]:
    """The figures of :func:`render`, one row per workload and device."""
    return [
        {
            "workload": r.workload.label,
            "device": r.device,
            "rps": r.rps,
            "p50_ms": r.p50 * 1e3,
            "p99_ms": r.p99 * 1e3,
            "requests_per_batch": r.requests_per_batch,
            "compute_ms": r.compute_ms,
        }
        for r in results
    ]


def _log(msg: str) -> None:
    print(f"[bench_gpu_e2e] {msg}", file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--devices", nargs="+", default=["cuda", "cpu"], help="servers to run; the last is 1.00×"
    )
    parser.add_argument("--quick", action="store_true", help="one request per client")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra rnnserve flag for every server (repeatable): --server-arg=--max-batch-size=9",
    )
    parser.add_argument(
        "--json", type=Path, default=None, help="also write the figures to this JSON file"
    )
    args = parser.parse_args(argv)
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as tmp:
        for device in args.devices:
            results += run_device(device, args.quick, args.server_arg, Path(tmp))
            if args.json is not None:  # after each device: a cut run keeps the first
                rows = {"step": "e2e", "rows": json_rows(results), "done": False}
                args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    section = render(results, args.devices, args.quick, args.server_arg)
    write_section(args.out, section, BEGIN, END)
    if args.json is not None:
        rows = {"step": "e2e", "rows": json_rows(results), "done": True}
        args.json.write_text(json.dumps(rows, indent=1), encoding="utf-8")
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
