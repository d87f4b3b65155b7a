"""rnnserve with its compiled JSON codec swapped for maintained libraries: the other side of the
codec decision, for ``bench/bench_ab.py``.

JSON bodies are read with pysimdjson (``Parser.parse``, the numbers taken with
``Array.as_buffer``, cast to float32) and answers written with ``orjson.dumps`` of the
per-sequence views (``OPT_SERIALIZE_NUMPY``); everything else is the server as it is. The reader
checks the limits, the width, finiteness and the first step of each sequence, not every step
(``as_buffer`` flattens a ragged list without a word, and a check of every step from Python
would cost more than the parse): it does less than the compiled reader, so its figures flatter
it. A body it cannot take goes to the precise parser, as the compiled reader's does.

Run as the B side: ``.venv/bin/python -m bench.bench_ab --a-command .venv/bin/rnnserve
--b-command ".venv/bin/python -m bench.codec_alternative" --b-path "$PWD"``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import orjson
import simdjson

from rnnserve.service.codec import bodies
from rnnserve.service.interface import FlatSequences, Limits

_compiled_decode = bodies.decode
_compiled_encode = bodies.encode


def _parser() -> Any:
    """One parser per thread would be right for the codec threads; pysimdjson's parser is not
    thread-safe, so each call gets its own (a parse allocates its buffers either way)."""
    return simdjson.Parser()


def decode(body: bytes, content_type: str | None, field: str, limits: Limits) -> Any:
    if bodies.is_safetensors(content_type):
        return _compiled_decode(body, content_type, field, limits)
    try:
        doc = _parser().parse(body)
        seqs = doc[field]
        model = doc.get("model")
        lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
        flat = np.frombuffer(seqs.as_buffer(of_type="d"), np.float64)
    except (ValueError, KeyError, TypeError):
        return None  # the precise parser says what is wrong
    total = int(lengths.sum())
    if not total or len(flat) % total or not (model is None or isinstance(model, str)):
        return None
    width = len(flat) // total
    if any(len(s[0]) != width for s in seqs):  # the first step of each: a cheap shape check
        return None
    with np.errstate(over="ignore"):  # beyond float32's range: refused as not finite
        data = flat.astype(np.float32).reshape(total, width)

    def finish(input_dim: int, name: str) -> FlatSequences:
        long = np.flatnonzero(lengths > limits.max_sequence_length)
        too_long = (int(long[0]), int(lengths[long[0]])) if len(long) else (-1, 0)
        bodies.check_limits(len(lengths), too_long, total, field, limits)
        if width != input_dim:
            raise bodies._width_error(width, field, input_dim, name)
        out = FlatSequences(data, lengths)
        if not out.all_finite():
            raise bodies.non_finite_error(out, field)
        return out

    return bodies.Decoded(model, finish)


def encode(
    model: str, out_field: str, outputs: Any, binary: bool, *, view: bool = False
) -> bytes | memoryview:
    if binary:
        return _compiled_encode(model, out_field, outputs, binary)
    return orjson.dumps(
        {"model": model, out_field: list(outputs)}, option=orjson.OPT_SERIALIZE_NUMPY
    )


def main() -> int:
    bodies.decode = decode  # looked up at each call by the HTTP layer
    bodies.encode = encode
    from rnnserve.service.cli import main as serve

    sys.argv[0] = "rnnserve"
    serve()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
