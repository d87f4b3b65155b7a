"""Where should model compute run? Main thread vs the server's worker thread, 1 vs 2 threads.

Usage::

    python -m bench.bench_threads [--quick] [--out docs/BENCHMARKS.md]

rnnserve runs every batch on one dedicated worker thread (``service/engine/runtime.py``) with
``torch_threads`` intra-op threads. Torch called from a thread other than the first one, with
the default OpenMP threads, has been seen 2.5-3x slower. Each layout runs in a fresh
process (OpenMP pools are per process), times the default models on server-like batches, and the
ratios are against "worker thread, 1 torch thread" -- rnnserve's default.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.models_harness import DEFAULT_OUT, cpu_model, random_sequences, spread_lengths
from bench.models_harness import write_section as _write_section
from rnnserve import models
from rnnserve.models.packing import pack
from rnnserve.models.traveller import Traveller

BEGIN = "<!-- bench_threads:begin -->"
END = "<!-- bench_threads:end -->"
LAYOUTS = (("worker", 1), ("worker", 2), ("main", 1), ("main", 2))
WORKLOADS = (
    ("smoother B=64 T=1000", "smoother", 64, 1000),
    ("traveller B=1 T=500", "traveller", 1, 500),
    ("traveller B=64 T=200", "traveller", 64, 200),
)


def _workload(kind: str, batch: int, steps: int) -> Callable[[], object]:
    model = models.load(kind)
    width = 16 if kind == "smoother" else 6
    packed = pack(random_sequences(spread_lengths(batch, steps), width, seed=0))
    if isinstance(model, Traveller):
        return lambda: model.rollout(packed)
    return lambda: model(packed)


def child(where: str, threads: int, repeats: int) -> dict[str, float]:
    """Median seconds per call of each workload, run the way ``where`` says."""

    def run_all() -> dict[str, float]:
        torch.set_num_threads(threads)
        out = {}
        with torch.inference_mode():
            for label, kind, batch, steps in WORKLOADS:
                fn = _workload(kind, batch, steps)
                for _ in range(3):
                    fn()
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    samples.append(time.perf_counter() - t0)
                out[label] = statistics.median(samples)
        return out

    torch.set_num_threads(threads)
    if where == "main":
        return run_all()
    with ThreadPoolExecutor(1, initializer=torch.set_num_threads, initargs=(threads,)) as pool:
        return pool.submit(run_all).result()


def render(results: dict[tuple[str, int], dict[str, float]], quick: bool, wall_s: float) -> str:
    base = results[("worker", 1)]
    lines = [
        BEGIN,
        "## Thread layout (`python -m bench.bench_threads`)",
        "",
        f"Mode: {'quick' if quick else 'full'}; {cpu_model()}, {os.cpu_count()} logical CPUs; "
        f"torch {torch.__version__}; {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; "
        f"run took {wall_s:.0f} s. Each layout in a fresh process; median ms per call of the "
        "bundled models; ratio against rnnserve's default (worker thread, 1 torch thread).",
        "",
        "| workload | " + " | ".join(f"{w} thread, {n} torch thread(s)" for w, n in LAYOUTS) + " |",
        "|---" * (len(LAYOUTS) + 1) + "|",
    ]
    for label, *_ in WORKLOADS:
        cells = [
            f"{results[layout][label] * 1e3:.2f} ms ({results[layout][label] / base[label]:.2f}×)"
            for layout in LAYOUTS
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Nothing else ran during the measurement; under load the second core is busy with the "
        "event loop and the clients, which is why rnnserve defaults to one torch thread.",
        END,
        "",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="few repeats (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    parser.add_argument("--child", nargs=2, metavar=("WHERE", "THREADS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else 15
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), repeats)))
        return 0
    t0 = time.perf_counter()
    results = {}
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for where, threads in LAYOUTS:
        cmd = [sys.executable, "-m", "bench.bench_threads", "--child", where, str(threads)]
        if args.quick:
            cmd.append("--quick")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
        results[(where, threads)] = json.loads(out.stdout.strip().splitlines()[-1])
    section = render(results, args.quick, time.perf_counter() - t0)
    _write_section(args.out, section, BEGIN, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
