"""Benchmark of the model kernels, as ratios measured in one run.

Usage::

    python -m bench.bench_models [--quick] [--out docs/BENCHMARKS.md]

Every implementation is warmed up, then timed in round-robin rounds (so slow drift of a shared,
noisy machine hits all of them alike); each is reported as the median time per call with the
min-max spread, and as a ratio against a reference measured in the same rounds:

- smoother: one ``torch.tanh`` pass over the same packed data (the floor, per MEASURED.md);
- Traveller: PyTorch's teacher-forced ``nn.LSTM`` + output layer over the same padded batch, in
  one call (the bound: it skips the feedback, so it can run the whole sequence in oneDNN).

Torch is pinned to one thread. Compile and first-call times are reported apart. The result is a
markdown section written into ``--out`` (replacing the section of an earlier run, if any).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from models.kernels import ema_packed_numba, ema_packed_torch
from models.packing import pack, unpack
from models.smoothing import LinearRecursion
from models.traveller import Traveller, TravellerConfig, scripted_rollout

BEGIN = "<!-- bench_models:begin -->"
END = "<!-- bench_models:end -->"
DEFAULT_OUT = Path("docs/BENCHMARKS.md")

# MEASURED.md's figures that the "expected / got" paragraph compares against.
EXPECTED_SMOOTHER = {"ema_packed_numba": 1.7, "ema_packed_torch": 30.0, "seed-style": 6000.0}
EXPECTED_TS_HIDDEN64 = {1: 26 / 10, 64: 209 / 100}  # fused cells + TorchScript vs nn.LSTM
EXPECTED_EAGER_HIDDEN64 = {1: 42 / 10, 64: 193 / 100}  # fused cells, eager vs nn.LSTM
EXPECTED_CPP_ATEN = {1: 2.00, 64: 1.20}  # C++ loop of ATen calls, default shapes
EXPECTED_JAX = {1: 0.94, 64: 0.80}  # JAX lax.scan rollout, default shapes


@dataclass(frozen=True)
class Plan:
    """Sizes and repeat counts of one run."""

    quick: bool
    smoother_shapes: tuple[tuple[int, int], ...]  # (B, T)
    traveller_shapes: tuple[tuple[int, int], ...]  # (B, T)
    rounds: int  # timed samples per implementation
    slow_rounds: int  # timed samples of the seed-style Python loops
    sample_s: float  # a sample repeats the call until it lasts about this long
    feat_dim: int = 16


FULL = Plan(
    quick=False,
    smoother_shapes=((64, 1000), (256, 200), (1, 4000)),
    traveller_shapes=((1, 1000), (64, 500)),
    rounds=21,
    slow_rounds=3,
    sample_s=0.05,
)
QUICK = Plan(
    quick=True,
    smoother_shapes=((4, 50), (8, 20), (1, 100)),
    traveller_shapes=((1, 20), (4, 10)),
    rounds=3,
    slow_rounds=1,
    sample_s=0.002,
)


# --------------------------------------------------------------------------- timing


@dataclass(frozen=True)
class Case:
    """One implementation to time: a call with all inputs bound."""

    name: str
    fn: Callable[[], object]
    slow: bool = False  # a seed-style Python loop: fewer samples, one call each


@dataclass
class Timing:
    """Seconds per call, one entry per timed sample."""

    number: int = 1  # calls per sample
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


def _clock(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return time.perf_counter() - start


def measure(cases: Sequence[Case], plan: Plan) -> dict[str, Timing]:
    """Warm up every case, then time them in rotated round-robin order."""
    timings: dict[str, Timing] = {}
    for case in cases:
        if case.slow:
            case.fn()
            timings[case.name] = Timing(number=1)
            continue
        for _ in range(3):  # TorchScript's profiling executor optimises after two calls
            case.fn()
        once = _clock(case.fn, 1)
        number = max(1, min(10_000, math.ceil(plan.sample_s / max(once, 1e-7))))
        timings[case.name] = Timing(number=number)
    for r in range(plan.rounds):
        gc.collect()
        k = r % len(cases)
        for case in [*cases[k:], *cases[:k]]:
            if case.slow and r >= plan.slow_rounds:
                continue
            t = timings[case.name]
            t.samples.append(_clock(case.fn, t.number) / t.number)
    return timings


# --------------------------------------------------------------------------- inputs


def spread_lengths(batch: int, steps: int) -> list[int]:
    """``batch`` lengths spread evenly from ``steps`` down (e.g. 1000, 985, ..., 16)."""
    return [steps - (i * steps) // batch for i in range(batch)]


def random_sequences(lengths: Sequence[int], width: int, seed: int) -> list[Tensor]:
    """``[T_i, width]`` normal sequences, in shuffled order (pack sorts them)."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(lengths), generator=gen).tolist()
    return [torch.randn(lengths[i], width, generator=gen) for i in order]


def shape_label(batch: int, steps: int) -> str:
    return f"B={batch}, T={steps}"


# --------------------------------------------------------------------------- seed-style code


def packed_sequence_indices(batch_sizes: Tensor) -> list[Tensor]:
    """Per sequence, a CPU ``LongTensor`` of its rows in the packed data (as seed 000 did)."""
    sizes: list[int] = batch_sizes.tolist()
    starts = [0]
    for b in sizes[:-1]:
        starts.append(starts[-1] + b)
    return [
        torch.tensor([starts[t] + i for t in range(len(sizes)) if sizes[t] > i], dtype=torch.long)
        for i in range(sizes[0])
    ]


def smoother_seed_style(x: PackedSequence, alpha: Tensor, wx: Tensor) -> Tensor:
    """The seed-000 layer: Python loops over sequences and steps, one row at a time."""
    data = x.data
    ydata = torch.zeros_like(data)
    for rows in packed_sequence_indices(x.batch_sizes):
        ydata[rows[0], :] = data[rows[0], :]
        for k in range(1, len(rows)):
            ydata[rows[k], :] = alpha * ydata[rows[k - 1], :] + (1 - alpha) * data[rows[k], :]
    return torch.tanh(wx * ydata)


def traveller_seed_style(model: Traveller, sequences: Sequence[Tensor]) -> list[Tensor]:
    """The seed-002 rollout: per sequence, ``nn.LSTM`` called once per step."""
    results = []
    for u in sequences:
        inputs = u.unsqueeze(1)  # [T, 1, num_inputs], the seed's layout
        hidden: tuple[Tensor, Tensor] | None = None
        prev = inputs.new_zeros(1, 1, 2)
        positions = []
        for t in range(inputs.shape[0]):
            out, hidden = model.lstm_layers(torch.cat([prev, inputs[t : t + 1]], 2), hidden)
            prev = model.activation(model.output_layer(out))
            positions.append(prev)
        results.append(torch.cat(positions, 0).squeeze(1))
    return results


# --------------------------------------------------------------------------- models


def make_smoother(feat_dim: int, kernel: str) -> LinearRecursion:
    gen = torch.Generator().manual_seed(0)
    model = LinearRecursion(feat_dim)
    with torch.no_grad():
        model.alpha_smooth.copy_(0.05 + 0.9 * torch.rand(feat_dim, generator=gen))
        model.wx.copy_(0.2 + 1.5 * torch.rand(feat_dim, generator=gen))
    model.kernel = "torch" if kernel == "torch" else "auto"
    return model.eval().requires_grad_(False)


def make_traveller() -> Traveller:
    torch.manual_seed(0)
    cfg = TravellerConfig()
    model = Traveller(cfg.num_inputs, cfg.hidden_size, cfg.num_layers, cfg.dropout)
    return model.eval().requires_grad_(False)


def with_backend(model: Traveller, backend: str) -> Traveller:
    clone = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        clone.compile_rollout("torchscript" if backend == "torchscript" else "eager")
    return clone


def _check_close(name: str, got: Tensor, want: Tensor, atol: float) -> None:
    err = (got - want).abs().max().item() if got.numel() else 0.0
    if got.shape != want.shape or not err <= atol:
        raise AssertionError(f"{name}: differs from the reference (max abs error {err:.2e})")


# --------------------------------------------------------------------------- benchmarks


@dataclass(frozen=True)
class Row:
    shape: str
    name: str
    timing: Timing
    ratio: float  # median over the reference's median, same run
    batch: int  # B
    steps: int  # T = max length: time steps of the batch
    packed_rows: int  # N = sum of the lengths


@dataclass
class Results:
    smoother: list[Row] = field(default_factory=list)
    traveller: list[Row] = field(default_factory=list)
    compile: list[tuple[str, str]] = field(default_factory=list)  # (what, figure)


SMOOTHER_FLOOR = "torch.tanh (floor)"
TRAVELLER_BOUND = "nn.LSTM teacher-forced + output layer (bound)"


def smoother_cases(
    x: PackedSequence, auto: LinearRecursion, torch_k: LinearRecursion
) -> list[Case]:
    """The smoother implementations on packed batch ``x``, after checking they agree."""
    data, bs = x.data, x.batch_sizes
    alpha, wx = auto.alpha_smooth, auto.wx
    ref = auto(x).data
    numba_out = ema_packed_numba(data, bs, alpha)
    _check_close("numba vs torch kernel", numba_out, ema_packed_torch(data, bs, alpha), 1e-5)
    _check_close("LinearRecursion torch vs auto", torch_k(x).data, ref, 1e-5)
    _check_close("seed-style vs LinearRecursion", smoother_seed_style(x, alpha, wx), ref, 1e-5)
    return [
        Case(SMOOTHER_FLOOR, lambda: torch.tanh(data)),
        Case("ema_packed_numba", lambda: ema_packed_numba(data, bs, alpha)),
        Case("ema_packed_torch", lambda: ema_packed_torch(data, bs, alpha)),
        Case('LinearRecursion, kernel "auto" (numba)', lambda: auto(x)),
        Case('LinearRecursion, kernel "torch"', lambda: torch_k(x)),
        Case(
            "seed-style (loops over sequences and steps)",
            lambda: smoother_seed_style(x, alpha, wx),
            slow=True,
        ),
    ]


def bench_smoother(plan: Plan, res: Results) -> None:
    auto = make_smoother(plan.feat_dim, "auto")
    torch_k = make_smoother(plan.feat_dim, "torch")
    for i, (batch, steps) in enumerate(plan.smoother_shapes):
        label = shape_label(batch, steps)
        _log(f"smoother {label}")
        x = pack(random_sequences(spread_lengths(batch, steps), plan.feat_dim, seed=i))
        cases = smoother_cases(x, auto, torch_k)
        timings = measure(cases, plan)
        floor = timings[SMOOTHER_FLOOR].median
        for case in cases:
            t = timings[case.name]
            ratio = t.median / floor
            res.smoother.append(Row(label, case.name, t, ratio, batch, steps, x.data.shape[0]))


def traveller_cases(
    seqs: Sequence[Tensor], base: Traveller, scripted: Traveller, eager: Traveller, seed: int
) -> list[Case]:
    """The Traveller implementations on ``seqs``, after checking the rollouts agree."""
    x = pack(seqs)
    padded, _ = pad_packed_sequence(x, batch_first=True)  # [B, T, num_inputs]
    gen = torch.Generator().manual_seed(seed)
    fed_back = torch.rand(padded.shape[0], padded.shape[1], 2, generator=gen) * 2 - 1
    z = torch.cat([fed_back, padded], 2)  # [B, T, 2 + num_inputs]: positions first

    def bound() -> Tensor:
        h, _ = base.lstm_layers(z)
        return torch.tanh(base.output_layer(h))

    want = torch.cat(traveller_seed_style(base, seqs), 0)
    for name, model in (("torchscript", scripted), ("eager", eager)):
        got = torch.cat(unpack(model.rollout(x)), 0)
        _check_close(f"rollout ({name}) vs seed-style loop", got, want, 1e-4)
    return [
        Case(TRAVELLER_BOUND, bound),
        Case('Traveller.rollout, "torchscript"', lambda: scripted.rollout(x)),
        Case('Traveller.rollout, "eager"', lambda: eager.rollout(x)),
        Case(
            "seed-style (nn.LSTM per step, per sequence)",
            lambda: traveller_seed_style(base, seqs),
            slow=True,
        ),
    ]


def bench_traveller(plan: Plan, res: Results, base: Traveller) -> None:
    scripted = with_backend(base, "torchscript")
    eager = with_backend(base, "eager")
    for i, (batch, steps) in enumerate(plan.traveller_shapes):
        label = shape_label(batch, steps)
        _log(f"traveller {label}")
        seqs = random_sequences(spread_lengths(batch, steps), base.num_inputs, seed=100 + i)
        cases = traveller_cases(seqs, base, scripted, eager, seed=200 + i)
        timings = measure(cases, plan)
        ref = timings[TRAVELLER_BOUND].median
        for case in cases:
            t = timings[case.name]
            ratio = t.median / ref
            n = sum(len(u) for u in seqs)
            res.traveller.append(Row(label, case.name, t, ratio, batch, steps, n))


def bench_compile(plan: Plan, res: Results, base: Traveller) -> None:
    """First calls, before anything else in this process has compiled them."""
    _log("compile and first-call times")
    x = pack(random_sequences(spread_lengths(4, 50), plan.feat_dim, seed=99))
    alpha = torch.full((plan.feat_dim,), 0.5)
    first = _clock(lambda: ema_packed_numba(x.data, x.batch_sizes, alpha), 1)
    again = min(_clock(lambda: ema_packed_numba(x.data, x.batch_sizes, alpha), 1) for _ in range(5))
    res.compile.append(
        ("numba `ema_packed_numba`, first call (JIT compile, B=4 T=50)", _fmt_s(first))
    )
    res.compile.append(("numba `ema_packed_numba`, a later call of the same size", _fmt_s(again)))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        script_s = _clock(scripted_rollout, 1)
    res.compile.append(("`torch.jit.script(rollout_packed)`", _fmt_s(script_s)))
    scripted = with_backend(base, "torchscript")
    batch, steps = plan.traveller_shapes[0]
    u = pack(random_sequences([steps] * batch, base.num_inputs, seed=98))
    calls = [_clock(lambda: scripted.rollout(u), 1) for _ in range(4)]
    steady = statistics.median(_clock(lambda: scripted.rollout(u), 1) for _ in range(5))
    where = shape_label(batch, steps)
    for k, t in enumerate(calls, 1):
        res.compile.append((f"TorchScript rollout, call {k} ({where})", _fmt_s(t)))
    res.compile.append(
        (f"TorchScript rollout, steady state ({where}, median of 5)", _fmt_s(steady))
    )


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


def _versions() -> str:
    try:
        import numba

        numba_v = str(numba.__version__)
    except ImportError:  # pragma: no cover
        numba_v = "not installed"
    return f"torch {torch.__version__}, numba {numba_v}, numpy {np.__version__}"


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


def _summary_table(
    rows: Sequence[Row], shapes: Sequence[str], heads: Sequence[str], per_step: bool
) -> list[str]:
    """Implementations down, shapes across; each cell the ratio and the median."""
    names = list(dict.fromkeys(r.name for r in rows))
    lines = ["| implementation | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for name in names:
        cells = []
        for shape in shapes:
            row = next((r for r in rows if r.shape == shape and r.name == name), None)
            if row is None:
                cells.append("")
            elif per_step:
                cells.append(
                    f"{_fmt_ratio(row.ratio)} ({row.timing.median / row.steps * 1e6:.1f} µs/step)"
                )
            else:
                cells.append(f"{_fmt_ratio(row.ratio)} ({_fmt_ms(row.timing.median)} ms)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _detail_table(rows: Sequence[Row], per_step: bool, ref: str) -> list[str]:
    if per_step:
        head = (
            f"| shape | implementation | ms per call | µs per step | min–max µs per step | "
            f"× {ref} | samples |"
        )
    else:
        head = f"| shape | implementation | ms per call | min–max ms | × {ref} | samples |"
    lines = [head, "|---" * head.count(" | ") + "|---|"]
    for r in rows:
        t = r.timing
        n = f"{len(t.samples)} × {t.number}"
        if per_step:
            us = 1e6 / r.steps
            lines.append(
                f"| {r.shape} | {r.name} | {_fmt_ms(t.median)} | {t.median * us:.1f} | "
                f"{t.lo * us:.1f}–{t.hi * us:.1f} | {_fmt_ratio(r.ratio)} | {n} |"
            )
        else:
            lines.append(
                f"| {r.shape} | {r.name} | {_fmt_ms(t.median)} | "
                f"{_fmt_ms(t.lo)}–{_fmt_ms(t.hi)} | {_fmt_ratio(r.ratio)} | {n} |"
            )
    return lines


def _verdict(got: float, expected: float) -> str:
    if got < expected / 1.5:
        return "better than"
    if got > expected * 1.5:
        return "worse than"
    return "in line with"


def _ratios(rows: Sequence[Row], prefix: str) -> str:
    found = [r for r in rows if r.name.startswith(prefix)]
    return ", ".join(f"{_fmt_ratio(r.ratio)} at {r.shape}" for r in found)


def _expectations(res: Results, plan: Plan) -> list[str]:
    sm, tr = res.smoother, res.traveller
    out = []
    if plan.quick:
        out.append(
            "*Quick mode: tiny sizes, so fixed per-call costs dominate and the figures "
            "below say nothing about the real shapes.*\n"
        )
    lines = []
    for name, expected in EXPECTED_SMOOTHER.items():
        found = [r for r in sm if r.name.startswith(name)]
        if not found:
            continue
        med = statistics.median(r.ratio for r in found)
        lines.append(
            f"- `{name}`: MEASURED.md ~{expected:g}× the tanh floor; got "
            f"{_ratios(sm, name)} — {_verdict(med, expected)} the lead."
        )
    lr = _ratios(sm, 'LinearRecursion, kernel "auto"')
    lines.append(
        f"- Full `LinearRecursion` forward with the numba kernel (EMA + `wx·s` + tanh, "
        f"so about numba + 2 elementwise passes ≈ 3.5× expected): got {lr}."
    )
    out.append("**Smoother.** Expected from MEASURED.md (F = 16 or 32, 2-core AVX-512 machine):")
    out.extend(lines)
    floors = [r for r in sm if r.name == SMOOTHER_FLOOR]
    numbas = [r for r in sm if r.name == "ema_packed_numba"]
    if floors and numbas:
        feat = plan.feat_dim
        ns_tanh = max(floors, key=lambda r: r.packed_rows)
        ns_numba = max(numbas, key=lambda r: r.packed_rows)
        out.append(
            f"- The floor itself: `torch.tanh` ran at "
            f"{ns_tanh.timing.median / (ns_tanh.packed_rows * feat) * 1e9:.2f} ns per element "
            f"at {ns_tanh.shape} (MEASURED.md: about 2.5 ns), and `ema_packed_numba` at "
            f"{ns_numba.timing.median / (ns_numba.packed_rows * feat) * 1e9:.2f} ns per element. "
            "A faster floor makes every ratio larger for the same absolute time, so compare "
            "absolute times too."
        )
    out.append("")

    lines = []
    for row in tr:
        b = row.batch
        key = 1 if b == 1 else 64
        per_step = row.timing.median / row.steps * 1e6
        if row.name.startswith('Traveller.rollout, "torchscript"'):
            lines.append(
                f"- TorchScript rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step). MEASURED.md: fused cells + TorchScript "
                f"{_fmt_ratio(EXPECTED_TS_HIDDEN64[key])} (hidden 64), a C++ loop of ATen calls "
                f"{_fmt_ratio(EXPECTED_CPP_ATEN[key])} and JAX `lax.scan` "
                f"{_fmt_ratio(EXPECTED_JAX[key])} (default shapes) — "
                f"{_verdict(row.ratio, EXPECTED_TS_HIDDEN64[key])} the TorchScript lead."
            )
        elif row.name.startswith('Traveller.rollout, "eager"'):
            lines.append(
                f"- Eager rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step); MEASURED.md's eager fused cells "
                f"{_fmt_ratio(EXPECTED_EAGER_HIDDEN64[key])} (hidden 64) — "
                f"{_verdict(row.ratio, EXPECTED_EAGER_HIDDEN64[key])} it."
            )
        elif row.name.startswith("seed-style"):
            per_row = row.timing.median / row.packed_rows * 1e6
            note = f" That is {per_row:.0f} µs per sequence step." if row.batch > 1 else ""
            note += (
                " MEASURED.md's 297 µs/step (hidden 64) is the figure to compare."
                if b == 1
                else " (MEASURED.md's 245 µs/step at B=64 called nn.LSTM on the whole batch per "
                "step; this loop goes per sequence, as seed 002 does, so it is not "
                "comparable.)"
            )
            lines.append(
                f"- Seed-style loop at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.0f} µs per batch step).{note}"
            )
    out.append(
        "**Traveller.** MEASURED.md measured the rollout variants at hidden 64 and, at the "
        "default shapes (hidden 128), only the C++-of-ATen loop and JAX:"
    )
    for shape in dict.fromkeys(r.shape for r in tr):
        by_name = {r.name: r for r in tr if r.shape == shape}
        ts = by_name.get('Traveller.rollout, "torchscript"')
        eager = by_name.get('Traveller.rollout, "eager"')
        if ts is not None and eager is not None:
            lines.append(
                f"- TorchScript against eager at {shape}: "
                f"{eager.timing.median / ts.timing.median:.2f}× faster."
            )
        if ts is not None and ts.batch > 1:
            active = ts.packed_rows / (ts.batch * ts.steps)
            lines.append(
                f"- At {shape} the bound runs the whole padded batch ({ts.batch * ts.steps:,} "
                f"rows, {active:.0%} of them real steps) while the rollouts run only the "
                f"{ts.packed_rows:,} real ones, so the ratio there flatters the rollouts by "
                f"up to {1 / active:.1f}×."
            )
    out.extend(lines)
    out.append("")
    out.append(
        "**JAX.** JAX is not installed here, so the JAX `jit` + `lax.scan` comparison "
        "(MEASURED.md: 0.74–1.44× `torch.tanh` for the smoother, 0.80–0.94× the nn.LSTM "
        "bound for the rollout) is not re-measured; it is left for the kernels issue."
    )
    return out


def render(res: Results, plan: Plan, started: dt.datetime, wall_s: float, load: str) -> str:
    sm_shapes = list(dict.fromkeys(r.shape for r in res.smoother))
    tr_shapes = list(dict.fromkeys(r.shape for r in res.traveller))
    sm_heads = [
        f"{r.shape} (N={r.packed_rows:,})" for r in res.smoother if r.name == SMOOTHER_FLOOR
    ]
    tr_heads = [
        f"{r.shape} (N={r.packed_rows:,}; padded {r.batch * r.steps:,})"
        for r in res.traveller
        if r.name == TRAVELLER_BOUND
    ]
    cfg = TravellerConfig()
    mode = "`--quick` (tiny sizes, smoke test only)" if plan.quick else "full"
    lines = [
        BEGIN,
        "## Model kernels (`python -m bench.bench_models`)",
        "",
        "Written by `bench/bench_models.py`; rerun it to refresh this section. "
        f"Mode: {mode}; run took {wall_s:.0f} s.",
        "",
        "**Machine.** "
        f"{cpu_model()}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}, "
        f"{_versions()}; torch threads: {torch.get_num_threads()} (pinned), "
        f"interop threads: {torch.get_num_interop_threads()}; "
        f"date {started.strftime('%Y-%m-%d %H:%M UTC')}; load average at start {load}. "
        "The machine is shared and noisy: read the ratios, not the absolute times.",
        "",
        "**Method.** fp32 on the CPU under `torch.inference_mode()`. Each implementation is "
        f"checked against a reference, warmed up (3 calls), then timed in {plan.rounds} "
        "round-robin rounds, each sample repeating the call until it lasts "
        f"≥ {plan.sample_s * 1e3:g} ms; the seed-style Python loops get {plan.slow_rounds} "
        "samples of one call. Reported: the median time per call, the min–max over samples, "
        "and the ratio of medians against the reference timed in the same rounds. Compile and "
        "first-call times are measured first, in a fresh process, and reported apart.",
        "",
        f"### Smoother (F = {plan.feat_dim}, packed, lengths spread evenly from T down)",
        "",
        "Reference: one `torch.tanh` over the packed data `[N, F]` (the floor). Ratios "
        "(median ms per call):",
        "",
        *_summary_table(res.smoother, sm_shapes, sm_heads, per_step=False),
        "",
        *_detail_table(res.smoother, per_step=False, ref="tanh"),
        "",
        f"### Traveller (num_inputs {cfg.num_inputs}, hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers)",
        "",
        "Reference: PyTorch's teacher-forced `nn.LSTM` over the same padded batch "
        "`[B, T, 2 + num_inputs]` plus output layer and tanh, in one call (the bound). B > 1 "
        "uses lengths spread evenly from T down. A step is one time step of the batch "
        "(time per call / T). Ratios (µs per step):",
        "",
        *_summary_table(res.traveller, tr_shapes, tr_heads, per_step=True),
        "",
        *_detail_table(res.traveller, per_step=True, ref="bound"),
        "",
        "### Compile and first-call times",
        "",
        "| what | time |",
        "|---|---|",
        *(f"| {what} | {fig} |" for what, fig in res.compile),
        "",
        "### What we expected / what we got",
        "",
        *_expectations(res, plan),
        END,
    ]
    return "\n".join(lines) + "\n"


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else FULL

    torch.set_num_threads(1)
    with contextlib.suppress(RuntimeError):  # refused once inter-op work has started
        torch.set_num_interop_threads(1)
    started = dt.datetime.now(dt.UTC)
    load = "n/a"
    if hasattr(os, "getloadavg"):
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    t0 = time.perf_counter()
    res = Results()
    base = make_traveller()
    with torch.inference_mode():
        bench_compile(plan, res, base)
        bench_smoother(plan, res)
        bench_traveller(plan, res, base)
    section = render(res, plan, started, time.perf_counter() - t0, load)
    write_section(args.out, section)
    print(section)
    _log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
