"""The shared harness of bench.bench_models: the plans, the timing of cases in round-robin
rounds, the inputs, the checks against float64 references, the rows and the report's formatting.
"""

from __future__ import annotations

import gc
import importlib
import importlib.metadata
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

BEGIN = "<!-- bench_models:begin -->"
END = "<!-- bench_models:end -->"
BEGIN_CUDA = "<!-- bench_models_cuda:begin -->"
END_CUDA = "<!-- bench_models_cuda:end -->"
# the GRU encoder's subsection inside the section above (--only encoder rewrites just this part)
BEGIN_ENCODER = "<!-- bench_models_encoder:begin -->"
END_ENCODER = "<!-- bench_models_encoder:end -->"
BEGIN_ENCODER_CUDA = "<!-- bench_models_encoder_cuda:begin -->"
END_ENCODER_CUDA = "<!-- bench_models_encoder_cuda:end -->"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("docs/BENCHMARKS.md")
TOLERANCE = 1e-5  # max abs error against the float64 reference, over the real steps


@dataclass(frozen=True)
class Plan:
    """Device, sizes and repeat counts of one run."""

    device: str  # "cpu" or "cuda"
    quick: bool
    smoother_shapes: tuple[tuple[int, int], ...]  # (B, T); lengths spread from T down to T/2
    traveller_shapes: tuple[tuple[int, int], ...]  # (B, T)
    rounds: int  # timed samples per implementation
    slow_rounds: int  # timed samples of slow implementations (one call each)
    sample_s: float  # a sample repeats the call until it lasts about this long
    slow_call_s: float = 0.25  # a first call slower than this makes the case slow
    step_loop_smoother_rows: int = 60_000  # the per-step smoother loop only up to this many rows
    step_loop_rollout_rows: int = 5_000  # the per-step rollout loop only up to this many rows
    feat_dim: int = 16
    encoder_shapes: tuple[tuple[int, int], ...] = ((1, 1000), (64, 500))  # GRU encoder (B, T)
    cell_loop_rows: int = 5_000  # the GRUCell loop (per sequence, per step) up to this many rows


PLANS = {
    ("cpu", False): Plan(
        device="cpu",
        quick=False,
        smoother_shapes=((64, 1000), (256, 4000)),
        traveller_shapes=((1, 1000), (64, 500)),
        rounds=21,
        slow_rounds=3,
        sample_s=0.05,
    ),
    ("cpu", True): Plan(
        device="cpu",
        quick=True,
        smoother_shapes=((4, 50), (8, 20)),
        traveller_shapes=((1, 20), (4, 10)),
        rounds=3,
        slow_rounds=1,
        sample_s=0.002,
        encoder_shapes=((1, 20), (4, 10)),
    ),
    ("cuda", False): Plan(
        device="cuda",
        quick=False,
        smoother_shapes=((64, 1000), (256, 4000), (1, 100_000)),
        traveller_shapes=((1, 1000), (64, 500), (1024, 200)),
        rounds=11,
        slow_rounds=2,  # torch's step loop at T=100000 takes seconds a call
        sample_s=0.03,
        step_loop_smoother_rows=0,  # Python loops of single-row CUDA ops: minutes per call
        step_loop_rollout_rows=0,
        encoder_shapes=((1, 1000), (64, 500), (1024, 200)),
        cell_loop_rows=0,
    ),
    ("cuda", True): Plan(
        device="cuda",
        quick=True,
        smoother_shapes=((4, 50), (8, 20)),
        traveller_shapes=((1, 20), (4, 10)),
        rounds=3,
        slow_rounds=1,
        sample_s=0.002,
        encoder_shapes=((1, 20), (4, 10)),
        step_loop_smoother_rows=0,
        step_loop_rollout_rows=0,
    ),
}


# --------------------------------------------------------------------------- timing


def _no_wait(_: object) -> None:
    return None


def _nothing() -> None:  # the call of a case timed elsewhere
    return None


def _cuda_wait(_: object) -> None:
    torch.cuda.synchronize()


@dataclass(frozen=True)
class Case:
    """One implementation to time: a call with all inputs bound, checked already."""

    name: str
    fn: Callable[[], object]
    wait: Callable[[object], object] = _no_wait  # blocks until fn's queued work is done
    slow: bool = False  # few samples of one call each
    err: float = 0.0  # max abs error against the float64 reference
    external: Timing | None = None  # timed elsewhere (JAX in a process of its own), not by fn


@dataclass
class Timing:
    """Seconds per call, one entry per timed sample."""

    number: int = 1  # calls per sample
    slow: bool = False
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def lo(self) -> float:
        return min(self.samples)

    @property
    def hi(self) -> float:
        return max(self.samples)


def _clock(case: Case, number: int) -> float:
    case.wait(None)  # nothing queued from before counts
    start = time.perf_counter()
    out: object = None
    for _ in range(number):
        out = case.fn()
    case.wait(out)
    return time.perf_counter() - start


def measure(cases: Sequence[Case], plan: Plan) -> dict[str, Timing]:
    """Warm up every case, then time them in rotated round-robin order."""
    timings: dict[str, Timing] = {}
    for case in cases:
        if case.external is not None:
            timings[case.name] = case.external
            continue
        once = _clock(case, 1)  # (the reference check was the first call)
        if case.slow or once > plan.slow_call_s:
            timings[case.name] = Timing(number=1, slow=True)
            continue
        for _ in range(2):  # TorchScript's profiling executor optimises after two calls
            once = min(once, _clock(case, 1))
        number = max(1, min(10_000, math.ceil(plan.sample_s / max(once, 1e-7))))
        timings[case.name] = Timing(number=number)
    for r in range(plan.rounds):
        gc.collect()
        k = r % len(cases)
        for case in [*cases[k:], *cases[:k]]:
            t = timings[case.name]
            if case.external is not None or (t.slow and r >= plan.slow_rounds):
                continue
            t.samples.append(_clock(case, t.number) / t.number)
    return timings


# --------------------------------------------------------------------------- inputs


def spread_lengths(batch: int, steps: int) -> list[int]:
    """``batch`` lengths spread evenly from ``steps`` down (e.g. 1000, 985, ..., 16)."""
    return [steps - (i * steps) // batch for i in range(batch)]


def half_spread_lengths(batch: int, steps: int) -> list[int]:
    """``batch`` lengths spread evenly from ``steps`` down to ``steps / 2`` (1000, ..., 500)."""
    return [steps - (i * (steps // 2)) // max(1, batch - 1) for i in range(batch)]


def random_sequences(lengths: Sequence[int], width: int, seed: int) -> list[Tensor]:
    """``[T_i, width]`` normal sequences, in shuffled order (pack sorts them)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    return [torch.randn(lengths[i], width, generator=gen) for i in order]


def shape_label(batch: int, steps: int) -> str:
    return f"B={batch}, T={steps}"


def padded64(seqs: Sequence[Tensor]) -> np.ndarray:
    """``[B, T, C]`` float64, zeros after each sequence's end."""
    steps = max(len(s) for s in seqs)
    out = np.zeros((len(seqs), steps, seqs[0].shape[1]))
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s.double().numpy()
    return out


def _mask(lengths: Sequence[int], steps: int) -> np.ndarray:
    return np.arange(steps)[None, :] < np.asarray(lengths)[:, None]


class CheckFailed(AssertionError):
    """An implementation's result differs from the float64 reference."""


class Unavailable(Exception):
    """An implementation that this run cannot measure (missing module, wrong device...)."""


def packed_to_padded(packed: PackedSequence) -> np.ndarray:
    """``[B, T, C]`` float64 in the original sequence order."""
    padded, _ = pad_packed_sequence(packed, batch_first=True)
    out: np.ndarray = padded.cpu().double().numpy()
    return out


def data_to_padded(data: Tensor, like: PackedSequence) -> np.ndarray:
    return packed_to_padded(
        PackedSequence(data, like.batch_sizes, like.sorted_indices, like.unsorted_indices)
    )


def check(name: str, got: np.ndarray, want: np.ndarray, lengths: Sequence[int]) -> float:
    """Max abs error of ``got`` against ``want`` (both ``[B, T, C]``) over the real steps."""
    if got.shape != want.shape:
        raise CheckFailed(f"{name}: shape {got.shape}, want {want.shape}")
    err = float(np.abs(got - want)[_mask(lengths, want.shape[1])].max(initial=0.0))
    if not err <= TOLERANCE:
        raise CheckFailed(
            f"{name}: max abs error {err:.2e} against the float64 reference (> {TOLERANCE:g})"
        )
    return err


# --------------------------------------------------------------------------- the suite


@dataclass(frozen=True)
class Row:
    shape: str
    name: str
    timing: Timing
    ratio: float  # median over the floor's median, same run
    batch: int  # B
    steps: int  # T = max length: time steps of the batch
    packed_rows: int  # N = sum of the lengths
    err: float = 0.0  # max abs error against the float64 reference


@dataclass
class Results:
    smoother: list[Row] = field(default_factory=list)
    traveller: list[Row] = field(default_factory=list)
    encoder: list[Row] = field(default_factory=list)
    encoder_compile: list[tuple[str, str]] = field(default_factory=list)  # (what, figure)
    compile: list[tuple[str, str]] = field(default_factory=list)  # (what, figure)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)  # (name, shape, why)
    failed: list[tuple[str, str, str]] = field(default_factory=list)  # (name, shape, why)
    notes: list[str] = field(default_factory=list)


SMOOTHER_FLOOR_CPU = "torch.tanh (floor)"
SMOOTHER_FLOOR_CUDA = "device-to-device copy (floor)"
TRAVELLER_BOUND = "nn.LSTM teacher-forced + output layer (bound)"
JAX_SCAN = "JAX lax.scan (padded)"
JAX_ASSOC = "JAX lax.associative_scan"
JAX_ROLLOUT = "JAX lax.scan rollout (padded)"
STEP_LOOP_SMOOTHER = "per-step loop (over sequences and steps)"
STEP_LOOP_ROLLOUT = "per-step loop (nn.LSTM per step, per sequence)"
ENCODER_FLOOR = "your nn.Module on the padded batch, one call (floor)"
ENCODER_RECURRENT = "kind recurrent (exported weights), packed batch"
ENCODER_TORCHSCRIPT = "kind torchscript (scripted forward(data, batch_sizes)), packed batch"
ENCODER_PER_SEQUENCE = "your nn.Module once per sequence (no batching)"
ENCODER_CELL_LOOP = "GRUCell loop, per sequence and step (the tests' reference)"
ENCODER_COMPILE = "torch.jit.script(PackedGRUEncoder)"
GRAPH_SUFFIX = ", in one CUDA graph"

ENCODER_NAMES = (
    ENCODER_FLOOR,
    ENCODER_RECURRENT,
    ENCODER_TORCHSCRIPT,
    ENCODER_PER_SEQUENCE,
    ENCODER_CELL_LOOP,
)

Builder = Callable[[], Case]


# --------------------------------------------------------------------------- report


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds * 1e6:.0f} µs"


def _fmt_ratio(r: float) -> str:
    if r >= 100:
        return f"{r:,.0f}×"
    if r >= 10:
        return f"{r:.1f}×"
    return f"{r:.2f}×"


def _fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f}" if ms >= 100 else f"{ms:.3g}"


def _fmt_us(us: float) -> str:
    return f"{us:,.0f}" if us >= 1000 else f"{us:.3g}"


def _version(module: str) -> str:
    try:
        return str(importlib.import_module(module).__version__)
    except ImportError:
        return "not installed"


def _versions(jax_version: str) -> str:
    return (
        f"torch {torch.__version__}, numba {_version('numba')}, numpy {np.__version__}, "
        f"triton {_version('triton')}, jax {jax_version}"
    )


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "unknown"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")),
        platform.processor() or "unknown",
    )
    flags = next((ln for ln in info.splitlines() if ln.startswith("flags")), "").split()
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{model} ({simd})"


def _cell(row: Row) -> str:
    us = row.timing.median / row.steps * 1e6
    return f"{_fmt_ratio(row.ratio)} · {_fmt_ms(row.timing.median)} ms · {_fmt_us(us)} µs/step"


def _summary_table(rows: Sequence[Row], shapes: Sequence[str], heads: Sequence[str]) -> list[str]:
    """Implementations down, shapes across; each cell the ratio, median and µs per step."""
    names = list(dict.fromkeys(r.name for r in rows))
    lines = ["| implementation | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for name in names:
        cells = []
        for shape in shapes:
            row = next((r for r in rows if r.shape == shape and r.name == name), None)
            cells.append("" if row is None else _cell(row))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _detail_table(rows: Sequence[Row], ref: str) -> list[str]:
    head = (
        "| shape | implementation | ms per call | min–max ms | µs per step | "
        f"× {ref} | max abs err vs float64 | samples |"
    )
    lines = [head, "|---" * (head.count(" | ") + 1) + "|"]
    for r in rows:
        t = r.timing
        lines.append(
            f"| {r.shape} | {r.name} | {_fmt_ms(t.median)} | {_fmt_ms(t.lo)}–{_fmt_ms(t.hi)} | "
            f"{_fmt_us(t.median / r.steps * 1e6)} | {_fmt_ratio(r.ratio)} | {r.err:.1e} | "
            f"{len(t.samples)} × {t.number} |"
        )
    return lines


def _verdict(got: float, expected: float) -> str:
    if got < expected / 1.5:
        return "better than"
    if got > expected * 1.5:
        return "worse than"
    return "in line with"


def _ratios(rows: Sequence[Row], prefix: str, exact: bool = False) -> str:
    found = [r for r in rows if (r.name == prefix if exact else r.name.startswith(prefix))]
    return ", ".join(f"{_fmt_ratio(r.ratio)} at {r.shape}" for r in found)


def _find(rows: Sequence[Row], name: str) -> list[Row]:
    return [r for r in rows if r.name == name]


def write_section(path: Path, section: str, begin: str = BEGIN, end: str = END) -> None:
    """Put ``section`` into ``path``: replace an earlier run's section, else append it."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def _pin_one_core() -> str:
    if not hasattr(os, "sched_setaffinity"):
        return "process not pinned (no sched_setaffinity)"
    core = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return f"process pinned to CPU {core}"


def _prepare_jax_env(device: str) -> None:
    """XLA reads these when its backend starts: set them before anything imports jax."""
    if device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_cpu_multi_thread_eigen" not in flags:
            extra = "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
            os.environ["XLA_FLAGS"] = f"{flags} {extra}".strip()
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share with torch


def _skipped_lines(res: Results, only: Sequence[str] | None = None) -> list[str]:
    grouped: dict[tuple[str, str], list[str]] = {}
    for name, shape, why in res.skipped:
        if (only is None and name in ENCODER_NAMES) or (only is not None and name not in only):
            continue  # the encoder's are listed in its own subsection
        grouped.setdefault((name, why), []).append(shape)
    return [f"- {name} ({'; '.join(shapes)}): {why}" for (name, why), shapes in grouped.items()]
