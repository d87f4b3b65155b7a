"""``bench/codec_alternative.py``: the swapped-in reader and writer give what the compiled codec
gives, and refuse what it refuses, so that ``bench_ab`` compares like with like."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from bench import codec_alternative as alt
from rnnserve.service.codec import bodies
from rnnserve.service.interface import FlatSequences, Limits, RequestError

LIMITS = Limits(8, 100, 400)


def _body(seqs: list[np.ndarray], model: str | None = None) -> bytes:
    doc: dict[str, object] = {"sequences": seqs}
    if model is not None:
        doc["model"] = model
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)


def test_the_alternative_reads_and_writes_what_the_compiled_codec_does() -> None:
    rng = np.random.default_rng(4)
    seqs = [rng.standard_normal((n, 3)).astype(np.float32) for n in (5, 1, 9)]
    body = _body(seqs, "m")
    ours, theirs = (
        bodies.decode(body, bodies.JSON, "sequences", LIMITS),
        alt.decode(body, bodies.JSON, "sequences", LIMITS),
    )
    assert ours is not None
    assert theirs is not None
    assert theirs.model == ours.model == "m"
    a, b = ours.sequences(3, "m"), theirs.sequences(3, "m")
    np.testing.assert_array_equal(b.data, a.data)
    np.testing.assert_array_equal(b.lengths, a.lengths)
    flat = FlatSequences.from_arrays(seqs)
    assert alt.encode("m", "sequences", flat, False) == bytes(
        bodies.encode("m", "sequences", flat, False)
    )


@pytest.mark.parametrize(
    ("seqs", "width", "kind"),
    [
        ([np.zeros((101, 3), np.float32)], 3, "sequence_too_long"),
        ([np.zeros((2, 3), np.float32)], 4, "wrong_feature_count"),
        ([np.full((2, 3), 1e39)], 3, "non_finite"),  # beyond float32's range
    ],
)
def test_the_alternative_refuses_what_the_route_must(
    seqs: list[np.ndarray], width: int, kind: str
) -> None:
    decoded = alt.decode(_body(seqs), bodies.JSON, "sequences", LIMITS)
    assert decoded is not None
    with pytest.raises(RequestError) as err:
        decoded.sequences(width, "m")
    assert err.value.type == kind


def test_bodies_it_cannot_take_go_to_the_precise_parser() -> None:
    for body in (b"{", b'{"sequences": [[[1, 2], [3]]]}', b'{"sequences": 3}'):
        assert alt.decode(body, bodies.JSON, "sequences", LIMITS) is None
