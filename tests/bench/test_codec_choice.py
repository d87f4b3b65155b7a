"""bench/bench_codec_choice.py: every contender reads the same arrays and writes the same bytes,
and the table has a row per contender (no timings checked)."""

from __future__ import annotations

import numpy as np
import pytest

from bench import bench_codec_choice as bc


def test_every_reader_gives_the_same_arrays_and_both_writers_the_same_bytes() -> None:
    body, flat = bc.body_of([5, 1, 12], seed=3)
    bc.check_same(body, flat)
    import simdjson

    got = bc.read_simdjson(simdjson.Parser(), body)
    assert got.lengths.tolist() == [5, 1, 12]
    assert np.array_equal(got.data, flat.data)


def test_a_reader_that_differs_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    body, flat = bc.body_of([3, 2])

    def off_by_one(parser: object, body: bytes) -> bc.FlatSequences:
        right = bc.read_orjson(body)
        return bc.FlatSequences(right.data + 1, right.lengths)

    monkeypatch.setattr(bc, "read_simdjson", off_by_one)
    with pytest.raises(AssertionError):
        bc.check_same(body, flat)


def test_the_section_has_a_row_per_contender(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bc, "WORKLOADS", {"tiny": [4, 2]})
    result = bc.measure(repeats=1)
    lines = bc.table(result)
    assert len(lines) == 2 + len(bc.contenders())
    assert all("(1.0x)" in line for line in lines if "rnnserve |" in line)
