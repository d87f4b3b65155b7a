"""Where a /smooth request's server time goes, stage by stage, in-process (no HTTP).

One request of 64 sequences x 1,000 steps x 16 features through the served smoother:
parse (JSON fast path, or safetensors), pack, model, unpack, serialise; next to
``orjson.loads`` + ``orjson.dumps`` of the same payload, and the precise (pydantic) parser.
Stages run interleaved, repeated, and reported as medians on one torch thread.

    .venv/bin/python -m bench.bench_wire [--repeats 15]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import torch

import models
from models.packing import FlatSequences, pack_flat, plan, unpack_flat
from service import wire
from service.validation import Limits, SmoothRequest, parse_body, to_arrays

LIMITS = Limits(256, 100_000, 1_000_000)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = models.load("smoother")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.sequences, args.steps, 16)).astype(np.float32)
    lengths = np.full(args.sequences, args.steps, np.int64)
    flat = x.reshape(-1, 16)
    json_body = orjson.dumps({"sequences": x}, option=orjson.OPT_SERIALIZE_NUMPY)
    bin_body = wire.encode_safetensors({"sequences": flat, "lengths": lengths}, {})
    st: dict[str, Any] = {}

    def parse_json() -> None:
        decoded = wire.decode(json_body, None, "sequences", LIMITS)
        assert decoded is not None
        st["in"] = decoded.sequences(16, "smoother")

    def parse_bin() -> None:
        decoded = wire.decode(bin_body, wire.SAFETENSORS, "sequences", LIMITS)
        assert decoded is not None
        st["in"] = decoded.sequences(16, "smoother")

    def layout() -> None:
        st["plan"] = plan(st["in"].lengths)

    def pack() -> None:
        st["packed"] = pack_flat([st["in"].data], st["in"].lengths, None, st["plan"])

    def run() -> None:
        with torch.inference_mode():
            st["out"] = model(st["packed"])

    def unpack() -> None:
        st["flat_out"] = unpack_flat(st["out"], st["in"].lengths, st["plan"]).numpy()

    def out_json() -> None:
        outputs = FlatSequences(st["flat_out"], lengths)  # as the route: views of one array
        st["resp"] = wire.encode("smoother", "sequences", outputs, False)

    def out_bin() -> None:
        st["resp"] = wire.encode_safetensors(
            {"sequences": st["flat_out"], "lengths": lengths}, {"model": "smoother"}
        )

    out_arr = np.tanh(flat)
    stages: dict[str, Callable[[], Any]] = {
        "json: parse (fast path)": parse_json,
        "binary: parse": parse_bin,
        "plan (row indices)": layout,
        "pack (scatter)": pack,
        "model": run,
        "unpack (gather)": unpack,
        "json: serialise (orjson, per-sequence views)": out_json,
        "binary: serialise": out_bin,
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
            stages[name]()
            times[name].append(time.perf_counter() - t0)
        if i < 3:
            t0 = time.perf_counter()
            to_arrays(parse_body(json_body, SmoothRequest, "sequences")[1], "sequences", 16,
                      LIMITS, "smoother")  # fmt: skip
            slow.append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    print(f"one /smooth request: {args.sequences} x {args.steps} x 16 float32; "
          f"JSON {len(json_body) / 1e6:.1f} MB, binary {len(bin_body) / 1e6:.1f} MB; "
          f"medians of {args.repeats}, ms")  # fmt: skip
    for k in order:
        print(f"  {k:48s} {med[k]:9.2f}")
    print(f"  {'ref: pydantic + to_arrays (precise path)':48s} {np.median(slow) * 1e3:9.2f}")
    common = med["plan (row indices)"] + med["pack (scatter)"] + med["unpack (gather)"]
    outside_bin = med["binary: parse"] + common + med["binary: serialise"]
    outside_json = (
        med["json: parse (fast path)"]
        + common
        + med["json: serialise (orjson, per-sequence views)"]
    )
    ref = med["ref: orjson.loads"] + med["ref: orjson.dumps (numpy)"]
    print(f"binary: outside the model {outside_bin:.2f} ms = {outside_bin / med['model']:.2f}x "
          "the model (target <= 1)")  # fmt: skip
    print(f"json: outside the model {outside_json:.2f} ms = {outside_json / ref:.2f}x "
          "orjson.loads + orjson.dumps (target <= 1.3)")  # fmt: skip


if __name__ == "__main__":
    main()
