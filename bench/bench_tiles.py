"""Tile sweeps of the Triton kernels: the data to choose their defaults by.

Usage::

    python -m bench.bench_tiles [--device cuda] [--quick] [--budget-s 150] [--out FILE]
        [--scans chunked,chained] [--kernels smoother,rollout] [--gpu-time]

The Triton kernels' tiles were chosen by reasoning, on a machine without a GPU; the first H200 run
(docs/BENCHMARKS.md) put both kernels well off their targets. GPU time comes in minutes, so this
sweep measures, within a time budget, candidate tiles for the benchmark's shapes (it is not part
of ``bench.gpu_decide``'s ten-minute run, which measures each design's default plan and a few
``sub`` tiles; run it on its own when a GPU host has time to spare):

- the smoother (``smooth_packed_triton``): the single-pass chained scan (``scan="chained"``, one
  program per column block walking its chunks in order) with its ``chunk`` × ``block`` tiles, then
  the default chunked scan's ``chunk`` × ``block`` × ``sub`` (the forward scanning each chunk in
  pieces of ``sub`` steps; ``sub == chunk`` is one tree scan of the tile); the single-pass
  look-back scan (``scan="lookback"``) only when ``--scans`` names it: its programs wait on one
  another, so a fault there is a hang: sweep it in a process of its own, under a timeout
  (``bench.gpu_decide`` measures each design in a step of its own);
- the Traveller's rollout (``TritonRollout``): ``KernelConfig`` tiles (rows × hidden units ×
  K, warps), ``tl.dot`` precision (``ieee`` or ``tf32x3``) and programmatic dependent launch.

Each candidate is checked against the default's output (max abs difference; over 1e-5 it is
flagged, not ranked), then timed: the median of ``reps`` calls after a warm-up call, each call
synchronised (CUDA events on the GPU). The default runs first, so it is always measured; the rest
run in order until the budget is spent, and the section says how many did. Reported per shape:
the default and the fastest candidates, as time per call, µs per step and × the default.

``--gpu-time`` (CUDA only) adds the GPU time of each of ``--scans``' forward designs, default
plan, without the host: the capturable inner entry (``launch_forward``) on several preallocated
buffer sets, together more than the L2 several times over, captured in one CUDA graph that runs
them in turn (rotating inputs: each forward reads rows the one before did not leave in L2);
CUDA events around each replay, the median replay divided by the forwards in it. The eager
figures above include Python, planning, the schedule's copy and allocation; these do not.

On the CPU (``--device cpu --quick``) the kernels run in Triton's interpreter on tiny shapes: a
smoke test of the sweep, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from bench.models_harness import DEFAULT_OUT, half_spread_lengths, random_sequences, write_section
from rnnserve.models.packing import pack
from rnnserve.models.traveller import Traveller

BEGIN = "<!-- bench_tiles:begin -->"
END = "<!-- bench_tiles:end -->"
TOLERANCE = 1e-5
SHOWN = 6  # fastest candidates listed per shape besides the default
# the smoother's forward designs swept by default; "lookback" spins on flags other programs set,
# so it is swept on its own, in a process under a timeout
DEFAULT_SCANS = ("chunked", "chained")
KERNELS = ("smoother", "rollout")
# --gpu-time: the buffer sets one graph rotates through hold at least this many bytes (an H200's
# L2 is 50 MiB), between 2 and GRAPH_MAX_SETS sets
GRAPH_BYTES = 256 << 20
GRAPH_MAX_SETS = 32
GRAPH_REPS = 20


@dataclass(frozen=True)
class Plan:
    smoother_shapes: tuple[tuple[int, int], ...]  # (B, T), lengths T/2..T, 16 features
    rollout_shapes: tuple[tuple[int, int], ...]  # (B, T), the served Traveller's size
    hidden: int
    reps: int
    quick: bool


PLANS = {
    False: Plan(
        ((64, 1000), (256, 4000), (1, 100_000)), ((1, 1000), (64, 500), (1024, 200)), 128, 7, False
    ),
    True: Plan(((3, 20),), ((1, 6), (20, 4)), 16, 1, True),
}


@dataclass
class Result:
    kernel: str  # "smoother" or "rollout"
    shape: tuple[int, int]
    config: str
    seconds: float | None  # None: not timed (failed, or off by more than the tolerance)
    error: float | None  # max abs difference from the default's output
    note: str = ""


# --------------------------------------------------------------------------- candidates


def smoother_candidates(
    batch: int, steps: int, feat: int, quick: bool, scans: Sequence[str] = DEFAULT_SCANS
) -> Iterator[dict[str, Any]]:
    """The default plan first (no override), then of ``scans`` in this order: the single-pass
    chained scan (its own plan, then its tiles), the look-back scan (likewise), the chunked
    scan's tiles from the likeliest up."""
    yield {}
    if quick:
        if "chained" in scans:
            yield {"scan": "chained", "chunk": 4, "block": 16}
        if "lookback" in scans:
            yield {"scan": "lookback", "chunk": 4, "block": 16}
        if "chunked" in scans:
            yield {"chunk": 4, "block": 16, "sub": 1}
            yield {"chunk": 8, "block": 32, "sub": 2}
        return
    if "chained" in scans:
        yield {"scan": "chained"}
        for block in (16, 32, 64):
            for chunk in (256, 128, 64):
                if chunk * block <= 8192:
                    yield {"scan": "chained", "chunk": chunk, "block": block}
    if "lookback" in scans:
        yield {"scan": "lookback"}
        for block in (128, 64, 32):
            for chunk in (32, 64, 16):
                yield {"scan": "lookback", "chunk": chunk, "block": block}
    if "chunked" not in scans:
        return
    widest = max(32, 1 << (batch * feat - 1).bit_length())  # no wider than the batch's columns
    for chunk in (64, 128, 32, 256):
        for block in (b for b in (128, 256, 64, 32) if b <= widest):
            for sub in (1, 8, chunk):
                if sub == chunk and chunk * block > 8192:
                    continue  # one tree scan of a tile that size spills registers
                yield {"chunk": chunk, "block": block, "sub": sub}


def rollout_candidates(batch: int, quick: bool) -> Iterator[dict[str, Any]]:
    """The default first, then its PDL and tf32x3 forms, then other tiles."""
    from rnnserve.models.kernels.rollout_triton import KernelConfig

    yield {}
    yield {"pdl": True}
    if quick:
        yield {"config": KernelConfig(2, 8, 16, use_dot=False, num_warps=1)}
        return
    yield {"precision": "tf32x3"}
    if batch < 16:  # broadcast-and-sum (tl.dot pads M to 16), with PDL (faster at B=1)
        for block_h in (4, 8, 16):
            for block_k in (128, 64, 256):
                for warps in (1, 2, 4):
                    cfg = KernelConfig(batch, block_h, block_k, use_dot=False, num_warps=warps)
                    yield {"config": cfg, "pdl": True}
        return
    for block_b in (32, 64, 16):
        for block_h in (32, 16, 64):
            for block_k in (32, 64):
                for warps in (4, 8):
                    cfg = KernelConfig(block_b, block_h, block_k, use_dot=True, num_warps=warps)
                    yield {"config": cfg}


def _describe(kwargs: dict[str, Any]) -> str:
    if not kwargs:
        return "default"
    parts = []
    for key, value in kwargs.items():
        if key == "config":
            kind = "dot" if value.use_dot else "sum"
            parts.append(
                f"{kind} {value.block_b}×{value.block_h}×{value.block_k}, {value.num_warps} warps"
            )
        elif key == "pdl":
            parts.append("PDL" if value else "no PDL")
        else:
            parts.append(f"{key}={value}")
    return ", ".join(parts)


# --------------------------------------------------------------------------- timing


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    def on_cuda(fn: Callable[[], object], reps: int) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return float(statistics.median(times))

    def on_cpu(fn: Callable[[], object], reps: int) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return float(statistics.median(times))

    return on_cuda if device.type == "cuda" else on_cpu


@dataclass
class GraphResult:
    shape: tuple[int, int]
    scan: str
    seconds: float | None  # GPU time per forward; None: failed
    sets: int  # buffer sets rotated through
    error: float | None  # max abs difference from the public call on one set's rows
    note: str = ""


def rotating_sets(
    data: Tensor, batch_sizes: Tensor, alpha: Tensor, wx: Tensor, scan: str
) -> list[Any]:
    """Buffer sets of ``scan``'s default plan for this batch, each with rows of its own, enough
    of them to hold :data:`GRAPH_BYTES`."""
    from rnnserve.models.kernels.smoother_triton import prepare_forward

    first = prepare_forward(data, batch_sizes, alpha, wx, scan=scan)
    held = sum(
        t.numel() * t.element_size() for t in (first.x, first.y, first.final, *first.scratch)
    )
    count = min(GRAPH_MAX_SETS, max(2, -(-GRAPH_BYTES // max(held, 1))))
    sets = [first]
    for k in range(1, count):
        rows = data * (1.0 + k / count) - k / count  # other rows, the same schedule
        sets.append(prepare_forward(rows, batch_sizes, alpha, wx, scan=scan))
    return sets


def graph_seconds(sets: Sequence[Any], reps: int) -> float:
    """GPU seconds per forward: one CUDA graph launching the forward on every set in turn,
    timed with CUDA events over ``reps`` replays (the median)."""
    from rnnserve.models.kernels.smoother_triton import launch_forward

    for buf in sets:  # compile (and load) outside the capture
        launch_forward(buf)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for buf in sets:
            launch_forward(buf)
    graph.replay()  # one untimed replay
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(sets))
    return float(statistics.median(times))


def gpu_time(
    shape: tuple[int, int], packed: PackedSequence, alpha: Tensor, wx: Tensor, scan: str
) -> GraphResult:
    """One design's GPU time on this batch, checked against the public call on one set."""
    from rnnserve.models.kernels.smoother_triton import smooth_packed_triton

    try:
        with torch.inference_mode():
            sets = rotating_sets(packed.data, packed.batch_sizes, alpha, wx, scan)
            seconds = graph_seconds(sets, GRAPH_REPS)
            last = sets[-1]
            want = smooth_packed_triton(last.x, packed.batch_sizes, alpha, wx, None, scan=scan)
            error = float((last.y - want[0]).abs().max())
    except Exception as e:  # a design that fails under capture is a result too
        note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        return GraphResult(shape, scan, None, 0, None, note)
    if error > TOLERANCE:
        return GraphResult(shape, scan, None, len(sets), error, "off")
    return GraphResult(shape, scan, seconds, len(sets), error)


class Sweep:
    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        budget_s: float,
        scans: Sequence[str] = DEFAULT_SCANS,
        kernels: Sequence[str] = KERNELS,
    ) -> None:
        self.plan, self.device = plan, device
        self.scans, self.kernels = tuple(scans), tuple(kernels)
        self.budget_s = budget_s  # per kernel, shared evenly by its shapes
        self.deadline = 0.0
        self.clock = _timer(device)
        self.results: list[Result] = []
        self.graph_results: list[GraphResult] = []
        self.left: dict[str, int] = {}  # candidates not tried for lack of time, per kernel

    def out_of_time(self) -> bool:
        return time.perf_counter() > self.deadline

    def _try(
        self,
        kernel: str,
        shape: tuple[int, int],
        config: str,
        run: Callable[[], Tensor],
        want: Tensor | None,
    ) -> Tensor | None:
        try:
            got = run()
            error = None if want is None else float((got - want).abs().max())
            if error is not None and error > TOLERANCE:
                self.results.append(Result(kernel, shape, config, None, error, "off"))
                return None
            seconds = self.clock(run, self.plan.reps)
        except Exception as e:  # a tile the compiler or the GPU refuses is a result too
            note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            self.results.append(Result(kernel, shape, config, None, None, note))
            return None
        self.results.append(Result(kernel, shape, config, seconds, error))
        return got

    def smoother(self) -> None:
        from rnnserve.models.kernels.smoother_triton import smooth_packed_triton

        feat = 16
        gen = torch.Generator().manual_seed(0)
        alpha = (0.05 + 0.9 * torch.rand(feat, generator=gen)).to(self.device)
        wx = (0.2 + 1.5 * torch.rand(feat, generator=gen)).to(self.device)
        shapes = self.plan.smoother_shapes
        for batch, steps in shapes:
            self.deadline = time.perf_counter() + self.budget_s / len(shapes)
            seqs = random_sequences(half_spread_lengths(batch, steps), feat, seed=steps)
            packed = pack(seqs, self.device)
            want: Tensor | None = None
            candidates = smoother_candidates(batch, steps, feat, self.plan.quick, self.scans)
            for n, tiles in enumerate(candidates):
                if n and self.out_of_time():
                    self.left["smoother"] = self.left.get("smoother", 0) + 1
                    continue

                def run(tiles: dict[str, Any] = tiles, x: Any = packed) -> Tensor:
                    with torch.inference_mode():
                        return smooth_packed_triton(
                            x.data, x.batch_sizes, alpha, wx, None, **tiles
                        )[0]

                got = self._try("smoother", (batch, steps), _describe(tiles), run, want)
                if n == 0:
                    want = got

    def smoother_gpu_time(self) -> None:
        """Each design's default plan, GPU time only (see ``--gpu-time``); CUDA only."""
        if self.device.type != "cuda":
            raise RuntimeError("--gpu-time replays CUDA graphs: it needs --device cuda")
        feat = 16
        gen = torch.Generator().manual_seed(0)
        alpha = (0.05 + 0.9 * torch.rand(feat, generator=gen)).to(self.device)
        wx = (0.2 + 1.5 * torch.rand(feat, generator=gen)).to(self.device)
        for batch, steps in self.plan.smoother_shapes:
            seqs = random_sequences(half_spread_lengths(batch, steps), feat, seed=steps)
            packed = pack(seqs, self.device)
            for scan in self.scans:
                self.graph_results.append(gpu_time((batch, steps), packed, alpha, wx, scan))
                torch.cuda.empty_cache()  # this design's sets are freed: give them back

    def rollout(self) -> None:
        from rnnserve.models.kernels.rollout_triton import TritonRollout

        torch.manual_seed(0)
        model = Traveller(6, self.plan.hidden, 2).to(self.device)
        weights = model.fused_weights()
        shapes = self.plan.rollout_shapes
        for batch, steps in shapes:
            self.deadline = time.perf_counter() + self.budget_s / len(shapes)
            seqs = random_sequences(half_spread_lengths(batch, steps), 6, seed=steps)
            packed = pack(seqs, self.device)
            sizes = packed.batch_sizes.tolist()
            want: Tensor | None = None
            for n, kwargs in enumerate(rollout_candidates(batch, self.plan.quick)):
                if n and self.out_of_time():
                    self.left["rollout"] = self.left.get("rollout", 0) + 1
                    continue
                roll = TritonRollout(**kwargs)

                def run(
                    roll: TritonRollout = roll, u: Tensor = packed.data, sizes: list[int] = sizes
                ) -> Tensor:
                    with torch.inference_mode():
                        return roll(u, sizes, *weights)[0]

                got = self._try("rollout", (batch, steps), _describe(kwargs), run, want)
                if n == 0:
                    want = got


# --------------------------------------------------------------------------- report


def render(sweep: Sweep, started: dt.datetime, wall: float, machine: str) -> str:
    plan = sweep.plan
    options = " --quick" if plan.quick else ""
    options += f" --device {sweep.device.type}" if sweep.device.type != "cuda" else ""
    options += f" --scans {','.join(sweep.scans)}" if sweep.scans != DEFAULT_SCANS else ""
    options += f" --kernels {','.join(sweep.kernels)}" if sweep.kernels != KERNELS else ""
    options += " --gpu-time" if sweep.graph_results else ""
    out = [
        BEGIN,
        f"## Triton tile sweep (`python -m bench.bench_tiles{options}`)",
        "",
        f"{machine}; {started.strftime('%Y-%m-%d %H:%M UTC')}; {wall:.0f} s. Median of "
        f"{plan.reps} synchronised calls after a warm-up call; each candidate checked against "
        f"the default's output first (over {TOLERANCE:g} it is listed as off, not timed). The "
        "default runs first; the rest in order until the time budget was spent.",
        "",
    ]
    if plan.quick:
        out += ["*Quick mode: tiny shapes, a smoke test of the sweep, not a measurement.*", ""]
    for kernel, shapes in (("smoother", plan.smoother_shapes), ("rollout", plan.rollout_shapes)):
        if kernel not in sweep.kernels:
            continue
        out += [f"### {kernel.capitalize()}", ""]
        out += ["| shape | tiles | ms per call | µs per step | × default | max abs diff |"]
        out += ["|---|---|---|---|---|---|"]
        for batch, steps in shapes:
            rows = [r for r in sweep.results if r.kernel == kernel and r.shape == (batch, steps)]
            timed = [r for r in rows if r.seconds is not None]
            if not timed:
                continue
            default = next((r for r in rows if r.config == "default"), None)
            base = default.seconds if default is not None and default.seconds else None
            best = sorted((r for r in timed if r is not default), key=lambda r: r.seconds or 0)
            for r in ([default] if default is not None else []) + best[:SHOWN]:
                seconds = r.seconds or 0.0
                ratio = f"{seconds / base:.2f}×" if base else "n/a"
                err = "—" if r.error is None else f"{r.error:.1e}"
                out.append(
                    f"| B={batch}, T={steps} | {r.config} | {seconds * 1e3:.3g} | "
                    f"{seconds / steps * 1e6:.3g} | {ratio} | {err} |"
                )
        out.append("")
        tried = [r for r in sweep.results if r.kernel == kernel]
        bad = [r for r in tried if r.seconds is None]
        out.append(
            f"{len(tried)} candidates tried, {len(tried) - len(bad)} timed"
            + (f", {sweep.left[kernel]} left for lack of time" if kernel in sweep.left else "")
            + "."
        )
        for r in bad[:10]:
            what = r.note if r.note != "off" else f"off by {r.error:.1e}"
            out.append(f"- B={r.shape[0]}, T={r.shape[1]}, {r.config}: {what}")
        out.append("")
    out += render_gpu_time(sweep.graph_results)
    out.append(END)
    return "\n".join(out) + "\n"


def render_gpu_time(results: Sequence[GraphResult]) -> list[str]:
    """The ``--gpu-time`` table (nothing when it did not run)."""
    if not results:
        return []
    out = [
        "### Smoother, GPU time (`--gpu-time`)",
        "",
        f"Each design's default plan: `launch_forward` on preallocated buffer sets (at least "
        f"{GRAPH_BYTES >> 20} MiB of them, rotated through) captured in one CUDA graph; median of "
        f"{GRAPH_REPS} replays timed with CUDA events, per forward. No Python, planning, "
        "schedule copy or allocation in these, unlike the eager figures above.",
        "",
        "| shape | design | µs per forward | ns per step | sets | max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        err = "—" if r.error is None else f"{r.error:.1e}"
        if r.seconds is None:
            what = r.note if r.note != "off" else f"off by {err}"
            out.append(
                f"| B={r.shape[0]}, T={r.shape[1]} | {r.scan} | {what} | | {r.sets} | {err} |"
            )
            continue
        out.append(
            f"| B={r.shape[0]}, T={r.shape[1]} | {r.scan} | {r.seconds * 1e6:.4g} | "
            f"{r.seconds / r.shape[1] * 1e9:.4g} | {r.sets} | {err} |"
        )
    out.append("")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop trying after this")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    parser.add_argument(
        "--scans",
        default=",".join(DEFAULT_SCANS),
        help="the smoother's forward designs to sweep, comma-separated (chunked, chained, "
        "lookback); the default plan runs first whatever they are",
    )
    parser.add_argument(
        "--kernels", default=",".join(KERNELS), help="comma-separated: smoother, rollout"
    )
    parser.add_argument(
        "--gpu-time",
        action="store_true",
        help="also time each --scans design's forward on the GPU alone: CUDA graph replays "
        "over rotating inputs, CUDA events (CUDA only)",
    )
    args = parser.parse_args(argv)
    from rnnserve.models.kernels.smoother_triton import SCANS

    scans = tuple(s for s in args.scans.split(",") if s)
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if not scans or set(scans) - set(SCANS):
        parser.error(f"--scans: choose from {', '.join(SCANS)}")
    if not kernels or set(kernels) - set(KERNELS):
        parser.error(f"--kernels: choose from {', '.join(KERNELS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_tiles: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if args.gpu_time and device.type != "cuda":
        parser.error("--gpu-time replays CUDA graphs and times them with CUDA events: CUDA only")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_tiles: on the CPU the kernels need TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if device.type == "cuda":
        machine = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    else:
        machine = "CPU, Triton's interpreter"
    plan = PLANS[args.quick]
    started = dt.datetime.now(dt.UTC)
    t0 = time.perf_counter()
    # shared evenly by the kernels, and by each kernel's shapes
    sweep = Sweep(plan, device, args.budget_s / len(kernels), scans, kernels)
    if "smoother" in kernels:
        sweep.smoother()
        if args.gpu_time:
            sweep.smoother_gpu_time()
    if "rollout" in kernels:
        sweep.rollout()
    section = render(sweep, started, time.perf_counter() - t0, machine)
    write_section(args.out, section, BEGIN, END)
    print(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
