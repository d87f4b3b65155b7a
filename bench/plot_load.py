"""Plots of p50/p99 latency against offered load (open loop), one PNG per workload.

Usage::

    python -m bench.plot_load --out docs/img/ [--data FILE] [--measure] [--seconds S] [--quick]

Reads the sweep data (default ``<out>/load_sweep.json``, as ``python -m bench.bench_load --sweep``
writes it). When that file is missing, or with ``--measure``, it first measures the sweep itself
(``bench.bench_load_sweep.sweep``: starts rnnserve and the naive baseline, finds each one's
closed-loop capacity, then sends Poisson arrivals at fractions of it) and writes the file. Then it
draws ``load_<workload>.png`` into ``--out``. Drawing needs matplotlib (the ``bench`` extra);
measuring does not, so CI's smoke tests never import it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STYLE = {  # (server, format) -> colour and label
    ("baseline", "json"): ("tab:red", "naive FastAPI (baseline), JSON"),
    ("rnnserve", "json"): ("tab:blue", "rnnserve, JSON"),
    ("rnnserve", "binary"): ("tab:green", "rnnserve, safetensors"),
}


def plot(data: Mapping[str, Any], out_dir: Path) -> list[Path]:
    """One PNG per workload in ``data["series"]``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    workloads: dict[str, list[Mapping[str, Any]]] = {}
    for s in data["series"]:
        workloads.setdefault(s["workload"], []).append(s)
    written = []
    for workload, series in workloads.items():
        fig, ax = plt.subplots(figsize=(7.5, 4.8))
        for s in series:
            colour, label = STYLE.get((s["server"], s["format"]), ("tab:gray", s["server"]))
            pts = [p for p in s["points"] if p["ok"] > 0]
            x = [p["offered_per_s"] for p in pts]
            ax.plot(x, [p["p99_ms"] for p in pts], "-o", color=colour, label=f"{label}, p99")
            ax.plot(x, [p["p50_ms"] for p in pts], "--", color=colour, label=f"{label}, p50")
            dropped = [p for p in pts if p["dropped"] > 0]
            ax.plot(
                [p["offered_per_s"] for p in dropped], [p["p99_ms"] for p in dropped], "x",
                color="black", markersize=9,
            )  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("offered load, requests/s (Poisson arrivals)")
        ax.set_ylabel("latency, ms")
        title = series[0].get("title", workload).replace("`", "")
        ax.set_title(f"{title}\n{data.get('machine', '')}; ×: arrivals dropped", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="best")
        fig.tight_layout()
        path = out_dir / f"load_{workload}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("docs/img"), help="folder for the PNGs")
    parser.add_argument(
        "--data", type=Path, default=None, help="sweep JSON (<out>/load_sweep.json)"
    )
    parser.add_argument("--measure", action="store_true", help="measure even if the data exists")
    parser.add_argument("--seconds", type=float, default=None, help="seconds per sweep point")
    parser.add_argument("--clients", type=int, default=None, help="clients for the capacity run")
    parser.add_argument("--quick", action="store_true", help="a short sweep (a smoke test)")
    args = parser.parse_args(argv)
    data_path = args.data if args.data is not None else args.out / "load_sweep.json"
    if args.measure or not data_path.is_file():
        from bench.bench_load import CLIENTS
        from bench.bench_load_sweep import SWEEP_FRACTIONS, sweep

        seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 5.0)
        clients = args.clients if args.clients is not None else (8 if args.quick else CLIENTS)
        fractions = (0.25, 1.0) if args.quick else SWEEP_FRACTIONS
        data = sweep(seconds=seconds, clients=clients, fractions=fractions)
        data_path.parent.mkdir(parents=True, exist_ok=True)
        data_path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
        print(f"wrote {data_path}")
    else:
        data = json.loads(data_path.read_text(encoding="utf-8"))
    for path in plot(data, args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
