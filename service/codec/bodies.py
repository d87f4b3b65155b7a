"""Request and response bodies <-> float32 arrays, for JSON and the safetensors binary format.

A request's sequences arrive as one :class:`~rnnserve.service.interface.FlatSequences`: a
``[sum T_i, F]`` float32 array and the lengths. No Python object is made per number.

JSON (the default) has a fast path: a compiled scanner over the body bytes that accepts only
the happy path, ``{"<field>": [[[num, ...], ...], ...], "model": "<plain string>" | null,
"return_state": true | false, "state": {...} | null}`` in any key order with any JSON
whitespace, one width F >= 1 for every step, every list non-empty. A ``state`` object is only
delimited (:attr:`Decoded.state_span`): the HTTP layer reads it alone, precisely.
Numbers are parsed to float64 exactly as Python's ``float()`` does (the digits after the
point read eight at a time, where they end found without a branch per digit; Clinger's fast
path, then Eisel-Lemire; numbers of more than 19 significant digits go through ``float()``
itself) and cast to float32 as ``np.array(..., dtype=np.float32)`` does. Anything else (unknown or
duplicate keys, escapes, a string or ``null`` where a number belongs, ragged widths, empty
lists, invalid JSON, numbers near or past float64's range) makes :func:`decode` return
``None``, and the caller takes the precise path (:mod:`rnnserve.service.http.validation`), which
says what is wrong and where. So the fast path changes speed, never answers.

The binary format is a safetensors file (``Content-Type: application/x-safetensors``) with
tensors ``<field>`` float32 ``[sum T_i, F]`` and ``lengths`` int64 ``[N]`` and optional
metadata ``model``; responses use the same layout (``sequences`` or ``positions``) when the
request's ``Accept`` header asks for ``application/x-safetensors``. See docs/WIRE.md.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import orjson

from rnnserve.service.codec import json_writer
from rnnserve.service.codec.intrinsics import load8, trailing_zeros
from rnnserve.service.interface import CarriedState, FlatSequences, Limits, RequestError, quote

SAFETENSORS = "application/x-safetensors"
JSON = "application/json"

# -- the compiled JSON scanner -----------------------------------------------------------------

_U64 = np.uint64
_MASK32 = _U64(0xFFFFFFFF)
_MAX_EXP = 1_000_000  # exponents saturate here; anything that large declines or underflows
_MAX_B10 = 308  # a number that may reach 10**309 is left to the precise path

# scan() result slots
_OK, _N_SEQ, _TOTAL, _WIDTH, _VAL_START, _MODEL, _MODEL_START, _MODEL_END = range(8)
_N_SLOW, _FIRST_INF, _TOO_LONG_AT, _TOO_LONG_LEN = range(8, 12)
_RETURN_STATE, _STATE_START, _STATE_END = range(12, 15)
_N_SLOTS = 15
# the other keys the scanner takes, as bytes
_KEY_STATE = np.frombuffer(b"state", np.uint8)
_KEY_RETURN_STATE = np.frombuffer(b"return_state", np.uint8)
_NULL = np.frombuffer(b"null", np.uint8)
_TRUE = np.frombuffer(b"true", np.uint8)
_FALSE = np.frombuffer(b"false", np.uint8)
_SHORT_OF_ROOM = -2  # _read_field: more numbers for float() than the slow table holds

_WS = (0x20, 0x09, 0x0A, 0x0D)


def _power_of_five_table() -> tuple[np.ndarray, np.ndarray]:
    """128-bit truncated powers of five 5**q, q in [-342, 308] (Lemire's fast_float table)."""
    hi, lo = [], []
    for q in range(-342, 309):
        if q < 0:
            p5 = 5**-q
            z = p5.bit_length()  # smallest z with 2**z >= p5 (p5 is never a power of two)
            if q >= -27:
                c = 2 ** (z + 127) // p5 + 1
            else:
                c = 2 ** (2 * z + 128) // p5 + 1
                while c >= 1 << 128:
                    c //= 2
        else:
            c = 5**q
            while c < 1 << 127:
                c *= 2
            while c >= 1 << 128:
                c //= 2
        hi.append(c >> 64)
        lo.append(c & ((1 << 64) - 1))
    return np.array(hi, dtype=np.uint64), np.array(lo, dtype=np.uint64)


_P5_HI, _P5_LO = _power_of_five_table()
_POW10 = np.array([10.0**i for i in range(23)], dtype=np.float64)  # exact in float64


_HI = _U64(0x8080808080808080)
_SIGN = np.array([1.0, -1.0])  # times 1 or -1: exact, and -0.0 for a negative 0
_POW10_INT = np.array([10**i for i in range(17)], dtype=np.int64)


def _digits16(buf: Any, pos: int) -> tuple[Any, Any]:
    """(k, value) of the k <= 16 decimal digits that start ``buf[pos:pos + 16]``, eight at a
    time and without a branch (numbers of 7 to 9 digits end at random places; a branch there
    mispredicts about every other number, ~20 % of the read): the first byte that is no digit
    ends them (as fast_float does)."""
    w0 = load8(buf, pos)
    w1 = load8(buf, pos + 8)
    k1 = np.int64(trailing_zeros(_stops(w0)) >> _U64(3))  # 8 if all are digits (64 zeros)
    k2 = np.int64(trailing_zeros(_stops(w1)) >> _U64(3))
    k2 = k2 if k1 == 8 else np.int64(0)  # the second word counts only after a full first
    v1 = _digit_value(w0 ^ _U64(0x3030303030303030), k1)
    v2 = _digit_value(w1 ^ _U64(0x3030303030303030), k2)
    return k1 + k2, v1 * _POW10_INT[k2] + v2


def _stops(w: Any) -> Any:
    """The top bit of each byte of ``w`` that is not an ASCII digit (0x30 ^ 0..9)."""
    x = w ^ _U64(0x3030303030303030)
    return (((x & _U64(0x7F7F7F7F7F7F7F7F)) + _U64(0x7676767676767676)) | x) & _HI


def _dots(w: Any) -> Any:
    """The top bit of each byte of ``w`` that is '.'."""
    y = w ^ _U64(0x2E2E2E2E2E2E2E2E)
    return ~(((y & _U64(0x7F7F7F7F7F7F7F7F)) + _U64(0x7F7F7F7F7F7F7F7F)) | y) & _HI


def _digit_value(x: Any, k: Any) -> Any:
    """The number the first ``k`` (0 to 8) bytes of ``x`` make, each a digit's value 0..9: moved
    to the top of the word (zeros in front), they become one number in three multiplications."""
    v = x << _U64((8 * (8 - k)) & 63)
    v = v * _U64(10) + (v >> _U64(8))
    v = (
        (v & _U64(0x000000FF000000FF)) * _U64(0x000F424000000064)
        + ((v >> _U64(16)) & _U64(0x000000FF000000FF)) * _U64(0x0000271000000001)
    ) >> _U64(32)
    return np.int64(v) if k else np.int64(0)  # k = 0: not digits (a select, not a branch)


def _is_ws(c: Any) -> bool:
    return bool(c == 0x20 or c == 0x0A or c == 0x0D or c == 0x09)


def _skip_ws(buf: Any, pos: int) -> int:
    n = buf.shape[0]
    while pos < n and _is_ws(buf[pos]):
        pos += 1
    return pos


def _check_number(buf: Any, pos: int) -> tuple[int, int, int]:
    """Validate one JSON number at ``pos``: (end or -1, digit count, bound on log10|x|)."""
    n = buf.shape[0]
    p = pos
    if p < n and buf[p] == 0x2D:  # '-'
        p += 1
    if p >= n:
        return -1, 0, 0
    c = buf[p]
    int_digits = 0
    if c == 0x30:  # '0'
        p += 1
        digits = 1
    elif 0x31 <= c <= 0x39:
        while p < n and 0x30 <= buf[p] <= 0x39:
            p += 1
            int_digits += 1
        digits = int_digits
    else:
        return -1, 0, 0
    if p < n and buf[p] == 0x2E:  # '.'
        p += 1
        start = p
        while p < n and 0x30 <= buf[p] <= 0x39:
            p += 1
        if p == start:
            return -1, 0, 0
        digits += p - start
    exp = 0
    if p < n and (buf[p] == 0x65 or buf[p] == 0x45):  # 'e' 'E'
        p += 1
        neg = False
        if p < n and (buf[p] == 0x2B or buf[p] == 0x2D):
            neg = buf[p] == 0x2D
            p += 1
        start = p
        while p < n and 0x30 <= buf[p] <= 0x39:
            if exp < _MAX_EXP:
                exp = exp * 10 + (buf[p] - 0x30)
            p += 1
        if p == start:
            return -1, 0, 0
        if neg:
            exp = -exp
    bound = int_digits + exp if int_digits > 0 else exp  # |x| < 10**bound
    return p, digits, bound


def _scan_string(buf: Any, pos: int) -> int:
    """``pos`` is just past an opening quote; the closing quote's index, or -1 (escapes too)."""
    n = buf.shape[0]
    while pos < n:
        c = buf[pos]
        if c == 0x22:
            return pos
        if c == 0x5C or c < 0x20:  # a backslash or a control character
            return -1
        pos += 1
    return -1


def _is_key(buf: Any, start: int, length: int, key: Any) -> bool:
    """Whether the ``length`` bytes at ``start`` are ``key``."""
    if length != key.shape[0]:
        return False
    for i in range(length):  # noqa: SIM110 (numba compiles the loop, not a generator)
        if buf[start + i] != key[i]:
            return False
    return True


def _skip_object(buf: Any, pos: int) -> int:
    """Just past the object that starts at ``pos`` (``{``): brackets counted, strings skipped
    whole; -1 where a string has an escape or the body ends first. What is inside is not
    checked: whoever reads it does."""
    n = buf.shape[0]
    depth = 0
    while pos < n:
        c = buf[pos]
        if c == 0x22:  # '"'
            end = _scan_string(buf, pos + 1)
            if end < 0:
                return -1
            pos = end + 1
            continue
        if c == 0x7B or c == 0x5B:  # '{' '['
            depth += 1
        elif c == 0x7D or c == 0x5D:  # '}' ']'
            depth -= 1
            if depth == 0:
                return pos + 1
        pos += 1
    return -1


def _read_field(
    buf: Any, pos: int, max_len: int, out: Any, data: Any, lengths: Any, slow: Any,
    p5_hi: Any, p5_lo: Any, pow10: Any,
) -> int:  # fmt: skip
    """Check ``[[[num, ...], ...], ...]`` at ``pos`` and read it in the same pass: numbers into
    ``data`` (float32, flat; at most its length, which the caller sizes from the body), each
    sequence's length into ``lengths`` (as many as fit: more are only counted, for the limit's
    error), counts into ``out``. The end, or -1 (not the happy path: the precise parser says
    why), or ``_SHORT_OF_ROOM`` (``slow`` cannot hold every number left to ``float()``).

    A number is valid JSON (no leading zeros, digits after a point and in an exponent) and
    within float64's range; up to 18 digits with a small power of ten it is read exactly here
    (Clinger), else by :func:`_parse_number` (Eisel-Lemire), or recorded in ``slow`` as
    (index, start, end) for ``float()`` when that cannot decide.

    One function on purpose, however long: it is the compiled scanner's inner loop, and numba
    does not inline calls across its nested loops without counting a reference per call, which
    costs more than the numbers' own reading. The loops are commented where each level starts.
    """
    n = buf.shape[0]
    cap = data.shape[0]
    bits = np.zeros(1, np.uint64)
    as_float = bits.view(np.float64)
    width = -1
    n_seq = 0
    total = 0
    k = 0
    n_slow = 0
    first_inf = -1
    if pos >= n or buf[pos] != 0x5B:
        return -1
    pos = _skip_ws(buf, pos + 1)
    while True:  # sequences
        if pos >= n or buf[pos] != 0x5B:
            return -1
        pos = _skip_ws(buf, pos + 1)
        steps = 0
        while True:  # steps
            if pos >= n or buf[pos] != 0x5B:
                return -1
            pos = _skip_ws(buf, pos + 1)
            count = 0
            while True:  # numbers
                if pos >= n or k >= cap:
                    return -1
                if pos + 24 <= n:
                    # the usual shape first (-?d+.d+ in at most 15 bytes, then ',' or ']', as
                    # float writers put it), read from words: where it ends and what ends it
                    # come from bit masks, without a dependent load or a branch per part, so the
                    # next number's reading starts while this one's digits are converted
                    w0 = load8(buf, pos)
                    w1 = load8(buf, pos + 8)
                    minus = (w0 & _U64(0xFF)) == _U64(0x2D)
                    stop0 = _stops(w0) & ~(_U64(minus) << _U64(7))  # the sign is no stop
                    z0 = trailing_zeros(stop0 & ~_dots(w0)) >> _U64(3)  # 8: none in w0
                    z1 = trailing_zeros(_stops(w1) & ~_dots(w1)) >> _U64(3)
                    length = z0 if z0 < _U64(8) else _U64(8) + z1  # 16: no end in 16 bytes
                    end = (w0 if length < _U64(8) else w1) >> ((_U64(8) * length) & _U64(63))
                    end &= _U64(0xFF)
                    point = trailing_zeros(stop0) >> _U64(3)  # the first byte after the digits
                    ints = np.int64(point) - np.int64(minus)
                    fracs = np.int64(length) - np.int64(point) - 1
                    lead = (w0 >> (_U64(8) * _U64(minus))) & _U64(0xFF)
                    got, v = _digits16(buf, pos + int(point) + 1)  # reads up to pos + 24
                    if (  # & (no branch per test); anything else is read below
                        (length < _U64(16))
                        & (point < _U64(8))
                        & (((w0 >> ((_U64(8) * point) & _U64(63))) & _U64(0xFF)) == _U64(0x2E))
                        & (ints >= 1)
                        & ((ints == 1) | (lead != _U64(0x30)))  # no leading zero
                        & (fracs >= 1)
                        & (got == fracs)  # digits only, up to the end
                        & ((end == _U64(0x2C)) | (end == _U64(0x5D)))
                    ):
                        digits_w0 = w0 ^ _U64(0x3030303030303030)
                        m = _digit_value(digits_w0 >> (_U64(8) * _U64(minus)), ints)
                        m = m * _POW10_INT[got] + v  # < 10**15
                        value = float(m) / pow10[fracs]  # Clinger's, as below
                        data[k] = np.float32(value * _SIGN[int(minus)])
                        k += 1
                        count += 1
                        pos += int(length) + 1
                        if end == _U64(0x2C):
                            pos = _skip_ws(buf, pos)
                            continue
                        break
                start = pos
                neg = buf[pos] == 0x2D  # '-'
                pos += int(neg)  # no branch: half the numbers have a sign, at random
                if pos >= n:
                    return -1
                c = buf[pos]
                m = 0
                int_digits = 0
                if c == 0x30:  # '0': no more integer digits may follow
                    pos += 1
                elif 0x31 <= c <= 0x39:
                    while pos < n and 0x30 <= buf[pos] <= 0x39:
                        m = m * 10 + (buf[pos] - 0x30)
                        int_digits += 1
                        pos += 1
                else:
                    return -1
                digits = int_digits
                frac = 0
                is_int = True
                if pos < n and buf[pos] == 0x2E:  # '.'
                    is_int = False
                    pos += 1
                    frac_start = pos
                    if pos + 16 <= n:  # up to 16 digits eight at a time
                        got, v = _digits16(buf, pos)
                        m = m * _POW10_INT[got] + v
                        pos += got
                    while pos < n and 0x30 <= buf[pos] <= 0x39:  # the rest, if any
                        m = m * 10 + (buf[pos] - 0x30)
                        pos += 1
                    frac = pos - frac_start
                    if frac == 0:
                        return -1
                    digits += frac
                exp = 0
                if pos < n and (buf[pos] == 0x65 or buf[pos] == 0x45):  # 'e' 'E'
                    is_int = False
                    pos += 1
                    eneg = False
                    if pos < n and (buf[pos] == 0x2B or buf[pos] == 0x2D):
                        eneg = buf[pos] == 0x2D
                        pos += 1
                    exp_start = pos
                    while pos < n and 0x30 <= buf[pos] <= 0x39:
                        if exp < _MAX_EXP:
                            exp = exp * 10 + (buf[pos] - 0x30)
                        pos += 1
                    if pos == exp_start:
                        return -1
                    if eneg:
                        exp = -exp
                # |x| < 10**bound; m holds the digits only while there are at most 18
                bound = int_digits + exp if int_digits > 0 else exp
                if bound > _MAX_B10:
                    return -1
                q = exp - frac
                exact = True
                if digits <= 18 and m <= 9007199254740992 and -22 <= q <= 22:  # Clinger
                    if m == 0:  # an integer literal is an int to the precise path: -0 is 0
                        value = -0.0 if neg and not is_int else 0.0
                    else:
                        value = float(m)
                        value = value * pow10[q] if q >= 0 else value / pow10[-q]
                        value *= _SIGN[int(neg)]  # no branch (half the numbers have a sign)
                else:
                    _, value, exact = _parse_number(buf, start, p5_hi, p5_lo, pow10, bits, as_float)
                if exact:
                    v32 = np.float32(value)
                    data[k] = v32
                    if first_inf < 0 and np.isinf(v32):
                        first_inf = k
                else:
                    if n_slow >= slow.shape[0]:
                        return _SHORT_OF_ROOM
                    slow[n_slow, 0] = k
                    slow[n_slow, 1] = start
                    slow[n_slow, 2] = pos
                    n_slow += 1
                k += 1
                count += 1
                pos = _skip_ws(buf, pos)
                if pos >= n:
                    return -1
                if buf[pos] == 0x2C:
                    pos = _skip_ws(buf, pos + 1)
                elif buf[pos] == 0x5D:
                    pos += 1
                    break
                else:
                    return -1
            if width < 0:
                width = count
            elif count != width:
                return -1
            steps += 1
            pos = _skip_ws(buf, pos)
            if pos >= n:
                return -1
            if buf[pos] == 0x2C:
                pos = _skip_ws(buf, pos + 1)
            elif buf[pos] == 0x5D:
                pos += 1
                break
            else:
                return -1
        if steps > max_len and out[_TOO_LONG_AT] < 0:
            out[_TOO_LONG_AT] = n_seq
            out[_TOO_LONG_LEN] = steps
        if n_seq < lengths.shape[0]:
            lengths[n_seq] = steps
        n_seq += 1
        total += steps
        pos = _skip_ws(buf, pos)
        if pos >= n:
            return -1
        if buf[pos] == 0x2C:
            pos = _skip_ws(buf, pos + 1)
        elif buf[pos] == 0x5D:
            pos += 1
            break
        else:
            return -1
    out[_N_SEQ] = n_seq
    out[_TOTAL] = total
    out[_WIDTH] = width
    out[_N_SLOW] = n_slow
    out[_FIRST_INF] = first_inf
    return pos


def _scan(
    buf: Any, field: Any, max_len: int, out: Any, data: Any, lengths: Any, slow: Any,
    p5_hi: Any, p5_lo: Any, pow10: Any,
) -> None:  # fmt: skip
    """One pass over the body: is it on the happy path? The field's numbers go to ``data``
    (see :func:`_read_field`), counts and positions to ``out``; ``out[_OK]`` is 1 if it is,
    0 if not, ``_SHORT_OF_ROOM`` if ``slow`` was too small.

    Part of the compiled scanner, long for the reason :func:`_read_field` gives.
    """
    for i in range(out.shape[0]):
        out[i] = 0
    out[_TOO_LONG_AT] = -1
    n = buf.shape[0]
    pos = _skip_ws(buf, 0)
    if pos >= n or buf[pos] != 0x7B:  # '{'
        return
    pos = _skip_ws(buf, pos + 1)
    seen_field = False
    seen_model = False
    seen_state = False
    seen_return_state = False
    while True:
        if pos >= n or buf[pos] != 0x22:
            return
        end = _scan_string(buf, pos + 1)
        if end < 0:
            return
        klen = end - pos - 1
        is_field = klen == field.shape[0]
        if is_field:
            for i in range(klen):
                if buf[pos + 1 + i] != field[i]:
                    is_field = False
                    break
        is_model = (
            klen == 5
            and buf[pos + 1] == 0x6D  # m
            and buf[pos + 2] == 0x6F  # o
            and buf[pos + 3] == 0x64  # d
            and buf[pos + 4] == 0x65  # e
            and buf[pos + 5] == 0x6C  # l
        )
        is_state = not is_field and _is_key(buf, pos + 1, klen, _KEY_STATE)
        is_return_state = _is_key(buf, pos + 1, klen, _KEY_RETURN_STATE)
        pos = _skip_ws(buf, end + 1)
        if pos >= n or buf[pos] != 0x3A:  # ':'
            return
        pos = _skip_ws(buf, pos + 1)
        if is_field and not seen_field:
            seen_field = True
            out[_VAL_START] = pos
            pos = _read_field(buf, pos, max_len, out, data, lengths, slow, p5_hi, p5_lo, pow10)
            if pos == _SHORT_OF_ROOM:
                out[_OK] = _SHORT_OF_ROOM
                return
            if pos < 0:
                return
        elif is_model and not seen_model:
            seen_model = True
            if pos + 4 <= n and (
                buf[pos] == 0x6E
                and buf[pos + 1] == 0x75
                and buf[pos + 2] == 0x6C
                and buf[pos + 3] == 0x6C
            ):  # null
                pos += 4
            elif pos < n and buf[pos] == 0x22:
                end = _scan_string(buf, pos + 1)
                if end < 0:
                    return
                out[_MODEL] = 1
                out[_MODEL_START] = pos + 1
                out[_MODEL_END] = end
                pos = end + 1
            else:
                return
        elif is_state and not seen_state:
            # its span only: the precise reader reads it (a few numbers a sequence)
            seen_state = True
            if pos < n and buf[pos] == 0x7B:  # '{'
                end = _skip_object(buf, pos)
                if end < 0:
                    return
                out[_STATE_START] = pos
                out[_STATE_END] = end
                pos = end
            elif pos + 4 <= n and _is_key(buf, pos, 4, _NULL):
                pos += 4
            else:
                return
        elif is_return_state and not seen_return_state:
            seen_return_state = True
            if pos + 4 <= n and _is_key(buf, pos, 4, _TRUE):
                out[_RETURN_STATE] = 1
                pos += 4
            elif pos + 5 <= n and _is_key(buf, pos, 5, _FALSE):
                pos += 5
            else:
                return
        else:  # an unknown or repeated key
            return
        pos = _skip_ws(buf, pos)
        if pos >= n:
            return
        if buf[pos] == 0x2C:
            pos = _skip_ws(buf, pos + 1)
        elif buf[pos] == 0x7D:  # '}'
            pos += 1
            break
        else:
            return
    if _skip_ws(buf, pos) != n or not seen_field:
        return
    out[_OK] = 1


def _mul128(a: Any, b: Any) -> tuple[Any, Any]:
    """Full 64 x 64 -> 128-bit product of two uint64: (high, low)."""
    a_lo = a & _MASK32
    a_hi = a >> _U64(32)
    b_lo = b & _MASK32
    b_hi = b >> _U64(32)
    p0 = a_lo * b_lo
    p1 = a_lo * b_hi
    p2 = a_hi * b_lo
    p3 = a_hi * b_hi
    mid = (p0 >> _U64(32)) + (p1 & _MASK32) + (p2 & _MASK32)
    lo = (p0 & _MASK32) | (mid << _U64(32))
    hi = p3 + (p1 >> _U64(32)) + (p2 >> _U64(32)) + (mid >> _U64(32))
    return hi, lo


def _eisel_lemire(w: Any, q: int, p5_hi: Any, p5_lo: Any) -> tuple[bool, Any]:
    """Bits of the float64 nearest to ``w * 10**q`` (w != 0, -342 <= q <= 308); ok flag.

    Lemire, "Number Parsing at a Gigabyte per Second" (2021), as in fast_float.
    """
    lz = 0
    if (w >> _U64(32)) == _U64(0):
        lz += 32
        w = w << _U64(32)
    if (w >> _U64(48)) == _U64(0):
        lz += 16
        w = w << _U64(16)
    if (w >> _U64(56)) == _U64(0):
        lz += 8
        w = w << _U64(8)
    if (w >> _U64(60)) == _U64(0):
        lz += 4
        w = w << _U64(4)
    if (w >> _U64(62)) == _U64(0):
        lz += 2
        w = w << _U64(2)
    if (w >> _U64(63)) == _U64(0):
        lz += 1
        w = w << _U64(1)
    idx = q + 342
    hi, lo = _mul128(w, p5_hi[idx])
    if (hi & _U64(0x1FF)) == _U64(0x1FF):
        hi2, _ = _mul128(w, p5_lo[idx])
        new_lo = lo + hi2
        if new_lo < lo:
            hi += _U64(1)
        lo = new_lo
        if lo == _U64(0xFFFFFFFFFFFFFFFF) and (q < -27 or q > 55):
            return False, _U64(0)  # too close to call: the caller asks float()
    upper = int(hi >> _U64(63))
    shift = _U64(upper + 9)
    mant = hi >> shift
    power2 = ((217706 * q) >> 16) + 63 + upper - lz + 1023
    if power2 <= 0:  # subnormal
        if -power2 + 1 >= 64:
            return True, _U64(0)
        mant = mant >> _U64(-power2 + 1)
        mant += mant & _U64(1)
        mant = mant >> _U64(1)
        power2 = 0 if mant < (_U64(1) << _U64(52)) else 1
        return True, mant | (_U64(power2) << _U64(52))
    half_way = lo <= _U64(1) and -4 <= q <= 23 and (mant & _U64(3)) == _U64(1)
    if half_way and (mant << shift) == hi:  # exactly half-way: round to even
        mant &= ~_U64(1)
    mant += mant & _U64(1)
    mant = mant >> _U64(1)
    if mant >= (_U64(2) << _U64(52)):
        mant = _U64(1) << _U64(52)
        power2 += 1
    mant &= ~(_U64(1) << _U64(52))
    if power2 >= 0x7FF:
        return False, _U64(0)  # overflow: not for the fast path
    return True, mant | (_U64(power2) << _U64(52))


def _parse_number(
    buf: Any, pos: int, p5_hi: Any, p5_lo: Any, pow10: Any, bits: Any, as_float: Any
) -> tuple[int, float, bool]:
    """Pass 2: (end, value, exact) of the number at ``pos`` (already known to be valid JSON)."""
    n = buf.shape[0]
    neg = buf[pos] == 0x2D
    if neg:
        pos += 1
    w = _U64(0)
    sig = 0  # significant digits seen
    frac = 0  # digits after the point
    is_int = True
    while pos < n and 0x30 <= buf[pos] <= 0x39:
        d = buf[pos] - 0x30
        if sig or d:
            sig += 1
            if sig <= 19:
                w = w * _U64(10) + _U64(d)
        pos += 1
    if pos < n and buf[pos] == 0x2E:
        is_int = False
        pos += 1
        while pos < n and 0x30 <= buf[pos] <= 0x39:
            d = buf[pos] - 0x30
            if sig or d:
                sig += 1
                if sig <= 19:
                    w = w * _U64(10) + _U64(d)
                    frac += 1
            else:
                frac += 1
            pos += 1
    exp = 0
    if pos < n and (buf[pos] == 0x65 or buf[pos] == 0x45):
        is_int = False
        pos += 1
        eneg = False
        if buf[pos] == 0x2B or buf[pos] == 0x2D:
            eneg = buf[pos] == 0x2D
            pos += 1
        while pos < n and 0x30 <= buf[pos] <= 0x39:
            if exp < _MAX_EXP:
                exp = exp * 10 + (buf[pos] - 0x30)
            pos += 1
        if eneg:
            exp = -exp
    if sig > 19:
        return pos, 0.0, False
    if w == _U64(0):
        # an integer literal is an int to the precise path: -0 is 0, not -0.0
        return pos, (-0.0 if neg and not is_int else 0.0), True
    q = exp - frac
    if q < -342:
        value = 0.0
    elif q > 308:
        return pos, 0.0, False
    elif w <= _U64(9007199254740992) and -22 <= q <= 22:  # Clinger: one rounding
        value = float(w)
        value = value * pow10[q] if q >= 0 else value / pow10[-q]
    else:
        ok, b = _eisel_lemire(w, q, p5_hi, p5_lo)
        if not ok:
            return pos, 0.0, False
        bits[0] = b
        value = as_float[0]
    return pos, (-value if neg else value), True


def _jit(fn: Any, **options: Any) -> Any:
    """Compile with numba, cached on disk where a cache folder is writable (else in memory)."""
    try:
        return numba.njit(cache=True, nogil=True, boundscheck=False, **options)(fn)
    except RuntimeError:  # no writable cache location
        return numba.njit(cache=False, nogil=True, boundscheck=False, **options)(fn)


def _first_non_finite(flat: Any) -> int:
    # the index of the first NaN or infinity in flat, or -1; blocks of x - x (NaN exactly for
    # non-finite x) are summed so the common all-finite case vectorises
    n = flat.shape[0]
    block = 4096
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        acc = flat.dtype.type(0)
        for i in range(b0, b1):
            acc += flat[i] - flat[i]
        if acc != acc:
            for i in range(b0, b1):
                if flat[i] - flat[i] != 0:
                    return i
    return -1


# reassoc: the block sums may be reordered (vectorised); NaN semantics stay (no nnan/ninf)
_first_non_finite = _jit(_first_non_finite, error_model="numpy", fastmath={"reassoc"})
_is_ws = _jit(_is_ws, inline="always")
_stops = _jit(_stops, inline="always")
_dots = _jit(_dots, inline="always")
_digit_value = _jit(_digit_value, inline="always")
_digits16 = _jit(_digits16, inline="always")
_skip_ws = _jit(_skip_ws)
_check_number = _jit(_check_number)
_scan_string = _jit(_scan_string)
_is_key = _jit(_is_key, inline="always")
_skip_object = _jit(_skip_object)
_read_field = _jit(_read_field)
_scan = _jit(_scan)
_mul128 = _jit(_mul128)
_eisel_lemire = _jit(_eisel_lemire)
_parse_number = _jit(_parse_number)


def parse_float(text: bytes) -> float:
    """One JSON number through the compiled parser (for tests); ``float(text)`` if it declines."""
    buf = np.frombuffer(text, np.uint8)
    end, _, _ = _check_number(buf, 0)
    if end != len(buf):
        raise ValueError(f"not a JSON number: {text!r}")
    bits = np.zeros(1, np.uint64)
    _, value, exact = _parse_number(buf, 0, _P5_HI, _P5_LO, _POW10, bits, bits.view(np.float64))
    return float(value) if exact else float(text)


# -- decoded requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StateAsked:
    """What a body asks of the carried state, in either format: the state it sends (the
    model and version that made it, and ``{part: rows}``: JSON's per-sequence lists, or a
    binary body's ``[N, *shape]`` tensors), and whether to answer the final state."""

    return_state: bool = False
    model: str | None = None
    version: str | None = None
    parts: Mapping[str, Any] | None = None  # None: no state sent
    binary: bool = False  # parts are the tensors ``state.<part>``, else the JSON lists


NO_STATE = StateAsked()  # a body that neither sends a state nor asks for one


@dataclass
class Decoded:
    """A request body that parsed: the model name it asked for, and how to get its arrays."""

    model: str | None
    _finish: Any  # (input_dim, model name) -> FlatSequences, raising RequestError
    state: StateAsked = NO_STATE
    # a JSON body's "state" object, (start, end) in the body: still to read (precisely), and
    # then ``state`` holds only whether the body asked for the final state
    state_span: tuple[int, int] | None = None

    def sequences(self, input_dim: int, model: str) -> FlatSequences:
        """Check limits and width against the model; the float32 sequences.

        JSON bodies are checked for values that are not finite too (the reader sees each
        number anyway); binary bodies are not: the engine refuses such values with
        :class:`~rnnserve.service.interface.NonFiniteInput`, answered with
        :func:`non_finite_error`.
        """
        result: FlatSequences = self._finish(input_dim, model)
        return result


def decode(body: bytes, content_type: str | None, field: str, limits: Limits) -> Decoded | None:
    """Decode a request body; ``None`` means "not on the JSON fast path: parse it precisely".

    Safetensors bodies never return ``None``: their errors are raised here (the format) or by
    :meth:`Decoded.sequences` (limits, width, values) as :class:`RequestError`.
    """
    if is_safetensors(content_type):
        return _decode_safetensors(body, field, limits)
    return _decode_json(body, field, limits)


def is_safetensors(content_type: str | None) -> bool:
    return (content_type or "").split(";")[0].strip().lower() == SAFETENSORS


def _decode_json(body: bytes, field: str, limits: Limits) -> Decoded | None:
    buf = np.frombuffer(body, np.uint8)
    info = np.zeros(_N_SLOTS, np.int64)
    key = np.frombuffer(field.encode(), np.uint8)
    # room for every number the body could hold (each takes a digit and a separator); the
    # pages never written are never touched, and what was read is copied out below
    data = np.empty(len(body) // 2 + 1, np.float32)
    lengths = np.empty(min(len(body) // 6 + 1, limits.max_sequences + 1), np.int64)
    room = 64  # numbers left to float(): more than 18 digits, or too close to call
    while True:
        slow = np.empty((room, 3), np.int64)
        _scan(buf, key, limits.max_sequence_length, info, data, lengths, slow, _P5_HI, _P5_LO,
              _POW10)  # fmt: skip
        if info[_OK] != _SHORT_OF_ROOM:
            break
        room = len(data)  # runs again, with room for every number (rare: crafted bodies)
    if info[_OK] != 1:
        return None
    model: str | None = None
    if info[_MODEL]:
        try:
            model = body[info[_MODEL_START] : info[_MODEL_END]].decode("utf-8")
        except UnicodeDecodeError:
            return None
    n_seq, total, width = int(info[_N_SEQ]), int(info[_TOTAL]), int(info[_WIDTH])
    first_inf = int(info[_FIRST_INF])
    for k, start, end in slow[: info[_N_SLOW]].tolist():
        with np.errstate(over="ignore"):
            v32 = np.float32(float(body[start:end]))
        data[k] = v32
        if np.isinf(v32) and (first_inf < 0 or k < first_inf):
            first_inf = k
    # what was read, out of the room for every number the body could hold (here, where the
    # body was read: on a codec thread for a large one, not on the event loop)
    data = data[: total * width].copy()  # (a body on the happy path has a step: width >= 1)

    def finish(input_dim: int, name: str) -> FlatSequences:
        # the scanner refused NaN and Infinity, and found where float32 overflows
        too_long = (int(info[_TOO_LONG_AT]), int(info[_TOO_LONG_LEN]))
        check_limits(n_seq, too_long, total, field, limits)
        if width != input_dim:  # the precise path reports the first step: every step has it
            raise _width_error(width, field, input_dim, name)
        out = FlatSequences(data.reshape(total, width), lengths[:n_seq])
        if first_inf >= 0:  # finite in JSON (float64) but out of float32's range
            raise _value_error(out, first_inf, field, "value is outside float32's range")
        return out

    asked = StateAsked(True) if info[_RETURN_STATE] else NO_STATE
    span = (int(info[_STATE_START]), int(info[_STATE_END])) if info[_STATE_END] else None
    return Decoded(model, finish, asked, span)


# -- errors shared by both formats --------------------------------------------------------------


def check_limits(
    n_seq: int, too_long: tuple[int, int], total: int, field: str, limits: Limits
) -> None:
    """The 413s of every body, JSON or safetensors, fast path or precise parser: ``n_seq``
    sequences, the first one over the length limit ``too_long`` (index, steps; index -1:
    none) and ``total`` steps in all."""
    if n_seq > limits.max_sequences:
        raise RequestError(
            "too_many_sequences",
            f"request has {n_seq} sequences; the limit is {limits.max_sequences}",
            (field,),
        )  # fmt: skip
    i, steps = too_long
    if i >= 0:
        raise RequestError(
            "sequence_too_long",
            f"sequence {i} has {steps} steps; the limit is {limits.max_sequence_length}",
            (field, i),
        )  # fmt: skip
    if total > limits.max_timesteps:
        raise RequestError(
            "too_many_timesteps",
            f"request has {total} timesteps in all; the limit is {limits.max_timesteps}",
            (field,),
        )  # fmt: skip


def _width_error(width: int, field: str, input_dim: int, model: str) -> RequestError:
    return RequestError(
        "wrong_feature_count",
        f"sequence 0, step 0: has {width} features; model '{model}' takes {input_dim}",
        (field, 0, 0),
    )  # fmt: skip


def non_finite_error(seqs: FlatSequences, field: str) -> RequestError:
    """The located error for sequences the engine found a NaN or an infinity in: the first
    such value and where it is."""
    first = int(_first_non_finite(seqs.data.reshape(-1)))
    if first < 0:  # the engine's word against the data: report it without a place
        return RequestError("non_finite", f"'{field}' holds a value that is not finite",
                            (field,))  # fmt: skip
    return _value_error(seqs, first, field, "value is not a finite number")


def _value_error(seqs: FlatSequences, flat: int, field: str, what: str) -> RequestError:
    """A non-finite value at flat index ``flat`` of ``seqs.data``, located."""
    width = seqs.data.shape[1]
    row, f = divmod(flat, width)
    ends = seqs.ends
    i = int(np.searchsorted(ends, row, side="right"))
    t = row - (int(ends[i - 1]) if i else 0)
    return RequestError(
        "non_finite", f"sequence {i}, step {t}, feature {f}: {what}", (field, i, t, f)
    )


# -- safetensors --------------------------------------------------------------------------------

_DTYPES: dict[str, np.dtype[Any]] = {"F32": np.dtype("<f4"), "I64": np.dtype("<i8")}
_ITEMSIZE = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2,
    "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# the most header bytes read: a request's header (two tensors, a model name) is a few hundred,
# and a larger one would be parsed on the event loop, where safetensors bodies are read
MAX_SAFETENSORS_HEADER = 64 * 1024


def _not_safetensors(why: str) -> RequestError:
    return RequestError("invalid_safetensors", f"body is not a safetensors file: {why}")


def safetensors_header_length(first: bytes, body_size: int) -> int:
    """The header length that ``first`` (the body's first bytes, 8 at least) declares, refused
    as ``invalid_safetensors`` if the header would run past a body of ``body_size`` bytes or
    is over :data:`MAX_SAFETENSORS_HEADER`.

    The one rule for both readers of it: the decoder on the whole body, and the HTTP layer on
    the first 8 bytes to arrive with the declared length (or the body limit) for ``body_size``,
    so that a body the decoder would refuse is refused before the rest of it is read."""
    if len(first) < 8:
        raise _not_safetensors("shorter than its 8-byte header length")
    (size,) = struct.unpack_from("<Q", first)
    if size > body_size - 8:
        raise _not_safetensors(f"header length {size} is past the end of the body")
    if size > MAX_SAFETENSORS_HEADER:
        raise _not_safetensors(
            f"its header of {size} bytes is over the limit of {MAX_SAFETENSORS_HEADER} bytes"
        )
    return int(size)


def _read_header(body: bytes) -> tuple[dict[str, Any], dict[str, str], int]:
    """The tensors' entries, the metadata and where the data starts; checked like the library."""
    size = safetensors_header_length(body, len(body))
    try:
        header = orjson.loads(body[8 : 8 + size])
    except orjson.JSONDecodeError:
        raise _not_safetensors("the header is not JSON") from None
    if not isinstance(header, dict):
        raise _not_safetensors("the header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _not_safetensors("__metadata__ must map names to strings")
    start = 8 + size
    data_len = len(body) - start
    for name, entry in header.items():
        ok = (
            isinstance(entry, dict)
            and entry.get("dtype") in _ITEMSIZE
            and isinstance(entry.get("shape"), list)
            and all(type(d) is int and d >= 0 for d in entry["shape"])
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and all(type(d) is int for d in entry["data_offsets"])
        )
        if not ok:
            raise _not_safetensors(
                f"tensor '{quote(name)}' has no valid dtype, shape and data_offsets"
            )
        begin, end = entry["data_offsets"]
        nbytes = int(np.prod(entry["shape"], dtype=object)) * _ITEMSIZE[entry["dtype"]]
        if not 0 <= begin <= end <= data_len or end - begin != nbytes:
            raise _not_safetensors(f"tensor '{quote(name)}' does not fit its data_offsets")
        # an empty tensor's other dimensions are free of its size: bounded here so that no
        # shape is beyond what an array can have ([2**62, 0])
        if int(np.prod([d for d in entry["shape"] if d], dtype=object)) > len(body):
            raise _not_safetensors(f"tensor '{quote(name)}' has a shape no body this size holds")
    _check_tiling(header, data_len)
    return header, meta, start


def _check_tiling(header: dict[str, Any], data_len: int) -> None:
    """The tensors' bytes, in the order of their offsets, follow one another from the start
    of the data to the body's end, as the safetensors library requires: no byte read twice,
    none left over."""
    end_before = 0
    for name, entry in sorted(header.items(), key=lambda item: item[1]["data_offsets"]):
        begin, end = entry["data_offsets"]
        if begin != end_before:
            why = "overlaps the tensor before it" if begin < end_before else "leaves a gap"
            raise _not_safetensors(f"tensor '{quote(name)}' {why} in the data")
        end_before = end
    if end_before != data_len:
        raise _not_safetensors(f"{data_len - end_before} bytes after the last tensor")


def _tensor(
    body: bytes, header: dict[str, Any], start: int, name: str, dtype: str, ndim: int
) -> np.ndarray:
    entry = header.get(name)
    shown = quote(name)  # a state tensor's name is the client's
    if entry is None:
        raise RequestError("missing", f"tensor '{shown}' is required", (shown,))
    if entry["dtype"] != dtype:
        raise RequestError(
            "wrong_dtype", f"tensor '{shown}' must be {dtype}, not {entry['dtype']}", (shown,)
        )
    shape = entry["shape"]
    if len(shape) != ndim:
        want = "[sum of lengths, features]" if ndim == 2 else "[sequences]"
        raise RequestError(
            "wrong_shape", f"tensor '{shown}' must be {ndim}-D {want}, not {quote(shape)}",
            (shown,),
        )  # fmt: skip
    begin, end = entry["data_offsets"]
    arr = np.frombuffer(body, _DTYPES[dtype], (end - begin) // _DTYPES[dtype].itemsize,
                        start + begin)  # fmt: skip
    if (start + begin) % _DTYPES[dtype].itemsize:  # unaligned: copy once
        arr = arr.copy()
    shaped: np.ndarray = arr.reshape(shape)
    return shaped


def _decode_safetensors(body: bytes, field: str, limits: Limits) -> Decoded:
    header, meta, start = _read_header(body)
    for name in header:
        if name not in (field, "lengths") and not name.startswith(STATE_PREFIX):
            raise RequestError(
                "unknown_field",
                f"unknown tensor '{quote(name)}' (expected '{field}', 'lengths' and "
                "'state.<part>')",
                (quote(name),),
            )  # fmt: skip
    state = _binary_state(body, header, meta, start)
    data = _tensor(body, header, start, field, "F32", 2)
    lengths = _tensor(body, header, start, "lengths", "I64", 1)
    if not len(lengths):
        raise RequestError("empty", f"'{field}' holds no sequences", (field,))
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise RequestError("wrong_lengths", f"sequence {i} has a negative length", ("lengths", i))
    if (lengths == 0).any():
        i = int(np.argmax(lengths == 0))
        raise RequestError("empty", f"sequence {i} has no steps", (field, i))
    # no overflow: each length is at most the body's size, and there are fewer than that
    total = int(lengths.sum())
    if total != len(data):
        raise RequestError(
            "wrong_lengths",
            f"lengths add up to {total} steps; tensor '{field}' has {len(data)} rows",
            ("lengths",),
        )  # fmt: skip
    if data.shape[1] == 0:
        raise RequestError("empty", "sequence 0, step 0 has no features", (field, 0, 0))

    def finish(input_dim: int, model: str) -> FlatSequences:
        long = np.flatnonzero(lengths > limits.max_sequence_length)
        too_long = (int(long[0]), int(lengths[long[0]])) if len(long) else (-1, 0)
        check_limits(len(lengths), too_long, total, field, limits)
        if data.shape[1] != input_dim:
            raise _width_error(data.shape[1], field, input_dim, model)
        return FlatSequences(data, lengths)

    return Decoded(meta.get("model"), finish, state)


STATE_PREFIX = "state."  # a binary body's or answer's state tensors: state.h, state.c, ...


def _binary_state(
    body: bytes, header: dict[str, Any], meta: dict[str, str], start: int
) -> StateAsked:
    """A binary body's carried state: tensors ``state.<part>`` (F32 ``[N, *shape]``) with
    metadata ``state_model`` and ``state_version``; metadata ``return_state`` ``"true"``
    asks for the final state."""
    flag = meta.get("return_state", "false")
    if flag not in ("true", "false"):
        raise RequestError(
            "invalid_request", "metadata 'return_state' must be \"true\" or \"false\"",
            ("__metadata__", "return_state"),
        )  # fmt: skip
    asked = flag == "true"
    names = [n for n in header if n.startswith(STATE_PREFIX)]
    if not names:
        return StateAsked(True) if asked else NO_STATE
    for key in ("state_model", "state_version"):
        if key not in meta:
            raise RequestError(
                "missing", f"metadata '{key}' is required with the state tensors",
                ("__metadata__", key),
            )  # fmt: skip
    parts = {}
    for name in names:
        ndim = len(header[name]["shape"])
        parts[name.removeprefix(STATE_PREFIX)] = _tensor(body, header, start, name, "F32", ndim)
    return StateAsked(asked, meta["state_model"], meta["state_version"], parts, binary=True)


def encode_safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """A safetensors file of ``tensors`` (float32 or int64), copied once, straight to bytes."""
    return b"".join(safetensors_parts(tensors, metadata))


def safetensors_parts(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> list[Any]:
    """A safetensors file of ``tensors`` as buffers to write one after another, not copied:
    the 8-byte header size, the header, then each tensor's bytes."""
    names = {np.dtype("<f4"): "F32", np.dtype("<i8"): "I64"}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    arrays = []
    for name, arr in tensors.items():
        a = np.ascontiguousarray(arr)
        header[name] = {
            "dtype": names[a.dtype],
            "shape": list(a.shape),
            "data_offsets": [offset, offset + a.nbytes],
        }
        offset += a.nbytes
        arrays.append(a)
    text = orjson.dumps(header)
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    parts: list[Any] = [struct.pack("<Q", len(text)), text]
    parts += [a.data.cast("B") for a in arrays]
    return parts


def encode(
    model: str,
    out_field: str,
    outputs: FlatSequences | list[np.ndarray],
    binary: bool,
    *,
    view: bool = False,
) -> bytes | memoryview:
    """The response body: safetensors when ``binary``, else JSON written from the buffers (with
    ``view``, a large one as a view of its own buffer: json_writer.sequences_json)."""
    if binary:
        return b"".join(encode_parts(model, out_field, outputs))
    flat = outputs if isinstance(outputs, FlatSequences) else FlatSequences.from_arrays(outputs)
    if flat.state is not None:  # the numbers as written, then the state (orjson: float32 exact)
        body = bytes(json_writer.sequences_json(model, out_field, flat.data, flat.lengths))
        state = orjson.dumps(state_json(flat.state), option=orjson.OPT_SERIALIZE_NUMPY)
        return body[:-1] + b',"state":' + state + b"}"
    return json_writer.sequences_json(model, out_field, flat.data, flat.lengths, view=view)


def warm_up() -> None:
    """Compile the JSON scanner and writer (seconds, once per process; then numba's cache)
    before the first request needs them."""
    json_writer.warm_up()
    limits = Limits(max_sequences=4, max_sequence_length=4, max_timesteps=16)
    for body in (b'{"sequences": [[[1.5, -2e-3], [0, 1]]], "model": "m"}', b'{"inputs": [[[1]]]}'):
        field = "sequences" if b"sequences" in body else "inputs"
        decoded = decode(body, JSON, field, limits)
        if decoded is None:
            raise RuntimeError("the JSON fast path refused its own warm-up body")
        outputs = decoded.sequences(2 if field == "sequences" else 1, "m")
        encode("m", field, outputs, binary=False)
        encode("m", field, outputs, binary=True)


def encode_parts(
    model: str, out_field: str, outputs: FlatSequences | list[np.ndarray]
) -> list[Any]:
    """The safetensors response as buffers (header, then the output rows and lengths, in place;
    with a final state, its tensors ``state.<part>`` and metadata ``state_model`` and
    ``state_version``)."""
    flat = outputs if isinstance(outputs, FlatSequences) else FlatSequences.from_arrays(outputs)
    tensors = {out_field: flat.data, "lengths": flat.lengths}
    meta = {"model": model}
    if flat.state is not None:
        for part, rows in flat.state.tensors.items():
            tensors[STATE_PREFIX + part] = np.asarray(rows, np.float32)
        meta.update(state_model=flat.state.model, state_version=flat.state.version)
    return safetensors_parts(tensors, meta)


def state_json(state: CarriedState) -> dict[str, Any]:
    """A final state as an answer's ``"state"``: what the next request sends back as it is."""
    names = list(state.tensors)
    sequences = [
        {name: state.tensors[name][i] for name in names}
        for i in range(len(next(iter(state.tensors.values()))) if names else 0)
    ]
    return {"model": state.model, "version": state.version, "sequences": sequences}
