"""Benchmark of the model kernels, as ratios measured in one run, on the CPU or on CUDA.

Usage::

    python -m bench.bench_models [--device cpu|cuda] [--quick] [--out docs/BENCHMARKS.md]

Every implementation is first checked against a float64 reference (max abs error 1e-5 over the
real steps), warmed up, then timed in round-robin rounds (so slow drift of a shared, noisy
machine hits all of them alike); each is reported as the median time per call with the min-max
spread, in µs per time step, and as a ratio against a floor measured in the same rounds:

- smoother: on the CPU one ``torch.tanh`` pass over the same packed data (the floor, per
  MEASURED.md); on CUDA a device-to-device copy of the same bytes;
- Traveller: PyTorch's teacher-forced ``nn.LSTM`` (oneDNN on the CPU, cuDNN on CUDA) + output
  layer over the same padded batch, in one call (the bound: it skips the feedback, so it can run
  the whole sequence in one library call);
- seed 003's GRU encoder (``examples/gru_encoder.py``: ``nn.GRU(6, 200, 2 layers)`` ->
  ``nn.Linear(200, 4)`` -> L2 norm per step), served as your own model: the user's plain module
  over the same padded batch in one call (the floor), against the served kinds on the packed
  batch (``recurrent``: the exported weights; ``torchscript``: the scripted packed-signature
  module) and the unbatched ways (the module once per sequence; a ``GRUCell`` loop per step).

``--only encoder`` runs the GRU encoder rows alone and puts them into an earlier run's section
(between their own markers inside it), leaving the smoother and Traveller figures as they were.

JAX (the optional ``bench`` extra) is measured in the same rounds: ``lax.scan`` and
``lax.associative_scan`` for the smoother, ``lax.scan`` of the autoregressive rollout
(``bench/jax_baselines.py``); without JAX its rows are skipped with a note. Backends that other
modules may or may not provide yet (the Triton smoother kernel, the numba and Triton rollout
backends) are discovered at run time and skipped, with the reason, when absent.

On the CPU the process is pinned to one core and torch to one thread. On CUDA every sample
synchronises before and after its calls (``torch.cuda.synchronize``; ``block_until_ready`` for
JAX) and TF32 is off. Compile and capture times (numba and Triton first calls, TorchScript, JAX
jit, CUDA graph capture) are reported apart. The result is a markdown section written into
``--out`` (replacing the section of an earlier run on the same device, if any) and printed.
Exit status 1 when an implementation disagreed with the reference (it is listed, not timed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as dt
import gc
import importlib
import importlib.metadata
import importlib.util
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import typing
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import numpy as np
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

import rnnserve.models.smoothing
from bench.padding import padded_time_major
from rnnserve.models.kernels import ema_packed_numba, ema_packed_torch
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import (
    ROLLOUT_BACKENDS,
    RolloutBackend,
    Traveller,
    TravellerConfig,
    rollout_backend_fn,
    scripted_rollout,
)

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

# MEASURED.md's CPU figures that the "expected / got" paragraph compares against.
# the server's CPU path: EMA + tanh fused, on the sequences' own rows (no packing)
SMOOTH_FLAT = "LinearRecursion.smooth_flat (no packing; the server's CPU path)"
TRITON_PIECES_8 = "Triton smoother, forward in pieces of 8 steps (sub=8)"
TRITON_LOOP = "Triton smoother, forward as a loop over the steps (sub=1)"
TRITON_LOOP_LONG = "Triton smoother, loop over 256-step chunks (chunk=256, sub=1)"
TRITON_CHAINED = "Triton smoother, single-pass chained scan (scan=chained)"
EXPECTED_SMOOTHER = {"ema_packed_numba": 1.7, "ema_packed_torch": 30.0, "seed-style": 6000.0}
EXPECTED_TS_HIDDEN64 = {1: 26 / 10, 64: 209 / 100}  # fused cells + TorchScript vs nn.LSTM
EXPECTED_EAGER_HIDDEN64 = {1: 42 / 10, 64: 193 / 100}  # fused cells, eager vs nn.LSTM
EXPECTED_CPP_ATEN = {1: 2.00, 64: 1.20}  # C++ loop of ATen calls, default shapes
EXPECTED_JAX = {1: 0.94, 64: 0.80}  # JAX lax.scan rollout vs the bound, default shapes
EXPECTED_JAX_SMOOTHER = (0.74, 1.44)  # JAX lax.scan vs torch.tanh (B=256 T=200; B=64 T=4000)

# MEASURED.md's H200 figures (rnnserve at its first landing; ms per call; same shapes as CUDA_FULL)
EXPECTED_H200_MS: dict[tuple[str, int, int], tuple[float, str]] = {
    ("device-to-device copy (floor)", 64, 1000): (0.022, "copy of the same bytes"),
    ("device-to-device copy (floor)", 256, 4000): (0.047, "copy of the same bytes"),
    ('LinearRecursion, kernel "torch"', 64, 1000): (28.3, "torch loop over steps"),
    ('LinearRecursion, kernel "torch"', 256, 4000): (160.0, "torch loop over steps"),
    ('LinearRecursion, kernel "triton"', 64, 1000): (0.39, "a naive Triton kernel"),
    ('LinearRecursion, kernel "triton"', 256, 4000): (2.27, "a naive Triton kernel"),
    ("JAX lax.associative_scan", 64, 1000): (0.19, "JAX associative_scan"),
    ("JAX lax.associative_scan", 256, 4000): (0.43, "JAX associative_scan"),
    ("JAX lax.scan (padded)", 64, 1000): (16.3, "JAX lax.scan"),
    ("JAX lax.scan (padded)", 256, 4000): (63.8, "JAX lax.scan"),
    ("nn.LSTM teacher-forced + output layer (bound)", 1, 1000): (3.8, "cuDNN nn.LSTM"),
    ("nn.LSTM teacher-forced + output layer (bound)", 64, 500): (2.8, "cuDNN nn.LSTM"),
    ("nn.LSTM teacher-forced + output layer (bound)", 1024, 200): (7.5, "cuDNN nn.LSTM"),
    ('Traveller.rollout, "torchscript"', 1, 1000): (154.0, "TorchScript"),
    ('Traveller.rollout, "torchscript"', 64, 500): (111.0, "TorchScript"),
    ('Traveller.rollout, "torchscript"', 1024, 200): (53.0, "TorchScript"),
    ('Traveller.rollout, "eager"', 1, 1000): (387.0, "eager"),
    ('Traveller.rollout, "eager", in one CUDA graph', 1, 1000): (39.5, "eager in a CUDA graph"),
    ('Traveller.rollout, "eager", in one CUDA graph', 64, 500): (27.4, "eager in a CUDA graph"),
    ('Traveller.rollout, "eager", in one CUDA graph', 1024, 200): (13.2, "eager in a CUDA graph"),
    ("JAX lax.scan rollout (padded)", 1, 1000): (11.8, "JAX lax.scan"),
    ("JAX lax.scan rollout (padded)", 64, 500): (10.0, "JAX lax.scan"),
    ("JAX lax.scan rollout (padded)", 1024, 200): (6.1, "JAX lax.scan"),
}


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
    seed_smoother_rows: int = 60_000  # the seed-style smoother loop only up to this many rows
    seed_rollout_rows: int = 5_000  # the seed-style rollout loop only up to this many rows
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
        seed_smoother_rows=0,  # Python loops of single-row CUDA ops: minutes per call
        seed_rollout_rows=0,
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
        seed_smoother_rows=0,
        seed_rollout_rows=0,
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


# --------------------------------------------------------------------------- references


def smoother_reference(
    seqs: Sequence[Tensor], alpha: Tensor, wx: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``s`` and ``y = tanh(wx * s)``, padded ``[B, T, F]`` (zeros after each end)."""
    x = padded64(seqs)
    a = alpha.detach().double().cpu().numpy()
    s = np.empty_like(x)
    s[:, 0] = x[:, 0]
    for t in range(1, x.shape[1]):
        s[:, t] = a * s[:, t - 1] + (1 - a) * x[:, t]
    mask = _mask([len(q) for q in seqs], x.shape[1])[..., None]
    y = np.tanh(wx.detach().double().cpu().numpy() * s)
    return np.where(mask, s, 0.0), np.where(mask, y, 0.0)


def rollout_reference(model64: Traveller, seqs: Sequence[Tensor]) -> np.ndarray:
    """float64 positions ``[B, T, 2]``: the seed's loop (``nn.LSTM`` once per step, state
    carried), run on the whole padded batch at once -- the rollout is causal, so each
    sequence's real steps are exact; padded steps are zeroed."""
    u = torch.from_numpy(padded64(seqs))
    p = u.new_zeros(u.shape[0], 1, 2)
    hidden: tuple[Tensor, Tensor] | None = None
    out = np.zeros((u.shape[0], u.shape[1], 2))
    with torch.no_grad():
        for t in range(u.shape[1]):
            h, hidden = model64.lstm_layers(torch.cat([p, u[:, t : t + 1]], 2), hidden)
            p = torch.tanh(model64.output_layer(h))
            out[:, t] = p[:, 0].numpy()
    return np.where(_mask([len(q) for q in seqs], u.shape[1])[..., None], out, 0.0)


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


def smoother_kernels() -> tuple[str, ...]:
    """The ``LinearRecursion.kernel`` names this checkout knows (its ``Kernel`` Literal)."""
    names = typing.get_args(getattr(rnnserve.models.smoothing, "Kernel", None))
    return tuple(str(n) for n in names) or ("auto", "numba", "torch")


def make_smoother(
    feat_dim: int, kernel: str, device: torch.device | str = "cpu"
) -> LinearRecursion:
    gen = torch.Generator().manual_seed(0)
    model = LinearRecursion(feat_dim)
    with torch.no_grad():
        model.alpha_smooth.copy_(0.05 + 0.9 * torch.rand(feat_dim, generator=gen))
        model.wx.copy_(0.2 + 1.5 * torch.rand(feat_dim, generator=gen))
    model.kernel = cast(rnnserve.models.smoothing.Kernel, kernel)
    with torch.inference_mode(False):  # parameters stay normal tensors, as when served
        return model.eval().requires_grad_(False).to(device)


def make_traveller() -> Traveller:
    torch.manual_seed(0)
    cfg = TravellerConfig()
    model = Traveller(cfg.num_inputs, cfg.hidden_size, cfg.num_layers, cfg.dropout)
    return model.eval().requires_grad_(False)


def copy_model(
    model: Traveller, device: torch.device | str = "cpu", dtype: torch.dtype | None = None
) -> Traveller:
    """A copy on ``device``; made outside inference mode, so its parameters are normal tensors
    (as in the service, which loads models before any request runs under inference mode)."""
    with torch.inference_mode(False):
        clone = copy.deepcopy(model).to(device)
        return clone if dtype is None else clone.to(dtype)


def with_backend(model: Traveller, backend: str, device: torch.device | str = "cpu") -> Traveller:
    """A copy of ``model`` on ``device`` with rollout ``backend``; Unavailable if it is not."""
    clone = copy_model(model, device)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            clone.compile_rollout(cast(RolloutBackend, backend))
    except ImportError as e:
        raise Unavailable(f"not in this checkout ({type(e).__name__}: {e})") from e
    return clone


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
SEED_SMOOTHER = "seed-style (loops over sequences and steps)"
SEED_ROLLOUT = "seed-style (nn.LSTM per step, per sequence)"
ENCODER_FLOOR = "your nn.Module on the padded batch, one call (floor)"
ENCODER_RECURRENT = "kind recurrent (exported weights), packed batch"
ENCODER_TORCHSCRIPT = "kind torchscript (scripted forward(data, batch_sizes)), packed batch"
ENCODER_PER_SEQUENCE = "your nn.Module once per sequence (no batching)"
ENCODER_CELL_LOOP = "GRUCell loop, per sequence and step (the tests' reference)"
ENCODER_COMPILE = "torch.jit.script(PackedGRUEncoder)"
GRAPH_SUFFIX = ", in one CUDA graph"

Builder = Callable[[], Case]


class Suite:
    """One run on one device: inputs, the implementations to try, and what came of them."""

    def __init__(self, plan: Plan, use_jax: bool = True, jax_process: bool = False) -> None:
        self.plan = plan
        # JAX in a process of its own per case (the default on CUDA): no JAX in this process
        self.jax_process = jax_process
        self.jax_elsewhere_ready = False  # process mode, asked for and installed
        self.device = torch.device(plan.device)
        self.cuda = self.device.type == "cuda"
        self.wait: Callable[[object], object] = _cuda_wait if self.cuda else _no_wait
        self.res = Results()
        self.jax: ModuleType | None = None
        self.jax_device: Any = None
        self.jax_reason = "not tried (--no-jax)"
        self.jax_version = "not installed"
        if use_jax:
            self._load_jax()

    @property
    def smoother_floor(self) -> str:
        return SMOOTHER_FLOOR_CUDA if self.cuda else SMOOTHER_FLOOR_CPU

    def _load_jax(self) -> None:
        if self.jax_process:  # checked here without importing it; its process may still fail
            if importlib.util.find_spec("jax") is None:
                self.jax_reason = "JAX is not installed; `pip install '.[bench]'` adds it"
                _log(f"skipping the JAX rows: {self.jax_reason}")
                return
            self.jax_version = f"{importlib.metadata.version('jax')} (in a process of its own)"
            self.jax_elsewhere_ready = True
            self.res.notes.append(
                "JAX rows: each measured in a process of its own (`--jax process`, the default on "
                "CUDA), right after the other rows of its shape were set up and before they were "
                "timed: not in their round-robin rounds, so its ratio compares medians of "
                "different rounds."
            )
            return
        try:
            jb = importlib.import_module("bench.jax_baselines")
        except ImportError as e:
            self.jax_reason = (
                f"JAX is not installed ({e}); `pip install '.[bench]'` adds it"
                if "jax" in str(e)
                else f"bench.jax_baselines did not import: {e}"
            )
            _log(f"skipping the JAX rows: {self.jax_reason}")
            return
        jax = importlib.import_module("jax")
        self.jax_version = f"{jax.__version__}"
        try:
            self.jax_device = jb.device_for(self.device.type)
        except RuntimeError as e:
            self.jax_reason = str(e)
            _log(f"skipping the JAX rows: {self.jax_reason}")
            return
        self.jax = jb
        self.jax_version += f" ({self.jax_device.platform})"

    # -- running one case -------------------------------------------------------------------

    def build(self, name: str, shape: str, builder: Builder) -> Case | None:
        """Build and check one case; record why not when it cannot or does not agree."""
        try:
            return builder()
        except Unavailable as e:
            self.res.skipped.append((name, shape, str(e)))
            _log(f"  skip {name}: {e}")
        except CheckFailed as e:
            self.res.failed.append((name, shape, str(e)))
            _log(f"  FAILED {e}")
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            self.res.failed.append((name, shape, f"{type(e).__name__}: {e}"))
            _log(f"  FAILED {name}: {type(e).__name__}: {e}")
        return None

    def run_shape(
        self,
        builders: Sequence[tuple[str, Builder]],
        rows: list[Row],
        batch: int,
        steps: int,
        packed_rows: int,
    ) -> None:
        label = shape_label(batch, steps)
        cases = [c for name, b in builders if (c := self.build(name, label, b)) is not None]
        floor_name = builders[0][0]
        if not cases or cases[0].name != floor_name:
            _log(f"  no floor at {label}: nothing timed")
            return
        timings = measure(cases, self.plan)
        floor = timings[floor_name].median
        for case in cases:
            t = timings[case.name]
            rows.append(
                Row(label, case.name, t, t.median / floor, batch, steps, packed_rows, case.err)
            )

    def first_call(self, what: str, fn: Callable[[], object]) -> object:
        """Call ``fn`` once, timing it (synchronised) into the compile table."""
        self.wait(None)
        start = time.perf_counter()
        out = fn()
        self.wait(out)
        self.res.compile.append((what, _fmt_s(time.perf_counter() - start)))
        return out

    # -- the smoother -------------------------------------------------------------------------

    def smoother_builders(
        self, seqs: Sequence[Tensor], x: PackedSequence, label: str
    ) -> list[tuple[str, Builder]]:
        plan, dev = self.plan, self.device
        lengths = [len(s) for s in seqs]
        base = make_smoother(plan.feat_dim, "torch")
        s_ref, y_ref = smoother_reference(seqs, base.alpha_smooth, base.wx)
        data, bs = x.data, x.batch_sizes
        alpha, wx = base.alpha_smooth.to(dev), base.wx.to(dev)

        out = torch.empty_like(data)

        def copy_floor() -> Tensor:
            return out.copy_(data)

        def tanh_floor() -> Tensor:
            return torch.tanh(data)

        def floor() -> Case:
            fn = copy_floor if self.cuda else tanh_floor
            want = padded64(seqs) if self.cuda else np.tanh(padded64(seqs))
            err = check(self.smoother_floor, data_to_padded(fn(), x), want, lengths)
            return Case(self.smoother_floor, fn, self.wait, err=err)

        def ema(name: str, kernel: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Builder:
            def build() -> Case:
                if name == "ema_packed_numba" and self.cuda:
                    raise Unavailable("a CPU kernel")
                got = data_to_padded(kernel(data, bs, alpha), x)
                err = check(name, got, s_ref, lengths)
                return Case(name, lambda: kernel(data, bs, alpha), self.wait, err=err)

            return build

        def layer(kernel: str) -> tuple[str, Builder]:
            name = f'LinearRecursion, kernel "{kernel}"'

            def build() -> Case:
                if kernel == "numba" and self.cuda:
                    raise Unavailable("a CPU kernel")
                if kernel == "triton":
                    if not self.cuda:
                        raise Unavailable(
                            "Triton needs CUDA (on the CPU it runs only in Triton's "
                            "interpreter, for the tests)"
                        )
                    try:
                        importlib.import_module("rnnserve.models.kernels.smoother_triton")
                    except ImportError as e:
                        raise Unavailable(f"not in this checkout ({e})") from e
                model = make_smoother(plan.feat_dim, kernel, dev)
                if kernel == "triton":
                    out = self.first_call(
                        f"Triton smoother kernel, first call ({label})", lambda: model(x)
                    )
                else:
                    out = model(x)
                err = check(name, packed_to_padded(cast(PackedSequence, out)), y_ref, lengths)
                return Case(name, lambda: model(x), self.wait, err=err)

            return name, build

        def pieces(name: str, **tiles: Any) -> tuple[str, Builder]:
            """The Triton kernel with other tiles or another forward design: each chunk scanned
            in pieces (``sub``), or the chained single-pass scan (``scan``)."""

            def build() -> Case:
                from rnnserve.models.kernels.smoother_triton import smooth_packed_triton

                def fn() -> Tensor:
                    return smooth_packed_triton(data, bs, alpha, wx, None, **tiles)[0]

                got = self.first_call(f"Triton smoother, {name} ({label})", fn)
                err = check(name, data_to_padded(cast(Tensor, got), x), y_ref, lengths)
                return Case(name, fn, self.wait, err=err)

            return name, build

        # variants of the Triton forward to choose between by measurement (CUDA only): the
        # default scans each [chunk, block] tile as one tree in three launches; the chained scan
        # is one launch reading x once; the rest walk the default's chunks in pieces
        variants = (
            [
                pieces(TRITON_CHAINED, scan="chained"),
                pieces(TRITON_PIECES_8, sub=8),
                pieces(TRITON_LOOP, sub=1),
                pieces(TRITON_LOOP_LONG, chunk=256, sub=1),
            ]
            if self.cuda
            else []
        )

        def flat() -> Case:
            if self.cuda:
                raise Unavailable("a CPU kernel")
            model = make_smoother(plan.feat_dim, "numba", dev)
            rows = np.concatenate([s.numpy() for s in seqs])
            lens = np.array(lengths, np.int64)
            got = model.smooth_flat(rows, lens)
            padded = np.zeros_like(y_ref)
            row = 0
            for i, n in enumerate(lengths):
                padded[i, :n] = got[row : row + n]
                row += n
            err = check(SMOOTH_FLAT, padded, y_ref, lengths)
            return Case(SMOOTH_FLAT, lambda: model.smooth_flat(rows, lens), self.wait, err=err)

        def seed() -> Case:
            if self.cuda:
                raise Unavailable("Python loops of one-row CUDA ops: minutes per call")
            if x.data.shape[0] > plan.seed_smoother_rows:
                raise Unavailable(
                    f"{x.data.shape[0]:,} rows would take ~{x.data.shape[0] * 13e-6:.0f} s a call"
                )
            got = data_to_padded(smoother_seed_style(x, alpha, wx), x)
            err = check(SEED_SMOOTHER, got, y_ref, lengths)
            return Case(
                SEED_SMOOTHER, lambda: smoother_seed_style(x, alpha, wx), slow=True, err=err
            )

        def jax_case(name: str, fn_name: str) -> Builder:
            def build() -> Case:
                if self.jax_process:
                    xs, mask = padded_time_major([s.numpy() for s in seqs])
                    arrays = {"x": xs, "mask": mask}
                    arrays |= {"alpha": base.alpha_smooth.numpy(), "wx": base.wx.numpy()}
                    out, timing = self.jax_elsewhere(fn_name, arrays, label)
                    got = out.astype(np.float64).transpose(1, 0, 2)
                    err = check(name, got, y_ref, lengths)
                    return Case(name, _nothing, err=err, external=timing)
                jb = self._jax()
                import jax

                xs, mask = jb.padded_time_major([s.numpy() for s in seqs])
                args = [
                    jax.device_put(v, self.jax_device)
                    for v in (xs, mask, base.alpha_smooth.numpy(), base.wx.numpy())
                ]
                fn, secs = jb.compile_for(getattr(jb, fn_name), *args)
                self.res.compile.append((f"JAX jit compile, `{fn_name}` ({label})", _fmt_s(secs)))
                got = np.asarray(fn(*args), dtype=np.float64).transpose(1, 0, 2)
                err = check(name, got, y_ref, lengths)
                return Case(name, lambda: fn(*args), jax.block_until_ready, err=err)

            return build

        return [
            (self.smoother_floor, floor),
            ("ema_packed_numba", ema("ema_packed_numba", ema_packed_numba)),
            ("ema_packed_torch", ema("ema_packed_torch", ema_packed_torch)),
            *(layer(k) for k in smoother_kernels()),
            *variants,
            (SMOOTH_FLAT, flat),
            (SEED_SMOOTHER, seed),
            (JAX_SCAN, jax_case(JAX_SCAN, "smoother_scan")),
            (JAX_ASSOC, jax_case(JAX_ASSOC, "smoother_associative_scan")),
        ]

    def _jax(self) -> Any:
        if self.jax is None:
            raise Unavailable(self.jax_reason)
        return self.jax

    def jax_elsewhere(
        self, fn_name: str, arrays: dict[str, np.ndarray], label: str
    ) -> tuple[np.ndarray, Timing]:
        """Compile, check-call and time ``bench.jax_baselines.<fn_name>`` in a process of its
        own (``python -m bench.jax_baselines``): its output and its timing, as ``measure`` would
        take them (the same number of rounds, each sample about ``sample_s`` long). A crash
        there costs this row only."""
        if not self.jax_elsewhere_ready:  # --no-jax, or not installed
            raise Unavailable(self.jax_reason)
        with tempfile.TemporaryDirectory(prefix="rnnserve-jax-") as tmp:
            inputs, result = Path(tmp) / "inputs.npz", Path(tmp) / "result.npz"
            np.savez(inputs, **arrays)  # type: ignore[arg-type]  # (allow_pickle)
            command = [
                sys.executable, "-m", "bench.jax_baselines", fn_name, str(inputs), str(result),
                "--device", self.device.type, "--rounds", str(self.plan.rounds),
                "--sample-s", str(self.plan.sample_s),
            ]  # fmt: skip
            try:
                done = subprocess.run(
                    command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
                )
            except subprocess.TimeoutExpired as e:
                raise Unavailable("its process took over 600 s") from e
            if done.returncode != 0:
                lines = done.stderr.strip().splitlines() or ["(no output)"]
                raise Unavailable(f"its process failed (exit {done.returncode}): {lines[-1][:300]}")
            with np.load(result) as r:
                out, samples = np.asarray(r["out"]), [float(v) for v in r["samples"]]
                number, secs = int(r["number"]), float(r["compile_s"])
        self.res.compile.append(
            (f"JAX jit compile, `{fn_name}` ({label}; in its own process)", _fmt_s(secs))
        )
        return out, Timing(number=number, samples=samples)

    def bench_smoother(self) -> None:
        plan = self.plan
        for i, (batch, steps) in enumerate(plan.smoother_shapes):
            label = shape_label(batch, steps)
            _log(f"smoother {label}")
            seqs = random_sequences(half_spread_lengths(batch, steps), plan.feat_dim, seed=i)
            x = pack(seqs, self.device)
            builders = self.smoother_builders(seqs, x, label)
            self.run_shape(builders, self.res.smoother, batch, steps, x.data.shape[0])

    # -- the Traveller ----------------------------------------------------------------------

    def traveller_builders(
        self, base: Traveller, seqs: Sequence[Tensor], seed: int, label: str
    ) -> list[tuple[str, Builder]]:
        plan, dev = self.plan, self.device
        lengths = [len(s) for s in seqs]
        x = pack(seqs, dev)
        base64 = copy_model(base, dtype=torch.float64)
        ref = rollout_reference(base64, seqs)

        def bound() -> Case:
            padded, _ = pad_packed_sequence(x, batch_first=True)  # [B, T, num_inputs]
            gen = torch.Generator().manual_seed(seed)
            fed_back = torch.rand(padded.shape[0], padded.shape[1], 2, generator=gen) * 2 - 1
            z = torch.cat([fed_back.to(dev), padded], 2)  # [B, T, 2 + num_inputs]
            model = copy_model(base, dev)

            def fn() -> Tensor:
                h, _ = model.lstm_layers(z)
                return torch.tanh(model.output_layer(h))

            with torch.no_grad():
                h64, _ = base64.lstm_layers(z.cpu().double())
                want = torch.tanh(base64.output_layer(h64)).numpy()
            got = fn().cpu().double().numpy()
            err = check(TRAVELLER_BOUND, got, want, [z.shape[1]] * z.shape[0])
            return Case(TRAVELLER_BOUND, fn, self.wait, err=err)

        def backend(name: str) -> tuple[str, Builder]:
            row = f'Traveller.rollout, "{name}"'

            def build() -> Case:
                if name == "numba" and self.cuda:
                    raise Unavailable("a CPU backend")
                if name == "triton" and not self.cuda:
                    raise Unavailable(
                        "Triton needs CUDA (on the CPU it runs only in Triton's interpreter, "
                        "for the tests)"
                    )
                model = with_backend(base, name, dev)
                if name in ("numba", "triton"):
                    what = f"{name} rollout backend, first call ({label})"
                    out = self.first_call(what, lambda: model.rollout(x))
                else:
                    out = model.rollout(x)
                err = check(row, packed_to_padded(cast(PackedSequence, out)), ref, lengths)
                return Case(row, lambda: model.rollout(x), self.wait, err=err)

            return row, build

        def graphed(name: str) -> tuple[str, Builder]:
            row = f'Traveller.rollout, "{name}"{GRAPH_SUFFIX}'

            def build() -> Case:
                if name == "triton":  # refused by the backend itself, before anything runs
                    raise Unavailable(
                        "it replays CUDA graphs of its own (one per chunk of steps), and a "
                        "graph's replay cannot be captured into another graph"
                    )
                model = with_backend(base, name, dev)
                try:
                    replay, out, secs = capture_graph(lambda: model.rollout(x))
                except Exception as e:
                    raise Unavailable(f"could not be captured ({type(e).__name__}: {e})") from e
                self.res.compile.append(
                    (f"CUDA graph capture, {name} rollout ({label})", _fmt_s(secs))
                )
                replay()
                torch.cuda.synchronize()
                err = check(row, packed_to_padded(cast(PackedSequence, out)), ref, lengths)
                return Case(row, replay, self.wait, err=err)

            return row, build

        def seed_style() -> Case:
            if self.cuda:
                raise Unavailable("per-step nn.LSTM calls of one row: minutes per call on CUDA")
            if x.data.shape[0] > plan.seed_rollout_rows:
                raise Unavailable(
                    f"{x.data.shape[0]:,} sequence steps would take ~"
                    f"{x.data.shape[0] * 320e-6:.0f} s a call; the B=1 row gives its cost per step"
                )
            got = torch.nn.utils.rnn.pad_sequence(
                traveller_seed_style(base, seqs), batch_first=True
            )
            err = check(SEED_ROLLOUT, got.double().numpy(), ref, lengths)
            return Case(SEED_ROLLOUT, lambda: traveller_seed_style(base, seqs), slow=True, err=err)

        def jax_rollout() -> Case:
            lstm = base.lstm_layers
            layers = range(base.num_layers)
            if self.jax_process:
                us, mask = padded_time_major([s.numpy() for s in seqs])
                arrays = {"u": us, "mask": mask, "layers": np.asarray(base.num_layers)}
                for k in layers:
                    for key, attr in (("w_ih", "weight_ih"), ("w_hh", "weight_hh")):
                        arrays[f"{key}_{k}"] = getattr(lstm, f"{attr}_l{k}").numpy()
                    for key, attr in (("b_ih", "bias_ih"), ("b_hh", "bias_hh")):
                        arrays[f"{key}_{k}"] = getattr(lstm, f"{attr}_l{k}").numpy()
                arrays["w_out"] = base.output_layer.weight.numpy()
                arrays["b_out"] = base.output_layer.bias.numpy()
                out, timing = self.jax_elsewhere("traveller_rollout_scan", arrays, label)
                got = out.astype(np.float64).transpose(1, 0, 2)
                err = check(JAX_ROLLOUT, got, ref, lengths)
                return Case(JAX_ROLLOUT, _nothing, err=err, external=timing)
            jb = self._jax()
            import jax

            weights = jb.traveller_weights(
                [getattr(lstm, f"weight_ih_l{k}").numpy() for k in layers],
                [getattr(lstm, f"weight_hh_l{k}").numpy() for k in layers],
                [getattr(lstm, f"bias_ih_l{k}").numpy() for k in layers],
                [getattr(lstm, f"bias_hh_l{k}").numpy() for k in layers],
                base.output_layer.weight.numpy(),
                base.output_layer.bias.numpy(),
                device=self.jax_device,
            )
            us, mask = jb.padded_time_major([s.numpy() for s in seqs])
            args = [jax.device_put(v, self.jax_device) for v in (us, mask)]
            fn, secs = jb.compile_for(jb.traveller_rollout_scan, *args, weights)
            self.res.compile.append(
                (f"JAX jit compile, `traveller_rollout_scan` ({label})", _fmt_s(secs))
            )
            got = np.asarray(fn(*args, weights), dtype=np.float64).transpose(1, 0, 2)
            err = check(JAX_ROLLOUT, got, ref, lengths)
            return Case(JAX_ROLLOUT, lambda: fn(*args, weights), jax.block_until_ready, err=err)

        backends = [b for b in ROLLOUT_BACKENDS if b != "auto"]
        builders: list[tuple[str, Builder]] = [
            (TRAVELLER_BOUND, bound),
            *(backend(b) for b in backends),
            (SEED_ROLLOUT, seed_style),
            (JAX_ROLLOUT, jax_rollout),
        ]
        if self.cuda:  # last: a capture that goes wrong should not upset the others' set-up
            builders += [graphed(b) for b in backends if b != "numba"]
        return builders

    def bench_traveller(self, base: Traveller) -> None:
        for i, (batch, steps) in enumerate(self.plan.traveller_shapes):
            label = shape_label(batch, steps)
            _log(f"traveller {label}")
            seqs = random_sequences(half_spread_lengths(batch, steps), base.num_inputs, 100 + i)
            builders = self.traveller_builders(base, seqs, 200 + i, label)
            n = sum(len(u) for u in seqs)
            self.run_shape(builders, self.res.traveller, batch, steps, n)
        try:
            auto = rollout_backend_fn("auto", self.device)[1]
            self.res.notes.append(
                f'`Traveller.compile_rollout("auto")` resolves to "{auto}" on {self.device.type}.'
            )
        except Exception as e:  # a backend module that is half there
            self.res.notes.append(f'`rollout_backend_fn("auto")` failed here: {e}')

    # -- the GRU encoder (your own model) ---------------------------------------------------

    def encoder_builders(self, seqs: Sequence[Tensor], label: str) -> list[tuple[str, Builder]]:
        from examples.gru_encoder import GRUEncoder, PackedGRUEncoder, gru_cell_loop, make
        from rnnserve.models import export, torchscript

        plan, dev = self.plan, self.device
        lengths = [len(s) for s in seqs]
        with torch.inference_mode(False):  # parameters stay normal tensors, as when served
            user: GRUEncoder = make().eval().requires_grad_(False)
            user64 = copy.deepcopy(user).double()
        with torch.no_grad():  # the float64 reference: the user's module, one sequence a call
            ref = np.zeros((len(seqs), max(lengths), 4))
            for i, seq in enumerate(seqs):
                ref[i, : len(seq)] = user64(seq.double()[:, None])[:, 0].numpy()
        x = pack(seqs, dev)

        def floor() -> Case:
            padded, _ = pad_packed_sequence(x)  # [T, B, 6], time-major as the seed's module
            model = copy.deepcopy(user).to(dev)

            def fn() -> Tensor:
                out: Tensor = model(padded)
                return out

            got = fn().transpose(0, 1).cpu().double().numpy()
            return Case(ENCODER_FLOOR, fn, self.wait, err=check(ENCODER_FLOOR, got, ref, lengths))

        def recurrent() -> Case:
            found = export.find_in_module(user)
            with torch.inference_mode(False):
                model = export.to_recurrent(found, export.config_of(found, "l2_normalize", {}))
                model = model.to(dev)
            out = cast(PackedSequence, model(x))
            err = check(ENCODER_RECURRENT, packed_to_padded(out), ref, lengths)
            return Case(ENCODER_RECURRENT, lambda: model(x), self.wait, err=err)

        def scripted() -> Case:
            with torch.inference_mode(False):
                start = time.perf_counter()
                module = torch.jit.script(PackedGRUEncoder(copy.deepcopy(user)).to(dev))
                script_s = time.perf_counter() - start
            if label == shape_label(*plan.encoder_shapes[0]):
                self.res.encoder_compile.append((ENCODER_COMPILE, _fmt_s(script_s)))
            model = torchscript.TorchScriptModel(module, 6, 4)
            self.wait(None)
            start = time.perf_counter()
            out = cast(PackedSequence, model(x))
            self.wait(out)
            first = _fmt_s(time.perf_counter() - start)
            self.res.encoder_compile.append((f"kind torchscript, first call ({label})", first))
            err = check(ENCODER_TORCHSCRIPT, packed_to_padded(out), ref, lengths)
            return Case(ENCODER_TORCHSCRIPT, lambda: model(x), self.wait, err=err)

        def per_sequence() -> Case:
            model = copy.deepcopy(user).to(dev)
            on_dev = [s.to(dev)[:, None] for s in seqs]  # [T_i, 1, 6] each

            def fn() -> list[Tensor]:
                return [model(s) for s in on_dev]

            got = torch.nn.utils.rnn.pad_sequence([y[:, 0].cpu() for y in fn()], batch_first=True)
            err = check(ENCODER_PER_SEQUENCE, got.double().numpy(), ref, lengths)
            return Case(ENCODER_PER_SEQUENCE, fn, self.wait, err=err)

        def cell_loop() -> Case:
            if self.cuda:
                raise Unavailable("per-step GRUCell calls of one row: minutes per call on CUDA")
            if sum(lengths) > plan.cell_loop_rows:
                raise Unavailable(
                    f"{sum(lengths):,} sequence steps in one call; the B=1 row gives its cost "
                    "per step"
                )

            def fn() -> list[Tensor]:
                return [gru_cell_loop(user, s) for s in seqs]

            got = torch.nn.utils.rnn.pad_sequence(fn(), batch_first=True)
            err = check(ENCODER_CELL_LOOP, got.double().numpy(), ref, lengths)
            return Case(ENCODER_CELL_LOOP, fn, slow=True, err=err)

        return [
            (ENCODER_FLOOR, floor),
            (ENCODER_RECURRENT, recurrent),
            (ENCODER_TORCHSCRIPT, scripted),
            (ENCODER_PER_SEQUENCE, per_sequence),
            (ENCODER_CELL_LOOP, cell_loop),
        ]

    def bench_encoder(self) -> None:
        for i, (batch, steps) in enumerate(self.plan.encoder_shapes):
            label = shape_label(batch, steps)
            _log(f"GRU encoder {label}")
            seqs = random_sequences(half_spread_lengths(batch, steps), 6, seed=300 + i)
            builders = self.encoder_builders(seqs, label)
            self.run_shape(builders, self.res.encoder, batch, steps, sum(len(s) for s in seqs))

    # -- compile times ----------------------------------------------------------------------

    def bench_compile(self, base: Traveller) -> None:
        """First calls, before anything else in this process has compiled them."""
        _log("compile and first-call times")
        res, plan, dev = self.res, self.plan, self.device
        if not self.cuda:
            x = pack(random_sequences(spread_lengths(4, 50), plan.feat_dim, seed=99))
            alpha = torch.full((plan.feat_dim,), 0.5)

            def numba_call() -> object:
                return ema_packed_numba(x.data, x.batch_sizes, alpha)

            first = _clock(Case("", numba_call), 1)
            again = min(_clock(Case("", numba_call), 1) for _ in range(5))
            res.compile.append(
                ("numba `ema_packed_numba`, first call (JIT compile, B=4 T=50)", _fmt_s(first))
            )
            res.compile.append(
                ("numba `ema_packed_numba`, a later call of the same size", _fmt_s(again))
            )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            script_s = _clock(Case("", scripted_rollout), 1)
        res.compile.append(("`torch.jit.script(rollout_packed)`", _fmt_s(script_s)))
        scripted = with_backend(base, "torchscript", dev)
        batch, steps = plan.traveller_shapes[0]
        u = pack(random_sequences([steps] * batch, base.num_inputs, seed=98), dev)
        call = Case("", lambda: scripted.rollout(u), self.wait)
        calls = [_clock(call, 1) for _ in range(4)]
        steady = statistics.median(_clock(call, 1) for _ in range(5))
        where = shape_label(batch, steps)
        for k, t in enumerate(calls, 1):
            res.compile.append((f"TorchScript rollout, call {k} ({where})", _fmt_s(t)))
        res.compile.append(
            (f"TorchScript rollout, steady state ({where}, median of 5)", _fmt_s(steady))
        )


def capture_graph(
    fn: Callable[[], object], warmup: int = 3
) -> tuple[Callable[[], object], object, float]:
    """``fn`` captured in one CUDA graph: (replay, the output it refills, capture seconds).

    Warm-up runs on a side stream first, as ``torch.cuda.graphs`` asks (TorchScript profiles and
    allocators settle there). Replays only ever run the captured shapes.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    start = time.perf_counter()
    with torch.cuda.graph(graph):
        out = fn()
    torch.cuda.synchronize()
    return graph.replay, out, time.perf_counter() - start


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


def _expectations_cpu(res: Results, plan: Plan) -> list[str]:
    sm, tr = res.smoother, res.traveller
    out = []
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
        f'- Full `LinearRecursion` forward with kernel "auto" (numba on the CPU: EMA + `wx·s` + '
        f"tanh, so about numba + 2 elementwise passes ≈ 3.5× expected): got {lr}."
    )
    out.append("**Smoother.** Expected from MEASURED.md (F = 16 or 32, 2-core AVX-512 machine):")
    out.extend(lines)
    floors = _find(sm, SMOOTHER_FLOOR_CPU)
    numbas = _find(sm, "ema_packed_numba")
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
        key = 1 if row.batch == 1 else 64
        per_step = row.timing.median / row.steps * 1e6
        if row.name == 'Traveller.rollout, "torchscript"':
            lines.append(
                f"- TorchScript rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step). MEASURED.md: fused cells + TorchScript "
                f"{_fmt_ratio(EXPECTED_TS_HIDDEN64[key])} (hidden 64), a C++ loop of ATen calls "
                f"{_fmt_ratio(EXPECTED_CPP_ATEN[key])} and JAX `lax.scan` "
                f"{_fmt_ratio(EXPECTED_JAX[key])} (default shapes) — "
                f"{_verdict(row.ratio, EXPECTED_TS_HIDDEN64[key])} the TorchScript lead."
            )
        elif row.name == 'Traveller.rollout, "eager"':
            lines.append(
                f"- Eager rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step); MEASURED.md's eager fused cells "
                f"{_fmt_ratio(EXPECTED_EAGER_HIDDEN64[key])} (hidden 64) — "
                f"{_verdict(row.ratio, EXPECTED_EAGER_HIDDEN64[key])} it."
            )
        elif row.name == 'Traveller.rollout, "numba"':
            lines.append(
                f"- numba rollout backend at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step). MEASURED.md has no numba rollout; the nearest lead, "
                f"a compiled C++ loop of ATen calls, was {_fmt_ratio(EXPECTED_CPP_ATEN[key])} — "
                f"{_verdict(row.ratio, EXPECTED_CPP_ATEN[key])} that."
            )
        elif row.name == JAX_ROLLOUT:
            lines.append(
                f"- JAX `lax.scan` rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step); MEASURED.md {_fmt_ratio(EXPECTED_JAX[key])} — "
                f"{_verdict(row.ratio, EXPECTED_JAX[key])} the lead."
            )
        elif row.name == SEED_ROLLOUT:
            lines.append(
                f"- Seed-style loop at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.0f} µs per step). MEASURED.md's 297 µs/step (hidden 64) is the "
                "figure to compare."
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
                f"rows, {active:.0%} of them real steps) while the packed rollouts run only the "
                f"{ts.packed_rows:,} real ones, so the ratio there flatters them by up to "
                f"{1 / active:.2f}× (the JAX row runs the padded batch, as the bound does)."
            )
    out.extend(lines)
    out.append("")
    out.extend(_jax_paragraph_cpu(res))
    return out


def _jax_paragraph_cpu(res: Results) -> list[str]:
    sm = res.smoother
    scan, assoc = _find(sm, JAX_SCAN), _find(sm, JAX_ASSOC)
    if not scan and not assoc:
        reason = next((why for name, _, why in res.skipped if name.startswith("JAX")), "")
        return [
            f"**JAX.** Not measured in this run: {reason or 'its rows failed (see above)'}. "
            "MEASURED.md's leads: `lax.scan` 0.74–1.44× `torch.tanh` for the smoother, "
            "0.80–0.94× the nn.LSTM bound for the rollout."
        ]
    lo, hi = EXPECTED_JAX_SMOOTHER
    out = [
        "**JAX** (jit, one core, XLA's own threads off; it works on the padded time-major batch, "
        "B·T rows, where the packed kernels walk only the N real ones):"
    ]
    if scan:
        med = statistics.median(r.ratio for r in scan)
        verdict = (
            "better than"
            if med < lo / 1.5
            else "worse than"
            if med > hi * 1.5
            else ("in line with")
        )
        out.append(
            f"- `lax.scan` smoother: {_ratios(sm, JAX_SCAN, exact=True)} the tanh floor; "
            f"MEASURED.md {lo:.2f}× (B=256 T=200) to {hi:.2f}× (B=64 T=4000) — {verdict} "
            "that range."
        )
    if assoc:
        out.append(
            f"- `lax.associative_scan` smoother: {_ratios(sm, JAX_ASSOC, exact=True)} the tanh "
            "floor (no CPU lead in MEASURED.md; it does O(log T) passes over B·T·F, so it is not "
            "expected to win on a CPU)."
        )
    return out


def _expectations_cuda(res: Results, gpu: str) -> list[str]:
    rows = [*res.smoother, *res.traveller]
    lines = []
    for (name, batch, steps), (lead_ms, what) in EXPECTED_H200_MS.items():
        row = next(
            (r for r in rows if r.name == name and (r.batch, r.steps) == (batch, steps)), None
        )
        if row is None:
            continue
        got_ms = row.timing.median * 1e3
        lines.append(
            f"- {name} at {row.shape}: {_fmt_ms(row.timing.median)} ms; MEASURED.md's "
            f"{what}: {lead_ms:g} ms — {_verdict(got_ms, lead_ms)} the lead "
            f"({got_ms / lead_ms:.2f}×)."
        )
    out = [
        f"**Against MEASURED.md's H200 run** (rnnserve at its first landing; this run: {gpu}; "
        "absolute times, since the shapes are the same; a different GPU moves them all):",
        *lines,
    ]
    if not lines:
        out.append("- no row of this run has a lead there (quick mode uses other shapes).")
    for title, table in (("Smoother", res.smoother), ("Traveller", res.traveller)):
        floor_names = (SMOOTHER_FLOOR_CUDA, SMOOTHER_FLOOR_CPU, TRAVELLER_BOUND)
        floors = {r.shape: r for r in table if r.name in floor_names}
        best: dict[str, Row] = {}
        for r in table:
            if (
                r.shape in floors
                and r.name != floors[r.shape].name
                and (r.shape not in best or r.timing.median < best[r.shape].timing.median)
            ):
                best[r.shape] = r
        if best:
            out.append("")
            out.append(f"**{title}: the fastest implementation per shape against its floor.**")
            out.extend(
                f"- {shape}: {r.name}, {_fmt_ms(r.timing.median)} ms, {_fmt_ratio(r.ratio)} "
                f"the {floors[shape].name}."
                for shape, r in best.items()
            )
    return out


ENCODER_NAMES = (
    ENCODER_FLOOR,
    ENCODER_RECURRENT,
    ENCODER_TORCHSCRIPT,
    ENCODER_PER_SEQUENCE,
    ENCODER_CELL_LOOP,
)


def _expectations_encoder(rows: Sequence[Row]) -> list[str]:
    out = []
    for shape in dict.fromkeys(r.shape for r in rows):
        by = {r.name: r for r in rows if r.shape == shape}
        floor = by.get(ENCODER_FLOOR)
        if floor is None:
            continue
        active = floor.packed_rows / (floor.batch * floor.steps)
        rec, ts = by.get(ENCODER_RECURRENT), by.get(ENCODER_TORCHSCRIPT)
        per, loop = by.get(ENCODER_PER_SEQUENCE), by.get(ENCODER_CELL_LOOP)
        expect = (
            "about 1× (the same GRU kernels on the same rows, plus the packing bookkeeping)"
            if floor.batch == 1
            else f"at most 1× and down to {active:.2f}× (the packed batch runs the "
            f"{floor.packed_rows:,} real steps; the padded floor runs all "
            f"{floor.batch * floor.steps:,})"
        )
        if rec is not None:
            out.append(
                f"- {shape}: kind recurrent {_fmt_ratio(rec.ratio)} the floor; expected "
                f"{expect} — {_verdict(rec.ratio, 1.0 if floor.batch == 1 else active)} it."
            )
        if rec is not None and ts is not None:
            out.append(
                f"- {shape}: kind torchscript {_fmt_ratio(ts.ratio)} the floor, "
                f"{ts.timing.median / rec.timing.median:.2f}× kind recurrent's time (expected "
                "about 1×: the same ATen GRU call, behind TorchScript's interpreter)."
            )
        if per is not None and floor.batch > 1:
            out.append(
                f"- {shape}: one call per sequence {_fmt_ratio(per.ratio)} the floor: what "
                f"batching {floor.batch} sequences into one call saves."
            )
        if loop is not None:
            us = loop.timing.median / loop.packed_rows * 1e6
            out.append(
                f"- {shape}: the GRUCell loop {_fmt_ratio(loop.ratio)} the floor "
                f"({us:.0f} µs per sequence step: Python and per-call overhead, not arithmetic)."
            )
    return out or ["- no GRU encoder row was measured."]


def render_encoder(
    res: Results, plan: Plan, separate: str | None = None, cuda: bool = False
) -> list[str]:
    """The GRU encoder's subsection, between its own markers; ``separate`` says when and where
    it was measured if not in the same run as the rest of the section."""
    begin, end = (BEGIN_ENCODER_CUDA, END_ENCODER_CUDA) if cuda else (BEGIN_ENCODER, END_ENCODER)
    rows = res.encoder
    shapes = list(dict.fromkeys(r.shape for r in rows))
    heads = [
        f"{r.shape} (N={r.packed_rows:,}; padded {r.batch * r.steps:,})"
        for r in rows
        if r.name == ENCODER_FLOOR
    ]
    lib = "cuDNN" if cuda else "oneDNN"
    lines = [
        begin,
        "### GRU encoder: your own model (seed 003)",
        "",
        "`examples/gru_encoder.py`: `nn.GRU(6, 200, num_layers=2)` → `nn.Linear(200, 4)` → each "
        "output step divided by its L2 norm, served as your own model. Floor: the user's plain "
        f"`nn.Module` over the same padded batch `[T, B, 6]` in one call ({lib}). The served "
        "kinds run the packed batch: `recurrent` (the weights exported by `python -m "
        "rnnserve.models.export`: one packed `nn.GRU` call, the head on the packed rows) and "
        "`torchscript` (`PackedGRUEncoder` scripted, called as `forward(data, batch_sizes)`). "
        "Each cell: × floor · median per call · µs per step; lengths T/2..T. Checked against "
        f"the user's module in float64 (≤ {TOLERANCE:g}).",
        "",
    ]
    if separate:
        lines += [separate, ""]
    if rows:
        lines += [
            *_summary_table(rows, shapes, heads),
            "",
            *_detail_table(rows, ref="floor"),
            "",
        ]
    else:
        lines += ["Not measured in this run.", ""]
    if res.encoder_compile:
        lines += [
            "Compile and first calls: "
            + "; ".join(f"{what}: {fig}" for what, fig in res.encoder_compile)
            + ".",
            "",
        ]
    failed = [f for f in res.failed if f[0] in ENCODER_NAMES]
    if failed:
        lines += [f"- FAILED {name} ({shape}): {why}" for name, shape, why in failed] + [""]
    skipped = _skipped_lines(res, only=ENCODER_NAMES)
    if skipped:
        lines += ["Not measured:", "", *skipped, ""]
    if rows:
        lines += ["What we expected / what we got:", "", *_expectations_encoder(rows), ""]
    lines.append(end)
    return lines


def _skipped_lines(res: Results, only: Sequence[str] | None = None) -> list[str]:
    grouped: dict[tuple[str, str], list[str]] = {}
    for name, shape, why in res.skipped:
        if (only is None and name in ENCODER_NAMES) or (only is not None and name not in only):
            continue  # the encoder's are listed in its own subsection
        grouped.setdefault((name, why), []).append(shape)
    return [f"- {name} ({'; '.join(shapes)}): {why}" for (name, why), shapes in grouped.items()]


def render(
    res: Results,
    plan: Plan,
    started: dt.datetime,
    wall_s: float,
    load: str,
    machine: str,
) -> str:
    cuda = plan.device == "cuda"
    begin, end = (BEGIN_CUDA, END_CUDA) if cuda else (BEGIN, END)
    floor = SMOOTHER_FLOOR_CUDA if cuda else SMOOTHER_FLOOR_CPU
    sm_shapes = list(dict.fromkeys(r.shape for r in res.smoother))
    tr_shapes = list(dict.fromkeys(r.shape for r in res.traveller))
    sm_heads = [f"{r.shape} (N={r.packed_rows:,})" for r in res.smoother if r.name == floor]
    tr_heads = [
        f"{r.shape} (N={r.packed_rows:,}; padded {r.batch * r.steps:,})"
        for r in res.traveller
        if r.name == TRAVELLER_BOUND
    ]
    cfg = TravellerConfig()
    mode = "`--quick` (tiny sizes, smoke test only)" if plan.quick else "full"
    command = "python -m bench.bench_models" + (" --device cuda" if cuda else "")
    if cuda:
        method = (
            "fp32 on CUDA under `torch.inference_mode()`, TF32 off (torch matmul and cuDNN; JAX "
            "asks for `Precision.HIGHEST`). Each sample synchronises before and after its calls "
            "(`torch.cuda.synchronize()`; `block_until_ready` for JAX). CUDA-graph rows capture "
            "one rollout of exactly that batch (what a per-shape graph cache would replay); the "
            "capture is timed apart."
        )
        sm_ref = "a device-to-device copy of the packed data `[N, F]` (`copy_`, the memory floor)"
        tr_ref = "cuDNN"
    else:
        method = (
            "fp32 on the CPU under `torch.inference_mode()`, the process pinned to one core, "
            "torch on one thread, XLA's CPU thread pool off."
        )
        sm_ref = "one `torch.tanh` over the packed data `[N, F]` (the floor)"
        tr_ref = "oneDNN"
    lines = [
        begin,
        f"## Model kernels{' on CUDA' if cuda else ''} (`{command}`)",
        "",
        f"Written by `bench/bench_models.py`; rerun `{command}` to refresh this section. "
        f"Mode: {mode}; run took {wall_s:.0f} s.",
        "",
        f"**Machine.** {machine}; date {started.strftime('%Y-%m-%d %H:%M UTC')}; load average "
        f"at start {load}."
        + (
            ""
            if cuda
            else " The machine is shared and noisy: read the ratios, not the absolute times."
        ),
        "",
        f"**Method.** {method} Each implementation is first checked against a float64 "
        f"reference (max abs error ≤ {TOLERANCE:g} over the real steps; the error is listed), "
        f"warmed up, then timed in {plan.rounds} round-robin rounds, each sample repeating the "
        f"call until it lasts ≥ {plan.sample_s * 1e3:g} ms; slow implementations (a call over "
        f"{plan.slow_call_s:g} s, and the seed-style loops) get {plan.slow_rounds} "
        f"sample{'s' if plan.slow_rounds != 1 else ''} of one call. Reported: the median time "
        "per call, the min–max over samples, µs per time step "
        "(time per call / T) and the ratio of medians against the floor timed in the same "
        "rounds. Lengths are spread evenly from T down to T/2. Compile, first-call and capture "
        "times are reported apart.",
        "",
        f"### Smoother (F = {plan.feat_dim}, packed, lengths T/2..T)",
        "",
        f"Floor: {sm_ref}. Each cell: × floor · median per call · µs per step.",
        "",
        *_summary_table(res.smoother, sm_shapes, sm_heads),
        "",
        *_detail_table(res.smoother, ref="floor"),
        "",
        f"### Traveller (num_inputs {cfg.num_inputs}, hidden {cfg.hidden_size}, "
        f"{cfg.num_layers} layers)",
        "",
        f"Bound: PyTorch's teacher-forced `nn.LSTM` ({tr_ref}) over the same padded batch "
        "`[B, T, 2 + num_inputs]` plus output layer and tanh, in one call. Each cell: × bound · "
        "median per call · µs per step.",
        "",
        *_summary_table(res.traveller, tr_shapes, tr_heads),
        "",
        *_detail_table(res.traveller, ref="bound"),
        "",
        *(f"{note}\n" for note in res.notes),
        *render_encoder(res, plan, cuda=cuda),
        "",
        "### Compile, first-call and capture times",
        "",
        "| what | time |",
        "|---|---|",
        *(f"| {what} | {fig} |" for what, fig in res.compile),
        "",
    ]
    failed = [f for f in res.failed if f[0] not in ENCODER_NAMES]
    if failed:
        lines += [
            "### FAILED: disagreed with the float64 reference or raised (not timed)",
            "",
            *(f"- {name} ({shape}): {why}" for name, shape, why in failed),
            "",
        ]
    skipped = _skipped_lines(res)
    if skipped:
        lines += ["### Not measured in this run", "", *skipped, ""]
    lines += ["### What we expected / what we got", ""]
    if plan.quick:
        lines.append(
            "*Quick mode: tiny sizes, so fixed per-call costs dominate and the figures below say "
            "nothing about the real shapes.*\n"
        )
    lines += (
        _expectations_cuda(res, machine.split(";")[0]) if cuda else _expectations_cpu(res, plan)
    )
    lines.append(end)
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


def write_encoder(path: Path, block: str, cuda: bool = False) -> None:
    """Put the GRU encoder's subsection into the section of an earlier run in ``path``
    (replacing its earlier rows), or, with no such section, write a section of its own."""
    begin, end = (BEGIN_CUDA, END_CUDA) if cuda else (BEGIN, END)
    sub_begin, sub_end = (
        (BEGIN_ENCODER_CUDA, END_ENCODER_CUDA) if cuda else (BEGIN_ENCODER, END_ENCODER)
    )
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        section, tail = rest.split(end, 1)
        if sub_begin in section and sub_end in section:
            before, after = section.split(sub_begin, 1)
            section = before + block.rstrip("\n") + after.split(sub_end, 1)[1]
        else:  # before the compile table, where a full run puts it
            marker = "### Compile, first-call and capture times"
            if marker in section:
                before, after = section.split(marker, 1)
                section = before + block + "\n" + marker + after
            else:
                section = section.rstrip("\n") + "\n\n" + block
        path.write_text(head + begin + section + end + tail, encoding="utf-8")
        return
    title = f"## Model kernels{' on CUDA' if cuda else ''} (`python -m bench.bench_models`)"
    write_section(path, f"{begin}\n{title}\n\n{block}{end}\n", begin, end)


def _machine(suite: Suite, pinned: str) -> str:
    versions = _versions(suite.jax_version)
    if suite.cuda:
        props = torch.cuda.get_device_properties(suite.device)
        return (
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}, "
            f"cuDNN {torch.backends.cudnn.version()}; host {cpu_model()}, {os.cpu_count()} "
            f"logical CPUs; Python {platform.python_version()}, {versions}"
        )
    return (
        f"{cpu_model()}, {os.cpu_count()} logical CPUs; Python {platform.python_version()}, "
        f"{versions}; torch threads: {torch.get_num_threads()} (pinned), interop threads: "
        f"{torch.get_num_interop_threads()}; {pinned}"
    )


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    parser.add_argument("--no-jax", action="store_true", help="leave the JAX rows out")
    parser.add_argument(
        "--jax",
        choices=("process", "inline"),
        default=None,
        help="JAX in a process of its own per case (the default on CUDA: JAX and torch in one "
        "process died of an illegal memory access on an H200) or in this one, timed round-robin "
        "with the others (the default on the CPU)",
    )
    parser.add_argument(
        "--no-pin", action="store_true", help="on the CPU, do not pin the process to one core"
    )
    parser.add_argument(
        "--only",
        choices=("all", "encoder"),
        default="all",
        help="encoder: only the GRU encoder rows, put into an earlier run's section",
    )
    args = parser.parse_args(argv)
    plan = PLANS[(args.device, args.quick)]
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_models: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2

    _prepare_jax_env(args.device)
    pinned = "process not pinned (--no-pin)"
    if args.device == "cpu":
        if not args.no_pin:
            pinned = _pin_one_core()
        torch.set_num_threads(1)
        with contextlib.suppress(RuntimeError):  # refused once inter-op work has started
            torch.set_num_interop_threads(1)
    else:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    started = dt.datetime.now(dt.UTC)
    load = "n/a"
    if hasattr(os, "getloadavg"):
        load = ", ".join(f"{v:.2f}" for v in os.getloadavg())
    t0 = time.perf_counter()
    jax_process = (args.jax or ("process" if args.device == "cuda" else "inline")) == "process"
    suite = Suite(plan, use_jax=not args.no_jax and args.only == "all", jax_process=jax_process)
    if args.only == "encoder":
        with torch.inference_mode():
            suite.bench_encoder()
        wall = time.perf_counter() - t0
        command = " ".join(["python -m bench.bench_models", *(argv or sys.argv[1:])])
        separate = (
            f"*Measured on its own (`{command}`) "
            f"on {started.strftime('%Y-%m-%d %H:%M UTC')} in {wall:.0f} s, load average at start "
            f"{load}; {_machine(suite, pinned)}. The rest of this section is from the run "
            "described above."
            + ("" if suite.cuda else " A shared, noisy machine: read the ratios, not the times.")
            + "*"
        )
        block = "\n".join(render_encoder(suite.res, plan, separate, suite.cuda)) + "\n"
        write_encoder(args.out, block, suite.cuda)
        print(block)
        _log(f"wrote the GRU encoder rows into {args.out}")
        return 1 if suite.res.failed else 0
    base = make_traveller()
    with torch.inference_mode():
        suite.bench_compile(base)
        suite.bench_smoother()
        suite.bench_traveller(base)
        suite.bench_encoder()
    section = render(
        suite.res, plan, started, time.perf_counter() - t0, load, _machine(suite, pinned)
    )
    begin, end = (BEGIN_CUDA, END_CUDA) if suite.cuda else (BEGIN, END)
    write_section(args.out, section, begin, end)
    print(section)
    _log(f"wrote {args.out}")
    if suite.res.failed:
        _log(f"{len(suite.res.failed)} implementation(s) FAILED their check: see the section")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
