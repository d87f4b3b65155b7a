"""Benchmark of the model kernels, as ratios measured in one run, on the CPU or on CUDA.

Usage::

    python -m bench.bench_models [--device cpu|cuda] [--quick] [--out docs/BENCHMARKS.md]

Every implementation is first checked against a float64 reference (max abs error 1e-5 over the
real steps), warmed up, then timed in round-robin rounds (so slow drift of a shared, noisy
machine hits all of them alike); each is reported as the median time per call with the min-max
spread, in µs per time step, and as a ratio against a floor measured in the same rounds:

- smoother: on the CPU one ``torch.tanh`` pass over the same packed data (the floor: every
  output needs one tanh); on CUDA a device-to-device copy of the same bytes;
- Traveller: PyTorch's teacher-forced ``nn.LSTM`` (oneDNN on the CPU, cuDNN on CUDA) + output
  layer over the same padded batch, in one call (the bound: it skips the feedback, so it can run
  the whole sequence in one library call);
- the GRU encoder example (``examples/gru_encoder.py``: ``nn.GRU(6, 200, 2 layers)`` ->
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

This module holds the command line, the report and the Suite; the cases are by subject in
``models_smoother``, ``models_traveller`` and ``models_encoder``, on the harness of
``models_harness`` (plans, timing, checks, formatting) and ``models_suite`` (one run's state).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from bench.models_encoder import EncoderBench, render_encoder, write_encoder
from bench.models_harness import (
    BEGIN,
    BEGIN_CUDA,
    DEFAULT_OUT,
    END,
    END_CUDA,
    JAX_ASSOC,
    JAX_ROLLOUT,
    JAX_SCAN,
    PLANS,
    SMOOTHER_FLOOR_CPU,
    SMOOTHER_FLOOR_CUDA,
    STEP_LOOP_ROLLOUT,
    TOLERANCE,
    TRAVELLER_BOUND,
    Plan,
    Results,
    Row,
    _detail_table,
    _find,
    _fmt_ms,
    _fmt_ratio,
    _log,
    _pin_one_core,
    _prepare_jax_env,
    _ratios,
    _skipped_lines,
    _summary_table,
    _verdict,
    _versions,
    cpu_model,
    write_section,
)

# what the other benchmarks and tests/bench import from here
from bench.models_harness import BEGIN_ENCODER as BEGIN_ENCODER
from bench.models_harness import ENCODER_NAMES as ENCODER_NAMES
from bench.models_harness import END_ENCODER as END_ENCODER
from bench.models_harness import GRAPH_SUFFIX as GRAPH_SUFFIX
from bench.models_harness import Timing as Timing
from bench.models_harness import Unavailable as Unavailable
from bench.models_harness import half_spread_lengths as half_spread_lengths
from bench.models_harness import random_sequences as random_sequences
from bench.models_harness import shape_label as shape_label
from bench.models_harness import spread_lengths as spread_lengths
from bench.models_smoother import TRITON_CHAINED as TRITON_CHAINED
from bench.models_smoother import TRITON_LOOP as TRITON_LOOP
from bench.models_smoother import TRITON_LOOP_LONG as TRITON_LOOP_LONG
from bench.models_smoother import TRITON_PIECES_8 as TRITON_PIECES_8
from bench.models_smoother import SmootherBench
from bench.models_smoother import smoother_reference as smoother_reference
from bench.models_traveller import TravellerBench, make_traveller
from bench.models_traveller import rollout_reference as rollout_reference
from rnnserve.models.traveller import (
    TravellerConfig,
)

EXPECTED_SMOOTHER = {"ema_packed_numba": 1.7, "ema_packed_torch": 30.0, "per-step loop": 6000.0}
EXPECTED_TS_HIDDEN64 = {1: 26 / 10, 64: 209 / 100}  # fused cells + TorchScript vs nn.LSTM
EXPECTED_EAGER_HIDDEN64 = {1: 42 / 10, 64: 193 / 100}  # fused cells, eager vs nn.LSTM
EXPECTED_CPP_ATEN = {1: 2.00, 64: 1.20}  # C++ loop of ATen calls, default shapes
EXPECTED_JAX = {1: 0.94, 64: 0.80}  # JAX lax.scan rollout vs the bound, default shapes
EXPECTED_JAX_SMOOTHER = (0.74, 1.44)  # JAX lax.scan vs torch.tanh (B=256 T=200; B=64 T=4000)

# Early H200 figures of rnnserve as first built (ms per call; the shapes of CUDA_FULL)
EXPECTED_H200_MS: dict[tuple[str, int, int], tuple[float, str]] = {
    ("device-to-device copy (floor)", 64, 1000): (0.022, "a copy of the same bytes"),
    ("device-to-device copy (floor)", 256, 4000): (0.047, "a copy of the same bytes"),
    ('LinearRecursion, kernel "torch"', 64, 1000): (28.3, "a torch loop over steps"),
    ('LinearRecursion, kernel "torch"', 256, 4000): (160.0, "a torch loop over steps"),
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


class Suite(SmootherBench, TravellerBench, EncoderBench):
    """One run on one device: inputs, the implementations to try, and what came of them."""


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
            f"- `{name}`: the reference figure ~{expected:g}× the tanh floor; got "
            f"{_ratios(sm, name)} — {_verdict(med, expected)} the lead."
        )
    lr = _ratios(sm, 'LinearRecursion, kernel "auto"')
    lines.append(
        f'- Full `LinearRecursion` forward with kernel "auto" (numba on the CPU: EMA + `wx·s` + '
        f"tanh, so about numba + 2 elementwise passes ≈ 3.5× expected): got {lr}."
    )
    out.append(
        "**Smoother.** Expected from the earlier reference measurement (F = 16 or 32, 2-core "
        "AVX-512 machine):"
    )
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
            f"at {ns_tanh.shape} (the reference figure: about 2.5 ns), and `ema_packed_numba` at "
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
                f"({per_step:.1f} µs/step). The reference figures: fused cells + TorchScript "
                f"{_fmt_ratio(EXPECTED_TS_HIDDEN64[key])} (hidden 64), a C++ loop of ATen calls "
                f"{_fmt_ratio(EXPECTED_CPP_ATEN[key])} and JAX `lax.scan` "
                f"{_fmt_ratio(EXPECTED_JAX[key])} (default shapes) — "
                f"{_verdict(row.ratio, EXPECTED_TS_HIDDEN64[key])} the TorchScript lead."
            )
        elif row.name == 'Traveller.rollout, "eager"':
            lines.append(
                f"- Eager rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step); the reference figure for eager fused cells "
                f"{_fmt_ratio(EXPECTED_EAGER_HIDDEN64[key])} (hidden 64) — "
                f"{_verdict(row.ratio, EXPECTED_EAGER_HIDDEN64[key])} it."
            )
        elif row.name == 'Traveller.rollout, "numba"':
            lines.append(
                f"- numba rollout backend at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step). The reference has no numba rollout; the nearest lead, "
                f"a compiled C++ loop of ATen calls, was {_fmt_ratio(EXPECTED_CPP_ATEN[key])} — "
                f"{_verdict(row.ratio, EXPECTED_CPP_ATEN[key])} that."
            )
        elif row.name == JAX_ROLLOUT:
            lines.append(
                f"- JAX `lax.scan` rollout at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.1f} µs/step); the reference figure {_fmt_ratio(EXPECTED_JAX[key])} — "
                f"{_verdict(row.ratio, EXPECTED_JAX[key])} the lead."
            )
        elif row.name == STEP_LOOP_ROLLOUT:
            lines.append(
                f"- Per-step loop at {row.shape}: {_fmt_ratio(row.ratio)} the bound "
                f"({per_step:.0f} µs per step). The reference figure, 297 µs/step (hidden 64), is "
                "the one to compare."
            )
    out.append(
        "**Traveller.** The earlier reference measurement has the rollout variants at hidden 64 "
        "and, at the default shapes (hidden 128), only the C++-of-ATen loop and JAX:"
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
            "The reference leads: `lax.scan` 0.74–1.44× `torch.tanh` for the smoother, "
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
            f"the reference figures {lo:.2f}× (B=256 T=200) to {hi:.2f}× (B=64 T=4000) — {verdict} "
            "that range."
        )
    if assoc:
        out.append(
            f"- `lax.associative_scan` smoother: {_ratios(sm, JAX_ASSOC, exact=True)} the tanh "
            "floor (no CPU reference figure; it does O(log T) passes over B·T·F, so it is not "
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
            f"- {name} at {row.shape}: {_fmt_ms(row.timing.median)} ms; the reference figure "
            f"for {what}: {lead_ms:g} ms — {_verdict(got_ms, lead_ms)} the lead "
            f"({got_ms / lead_ms:.2f}×)."
        )
    out = [
        f"**Against the earlier reference measurement on an H200** (rnnserve at its first "
        f"landing; this run: {gpu}; "
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
        f"{plan.slow_call_s:g} s, and the per-step loops) get {plan.slow_rounds} "
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
