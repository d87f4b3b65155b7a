"""Where a /smooth request's server time goes, stage by stage, in-process (no HTTP).

One request of 64 sequences x 1,000 steps x 16 features through the served smoother:
parse (JSON fast path, or safetensors), pack, model, unpack, serialise; next to
``orjson.loads`` + ``orjson.dumps`` of the same payload, and the precise (pydantic) parser.
Stages run interleaved, repeated, and reported as medians on one torch thread.

    .venv/bin/python -m bench.bench_wire [--repeats 15]
"""

from __future__ import annotations

import argparse
import datetime as dt
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from bench.models_harness import DEFAULT_OUT, cpu_model, write_section
from rnnserve import models
from rnnserve.models.packing import pack_flat, plan, unpack_flat
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.codec import bodies
from rnnserve.service.http.validation import SmoothRequest, parse_body, parse_state, to_arrays
from rnnserve.service.interface import FlatSequences, Limits

LIMITS = Limits(256, 100_000, 1_000_000)
BEGIN = "<!-- bench_wire:begin -->"
END = "<!-- bench_wire:end -->"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown file to write")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = models.load("smoother")
    assert isinstance(model, LinearRecursion)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.sequences, args.steps, 16)).astype(np.float32)
    lengths = np.full(args.sequences, args.steps, np.int64)
    flat = x.reshape(-1, 16)
    json_body = orjson.dumps({"sequences": x}, option=orjson.OPT_SERIALIZE_NUMPY)
    bin_body = bodies.encode_safetensors({"sequences": flat, "lengths": lengths}, {})
    # the same body carrying a state (a smoother's: 16 numbers a sequence) and asking for one
    state = {"model": "smoother", "version": "v", "sequences": [{"s": [0.5] * 16}] * len(x)}
    state_body = orjson.dumps(
        {"sequences": x, "state": state, "return_state": True}, option=orjson.OPT_SERIALIZE_NUMPY
    )
    st: dict[str, Any] = {}

    def parse_json() -> None:
        decoded = bodies.decode(json_body, None, "sequences", LIMITS)
        assert decoded is not None
        st["in"] = decoded.sequences(16, "smoother")

    def parse_json_state() -> None:  # as the route: the state alone to the precise parser
        decoded = bodies.decode(state_body, None, "sequences", LIMITS)
        assert decoded is not None
        assert decoded.state_span is not None
        begin, end = decoded.state_span
        st["state"] = parse_state(b'{"state":' + state_body[begin:end] + b"}")
        st["in"] = decoded.sequences(16, "smoother")

    # the body as the server receives it: the event loop hands it over in reads of at most
    # 256 KiB (asyncio's transport), made fresh by the HTTP parser, and the route joins them
    # (auth.read_body). The pieces are made here and only the join is timed (the stage
    # returns its own time). Copying each piece into a buffer as it arrives measured slower
    # (a bytearray is zeroed first), so the route joins.
    piece = 256 * 1024

    def join_bin() -> float:
        pieces = [bin_body[i : i + piece] for i in range(0, len(bin_body), piece)]  # not counted
        t0 = time.perf_counter()
        st["body"] = b"".join(pieces)
        return time.perf_counter() - t0

    def parse_bin() -> None:  # as the route: the values are the engine's to check
        decoded = bodies.decode(st["body"], bodies.SAFETENSORS, "sequences", LIMITS)
        assert decoded is not None
        st["in"] = decoded.sequences(16, "smoother")

    def parse_bin_checked() -> None:  # and the engine's check, for models that do not check
        parse_bin()
        assert st["in"].all_finite()

    def layout() -> None:
        st["plan"] = plan(st["in"].lengths)

    def pack() -> None:
        st["packed"] = pack_flat([st["in"].data], st["in"].lengths, None, st["plan"])

    def run() -> None:
        with torch.inference_mode():
            st["out"] = model(st["packed"])

    finite = np.empty(args.sequences, np.bool_)

    def run_flat() -> None:  # what the server runs for the smoother on the CPU: no packing,
        # the inputs checked for NaN and infinity in the same pass
        st["flat_out_server"] = model.smooth_flat(st["in"].data, st["in"].lengths, finite)

    def unpack() -> None:
        st["flat_out"] = unpack_flat(st["out"], st["in"].lengths, st["plan"]).numpy()

    def out_json() -> None:
        outputs = FlatSequences(st["flat_out"], lengths)  # as the route: one flat array
        st["resp"] = bodies.encode("smoother", "sequences", outputs, False)

    def out_bin() -> None:  # as the route: the buffers go to the socket as they are
        outputs = FlatSequences(st["flat_out"], lengths)
        st["resp"] = bodies.encode_parts("smoother", "sequences", outputs)

    out_arr = np.tanh(flat)
    stages: dict[str, Callable[[], Any]] = {
        "json: parse (fast path)": parse_json,
        "json carrying a state: parse (fast path, the state alone precisely)": parse_json_state,
        "binary: join the received pieces": join_bin,
        "binary: parse (finite check left to the model)": parse_bin,
        "binary: parse, then the engine's finite check": parse_bin_checked,
        "plan (row indices)": layout,
        "pack (scatter)": pack,
        "model": run,
        "unpack (gather)": unpack,
        "model, server path (smooth_flat: no packing, finite check fused)": run_flat,
        "json: serialise (rnnserve.service.codec.json_writer, from the flat buffer)": out_json,
        "binary: serialise (header + buffers, no copy)": out_bin,
        "ref: orjson.loads": lambda: orjson.loads(json_body),
        "ref: orjson.dumps (numpy)": lambda: orjson.dumps(
            {"model": "smoother", "sequences": out_arr}, option=orjson.OPT_SERIALIZE_NUMPY
        ),
    }
    order = list(stages)
    for name in order:  # warm up (compiles the scanner and kernels)
        stages[name]()
    times: dict[str, list[float]] = {k: [] for k in order}
    slow: list[float] = []
    for i in range(args.repeats):
        for name in order:
            t0 = time.perf_counter()
            own = stages[name]()
            wall = time.perf_counter() - t0
            times[name].append(own if isinstance(own, float) else wall)  # a stage may time itself
        if i < 3:
            t0 = time.perf_counter()
            to_arrays(parse_body(json_body, SmoothRequest, "sequences")[1], "sequences", 16,
                      LIMITS, "smoother")  # fmt: skip
            slow.append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    lines = [
        f"One `/smooth` request: {args.sequences} × {args.steps} × 16 float32; JSON "
        f"{len(json_body) / 1e6:.1f} MB, binary {len(bin_body) / 1e6:.1f} MB; in-process, one "
        f"torch thread, medians of {args.repeats} interleaved rounds; {cpu_model()}; "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC.",
        "",
        "| stage | ms |",
        "|---|---|",
    ]
    lines += [f"| {k} | {med[k]:.2f} |" for k in order]
    lines.append(f"| ref: pydantic + to_arrays (the precise path) | {np.median(slow) * 1e3:.2f} |")
    flat_model = med["model, server path (smooth_flat: no packing, finite check fused)"]
    packed = med["plan (row indices)"] + med["pack (scatter)"] + med["unpack (gather)"]
    bin_serialise = med["binary: serialise (header + buffers, no copy)"]
    join = med["binary: join the received pieces"]
    outside_bin = join + med["binary: parse (finite check left to the model)"] + bin_serialise
    outside_checked = join + med["binary: parse, then the engine's finite check"] + bin_serialise
    json_write = med["json: serialise (rnnserve.service.codec.json_writer, from the flat buffer)"]
    outside_json = med["json: parse (fast path)"] + json_write
    ref = med["ref: orjson.loads"] + med["ref: orjson.dumps (numpy)"]
    lines += [
        "",
        "The server runs the smoother on the CPU straight on the request's rows "
        "(`smooth_flat`); the packed path (plan, pack, model, unpack) is what the Traveller and "
        "the GPU take.",
        "",
        f"- binary, server path (join, parse, serialise): outside the model "
        f"{outside_bin:.2f} ms = **{outside_bin / flat_model:.2f}×** the model's "
        f"{flat_model:.2f} ms (target ≤ 1); with the finite check in the route instead of the "
        f"model it would be {outside_checked:.2f} ms = {outside_checked / flat_model:.2f}×; "
        f"through the packed path {outside_checked + packed:.2f} ms = "
        f"{(outside_checked + packed) / med['model']:.2f}× that path's model time. Not "
        "counted: the kernel's copies into and out of the socket and the HTTP parser's copy of "
        "each piece (uvicorn's, before the route sees it).",
        f"- JSON: outside the model {outside_json:.2f} ms = **{outside_json / ref:.2f}×** "
        "`orjson.loads` + `orjson.dumps` of the same payload (target ≤ 1.3).",
        f"- JSON carrying a state (`state` for every sequence, `return_state`): "
        f"{med['json carrying a state: parse (fast path, the state alone precisely)']:.2f} ms "
        f"to read, against the precise path's {np.median(slow) * 1e3:.0f} ms, which read such "
        "bodies whole until the fast path took `state` and `return_state`.",
        f"- The whole server path, binary: {outside_bin + flat_model:.2f} ms; through the "
        "precise path instead (pydantic + packed): "
        f"{np.median(slow) * 1e3 + packed + med['model']:.0f} ms plus JSON writing.",
    ]
    section = "\n".join([BEGIN, "## Wire format, stage by stage (`python -m bench.bench_wire`)",
                         "", *lines, END, ""])  # fmt: skip
    write_section(args.out, section, BEGIN, END)
    print(section)


if __name__ == "__main__":
    main()
