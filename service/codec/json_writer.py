"""The JSON response body for float32 sequences, written by a compiled loop: orjson's bytes, faster.

:func:`sequences_json` returns exactly the bytes of rnnserve.service.codec.bodies's ::

    orjson.dumps({"model": model, out_field: list(FlatSequences(data, lengths))},
                 option=orjson.OPT_SERIALIZE_NUMPY)

for a C-contiguous float32 ``data`` ``[sum T_i, F]`` and integer ``lengths`` ``[N]``. orjson
itself writes the header ``{"model":"<escaped>","<field>":[`` (so names are escaped, or
refused, its way); the numbers, brackets and commas are written by one numba loop into a
preallocated buffer, copied once into the ``bytes`` returned (or, for the routes, a body of
its own buffer given as a ``memoryview``, not copied). Anything else (another dtype, not
2-D, not C-contiguous, a field named ``model``, lengths that do not add up) goes to that orjson
call itself, so the answer, or the error, is orjson's in every case.

Why: orjson takes 25-30 ns of CPU per float32. Medians on the shared 2-core development
machine (``python scripts/check_jsonwrite.py --bench``, CPU time): the typical response, 280
steps x 16 tanh outputs, 49 us against orjson's 119 us (0.41x, about 11 ns per float; 63-66
against 128-136 before rows were written in two passes); 64 sequences x 1000 steps x 16,
13.3 ms against 25.3 ms (0.53x: a fresh buffer and result, 11 MB each, cost page faults and
a copy). Bodies up to 1 MiB are written into a buffer kept per thread, so that its pages stay
mapped and cached; headers are kept by name.

Each number is the shortest decimal that reads back as the same float32, the closest such
(ties to even digits): Dragonbox (Junekey Jeon, 2020) for binary32, its common case without
divisions or unpredictable branches; these are the digits Ryu gives, and orjson 3.13 writes
Ryu's. They are laid out as orjson lays out a numpy float32: ``0.0``, ``-0.0``; plain decimals
(``123.0``, ``0.001234``) while the decimal exponent of the first digit is in [-6, 12];
otherwise ``1e-7``, ``1.5e+13``, ``3.4028235e+38``; NaN and infinities as ``null``. Numbers in
[1e-6, 1) in magnitude (the usual outputs) are written with a few wide stores and no loops.

Verified byte for byte against orjson 3.13.0: ``scripts/check_jsonwrite.py`` compares the text
of all 2**32 float32 bit patterns (orjson on chunks of 2**20 against :func:`floats_json`): no
difference; ``tests/unit/codec/test_json_writer.py`` compares whole bodies (edge and random values,
hypothesis, several shapes and lengths, names needing escapes, what goes to orjson).
"""

from __future__ import annotations

import threading
from typing import Any, Literal, overload

import numba
import numpy as np
import orjson

from rnnserve.service.codec.intrinsics import bit_length, store8
from rnnserve.service.interface import FlatSequences

# -- Dragonbox for binary32 ------------------------------------------------------------------


def _cache_table() -> tuple[np.ndarray, np.ndarray]:
    """ceil(10**k * 2**(63 - floor(log2(10**k)))), k in [-31, 46], as high and low 32 bits."""
    hi, lo = [], []
    for k in range(-31, 47):
        if k >= 0:
            v, n = 10**k, (10**k).bit_length()
            c = v << (64 - n) if n <= 64 else -(-v >> (n - 64))
        else:
            d = 10**-k  # not a power of two, so floor(log2(10**k)) = -d.bit_length()
            c = -(-(1 << (63 + d.bit_length())) // d)
        assert 1 << 63 <= c < 1 << 64
        hi.append(c >> 32)
        lo.append(c & 0xFFFFFFFF)
    return np.array(hi, dtype=np.int64), np.array(lo, dtype=np.int64)


_CACHE_HI, _CACHE_LO = _cache_table()


def _shorter_interval(ieee_exponent: int) -> tuple[int, int]:
    """Dragonbox's shorter-interval case (a power of two above the smallest normal), in Python:
    253 of them, tabled at import."""
    e = ieee_exponent - 150
    minus_k = (e * 631305 - 261663) >> 21  # floor(log10(2**e) - log10(4/3))
    beta = e + ((-minus_k * 1741647) >> 19)  # e + floor(log2(10**-minus_k))
    cache = int(_CACHE_HI[-minus_k + 31]) << 32 | int(_CACHE_LO[-minus_k + 31])
    xi = (cache - (cache >> 25)) >> (40 - beta)
    zi = (cache + (cache >> 24)) >> (40 - beta)
    if not 2 <= e <= 3:  # the left endpoint is not an integer
        xi += 1
    sig = zi // 10
    if sig * 10 >= xi:
        exp = minus_k + 1
        while sig % 10 == 0:
            sig //= 10
            exp += 1
        return sig, exp
    sig = ((cache >> (39 - beta)) + 1) // 2
    if e == -35:  # a tie: to even
        sig -= sig & 1
    elif sig < xi:
        sig += 1
    return sig, minus_k


# _to_decimal's minus_k, beta, cache and deltai for each biased exponent (e = exponent - 150)
_MINUS_K = np.array([((e * 315653) >> 20) - 1 for e in range(-150, 106)], np.int64)
_BETA = np.arange(-150, 106) + ((-_MINUS_K * 1741647) >> 19)
_EXP_HI = _CACHE_HI[np.clip(31 - _MINUS_K, 0, 77)]  # (exponents 0 and 255 do not use them)
_EXP_LO = _CACHE_LO[np.clip(31 - _MINUS_K, 0, 77)]
_DELTAI = _EXP_HI >> (31 - _BETA)
_SHORT_SIG = np.zeros(256, np.int64)
_SHORT_EXP = np.zeros(256, np.int64)
for _e in range(2, 255):
    _SHORT_SIG[_e], _SHORT_EXP[_e] = _shorter_interval(_e)
_U = np.uint64  # an unsigned index: numba leaves out the negative-index wraparound
_POW10 = np.array([10**i for i in range(10)], dtype=np.int64)
_DIGITS = np.frombuffer("".join(f"{i:02d}" for i in range(100)).encode(), np.uint8).copy()

# the most bytes one number takes with its comma ("-0.000001234567891," is 18), and the most
# it writes past its start (its sign and "0.00000" then 9 digits: 17)
_MAX_NUMBER = 18
_SLACK = 32


def _to_decimal_general(ieee_mantissa: int, ieee_exponent: int) -> tuple[int, int]:
    """The shortest (digits, decimal exponent) of a finite non-zero float32, the closest of those
    to it, ties to even digits: Dragonbox's compute_nearest_normal, round to nearest even."""
    if ieee_exponent != 0:
        if ieee_mantissa == 0 and ieee_exponent > 1:
            return _SHORT_SIG[ieee_exponent], _SHORT_EXP[ieee_exponent]
        e = ieee_exponent - 150
        fc = ieee_mantissa | (1 << 23)
    else:
        e = -149
        fc = ieee_mantissa
    even = (fc & 1) == 0
    two_fc = fc << 1
    minus_k = ((e * 315653) >> 20) - 1  # floor(log10(2**e)) - kappa, kappa = 1
    beta = e + ((-minus_k * 1741647) >> 19)  # in [3, 6]
    chi = _CACHE_HI[31 - minus_k]
    clo = _CACHE_LO[31 - minus_k]
    deltai = chi >> (31 - beta)
    u = (two_fc | 1) << beta  # < 2**31: the products below stay under 2**63
    r64 = u * chi + ((u * clo) >> 32)  # the upper 64 bits of the 96-bit u * cache
    zi = r64 >> 32
    sig = zi // 100
    r = zi - 100 * sig
    small = False
    if r < deltai:
        if r == 0 and (r64 & 0xFFFFFFFF) == 0 and not even:  # z is the excluded endpoint
            sig -= 1
            r = 100
            small = True
    elif r > deltai:
        small = True
    else:  # r == deltai: compare the fractional parts of x = (two_fc - 1) * cache
        xf = two_fc - 1
        a = xf * clo
        s = (a >> 32) + xf * chi
        parity = (s >> (32 - beta)) & 1
        x_int = (((a & 0xFFFFFFFF) >> (32 - beta)) | ((s & ((1 << (32 - beta)) - 1)) << beta)) == 0
        if not (parity or (x_int and even)):
            small = True
    if not small:
        exp = minus_k + 2
        while sig % 10 == 0:
            sig //= 10
            exp += 1
        return sig, exp
    dist = r - (deltai >> 1) + 5
    sig = sig * 10 + dist // 10
    if dist % 10 == 0:
        a = two_fc * clo
        s = (a >> 32) + two_fc * chi
        parity = (s >> (32 - beta)) & 1
        if parity != ((dist ^ 5) & 1):
            sig -= 1
        elif (((a & 0xFFFFFFFF) >> (32 - beta)) | ((s & ((1 << (32 - beta)) - 1)) << beta)) == 0:
            sig -= sig & 1  # y is an integer: a tie, to even
    return sig, minus_k + 1


def _to_decimal(ieee_mantissa: int, ieee_exponent: int) -> tuple[int, int]:
    """:func:`_to_decimal_general`, with its common cases in fewer branches and no divisions.

    The divisions are multiplications by rounded-up reciprocals, exact in their ranges (checked
    over the whole range): zi < 2**31, the significand < 2**25 and dist <= 105.
    """
    if ieee_exponent == 0 or ieee_mantissa == 0:  # subnormals and powers of two
        return _to_decimal_general(ieee_mantissa, ieee_exponent)
    fc = ieee_mantissa | (1 << 23)
    x = _U(ieee_exponent)  # these five depend on the exponent only: tabled by it
    minus_k = _MINUS_K[x]
    beta = _BETA[x]
    chi = _EXP_HI[x]
    clo = _EXP_LO[x]
    deltai = _DELTAI[x]
    u = ((fc << 1) | 1) << beta
    r64 = u * chi + ((u * clo) >> 32)
    zi = r64 >> 32
    sig = (zi * 1374389535) >> 37  # zi // 100
    r = zi - 100 * sig
    # whether the digits are sig (the interval holds a multiple of 100) or small_sig: at random,
    # so both are computed and one chosen without a branch
    big = int(r < deltai)
    dist = r - (deltai >> 1) + 5
    q10 = (dist * 103) >> 10  # dist // 10
    small_sig = sig * 10 + q10
    out = small_sig ^ ((sig ^ small_sig) & -big)
    q = (out * 3435973837) >> 35  # out // 10
    rare = (
        int(r == deltai)  # the fractional parts decide
        | int((r | (r64 & 0xFFFFFFFF)) == 0)  # zi may be an excluded endpoint
        | (int(dist == q10 * 10) & (1 - big))  # a possible tie, or one less
        | int(out == q * 10)  # trailing zeros
    )  # fmt: skip
    if rare:  # a few percent
        return _to_decimal_general(ieee_mantissa, ieee_exponent)
    return out, minus_k + 1 + big


def _decimal_length9(v: int) -> int:
    # the digits of 0 < v < 10**9 without branches (their number varies at random):
    # floor(log10(2**bit_length)), one less where v is below that power of ten
    t: int = (bit_length(v) * 1233) >> 12
    return t - int(v < _POW10[_U(t)]) + 1


def _ascii8(a: int) -> int:
    """The 8 digits of 0 <= a < 10**8 as ASCII bytes in an int64, the first in the lowest byte.

    Two 4-digit halves in 32-bit lanes, then four 2-digit quarters in 16-bit lanes, each
    split by multiplying by a rounded-up reciprocal (exact in these ranges; P. Khuong's trick).
    """
    hi = (a * 109951163) >> 40  # a // 10**4
    merged = hi | ((a - hi * 10000) << 32)
    top = ((merged * 10486) >> 20) & 0x0000007F_0000007F  # each lane // 100
    hundreds = ((merged - top * 100) << 16) + top
    tens = ((hundreds * 103) >> 10) & 0x000F_000F_000F_000F  # each lane // 10
    tens += (hundreds - tens * 10) << 8
    return tens + 0x3030303030303030


def _write_digits(buf: Any, end: int, v: int) -> None:
    """Write the decimal digits of ``v`` (> 0) so that the last one is at ``end - 1``."""
    p = end
    while v >= 100:
        c = (v % 100) * 2
        v //= 100
        p -= 2
        buf[p] = _DIGITS[c]
        buf[p + 1] = _DIGITS[c + 1]
    if v >= 10:
        c = v * 2
        buf[p - 2] = _DIGITS[c]
        buf[p - 1] = _DIGITS[c + 1]
    else:
        buf[p - 1] = 0x30 + v


def _format_f32(bits: int, buf: Any, pos: int) -> int:
    """Write the float32 with these bits as orjson does at ``buf[pos:]``; the end position.

    The plain way (a call per number, with loops): :func:`_write_rows` writes the common
    numbers itself and calls this for the others."""
    ieee_mantissa = bits & 0x7FFFFF
    ieee_exponent = (bits >> 23) & 0xFF
    if ieee_exponent == 0xFF:
        buf[pos] = 0x6E  # null
        buf[pos + 1] = 0x75
        buf[pos + 2] = 0x6C
        buf[pos + 3] = 0x6C
        return pos + 4
    buf[pos] = 0x2D  # '-', kept only for a negative number (no branch on the sign)
    pos += bits >> 31
    if ieee_exponent == 0 and ieee_mantissa == 0:
        buf[pos] = 0x30  # 0.0
        buf[pos + 1] = 0x2E
        buf[pos + 2] = 0x30
        return pos + 3
    mant, k = _to_decimal(ieee_mantissa, ieee_exponent)
    length = _decimal_length9(mant)
    kk = length + k  # 10**(kk - 1) <= |x| < 10**kk
    if k >= 0 and kk <= 13:  # 1234e7 -> 12340000000.0
        _write_digits(buf, pos + length, mant)
        for i in range(length, kk):
            buf[pos + i] = 0x30
        buf[pos + kk] = 0x2E
        buf[pos + kk + 1] = 0x30
        return pos + kk + 2
    if 0 < kk <= 13:  # 1234e-2 -> 12.34
        _write_digits(buf, pos + length + 1, mant)
        for i in range(kk):
            buf[pos + i] = buf[pos + i + 1]
        buf[pos + kk] = 0x2E
        return pos + length + 1
    if -6 < kk <= 0:  # 1234e-6 -> 0.001234
        buf[pos] = 0x30
        buf[pos + 1] = 0x2E
        offset = 2 - kk
        for i in range(2, offset):
            buf[pos + i] = 0x30
        _write_digits(buf, pos + length + offset, mant)
        return pos + length + offset
    # 1e30, 1.234e-33
    if length == 1:
        buf[pos] = 0x30 + mant
        pos += 1
    else:
        _write_digits(buf, pos + length + 1, mant)
        buf[pos] = buf[pos + 1]
        buf[pos + 1] = 0x2E
        pos += length + 1
    buf[pos] = 0x65  # 'e'
    e = kk - 1
    if e < 0:
        buf[pos + 1] = 0x2D
        e = -e
    else:
        buf[pos + 1] = 0x2B
    pos += 2
    if e >= 10:
        buf[pos] = _DIGITS[2 * e]
        buf[pos + 1] = _DIGITS[2 * e + 1]
        return pos + 2
    buf[pos] = 0x30 + e
    return pos + 1


def _write_rows(bits: Any, k: int, rows: int, width: int, buf: Any, pos: int) -> int:
    """``rows`` rows ``[x,...]`` of ``width`` float32s from ``bits[k:]``, comma-separated, at
    ``buf[pos:]``; the end position.

    Numbers in 1e-6 <= |x| < 1 (the usual outputs) are written here, without loops or
    unpredictable branches; the others by :func:`_format_f32`. Each row in two passes: the
    shortest digits of its numbers first, then the text. (In one pass a number's ~150
    instructions and ~60 cycles of dependent multiplications filled the reorder buffer, so
    numbers hardly overlapped; apart, each pass's iterations are short and independent. The
    per-number code is in this loop, not in a function numba inlines: an inlined function taking
    ``buf`` would cost an atomic reference count increment per number.)
    """
    ws = np.empty(width, np.int64)  # the digits, left-aligned to 9; -1: _format_f32 writes it
    kks = np.empty(width, np.int64)  # 10**(kk - 1) <= |x| < 10**kk
    lens = np.empty(width, np.int64)  # how many digits
    for r in range(rows):
        if r:
            buf[_U(pos)] = 0x2C
            pos += 1
        buf[_U(pos)] = 0x5B
        pos += 1
        for j in range(width):  # the digits
            b: Any = np.int64(bits[_U(k + j)])
            ieee_mantissa = b & 0x7FFFFF
            ieee_exponent = (b >> 23) & 0xFF
            ws[j] = -1
            if ieee_exponent < 104 or ieee_exponent > 126:  # not in [2**-23, 1): maybe not 0.xxx
                continue
            mant, e10 = _to_decimal(ieee_mantissa, ieee_exponent)
            length = _decimal_length9(mant)
            kk = length + e10
            if kk <= -6:  # 2**-23 < 1e-6: a few of these are written 1.2e-6
                continue
            ws[j] = mant * _POW10[_U(9 - length)]
            kks[j] = kk
            lens[j] = length
        for j in range(width):  # the text
            if j:
                buf[_U(pos)] = 0x2C
                pos += 1
            w = ws[j]
            b = np.int64(bits[_U(k + j)])
            if w < 0:
                pos = _format_f32(b, buf, pos)
                continue
            # 1234e-6 -> 0.001234: the sign (kept only when negative: no branch), "0.000000",
            # then the digits, left-aligned to 9, over it from the right place; what is written
            # past the end is overwritten by what follows (the buffer has room for it)
            buf[_U(pos)] = 0x2D
            pos += b >> 31
            store8(buf, pos, 0x3030303030302E30)
            first = (w * 1441151881) >> 57  # w // 10**8
            p = pos + 2 - kks[j]
            buf[_U(p)] = 0x30 + first
            store8(buf, p + 1, _ascii8(w - first * 100000000))
            pos = p + lens[j]
        buf[_U(pos)] = 0x5D
        pos += 1
        k += width
    return pos


def _write_body(data: Any, lengths: Any, head: Any, buf: Any) -> int:
    """``head``, then each sequence ``[[x, ...], ...]`` of the float32 ``data`` (2-D, C order),
    comma-separated, then ``]}``; the end, or -1 (nothing written) if a length is negative or
    they do not add up to the rows."""
    rows, width = data.shape
    bits = data.reshape(-1).view(np.uint32)
    total = 0
    for s in range(lengths.shape[0]):
        if lengths[s] < 0:
            return -1
        total += lengths[s]
    if total != rows:
        return -1
    for i in range(head.shape[0]):
        buf[i] = head[i]
    pos: int = head.shape[0]
    k = 0
    for s in range(lengths.shape[0]):
        if s:
            buf[pos] = 0x2C
            pos += 1
        buf[pos] = 0x5B
        pos = _write_rows(bits, k, lengths[s], width, buf, pos + 1)
        k += lengths[s] * width
        buf[pos] = 0x5D
        pos += 1
    buf[pos] = 0x5D
    buf[pos + 1] = 0x7D
    return pos + 2


def _write_list(bits: Any, buf: Any) -> int:
    """``[x,...]`` of the float32s with these bits, as orjson writes a 1-D array; the end."""
    end: int = _write_rows(bits, 0, 1, bits.shape[0], buf, 0)  # one row: "[x,...]"
    return end


def _jit(fn: Any, **options: Any) -> Any:
    """Compile with numba, cached on disk where a cache folder is writable (else in memory)."""
    try:
        return numba.njit(cache=True, nogil=True, boundscheck=False, **options)(fn)
    except RuntimeError:  # no writable cache location
        return numba.njit(cache=False, nogil=True, boundscheck=False, **options)(fn)


_decimal_length9 = _jit(_decimal_length9, inline="always")
_to_decimal_general = _jit(_to_decimal_general)
_to_decimal = _jit(_to_decimal, inline="always")
_write_digits = _jit(_write_digits)
_ascii8 = _jit(_ascii8, inline="always")
_format_f32 = _jit(_format_f32)
_write_rows = _jit(_write_rows)
_write_body = _jit(_write_body)
_write_list = _jit(_write_list)


def floats_json(values: np.ndarray) -> bytes:
    """A 1-D float32 array as ``orjson.dumps(values, option=OPT_SERIALIZE_NUMPY)`` writes it."""
    bits = np.ascontiguousarray(values, dtype=np.float32).reshape(-1).view(np.uint32)
    buf = np.empty(bits.shape[0] * _MAX_NUMBER + 2 + _SLACK, np.uint8)
    return buf[: _write_list(bits, buf)].tobytes()


def _orjson(model: str, out_field: str, data: np.ndarray, lengths: np.ndarray) -> bytes:
    seqs = list(FlatSequences(data, lengths))  # as rnnserve.service.codec.bodies.encode has them
    return orjson.dumps({"model": model, out_field: seqs}, option=orjson.OPT_SERIALIZE_NUMPY)


_SCRATCH_MAX = 1 << 20
_scratch = threading.local()  # each thread's buffer for bodies up to _SCRATCH_MAX bytes
_HEADERS_MAX = 256
_headers: dict[tuple[str, str], np.ndarray] = {}  # '{"model":"<model>","<field>":[' by names


@overload
def sequences_json(
    model: str, out_field: str, data: np.ndarray, lengths: np.ndarray, *, view: Literal[False] = ...
) -> bytes: ...
@overload
def sequences_json(
    model: str, out_field: str, data: np.ndarray, lengths: np.ndarray, *, view: bool
) -> bytes | memoryview: ...
def sequences_json(
    model: str, out_field: str, data: np.ndarray, lengths: np.ndarray, *, view: bool = False
) -> bytes | memoryview:
    """``{"model": model, out_field: [[[x, ...], ...], ...]}`` exactly as orjson writes it.

    ``bytes``; with ``view``, a body too large for the thread's scratch buffer is returned as a
    ``memoryview`` of the buffer written for it alone (not copied: ~5 % of the write for a
    4,000 x 16 answer; an HTTP response sends either)."""
    if (
        type(data) is not np.ndarray
        or data.dtype != np.float32
        or data.ndim != 2
        or not data.flags.c_contiguous  # orjson refuses these
        or out_field == "model"
        or type(lengths) is not np.ndarray
        or lengths.ndim != 1
        or lengths.dtype.kind not in "iu"
    ):
        return _orjson(model, out_field, data, lengths)
    names = type(model) is str and type(out_field) is str
    head = _headers.get((model, out_field)) if names else None
    if head is None:  # orjson escapes the names (and refuses what it refuses)
        head = np.frombuffer(orjson.dumps({"model": model, out_field: []})[:-2], np.uint8)
        if names:
            if len(_headers) >= _HEADERS_MAX:
                _headers.clear()
            _headers[model, out_field] = head
    rows, width = data.shape
    size = len(head) + 3 * len(lengths) + rows * (3 + width * _MAX_NUMBER) + 2 + _SLACK
    if size <= _SCRATCH_MAX:  # a buffer already in the cache and mapped: about 6 us less
        buf = getattr(_scratch, "buf", None)
        if buf is None:
            buf = _scratch.buf = np.empty(_SCRATCH_MAX, np.uint8)
    else:
        buf = np.empty(size, np.uint8)
    end = _write_body(data, lengths.astype(np.int64, copy=False), head, buf)
    if end < 0:  # lengths that do not add up: FlatSequences raises ValueError
        return _orjson(model, out_field, data, lengths)
    if view and buf is not getattr(_scratch, "buf", None):
        return buf[:end].data
    return buf[:end].tobytes()


def warm_up() -> None:
    """Load (or compile: seconds, once) the compiled writer before the first response needs it."""
    data = np.array([[0.5, -1e-7], [np.nan, 1e13]], np.float32)
    sequences_json("m", "sequences", data, np.array([1, 1], np.int64))
