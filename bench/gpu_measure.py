"""The measurements of ``bench.gpu_decide``, one step a process: ``python -m bench.gpu_measure
STEP OUT.json [--cpu] [--quick]``.

Each step writes its results to ``OUT.json`` as it goes (after each shape), so a step killed by
its timeout leaves what it had measured. On CUDA the figures are:

- GPU µs: a CUDA graph launching the work on several buffer sets in turn (rotating inputs, more
  bytes than the L2 holds), timed with CUDA events over replays, the median per launch;
- wall µs: one public call, synchronised before and after (what a caller waits), the median;
- error: the largest absolute difference from a float64 reference computed on the CPU.

With ``--cpu`` the kernels run in Triton's interpreter on tiny shapes and every "GPU" figure is a
``perf_counter`` time of the same inner entry: a dry run of the code paths, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from bench.models_harness import half_spread_lengths, random_sequences
from rnnserve.models.kernels import ema_packed_numba
from rnnserve.models.packing import pack

FEAT = 16  # the served smoother's features
ROLLING_BYTES = 256 << 20  # bytes the rotated buffer sets hold together (an H200's L2: 50 MiB)
MAX_SETS = 32
SMOOTHER_SHAPES = {False: ((256, 4000), (64, 1000), (1, 100_000)), True: ((3, 9), (1, 12))}
ROLLOUT_SHAPES = {False: ((1, 1000), (64, 500), (1024, 200)), True: ((1, 6), (5, 4))}
ROLLOUT_HIDDEN = {False: 128, True: 16}
HOST_SHAPE = {False: (1, 100), True: (1, 8)}  # one sequence: GPU time of a few µs
DEFAULT = "default plan"
# (label, tiles): each design's default plan and the variants measured beside it
DESIGN_TILES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "chunked": ((DEFAULT, {}), ("sub=8", {"sub": 8}), ("sub=1", {"sub": 1})),
    "chained": ((DEFAULT, {}),),
    "lookback": ((DEFAULT, {}),),
}
# --quick: tiny tiles stand in for every plan (the interpreter pays per program and operation)
_TINY: dict[str, Any] = {"chunk": 4, "block": 16}
QUICK_TILES: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {
    "chunked": ((DEFAULT, {**_TINY, "carry": 4}), ("sub=2", {**_TINY, "carry": 4, "sub": 2})),
    "chained": ((DEFAULT, _TINY),),
    "lookback": ((DEFAULT, _TINY),),
}


class Emitter:
    """A step's results, rewritten to its JSON file after every addition."""

    def __init__(self, path: Path, step: str, device: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"step": step, "device": device, "rows": [], "done": False}

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        self.write()

    def set(self, **fields: Any) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str), encoding="utf-8")
        tmp.replace(self.path)


# --------------------------------------------------------------------------- clocks


def synced(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def wall_us(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median µs of one call, synchronised before and after."""
    sync = synced(device)
    fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times)) * 1e6


def gpu_us(launches: Sequence[Callable[[], object]], device: torch.device, reps: int) -> float:
    """Median µs per launch of ``launches`` (each on buffers of its own) captured in one CUDA
    graph, timed with events; on the CPU the same launches timed with ``perf_counter``."""
    for launch in launches:  # compile and load outside the capture
        launch()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for launch in launches:
            launch()
        return (time.perf_counter() - t0) / len(launches) * 1e6
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(launches))
    return float(statistics.median(times))


def forwards(sets: Sequence[Any]) -> list[Callable[[], None]]:
    """The smoother's inner entry on each buffer set, as launches for :func:`gpu_us`."""
    from rnnserve.models.kernels.smoother_triton import launch_forward

    def launch(buf: Any) -> Callable[[], None]:
        return lambda: launch_forward(buf)

    return [launch(b) for b in sets]


def set_count(bytes_per_set: int) -> int:
    return int(min(MAX_SETS, max(2, -(-ROLLING_BYTES // max(bytes_per_set, 1)))))


# --------------------------------------------------------------------------- floors


def step_floors(em: Emitter, device: torch.device, quick: bool) -> None:
    """A copy of each smoother shape's packed bytes (graph-timed like the kernels, and one
    ``copy_`` call's wall time), and the cost of launching an empty Triton kernel."""
    reps = 3 if quick else 20
    for batch, steps in SMOOTHER_SHAPES[quick]:
        rows = sum(half_spread_lengths(batch, steps))
        count = set_count(2 * rows * FEAT * 4)
        src = [torch.randn(rows, FEAT, device=device) for _ in range(count)]
        dst = [torch.empty_like(s) for s in src]
        copies = [lambda d=d, s=s: d.copy_(s) for d, s in zip(dst, src, strict=True)]
        em.add(
            {
                "what": "copy",
                "shape": [batch, steps],
                "bytes_moved": 2 * rows * FEAT * 4,
                "gpu_us": gpu_us(copies, device, reps),
                "wall_us": wall_us(copies[0], device, reps * 5),
            }
        )
        del src, dst, copies
    from bench.gpu_kernels import empty_launch

    target = torch.zeros(16, device=device)
    launch = empty_launch(target)
    launches = 1 if device.type != "cuda" else 200
    t0 = time.perf_counter()
    for _ in range(launches):
        launch()
    synced(device)()
    em.add(
        {
            "what": "launch",
            "host_us_per_launch": (time.perf_counter() - t0) / launches * 1e6,
            "wall_us": wall_us(launch, device, reps * 5),
            "gpu_us": gpu_us([launch] * (1 if device.type != "cuda" else 50), device, reps),
        }
    )


# --------------------------------------------------------------------------- the smoother


def smoother_batch(batch: int, steps: int, device: torch.device) -> tuple[Any, Tensor, Tensor]:
    seqs = random_sequences(half_spread_lengths(batch, steps), FEAT, seed=steps)
    gen = torch.Generator().manual_seed(0)
    alpha = 0.05 + 0.9 * torch.rand(FEAT, generator=gen)
    wx = 0.2 + 1.5 * torch.rand(FEAT, generator=gen)
    return pack(seqs, device), alpha.to(device), wx.to(device)


def smoother_reference(packed: Any, alpha: Tensor, wx: Tensor) -> Tensor:
    """float64 ``y`` of the packed rows, on the CPU (the numba kernel)."""
    x = packed.data.detach().cpu().double()
    s = ema_packed_numba(x, packed.batch_sizes, alpha.cpu().double(), None)
    return torch.tanh(wx.cpu().double() * s)


def smoother_row(
    design: str,
    label: str,
    tiles: dict[str, Any],
    shape: tuple[int, int],
    device: torch.device,
    quick: bool,
) -> dict[str, Any]:
    from rnnserve.models.kernels import smoother_triton as st

    packed, alpha, wx = smoother_batch(*shape, device)
    want = smoother_reference(packed, alpha, wx)
    reps = 2 if quick else 20
    row: dict[str, Any] = {"design": design, "tiles": label, "shape": list(shape)}
    with torch.inference_mode():
        call = lambda: st.smooth_packed_triton(  # noqa: E731
            packed.data, packed.batch_sizes, alpha, wx, None, scan=design, **tiles
        )
        y, _ = call()
        row["error"] = float((y.double().cpu() - want).abs().max())
        row["wall_us"] = wall_us(call, device, reps)
        first = st.prepare_forward(packed.data, packed.batch_sizes, alpha, wx, scan=design, **tiles)
        held = sum(t.numel() * t.element_size() for t in (first.x, first.y, *first.scratch))
        sets = [first] + [
            st.prepare_forward(
                packed.data * (1 + k / 8), packed.batch_sizes, alpha, wx, scan=design, **tiles
            )
            for k in range(1, 1 if device.type != "cuda" else set_count(held))
        ]
        row["gpu_us"] = gpu_us(forwards(sets), device, reps)
        row["sets"] = len(sets)
        row["plan"] = {k: getattr(first.plan, k) for k in ("chunk", "block", "sub", "carry")}
    del sets, first
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def step_smoother(em: Emitter, device: torch.device, quick: bool, design: str) -> None:
    for shape in SMOOTHER_SHAPES[quick]:
        for label, tiles in (QUICK_TILES if quick else DESIGN_TILES)[design]:
            try:
                em.add(smoother_row(design, label, tiles, shape, device, quick))
            except Exception as e:  # a design the GPU refuses is a result too
                em.add(
                    {
                        "design": design,
                        "tiles": label,
                        "shape": list(shape),
                        "failed": f"{type(e).__name__}: {str(e)[:300]}",
                    }
                )


def compiled_binaries() -> int | None:
    """Binaries the smoother's kernels hold in Triton's in-process caches (None: unknown, as
    in the interpreter)."""
    from rnnserve.models.kernels import smoother_triton as st

    total = 0
    for kernel in (st._fwd_chunk_summary, st._carry_scan, st._fwd_replay):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        try:  # (kernel cache, ...) per device in the Triton versions met so far
            total += sum(len(entry[0]) for entry in caches.values())
        except (TypeError, IndexError, KeyError):
            return None
    return total


def step_host(em: Emitter, device: torch.device, quick: bool) -> None:
    """Host overhead of the public call on a one-sequence batch (wall per call minus its GPU
    time, and the host parts timed alone), then compiles over random batches after warm-up."""
    from rnnserve.models.kernels import smoother_triton as st

    packed, alpha, wx = smoother_batch(*HOST_SHAPE[quick], device)
    reps = 2 if quick else 300
    tiles: dict[str, Any] = QUICK_TILES["chunked"][0][1] if quick else {}
    with torch.inference_mode():
        data, sizes = packed.data, packed.batch_sizes
        call = lambda: st.smooth_packed_triton(data, sizes, alpha, wx, None, **tiles)  # noqa: E731
        wall = wall_us(call, device, reps)
        count = 1 if quick else 8
        sets = [
            st.prepare_forward(data * (1 + k / 8), sizes, alpha, wx, **tiles) for k in range(count)
        ]
        gpu = gpu_us(forwards(sets), device, reps)
        plan = st.plan_tiles(int(sizes.numel()), int(sizes[0]), FEAT, **tiles)
        parts = {
            "plan_tiles": lambda: st.plan_tiles(int(sizes.numel()), int(sizes[0]), FEAT, **tiles),
            "device_schedule": lambda: st.device_schedule(sizes, plan, data.device),
            "prepare_forward": lambda: st.prepare_forward(data, sizes, alpha, wx, **tiles),
            "launch_forward": lambda: st.launch_forward(sets[0]),
        }
        host = {name: _host_us(fn, reps) for name, fn in parts.items()}
    em.add(
        {
            "what": "host overhead",
            "shape": list(HOST_SHAPE[quick]),
            "wall_us": wall,
            "gpu_us": gpu,
            "host_us": wall - gpu,
            "parts_us": host,
        }
    )
    em.add(compiles_after_warm_up(device, 2 if quick else 200, quick))


def _host_us(fn: Callable[[], object], reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def compiles_after_warm_up(device: torch.device, batches: int, quick: bool) -> dict[str, Any]:
    """New binaries in Triton's caches over random served batches (1 to 256 sequences, 1 to
    4000 steps) after the server's warm-up. Quick: two tiny batches, the warm-up not run (the
    interpreter has no binaries to count)."""
    from rnnserve.models.kernels import smoother_triton as st

    rng = np.random.default_rng(22)
    gen = torch.Generator().manual_seed(1)
    alpha, wx = torch.full((FEAT,), 0.5, device=device), torch.ones(FEAT, device=device)
    max_steps, max_seqs = (4, 2) if quick else (4000, 256)
    if not quick:
        st.warm_up(FEAT, max_steps, alpha, wx, device=device)
    before = compiled_binaries()
    for _ in range(batches):
        lengths = rng.integers(1, max_steps + 1, size=int(rng.integers(1, max_seqs + 1)))
        seqs = [torch.randn(int(n), FEAT, generator=gen) for n in lengths]
        packed = pack(seqs, device)
        tiles: dict[str, Any] = QUICK_TILES["chunked"][0][1] if quick else {}
        with torch.inference_mode():
            st.smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, None, **tiles)
    after = compiled_binaries()
    compiles = None if before is None or after is None else after - before
    return {"what": "compiles after warm-up", "batches": batches, "compiles": compiles}


# --------------------------------------------------------------------------- the rollout


def traveller(hidden: int, device: torch.device) -> Any:
    from rnnserve.models.traveller import Traveller

    torch.manual_seed(0)
    return Traveller(6, hidden, 2).to(device)


def rollout_reference(model: Any, packed: Any) -> Tensor:
    """float64 positions of the packed inputs, on the CPU (the torch rollout)."""
    import copy

    from rnnserve.models.traveller import rollout_packed

    cpu = copy.deepcopy(model).cpu().double()
    u = packed.data.detach().cpu().double()
    return rollout_packed(u, packed.batch_sizes.tolist(), *cpu.fused_weights())[0]


def step_rollout(em: Emitter, device: torch.device, quick: bool) -> None:
    from rnnserve.models.kernels.rollout_triton import TritonRollout

    model = traveller(ROLLOUT_HIDDEN[quick], device)
    weights = model.fused_weights()
    reps = 2 if quick else 10
    for batch, steps in ROLLOUT_SHAPES[quick]:
        packed = pack(random_sequences(half_spread_lengths(batch, steps), 6, seed=steps), device)
        want = rollout_reference(model, packed)
        sizes = packed.batch_sizes.tolist()
        variants: tuple[tuple[str, dict[str, Any]], ...] = (("default", {}), ("PDL", {"pdl": True}))
        for label, kwargs in variants:
            if kwargs and device.type != "cuda":
                continue  # programmatic dependent launch is a GPU launch option
            try:
                roll = TritonRollout(**kwargs)
                with torch.inference_mode():
                    call = lambda r=roll, u=packed.data, n=sizes: r(u, n, *weights)  # noqa: E731
                    got = call()[0]
                    error = float((got.double().cpu() - want).abs().max())
                    wall = wall_us(call, device, reps)
            except Exception as e:
                em.add({"variant": label, "shape": [batch, steps], "failed": str(e)[:300]})
                continue
            em.add(
                {
                    "variant": label,
                    "shape": [batch, steps],
                    "error": error,
                    "wall_us": wall,
                    "us_per_step": wall / steps,
                }
            )


# --------------------------------------------------------------------------- ncu's target


def step_ncu_target(em: Emitter, device: torch.device, quick: bool) -> None:
    """A few launches of the kernels ``ncu`` profiles (run under it by the decision script)."""
    from rnnserve.models.kernels import smoother_triton as st

    packed, alpha, wx = smoother_batch(*SMOOTHER_SHAPES[quick][0], device)
    with torch.inference_mode():
        for design in ("chunked", "chained"):
            st.smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, None, scan=design)
    step_rollout(em, device, quick=True)
    synced(device)()


STEPS: dict[str, Callable[..., None]] = {
    "floors": step_floors,
    "smoother": step_smoother,
    "host": step_host,
    "rollout": step_rollout,
    "ncu-target": step_ncu_target,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("step", choices=sorted([*STEPS, "jax"]))
    parser.add_argument("out", type=Path)
    parser.add_argument("--cpu", action="store_true", help="Triton's interpreter, on the CPU")
    parser.add_argument("--quick", action="store_true", help="tiny shapes")
    parser.add_argument("--design", default="chunked", help="smoother: the forward's design")
    args = parser.parse_args(argv)
    if args.cpu and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--cpu runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    device = torch.device("cpu" if args.cpu else "cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("gpu_measure: torch sees no CUDA device (--cpu for a dry run)", file=sys.stderr)
            return 2
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    em = Emitter(args.out, args.step, device.type)
    em.write()
    extra = {"design": args.design} if args.step == "smoother" else {}
    if args.step == "jax":  # its own module: it imports this one
        from bench.gpu_jax import step_jax

        step_jax(em, device, args.quick)
    else:
        STEPS[args.step](em, device, args.quick, **extra)
    em.set(done=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
