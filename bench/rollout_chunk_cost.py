"""What one chunk of continuous batching costs on the CPU beyond the compiled rollout loop.

Usage::

    python -m bench.rollout_chunk_cost [--rounds 15] [--batch 1 4 16 64] [--out docs/BENCHMARKS.md]

``/rollout`` advances its running sequences ``rollout_chunk_steps`` (64) steps at a time: one
``ChunkedRollout.advance`` per chunk, which packs the chunk's inputs, calls the Traveller's
rollout (the numba backend, with the GEMM routes measured at load, as served) and hands each
sequence its outputs and state. Everything around the compiled loop is paid once per chunk, so
at few rows it is a large share of a chunk. For B running sequences (all long, so none joins or
leaves: the steady state), in one process pinned to one core, torch on one thread, each layer
is timed on the same 64-step chunk in interleaved rounds, as the thread's CPU time, the fastest
call of each round kept:

- ``loop``: the compiled loop alone, its arguments prepared beforehand (the floor);
- ``rollout function``: the model's rollout function (the loop's arguments prepared in it);
- ``Traveller.rollout_with_state``: the model's call on a packed chunk (state in and out);
- ``ChunkedRollout.advance``: the whole chunk as the service runs it.

Reported: the median over rounds of each layer's time and its ratio to the loop's.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.models_harness import DEFAULT_OUT, _pin_one_core, cpu_model, write_section
from rnnserve import models
from rnnserve.models.kernels import rollout_cpu as rc
from rnnserve.models.packing import pack
from rnnserve.models.traveller import RolloutState, Traveller
from rnnserve.service.engine.chunked_rollout import ChunkedRollout

BEGIN = "<!-- rollout_chunk_cost:begin -->"
END = "<!-- rollout_chunk_cost:end -->"
CHUNK = 64
LAYERS = ("loop", "rollout function", "Traveller.rollout_with_state", "ChunkedRollout.advance")


def _fastest_call(fn: Callable[[], object], calls: int) -> float:
    # the calling thread's CPU time: every layer runs on this thread, and time the machine
    # gives to other guests or processes does not count (a wall clock here moved 20 % between
    # runs minutes apart)
    best = float("inf")
    for _ in range(calls):
        t0 = time.thread_time()
        fn()
        best = min(best, time.thread_time() - t0)
    return best


def _layers(model: Traveller, batch: int, chunks: int, seed: int) -> dict[str, Callable[[], Any]]:
    """One callable per layer, each running the same 64-step chunk of ``batch`` sequences."""
    rng = np.random.default_rng(seed)
    width = model.num_inputs
    steps = CHUNK * (chunks + 2)  # long enough that no sequence finishes while timed
    inputs = [rng.standard_normal((steps, width)).astype(np.float32) for _ in range(batch)]
    chunked = ChunkedRollout(model, torch.device("cpu"), CHUNK)
    chunked.advance([(1, inputs)], [])  # admitted and one chunk run: the steady state
    chunk = pack([torch.from_numpy(a[:CHUNK]) for a in inputs])
    state = RolloutState.zeros(
        model.num_layers, batch, model.hidden_size, dtype=torch.float32, device=torch.device("cpu")
    )
    w_cat, bias, w_out, b_out = model.fused_weights()
    sizes = chunk.batch_sizes.tolist()
    kernel: Any = model._rollout_fn
    call_args = (chunk.data, sizes, w_cat, bias, w_out, b_out, state.h, state.c, state.p)
    weights = rc.loop_weights(w_cat, bias, w_out, b_out, torch.float32, width)
    table = rc.route_table(model.num_layers, batch, routes=getattr(kernel, "routes", None))
    per_step = np.asarray(sizes, dtype=np.int64)
    if rc._worth_packing(weights, int(rc._mkl_widths(table)[per_step].sum())):
        packed = rc._packed_weights(weights, batch)
    else:
        packed = rc._unpacked(model.num_layers)
    start = (state.h, state.c, state.p)
    prepared = rc.loop_arguments(chunk.data, per_step, weights, start, table, packed)

    def loop() -> None:
        args = dict(prepared)
        for name in ("z0", "z_up", "c"):  # the state buffers the loop updates in place
            args[name] = prepared[name].copy()
        with rc._one_openblas_thread(args["routes"]):
            rc._rollout_loop_jit(*args.values())

    def model_call() -> object:
        with torch.inference_mode():
            return model.rollout_with_state(chunk, state)

    return {
        "loop": loop,
        "rollout function": lambda: kernel(*call_args),
        "Traveller.rollout_with_state": model_call,
        "ChunkedRollout.advance": lambda: chunked.advance([], []),
    }


def measure(
    model: Traveller, batch: int, rounds: int, calls: int, seed: int = 0
) -> dict[str, list[float]]:
    """Seconds per call of each layer: the fastest of ``calls`` calls, once per round, the layers
    taking turns within a round (their order rotated), so drift reaches all of them alike."""
    layers = _layers(model, batch, chunks=rounds * calls + 4, seed=seed)
    for fn in layers.values():  # warm: first calls allocate and touch fresh pages
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in layers}
    names = list(layers)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times[name].append(_fastest_call(layers[name], calls))
    return times


def table(results: dict[int, dict[str, list[float]]]) -> list[str]:
    """Markdown rows: per batch size, each layer's median µs and its ratio to the loop's."""
    head = "| B | " + " | ".join(f"`{name}`" for name in LAYERS) + " | beyond the loop |"
    lines = [head, "|" + "---|" * (len(LAYERS) + 2)]
    for batch, times in results.items():
        med = {name: statistics.median(times[name]) * 1e6 for name in LAYERS}
        cells = [f"{med[n]:,.0f} µs ({med[n] / med['loop']:.2f}×)" for n in LAYERS]
        extra = med["ChunkedRollout.advance"] - med["loop"]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | {extra:,.0f} µs |")
    return lines


def run(batches: Sequence[int], rounds: int, calls: int) -> tuple[str, list[str]]:
    torch.set_num_threads(1)
    pinned = _pin_one_core()
    model = models.load("traveller")
    assert isinstance(model, Traveller)
    results = {b: measure(model, b, rounds, calls) for b in batches}
    stamp = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    head = (
        f"{cpu_model()}, {pinned}, torch {torch.__version__} on 1 thread; {stamp}. "
        f"The bundled Traveller, numba backend, routes `{model.rollout_routes}`. "
        f"Median over {rounds} rounds of the fastest of {calls} calls, CPU time of the thread."
    )
    return head, table(results)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 4, 16, 64])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--out", type=Path, default=None, help=f"e.g. {DEFAULT_OUT}")
    args = ap.parse_args()
    head, rows = run(args.batch, args.rounds, args.calls)
    print(head)
    print("\n".join(rows))
    if args.out is not None:
        title = "## A chunk's cost beyond the loop (`python -m bench.rollout_chunk_cost`)"
        section = "\n".join([BEGIN, title, "", head, "", *rows, END]) + "\n"
        write_section(args.out, section, BEGIN, END)


if __name__ == "__main__":
    main()
