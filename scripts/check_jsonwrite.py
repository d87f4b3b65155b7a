"""Check rnnserve.service.codec.json_writer's float32 text against orjson's for every float32 bit
pattern.

For each chunk of 2**20 consecutive bit patterns (all 2**32 by default: the finite ones, and
the NaNs and infinities, which both write as ``null``), ``orjson.dumps(chunk,
option=OPT_SERIALIZE_NUMPY)`` must equal ``rnnserve.service.codec.json_writer.floats_json(chunk)``
byte for byte; a chunk that differs is searched for its first differing value, which is printed.

    python scripts/check_jsonwrite.py [--chunks N] [--stride S]
    python scripts/check_jsonwrite.py --bench

``--stride`` checks every S-th chunk only (a quick run). Exits 1 on any mismatch. The whole
run takes about 180 s of CPU time in one process (3 to 11 minutes on the shared development
machine); run it niced. Result there, orjson 3.13.0: all 2**32 patterns, no mismatch.

``--bench`` times rnnserve.service.codec.bodies's orjson call and
:func:`rnnserve.service.codec.json_writer.sequences_json` on the same bodies (the typical response,
one sequence of 280 steps x 16 tanh outputs, and 64 sequences of 1000 steps x 16), interleaved, and
prints the medians: wall clock, and the thread's CPU time (steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import orjson

from rnnserve.service.codec.json_writer import floats_json

CHUNK = 1 << 20


def first_mismatch(values: np.ndarray) -> int:
    """The index of the first value whose text differs (bisecting on whole-array equality)."""
    lo, hi = 0, len(values)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        part = values[lo:mid]
        if floats_json(part) != orjson.dumps(part, option=orjson.OPT_SERIALIZE_NUMPY):
            hi = mid
        else:
            lo = mid
    return lo


def bench() -> None:
    from rnnserve.service.codec.json_writer import sequences_json
    from rnnserve.service.interface import FlatSequences

    rng = np.random.default_rng(0)
    for n_seq, steps, reps in ((1, 280, 400), (64, 1000, 4)):
        data = np.tanh(rng.uniform(-1, 1, (n_seq * steps, 16))).astype(np.float32)
        lengths = np.full(n_seq, steps, np.int64)
        seqs = FlatSequences(data, lengths)

        def with_orjson(seqs: FlatSequences = seqs) -> bytes:
            return orjson.dumps(
                {"model": "gru", "sequences": list(seqs)}, option=orjson.OPT_SERIALIZE_NUMPY
            )

        def with_jsonwrite(data: np.ndarray = data, lengths: np.ndarray = lengths) -> bytes:
            return sequences_json("gru", "sequences", data, lengths)

        assert with_orjson() == with_jsonwrite()
        times: dict[str, tuple[list[float], list[float]]] = {}
        for _ in range(21):
            for name, fn in (("orjson", with_orjson), ("jsonwrite", with_jsonwrite)):
                wall, cpu = times.setdefault(name, ([], []))
                w0, c0 = time.perf_counter(), time.thread_time()
                for _ in range(reps):
                    fn()
                cpu.append((time.thread_time() - c0) / reps)
                wall.append((time.perf_counter() - w0) / reps)
        floats = data.size
        for name, (wall, cpu) in times.items():
            w, c = float(np.median(wall)), float(np.median(cpu))
            print(
                f"{n_seq}x{steps}x16 {name:9s}: median {w * 1e6:9.1f} us wall, "
                f"{c * 1e6:9.1f} us CPU ({c * 1e9 / floats:.1f} ns per float)"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=(1 << 32) // CHUNK)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--bench", action="store_true")
    args = parser.parse_args()
    if args.bench:
        bench()
        return 0
    start = time.perf_counter()
    checked = mismatched = 0
    base = np.arange(CHUNK, dtype=np.uint32)
    for c in range(0, args.chunks, args.stride):
        values = (base + np.uint32(c * CHUNK)).view(np.float32)
        ref = orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)
        if floats_json(values) != ref:
            mismatched += 1
            i = first_mismatch(values)
            bits = int(values[i : i + 1].view(np.uint32)[0])
            print(
                f"chunk {c}: first mismatch at bits {bits:#010x}: "
                f"ours {floats_json(values[i : i + 1])!r}, "
                f"orjson {orjson.dumps(values[i : i + 1], option=orjson.OPT_SERIALIZE_NUMPY)!r}",
                flush=True,
            )
        checked += CHUNK
        if c % 256 == 0:
            print(f"{c}/{args.chunks} chunks, {time.perf_counter() - start:.0f} s", flush=True)
    elapsed = time.perf_counter() - start
    print(
        f"checked {checked} float32 bit patterns ({checked / 2**32:.4f} of all) in {elapsed:.0f} s:"
        f" {mismatched} chunks with mismatches"
    )
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
