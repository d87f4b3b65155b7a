"""Where the numba rollout's time goes: each piece of a step timed apart, at every batch size.

Usage (one core, one thread, as the rollout's FLOP floor is taken)::

    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 taskset -c 0 \\
        python -m bench.rollout_cpu_probe --breakdown [--shape 64x500] [--gemm-pad 1 4 8]

A step of the rollout (``models/kernels/rollout_cpu.py``) with ``b`` active rows is, per layer,
one GEMM ``g[:b] = z[:b] @ W`` and one fused cell over ``b`` rows, then the output layer and the
position feedback over ``b`` rows. Each piece is timed through the kernel's own compiled
functions, called ``n`` times inside one compiled loop (so Python's call overhead is not in the
figure), as this process's CPU time, the fastest of a few samples. The per-``b`` times summed
over the real batch-size schedule are then set against the whole rollout (the compiled loop
alone, and the public call with its host-side preparation), timed in interleaved rounds; what
is left over is the loop's own bookkeeping. ``--gemm-pad m`` adds the GEMMs' sum had each step
computed ``b`` rounded up to a multiple of ``m`` rows (capped at the batch).
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from bench.models_harness import half_spread_lengths, random_sequences
from bench.models_traveller import make_traveller
from bench.rollout_vs_jax import FLOP_PER_CYCLE, clock_hz, rollout_flops, vendor
from rnnserve.models.kernels import rollout_cpu as rc
from rnnserve.models.packing import pack


def _repeat_gemm(
    route: Any, z: Any, w: Any, packed: Any, b: int, g: Any, ints: Any, scalars: Any, n: int
) -> None:
    # the loop's own dispatch on the route it takes at b rows (packed: [S] bytes, or none)
    longs = np.zeros(9, np.int64)
    for _ in range(n):
        rc._gemm_route_jit(route, z, w, packed, b, g, ints, longs, scalars)


def _repeat_cell(g: Any, add: Any, c: Any, b: int, z: Any, col: int, z_next: Any, n: int) -> None:
    for _ in range(n):
        rc._cell_jit(g, add, c, b, z, col, z_next)


def _repeat_output(
    z_top: Any, col: int, w_out_t: Any, b_out: Any, b: int, scratch: Any, out: Any, z0: Any, n: int
) -> None:
    lanes, sums = scratch
    for _ in range(n):
        rc._output_layer_jit(z_top, col, w_out_t, b_out, b, lanes, sums, out, z0)


repeat_gemm = rc._jit(_repeat_gemm)
repeat_cell = rc._jit(_repeat_cell)
repeat_output = rc._jit(_repeat_output)


def cpu_seconds(fn: Callable[[int], object], min_s: float = 0.004, samples: int = 5) -> float:
    """CPU seconds of one repetition of ``fn(n)`` (which repeats its work ``n`` times): ``n`` is
    grown until a sample lasts ``min_s``, then the fastest of ``samples`` samples is kept."""
    n = 1
    while True:
        start = time.thread_time()
        fn(n)
        if time.thread_time() - start >= min_s:
            break
        n *= 4
    best = float("inf")
    for _ in range(samples):
        start = time.thread_time()
        fn(n)
        best = min(best, (time.thread_time() - start) / n)
    return best


def rollout_arrays(base: Any, x: Any) -> dict[str, Any]:
    """The arrays the public call hands to the compiled loop (``rollout_packed_numba``), zero
    initial state, float32; the weights packed for MKL wherever this build can, as the pieces
    are timed both ways."""
    w_cat, bias, w_out, b_out = base.fused_weights()
    u = x.data.float()
    weights = rc.loop_weights(w_cat, bias, w_out, b_out, torch.float32, u.shape[1])
    sizes = x.batch_sizes.numpy().astype(np.int64)
    table = rc.route_table(weights.num_layers, int(sizes[0]))
    if rc._MKL_PACK is not None:  # packed however short the rollout
        packed = rc._packed_weights(weights, int(sizes[0]))
    else:
        packed = rc._unpacked(weights.num_layers)
    return rc.loop_arguments(u, sizes, weights, (None, None, None), table, packed)


def piece_times(
    a: dict[str, Any], b: int, gemm_rows: int | None = None, packed: bool = True
) -> dict[str, float]:
    """CPU seconds of each piece of one step with ``b`` active rows (the GEMMs computing
    ``gemm_rows`` rows where given), on the rollout's own arrays; unless ``packed``, only the
    GEMMs, through sgemm_ on the unpacked weights."""
    rng = np.random.default_rng(b)
    hidden = a["c"].shape[2]
    z0 = (rng.standard_normal(a["z0"].shape) * 0.5).astype(np.float32)
    z1 = (rng.standard_normal(a["z_up"].shape[1:]) * 0.5).astype(np.float32)
    c = np.zeros(a["c"].shape[1:], np.float32)
    g = np.zeros((z0.shape[0], 4 * hidden), np.float32)
    ints, scalars = np.zeros(8, np.int32), np.zeros(2, np.float32)
    lanes, sums = np.zeros((2, 16), np.float32), np.zeros((2, 17, z0.shape[0]), np.float32)
    out = np.empty((z0.shape[0], 2), np.float32)
    no_rows = np.empty((0, 2 * hidden), np.float32)
    rows = b if gemm_rows is None else gemm_rows
    p0, p1 = a["packed"] if packed else np.zeros((2, 0), np.uint8)
    r0, r1 = a["routes"][:, min(rows, a["routes"].shape[1] - 1)]  # the route the rollout takes
    bias, w_up, pre = a["bias"], a["w_up"][0], g + 0.1
    gemms = {
        "gemm 0": cpu_seconds(
            lambda n: repeat_gemm(r0, z0, a["w0"], p0, rows, g, ints, scalars, n)
        ),
        "gemm 1": cpu_seconds(lambda n: repeat_gemm(r1, z1, w_up, p1, rows, g, ints, scalars, n)),
    }
    if not packed:
        return gemms
    return {
        **gemms,
        "cell 0": cpu_seconds(lambda n: repeat_cell(pre, bias[0], c, b, z0, 2, z1, n)),
        "cell 1": cpu_seconds(lambda n: repeat_cell(pre, bias[1], c, b, z1, hidden, no_rows, n)),
        "output": cpu_seconds(
            lambda n: repeat_output(
                z1, hidden, a["w_out_t"], a["b_out"], b, (lanes, sums), out, z0, n
            )
        ),
    }


def whole_times(base: Any, x: Any, a: dict[str, Any], rounds: int) -> dict[str, float]:
    """CPU seconds of the whole rollout, the fastest of ``rounds`` interleaved rounds: the
    compiled loop on prepared arrays, and the public call (host-side preparation included)."""
    sizes = x.batch_sizes.tolist()
    weights = base.fused_weights()
    keys = ("u", "batch_sizes", "w0", "w_up", "bias", "w_out_t", "b_out")

    def loop() -> None:
        state = {k: a[k].copy() for k in ("z0", "z_up", "c")}
        rc._rollout_loop_jit(
            *(a[k] for k in keys),
            *(state[k] for k in ("z0", "z_up", "c")),
            a["out"],
            a["routes"],
            a["packed"],
        )

    cases: dict[str, Callable[[], object]] = {
        "compiled loop": loop,
        "rollout_packed_numba": lambda: rc.rollout_packed_numba(x.data, sizes, *weights),
    }
    best = dict.fromkeys(cases, float("inf"))
    for fn in cases.values():
        fn()
    for r in range(rounds):
        names = list(cases)[r % 2 :] + list(cases)[: r % 2]
        for name in names:
            start = time.thread_time()
            cases[name]()
            best[name] = min(best[name], time.thread_time() - start)
    return best


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.2f}"


def min_over_passes(
    a: dict[str, Any], sizes: Sequence[int], passes: int
) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """Each piece at each batch size (and the GEMMs unpacked), the fastest of ``passes`` passes
    over all the sizes: a burst of load on the machine then spoils one pass, not the figure."""
    per_b: dict[int, dict[str, float]] = {}
    unpacked: dict[int, dict[str, float]] = {}
    for _ in range(passes):
        for b in sizes:
            t = piece_times(a, b)
            u = piece_times(a, b, packed=False)
            for table, new in ((per_b, t), (unpacked, u)):
                old = table.setdefault(b, new)
                table[b] = {k: min(old[k], new[k]) for k in new}
    return per_b, unpacked


def breakdown(batch: int, steps: int, rounds: int, pads: Sequence[int], passes: int = 3) -> None:
    base = make_traveller()
    x = pack(random_sequences(half_spread_lengths(batch, steps), base.num_inputs, 101))
    a = rollout_arrays(base, x)
    sizes = [int(v) for v in x.batch_sizes.tolist()]
    hidden, layers, inputs = base.hidden_size, base.num_layers, base.num_inputs
    peak = clock_hz() * FLOP_PER_CYCLE.get(vendor(), 32)
    floor_s = rollout_flops(sizes, inputs, hidden, layers) / peak
    print(f"B={batch} T={steps}: {sum(sizes)} rows, peak {peak / 1e9:.0f} GFLOP/s, BLAS {rc.BLAS}")
    per_b, unpacked = min_over_passes(a, sorted(set(sizes)), passes)
    names = [*per_b[sizes[0]], *(f"sgemm_ {k[-1]}" for k in unpacked[sizes[0]])]
    print("   b | " + " | ".join(f"{k:>8s}" for k in names) + " | µs/step | × floor")
    for b, t in per_b.items():
        step = sum(t.values())
        flo = rollout_flops([b], inputs, hidden, layers) / peak
        cells = " | ".join(f"{v * 1e6:8.1f}" for v in [*t.values(), *unpacked[b].values()])
        print(f"{b:4d} | {cells} | {step * 1e6:7.1f} | {step / flo:6.2f}")
    full = [b for b in sizes if b == sizes[0]]
    tail = [b for b in sizes if b != sizes[0]]
    print(f"summed over the schedule ({len(full)} full steps, {len(tail)} narrower), ms:")
    total = 0.0
    for piece in per_b[sizes[0]]:
        f_s = sum(per_b[b][piece] for b in full)
        t_s = sum(per_b[b][piece] for b in tail)
        total += f_s + t_s
        print(f"  {piece:8s} full {_ms(f_s)}  tail {_ms(t_s)}  all {_ms(f_s + t_s)}")
    print(f"  pieces   all {_ms(total)}  ({total / floor_s:.2f}× the floor {_ms(floor_s)})")
    for layer in ("0", "1"):
        f_s, t_s = (sum(unpacked[b][f"gemm {layer}"] for b in part) for part in (full, tail))
        print(
            f"  sgemm_ {layer} full {_ms(f_s)}  tail {_ms(t_s)}  all {_ms(f_s + t_s)}  (unpacked)"
        )
    whole = whole_times(base, x, a, rounds)
    for name, s in whole.items():
        print(f"  {name:22s} {_ms(s)}  ({s / floor_s:.2f}× floor; {_ms(s - total)} beyond pieces)")
    for m in pads:
        padded = {b: min(sizes[0], -(-b // m) * m) for b in set(sizes)}
        cache: dict[int, dict[str, float]] = {}
        for b in set(padded.values()):
            cache[b] = per_b[b] if b in per_b else piece_times(a, b, b)
        gemm = sum(cache[padded[b]]["gemm 0"] + cache[padded[b]]["gemm 1"] for b in sizes)
        now = sum(per_b[b]["gemm 0"] + per_b[b]["gemm 1"] for b in sizes)
        print(f"  GEMMs, rows padded to a multiple of {m:2d}: {_ms(gemm)} (unpadded {_ms(now)})")


def load_kernel(path: str) -> Any:
    """Another version of the kernel module, from a file (e.g. one ``git show`` wrote out)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"rollout_cpu_{abs(hash(path))}", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # registered before it runs, as an import would: dataclasses look their module up there
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def versions_ab(batch: int, steps: int, rounds: int, paths: Sequence[str]) -> None:
    """The public call of this kernel and of each version in ``paths``, on the same inputs, in
    interleaved rounds (the order rotated each round): CPU ms per call, min and median, and the
    median over rounds of each version's time over this tree's in the same round."""
    base = make_traveller()
    x = pack(random_sequences(half_spread_lengths(batch, steps), base.num_inputs, 101))
    sizes, weights = x.batch_sizes.tolist(), base.fused_weights()
    kernels = {"this tree": rc, **{p: load_kernel(p) for p in paths}}
    want = rc.rollout_packed_numba(x.data, sizes, *weights)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for name, k in kernels.items():
        got = k.rollout_packed_numba(x.data, sizes, *weights)
        err = max(float((a - b).abs().max()) for a, b in zip(got, want, strict=True))
        print(f"  {name}: max |diff| vs this tree {err:.1e}")
    names = list(kernels)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.thread_time()
            kernels[name].rollout_packed_numba(x.data, sizes, *weights)
            times[name].append(time.thread_time() - start)
    flops = rollout_flops(sizes, base.num_inputs, base.hidden_size, base.num_layers)
    peak = clock_hz() * FLOP_PER_CYCLE.get(vendor(), 32)
    first = times[names[0]]
    for name, ts in times.items():
        med = statistics.median(ts)
        # a round's calls ran within a second of each other: their ratio cancels slower swings
        # of the machine's load, which the spread of each version's own times does not
        paired = statistics.median(t / f for t, f in zip(ts, first, strict=True))
        print(
            f"  {name:40s} min {_ms(min(ts))}  median {_ms(med)} ms  "
            f"({min(ts) * peak / flops:.2f}-{med * peak / flops:.2f}× floor)  "
            f"paired median {paired:.3f}× this tree"
        )
