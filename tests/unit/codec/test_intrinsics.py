"""service/codec/intrinsics.py through small compiled callers: each intrinsic against Python's own
arithmetic, at its edges (a zero word for the trailing-zero count, which the JSON reader's
branch-free digit count relies on)."""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import pytest

from rnnserve.service.codec.intrinsics import bit_length, load8, store8, trailing_zeros


@numba.njit(cache=False)
def _tz(v: np.uint64) -> Any:
    return trailing_zeros(v)


@numba.njit(cache=False)
def _bl(v: np.int64) -> Any:
    return bit_length(v)


@numba.njit(cache=False)
def _load(buf: np.ndarray, pos: int) -> Any:
    return load8(buf, pos)


@numba.njit(cache=False)
def _store(buf: np.ndarray, pos: int, word: np.int64) -> None:
    store8(buf, pos, word)


def test_trailing_zeros_of_every_single_bit_and_of_zero() -> None:
    assert _tz(np.uint64(0)) == 64  # a digit word with no stop: 8 digits
    for bit in range(64):
        assert _tz(np.uint64(1 << bit)) == bit
        assert _tz(np.uint64((1 << bit) | (1 << 63))) == bit


@pytest.mark.parametrize("v", [1, 2, 3, 255, 256, 10**18, 2**62, 2**63 - 1])
def test_bit_length(v: int) -> None:
    assert _bl(np.int64(v)) == v.bit_length()


def test_load8_and_store8_are_little_endian_and_unaligned() -> None:
    buf = np.arange(32, dtype=np.uint8)
    for pos in range(0, 25):
        assert int(_load(buf, pos)) == int.from_bytes(bytes(buf[pos : pos + 8]), "little")
    out = np.zeros(16, np.uint8)
    _store(out, 3, np.int64(0x0807060504030201))
    assert bytes(out) == b"\0\0\0" + bytes(range(1, 9)) + b"\0" * 5
