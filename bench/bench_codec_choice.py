"""Is the compiled JSON codec worth keeping? rnnserve's reader and writer against maintained ones.

Each contender turns the same ``/smooth`` body into what the route needs (one ``[sum T_i, F]``
float32 array and the lengths) or writes the same answer:

- read: rnnserve's compiled reader (``codec.bodies.decode`` + ``.sequences``); pysimdjson's
  parser with ``Array.as_buffer`` (float64, then cast) and the lengths from the parsed document;
  ``orjson.loads`` then one ``np.asarray`` per sequence, concatenated;
- write: rnnserve's compiled writer (``codec.bodies.encode``, the bytes orjson writes) against
  ``orjson.dumps`` of the per-sequence views with ``OPT_SERIALIZE_NUMPY``.

Neither alternative checks shapes, widths or finiteness as the route must, so their figures are
a lower bound of what they would cost in the server. In-process, medians of interleaved rounds.
Run: ``.venv/bin/python -m bench.bench_codec_choice [--out docs/BENCHMARKS.md]``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rnnserve.service.codec import bodies
from rnnserve.service.interface import FlatSequences, Limits

LIMITS = Limits(256, 100_000, 1_000_000)
BEGIN = "<!-- bench_codec_choice:begin -->"
END = "<!-- bench_codec_choice:end -->"
WORKLOADS = {  # name: sequence lengths (16 features each)
    "one sequence of 280 steps": [280],
    "one sequence of 4,000 steps": [4000],
    "64 sequences of 1,000 steps": [1000] * 64,
}


def body_of(lengths: list[int], seed: int = 0) -> tuple[bytes, FlatSequences]:
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((n, 16)).astype(np.float32) for n in lengths]
    body = orjson.dumps({"sequences": seqs}, option=orjson.OPT_SERIALIZE_NUMPY)
    return body, FlatSequences.from_arrays(seqs)


def read_rnnserve(body: bytes) -> FlatSequences:
    decoded = bodies.decode(body, bodies.JSON, "sequences", LIMITS)
    assert decoded is not None
    return decoded.sequences(16, "smoother")


def read_simdjson(parser: Any, body: bytes) -> FlatSequences:
    seqs = parser.parse(body)["sequences"]
    lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    data = np.frombuffer(seqs.as_buffer(of_type="d"), np.float64).astype(np.float32)
    return FlatSequences(data.reshape(-1, 16), lengths)


def read_orjson(body: bytes) -> FlatSequences:
    seqs = orjson.loads(body)["sequences"]
    return FlatSequences.from_arrays([np.asarray(s, np.float32) for s in seqs])


def write_rnnserve(out: FlatSequences) -> Any:
    return bodies.encode("smoother", "sequences", out, False)


def write_orjson(out: FlatSequences) -> bytes:
    return orjson.dumps(
        {"model": "smoother", "sequences": list(out)}, option=orjson.OPT_SERIALIZE_NUMPY
    )


def contenders() -> dict[str, Callable[[bytes, FlatSequences], Any]]:
    import simdjson  # the bench extra's; imported here so --help works without it

    parser = simdjson.Parser()
    return {
        "read: rnnserve": lambda body, _: read_rnnserve(body),
        "read: pysimdjson as_buffer": lambda body, _: read_simdjson(parser, body),
        "read: orjson.loads + numpy": lambda body, _: read_orjson(body),
        "write: rnnserve": lambda _, out: write_rnnserve(out),
        "write: orjson.dumps (numpy)": lambda _, out: write_orjson(out),
    }


def check_same(body: bytes, flat: FlatSequences) -> None:
    """Every reader gives the same arrays; both writers the same bytes (else no comparison)."""
    import simdjson

    ours = read_rnnserve(body)
    for other in (read_simdjson(simdjson.Parser(), body), read_orjson(body)):
        assert np.array_equal(other.data, ours.data)
        assert np.array_equal(other.lengths, ours.lengths)
    assert bytes(write_rnnserve(flat)) == write_orjson(flat)


def measure(repeats: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per contender and workload, rounds interleaved."""
    runs = contenders()
    result: dict[str, dict[str, float]] = {}
    for workload, lengths in WORKLOADS.items():
        body, flat = body_of(lengths)
        check_same(body, flat)
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(repeats):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run(body, flat)
                times[name].append(time.perf_counter() - t0)
        result[workload] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return result


def table(result: dict[str, dict[str, float]]) -> list[str]:
    names = list(next(iter(result.values())))
    lines = ["| contender | " + " | ".join(result) + " |", "|---|" + "---:|" * len(result)]
    for name in names:
        ours = "read: rnnserve" if name.startswith("read") else "write: rnnserve"
        cells = [f"{r[name]:.3f} ms ({r[name] / r[ours]:.1f}x)" for r in result.values()]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--out", type=Path, help="markdown file whose section to rewrite")
    args = ap.parse_args(argv)
    bodies.warm_up()
    result = measure(args.repeats)
    lines = [
        BEGIN,
        "## The JSON codec against maintained ones (`python -m bench.bench_codec_choice`)",
        "",
        f"In-process, medians of {args.repeats} interleaved rounds, "
        f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; in brackets: time against rnnserve's.",
        "",
        *table(result),
        END,
        "",
    ]
    section = "\n".join(lines)
    if args.out:
        text = args.out.read_text()
        if BEGIN in text:
            head, rest = text.split(BEGIN, 1)
            text = head + section + rest.split(END, 1)[1].lstrip("\n")
        else:
            text += "\n" + section
        args.out.write_text(text)
    print(section)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
