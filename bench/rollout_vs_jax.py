"""The Traveller's CPU rollout against the fastest JAX ``lax.scan`` rollout, and its FLOP floor.

Usage::

    python -m bench.rollout_vs_jax [--runs 2] [--rounds 11] [--out docs/BENCHMARKS.md]

For each thread layout a child process of its own (XLA reads its thread flags when its backend
starts, and pinning holds for a whole process):

- ``one``: pinned to one core, torch (so MKL) on one thread, XLA's CPU thread pool off, as
  ``bench.bench_models`` runs;
- ``jax-default``: not pinned, XLA's default threads; torch (so MKL) on one thread, as the
  service runs it.

In each, at B=1 T=1000 and B=64 T=500 (the default Traveller, lengths spread from T down to
T/2, the same inputs as ``bench.bench_models``), the numba rollout backend and every JAX variant
(``bench.jax_baselines.ROLLOUT_VARIANTS`` on the first run, the fastest few after) are checked
against the float64 reference, then timed in the same interleaved round-robin rounds
(``bench.models_harness.measure``). The pinned child also measures the core's fp32 peak: the
clock from a chain of dependent FMAs (4 cycles each on Zen 4 and Skylake-X alike) times the FMA
width of the core, and, for scale, what a large single-threaded ``sgemm`` reaches. The floor of
a rollout is its GEMM FLOPs (from the weight shapes, over the real rows it computes) at that
peak; the activations are left out of it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import functools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.models_harness import (
    DEFAULT_OUT,
    ROOT,
    TOLERANCE,
    Case,
    CheckFailed,
    _pin_one_core,
    _prepare_jax_env,
    check,
    cpu_model,
    half_spread_lengths,
    random_sequences,
    shape_label,
    write_section,
)

BEGIN = "<!-- rollout_vs_jax:begin -->"
END = "<!-- rollout_vs_jax:end -->"
SHAPES = ((1, 1000), (64, 500))
QUICK_SHAPES = ((1, 20), (4, 10))
NUMBA = 'Traveller.rollout, "numba"'
# --kernel-ab: the numba kernel's unplanned paths, called directly beside the backend (which
# runs the routes plan_routes measured on this machine)
KERNEL_OPTIONS: dict[str, dict[str, Any]] = {
    "numba kernel, unplanned: MKL gemm from 2 rows": {},
    "numba kernel, its own loop at every batch size": {"gemm_from": 1 << 30},
}
LAYOUTS = ("one", "jax-default")
# fp32 FLOPs per cycle of one core: 2 FMA pipes x lanes x 2. Zen 4 runs an AVX-512 FMA as two
# 256-bit halves, so its AVX-512 peak is the AVX2 one; Intel cores with AVX-512 have 2 x 512 bits.
FLOP_PER_CYCLE = {"AuthenticAMD": 32, "GenuineIntel": 64}
FMA_LATENCY_CYCLES = 4


# --------------------------------------------------------------------------- FLOPs and peak


def rollout_flops(
    batch_sizes: Sequence[int], num_inputs: int, hidden: int, num_layers: int
) -> float:
    """GEMM FLOPs of a rollout over ``batch_sizes`` active rows a step: per row and step, layer 0
    multiplies ``(p, h_0, u)`` [2 + H + num_inputs] by [., 4H], each later layer ``(x, h_l)``
    [2H] by [2H, 4H], the output layer [H] by [H, 2]; one multiply-add counts two."""
    per_row = 2 * (4 * hidden * (2 + hidden + num_inputs + (num_layers - 1) * 2 * hidden))
    per_row += 2 * 2 * hidden
    return float(per_row * sum(batch_sizes))


def _fma_chain(n: int, a: float, b: float) -> float:
    x = 1.0
    for _ in range(n):
        x = x * a + b  # each FMA waits for the previous one: n x its latency
    return x


def clock_hz(n: int = 2_000_000, repeats: int = 200) -> float:
    """This core's clock, from ``n`` dependent FMAs (numba, ``contract``: one ``vfmadd`` each),
    the fastest of ``repeats`` short runs: on a shared machine the fastest is the one that had
    the core to itself."""
    import numba

    chain: Any = numba.njit(fastmath={"contract"})(_fma_chain)
    chain(10, 0.999, 1e-3)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        chain(n, 0.999, 1e-3)
        best = min(best, time.perf_counter() - start)
    return n * FMA_LATENCY_CYCLES / best


def vendor() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def sgemm_flops_per_s(n: int = 512, repeats: int = 100) -> float:
    """A square ``n`` fp32 GEMM's FLOP/s through torch (MKL, torch's threads): the fastest of
    ``repeats`` calls, as for the clock. (numpy's OpenBLAS is left out: its threads start when
    numpy is imported, before this process pins itself, so they would not keep to one core.)"""
    import torch

    a = torch.randn(n, n)
    b = a.t().contiguous()
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def peak(quick: bool = False) -> dict[str, Any]:
    hz = clock_hz(repeats=5 if quick else 200)
    who = vendor()
    per_cycle = FLOP_PER_CYCLE.get(who, 32)
    return {
        "clock_ghz": hz / 1e9,
        "vendor": who,
        "flop_per_cycle": per_cycle,
        "peak_gflops": hz * per_cycle / 1e9,
        "sgemm_gflops": sgemm_flops_per_s(256 if quick else 512, 10 if quick else 100) / 1e9,
    }


# --------------------------------------------------------------------------- one child


def _sample(case: Case, number: int) -> tuple[float, float]:
    """Seconds per call of ``number`` calls: wall clock, and this process's CPU time."""
    case.wait(None)
    wall, cpu = time.perf_counter(), time.process_time()
    out: object = None
    for _ in range(number):
        out = case.fn()
    case.wait(out)
    return (time.perf_counter() - wall) / number, (time.process_time() - cpu) / number


def measure_both(cases: Sequence[Case], rounds: int, sample_s: float) -> dict[str, Any]:
    """Each case warmed up, then timed in ``rounds`` rounds, each sample about ``sample_s``
    long: the wall-clock seconds per call (``samples``) and the process's CPU seconds per call
    (``cpu``). Pinned to one core, the CPU time is the time the process had the core: what the
    wall clock would read on a machine nobody else was using.

    Each round runs the cases in a new order (shuffled, fixed seed), and a sample of one call
    comes after an untimed call of the same case: a timed call would otherwise find the caches
    as the case before it left them (a JAX case's padded arrays, a numba case's weights), and in
    a rotation, which keeps the cyclic order, always the same case before it."""
    numbers = {}
    for case in cases:
        once = min(_sample(case, 1)[1] for _ in range(3))
        numbers[case.name] = max(1, min(10_000, math.ceil(sample_s / max(once, 1e-7))))
    out: dict[str, Any] = {
        c.name: {"samples": [], "cpu": [], "number": numbers[c.name]} for c in cases
    }
    order = list(cases)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for case in order:
            if numbers[case.name] == 1:
                case.wait(case.fn())
            wall, cpu = _sample(case, numbers[case.name])
            out[case.name]["samples"].append(wall)
            out[case.name]["cpu"].append(cpu)
    return out


def _child_env(layout: str) -> None:
    if layout == "one":
        _prepare_jax_env("cpu")
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        os.environ.pop("XLA_FLAGS", None)


def _jax_cases(jb: Any, base: Any, seqs: Any, ref: np.ndarray, variants: Any) -> list[Case]:
    import jax

    lstm = base.lstm_layers
    layers = range(base.num_layers)
    weights = jb.traveller_weights(
        *(
            [getattr(lstm, f"{kind}_l{k}").numpy() for k in layers]
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ),
        base.output_layer.weight.numpy(),
        base.output_layer.bias.numpy(),
    )
    us, mask = jb.padded_time_major([s.numpy() for s in seqs])
    u, m = jax.device_put(us), jax.device_put(mask)
    lengths = [len(s) for s in seqs]
    cases = []
    for variant in variants:
        fn, _ = jb.compile_for(jb.rollout_variant_fn(variant), u, m, weights)
        got = np.asarray(fn(u, m, weights), dtype=np.float64).transpose(1, 0, 2)
        try:
            err = check(variant.key, got, ref, lengths)
        except CheckFailed as e:
            print(f"[rollout_vs_jax] {e}", file=sys.stderr, flush=True)
            continue

        def call(fn: Any = fn) -> object:
            return fn(u, m, weights)

        cases.append(Case(f"JAX {variant.key}", call, jax.block_until_ready, err=err))
    return cases


def _kernel_cases(base: Any, x: Any, ref: np.ndarray, lengths: list[int]) -> list[Case]:
    """The numba kernel called directly, with each of ``KERNEL_OPTIONS`` (A/B of its paths)."""
    import torch

    from rnnserve.models.kernels.rollout_cpu import rollout_packed_numba

    weights = base.fused_weights()
    sizes = x.batch_sizes.tolist()
    cases = []
    for name, options in KERNEL_OPTIONS.items():

        def call(options: dict[str, Any] = options) -> Any:
            return rollout_packed_numba(x.data, sizes, *weights, **options)

        out = torch.nn.utils.rnn.PackedSequence(
            call()[0], x.batch_sizes, x.sorted_indices, x.unsorted_indices
        )
        padded = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]
        cases.append(Case(name, call, err=check(name, padded.double().numpy(), ref, lengths)))
    return cases


def child(
    layout: str,
    variants: str,
    rounds: int,
    sample_s: float,
    quick: bool = False,
    kernel_ab: bool = False,
) -> dict[str, Any]:
    """Measure every shape in this process (its environment set already)."""
    import torch

    from bench import jax_baselines as jb
    from bench.models_traveller import copy_model, make_traveller, rollout_reference, with_backend
    from rnnserve.models.packing import pack

    pinned = _pin_one_core() if layout == "one" else "not pinned"
    torch.set_num_threads(1)
    if variants == "all":
        chosen = jb.ROLLOUT_VARIANTS
    else:
        chosen = tuple(jb.RolloutVariant.parse(key) for key in variants.split(","))
    shapes = QUICK_SHAPES if quick else SHAPES
    base = make_traveller()
    result: dict[str, Any] = {
        "layout": layout,
        "pinned": pinned,
        "torch_threads": torch.get_num_threads(),
        "load": os.getloadavg(),
        "shapes": [],
    }
    with torch.inference_mode():
        for i, (batch, steps) in enumerate(shapes):
            # the seeds and inputs of bench.bench_models' traveller rows
            seqs = random_sequences(half_spread_lengths(batch, steps), base.num_inputs, 100 + i)
            x = pack(seqs)
            ref = rollout_reference(copy_model(base, dtype=torch.float64), seqs)
            model = with_backend(base, "numba")
            got = model.rollout(x)
            padded = torch.nn.utils.rnn.pad_packed_sequence(got, batch_first=True)[0]
            err = check(NUMBA, padded.double().numpy(), ref, [len(s) for s in seqs])
            cases = [Case(NUMBA, functools.partial(model.rollout, x), err=err)]
            if kernel_ab:
                cases += _kernel_cases(base, x, ref, [len(s) for s in seqs])
            cases += _jax_cases(jb, base, seqs, ref, chosen)
            timings = measure_both(cases, rounds, sample_s)
            hidden, layers = base.hidden_size, base.num_layers
            sizes = x.batch_sizes.tolist()
            result["shapes"].append(
                {
                    "batch": batch,
                    "steps": steps,
                    "flops_packed": rollout_flops(sizes, base.num_inputs, hidden, layers),
                    "flops_padded": rollout_flops([batch] * steps, base.num_inputs, hidden, layers),
                    "flops_step_full": rollout_flops([batch], base.num_inputs, hidden, layers),
                    "cases": {c.name: {**timings[c.name], "err": c.err} for c in cases},
                }
            )
    result["peak"] = peak(quick)
    return result


# --------------------------------------------------------------------------- the report


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if seconds < 0.1 else f"{seconds * 1e3:.0f}"


def _median(case: dict[str, Any], clock: str = "cpu") -> float:
    return float(statistics.median(case[clock]))


def clock_of(layout: str) -> str:
    """The clock a layout is ranked by: CPU time where the process is pinned to one core (the
    time it had the core), the wall clock where XLA may use several threads."""
    return "cpu" if layout == "one" else "samples"


def best_jax(cases: dict[str, Any], clock: str = "cpu") -> str:
    jax_names = (n for n in cases if n.startswith("JAX "))
    return min(jax_names, key=lambda n: _median(cases[n], clock))


def fastest_keys(run: dict[str, Any], keep: int) -> str:
    """The ``keep`` fastest JAX variants of each shape of ``run`` and the first baseline, as the
    ``--variants`` argument of a later run."""
    from bench.jax_baselines import CONCAT_STACKED

    clock = clock_of(run["layout"])
    keys = []
    for shape in run["shapes"]:
        jax_names = [n for n in shape["cases"] if n.startswith("JAX ")]
        jax_names.sort(key=lambda n: _median(shape["cases"][n], clock))
        keys += [n.removeprefix("JAX ") for n in jax_names[:keep]]
    return ",".join(dict.fromkeys([*keys, CONCAT_STACKED.key]))


def shape_table(shape: dict[str, Any], peak_gflops: float | None, clock: str = "cpu") -> list[str]:
    cases = shape["cases"]
    best = best_jax(cases, clock)
    what = "CPU" if clock == "cpu" else "wall"
    lines = [
        f"| implementation | {what} ms per call (median) | min–max | wall ms (median) | "
        "× fastest JAX | GFLOP/s | × FLOP floor | max abs err |",
        "|---|---|---|---|---|---|---|---|",
    ]
    order = sorted(cases, key=lambda n: (n != NUMBA, _median(cases[n], clock)))
    for name in order:
        case = cases[name]
        med = _median(case, clock)
        # the packed rollout computes only the real rows; JAX the padded batch
        flops = shape["flops_padded"] if name.startswith("JAX ") else shape["flops_packed"]
        floor = "" if peak_gflops is None else f"{med / (flops / (peak_gflops * 1e9)):.2f}×"
        lines.append(
            f"| {name}{' (fastest)' if name == best else ''} | {_ms(med)} | "
            f"{_ms(min(case[clock]))}–{_ms(max(case[clock]))} | {_ms(_median(case, 'samples'))} | "
            f"{med / _median(cases[best], clock):.2f}× | {flops / med / 1e9:.1f} | {floor} | "
            f"{case['err']:.1e} |"
        )
    return lines


def render(runs: Sequence[dict[str, Any]], started: dt.datetime, argv: Sequence[str]) -> str:
    pinned_runs = [r for r in runs if r["layout"] == "one"] or list(runs)
    pk = pinned_runs[0]["peak"]
    peak_gflops = pk["peak_gflops"]
    command = " ".join(["python -m bench.rollout_vs_jax", *argv])
    out = [
        BEGIN,
        "## The CPU rollout against the fastest JAX rollout (`python -m bench.rollout_vs_jax`)",
        "",
        f"Written by `bench/rollout_vs_jax.py` (`{command}`); {cpu_model()}; "
        f"{started.strftime('%Y-%m-%d %H:%M UTC')}. Each run below is a process "
        "of its own; in it the numba rollout and the JAX variants were checked against the "
        f"float64 reference (max abs error ≤ {TOLERANCE:g}) and timed in the same interleaved "
        "rounds. Pinned to one core (threads `one`), each figure is the process's CPU time per "
        "call: the time it had the core, which a machine shared with other jobs leaves nearly "
        "as it would be on an idle one, where the wall clock (also given) grows with the load; "
        "unpinned (`jax-default`), the wall clock. JAX runs the padded batch (B·T rows), the "
        "packed rollout the real rows only (N); GFLOP/s and the floor count each one's own "
        "GEMM FLOPs.",
        "",
        f"**FLOP floor.** Clock {pk['clock_ghz']:.2f} GHz (dependent FMAs, "
        f"{FMA_LATENCY_CYCLES} cycles each) × {pk['flop_per_cycle']} fp32 FLOP per cycle "
        f"({pk['vendor']}) = **{peak_gflops:.0f} GFLOP/s**, the theoretical peak of one core "
        f"that the floor uses; MKL's sgemm of two 512 × 512 matrices reaches "
        f"{pk['sgemm_gflops']:.1f} GFLOP/s on it (one thread, the fastest of 100 calls).",
        "",
    ]
    for k, run in enumerate(runs, 1):
        load = ", ".join(f"{v:.2f}" for v in run["load"])
        out += [
            f"### Run {k}: threads `{run['layout']}` (torch threads {run['torch_threads']}, "
            f"{run['pinned']}; load average {load})",
            "",
        ]
        for shape in run["shapes"]:
            step_us = shape["flops_step_full"] / (peak_gflops * 1e3)
            out += [
                f"**{shape_label(shape['batch'], shape['steps'])}** (floor of a step with all "
                f"{shape['batch']} rows active: {shape['flops_step_full'] / 1e6:.2f} MFLOP, "
                f"{step_us:.1f} µs)",
                "",
                *shape_table(shape, peak_gflops, clock_of(run["layout"])),
                "",
            ]
    out.append(END)
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=2, help="runs of each thread layout")
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--sample-s", type=float, default=0.05)
    ap.add_argument("--layouts", nargs="*", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--out", type=Path, default=None, help=f"markdown file, e.g. {DEFAULT_OUT}")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--kernel-ab", action="store_true", help="also the kernel's own paths")
    ap.add_argument("--child", choices=LAYOUTS, help=argparse.SUPPRESS)
    ap.add_argument(
        "--variants", default="all", help="all, or RolloutVariant keys joined by commas"
    )
    ap.add_argument("--keep", type=int, default=3, help="after the first run: the fastest K")
    ap.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _child_env(args.child)
        result = child(
            args.child, args.variants, args.rounds, args.sample_s, args.quick, args.kernel_ab
        )
        args.json.write_text(json.dumps(result), encoding="utf-8")
        return 0
    started = dt.datetime.now(dt.UTC)
    runs = []
    kept: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="rnnserve-rvj-") as tmp:
        for k in range(args.runs):
            for layout in args.layouts:
                out = Path(tmp) / f"{k}-{layout}.json"
                variants = args.variants if k == 0 else kept[layout]
                cmd = [
                    sys.executable, "-m", "bench.rollout_vs_jax", "--child", layout,
                    "--variants", variants, "--rounds", str(args.rounds),
                    "--sample-s", str(args.sample_s), "--json", str(out),
                    *(["--quick"] if args.quick else []),
                    *(["--kernel-ab"] if args.kernel_ab else []),
                ]  # fmt: skip
                print(f"[rollout_vs_jax] run {k + 1}, threads {layout}", file=sys.stderr)
                subprocess.run(cmd, cwd=ROOT, check=True)
                runs.append(json.loads(out.read_text(encoding="utf-8")))
                if k == 0:
                    kept[layout] = fastest_keys(runs[-1], args.keep)
    text = render(runs, started, sys.argv[1:] if argv is None else argv)
    if args.out is not None:
        write_section(args.out, text, BEGIN, END)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
