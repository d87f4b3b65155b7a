"""The request-body codec: the safetensors decoder's refusals and where its arrays live.

Each malformed body is refused with its status, error type and location, and a message naming
what was wrong (the tensor, the sequence, the limit); aligned tensors are read in place and
unaligned ones copied; the JSON fast path's number parsing, limits and warm-up are checked too.
"""

from __future__ import annotations

import struct
import warnings
from typing import Any

import numpy as np
import orjson
import pytest
from safetensors.numpy import save

from rnnserve.service.codec import bodies
from rnnserve.service.http.errors import status as status_of
from rnnserve.service.interface import Limits, RequestError

LIMITS = Limits(256, 100_000, 1_000_000)
NOT_ST = "not a safetensors file"


def mentions(message: str, *words: str) -> bool:
    """Whether an error's message names every one of ``words``."""
    missing = [w for w in words if w not in message]
    assert not missing, f"{message!r} does not mention {missing}"
    return True


def _raw(header: dict[str, Any], data: bytes = b"", start_mod8: int | None = None) -> bytes:
    """A safetensors body written by hand; with ``start_mod8``, the header is padded with spaces
    so that the data starts that many bytes past a multiple of 8."""
    text = orjson.dumps(header)
    if start_mod8 is not None:
        text += b" " * ((start_mod8 - 8 - len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _decode(body: bytes, width: int, limits: Limits) -> None:
    decoded = bodies.decode(body, bodies.SAFETENSORS, "sequences", limits)
    assert decoded is not None
    decoded.sequences(width, "m")


def _refusal(
    body: bytes, width: int = 3, limits: Limits = LIMITS
) -> tuple[int, str, str, tuple[Any, ...]]:
    with pytest.raises(RequestError) as err:
        _decode(body, width, limits)
    e = err.value
    return status_of(e.type), e.type, e.message, e.loc


def _entry(dtype: str, shape: list[Any], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


GOOD = np.arange(6, dtype=np.float32).reshape(2, 3)

HEADER_REFUSALS = [
    ("seven bytes", b"\x00" * 7, ("shorter", "8-byte header length")),
    ("eight bytes", b"\x00" * 8, ("header", "not JSON")),  # an empty header
    ("header past the end", struct.pack("<Q", 10) + b"{}",
     ("header length 10", "past the end")),
    ("header not JSON", struct.pack("<Q", 3) + b"{{{", ("header", "not JSON")),
    ("header a list", struct.pack("<Q", 2) + b"[]", ("header", "not a JSON object")),
    ("metadata not strings", _raw({"__metadata__": {"model": 1}}),
     ("__metadata__", "strings")),
    ("metadata a list", _raw({"__metadata__": ["m"]}), ("__metadata__", "strings")),
    ("negative dimension", _raw({"lengths": _entry("I64", [-1], 0, 0)}),
     ("'lengths'", "dtype, shape and data_offsets")),
    ("dimension a string", _raw({"lengths": _entry("I64", ["1"], 0, 8)}, b"\x00" * 8),
     ("'lengths'", "dtype, shape and data_offsets")),
    # 2**32 * 2**32 elements: 0 in int64 arithmetic, which would "fit" offsets [0, 0]
    ("size past int64", _raw({"sequences": _entry("F32", [2**32, 2**32], 0, 0)}),
     ("'sequences'", "does not fit", "data_offsets")),
    # no bytes, so the offsets fit; no array can have that shape
    ("empty with a huge dimension",
     _raw({"sequences": _entry("F32", [2**62, 0], 0, 0), "lengths": _entry("I64", [1], 0, 8)},
          b"\x00" * 8),
     ("'sequences'", "shape")),
    ("empty state with huge dimensions",
     _raw({"state.h": _entry("F32", [2**31, 2**31, 0], 0, 0)}), ("'state.h'", "shape")),
    # the library's rules: the tensors' bytes one after another, from the start to the end
    ("overlapping tensors",
     _raw({"sequences": _entry("F32", [2, 1], 0, 8), "lengths": _entry("I64", [1], 0, 8)},
          b"\x00" * 8),
     ("overlaps",)),
    ("a gap between tensors",
     _raw({"sequences": _entry("F32", [2, 1], 0, 8), "lengths": _entry("I64", [1], 16, 24)},
          b"\x00" * 24),
     ("'lengths'", "gap")),
    ("bytes after the last tensor",
     _raw({"sequences": _entry("F32", [2, 1], 0, 8), "lengths": _entry("I64", [1], 8, 16)},
          b"\x00" * 20),
     ("4 bytes after the last tensor",)),
]  # fmt: skip


@pytest.mark.parametrize(("body", "why"), [c[1:] for c in HEADER_REFUSALS],
                         ids=[c[0] for c in HEADER_REFUSALS])  # fmt: skip
def test_header_refusals_name_what_is_wrong(body: bytes, why: tuple[str, ...]) -> None:
    status, kind, message, loc = _refusal(body)
    assert (status, kind, loc) == (400, "invalid_safetensors", ())
    assert mentions(message, NOT_ST, *why)


TENSOR_REFUSALS = [
    ("no lengths", save({"sequences": GOOD}),
     ("missing", ("'lengths'", "required"), ("lengths",))),
    ("no data", save({"lengths": np.array([2])}),
     ("missing", ("'sequences'", "required"), ("sequences",))),
    ("float64 data", save({"sequences": GOOD.astype(np.float64), "lengths": np.array([2])}),
     ("wrong_dtype", ("'sequences'", "F32", "not F64"), ("sequences",))),
    ("3-D data", save({"sequences": GOOD[None], "lengths": np.array([2])}),
     ("wrong_shape", ("'sequences'", "2-D", "not [1, 2, 3]"),
      ("sequences",))),
    ("2-D lengths", save({"sequences": GOOD, "lengths": np.array([[2]])}),
     ("wrong_shape", ("'lengths'", "1-D", "not [1, 1]"), ("lengths",))),
    # a state tensor's name is the client's: quoted in short
    ("a long state name of the wrong dtype",
     save({"sequences": GOOD, "lengths": np.array([2]), "state." + "q" * 5000: GOOD[:1, :1]
           .astype(np.float64)}, metadata={"state_model": "m", "state_version": "v"}),
     ("wrong_dtype", ("'state.qqq", "…", "F32", "not F64"), ("state." + "q" * 58 + "…",))),
]  # fmt: skip


@pytest.mark.parametrize(("body", "want"), [c[1:] for c in TENSOR_REFUSALS],
                         ids=[c[0] for c in TENSOR_REFUSALS])  # fmt: skip
def test_tensor_refusals_name_the_tensor(
    body: bytes, want: tuple[str, tuple[str, ...], tuple[Any, ...]]
) -> None:
    status, kind, message, loc = _refusal(body)
    assert (status, kind, loc) == (422, want[0], want[2])
    assert mentions(message, *want[1])
    assert len(message) < 200


def test_aligned_tensors_are_views_of_the_body_and_unaligned_ones_aligned_copies() -> None:
    lengths = np.array([1, 1], np.int64)
    # the library's layout: header padded to 8 bytes, data then lengths (both aligned)
    body = save({"sequences": GOOD, "lengths": lengths})
    decoded = bodies.decode(body, bodies.SAFETENSORS, "sequences", LIMITS)
    assert decoded is not None
    seqs = decoded.sequences(3, "m")
    whole = np.frombuffer(body, np.uint8)
    assert np.array_equal(seqs.data, GOOD)
    assert seqs.lengths.tolist() == [1, 1]
    assert np.shares_memory(seqs.data, whole)
    assert np.shares_memory(seqs.lengths, whole)
    # by hand: data starts 4 bytes past an 8-byte boundary; the sequences there are 4-byte
    # aligned (a view); the lengths after their 24 bytes are 4 bytes off (copied)
    header = {
        "sequences": _entry("F32", [2, 3], 0, 24),
        "lengths": _entry("I64", [2], 24, 40),
    }
    body = _raw(header, GOOD.tobytes() + lengths.tobytes(), start_mod8=4)
    assert (len(body) - 40) % 8 == 4
    decoded = bodies.decode(body, bodies.SAFETENSORS, "sequences", LIMITS)
    assert decoded is not None
    seqs = decoded.sequences(3, "m")
    whole = np.frombuffer(body, np.uint8)
    assert np.array_equal(seqs.data, GOOD)
    assert seqs.lengths.tolist() == [1, 1]
    assert seqs.lengths.flags.aligned
    assert not np.shares_memory(seqs.lengths, whole)
    assert np.shares_memory(seqs.data, whole)


def _st(data: np.ndarray, lengths: list[int], **more: np.ndarray) -> bytes:
    return save({"sequences": data, "lengths": np.array(lengths, np.int64), **more})


def _nan_at(rows: int, row: int, feature: int) -> np.ndarray:
    data = np.zeros((rows, 3), np.float32)
    data[row, feature] = np.nan
    data[rows - 1, 2] = np.inf  # a later one is not the one named
    return data


SMALL = Limits(max_sequences=3, max_sequence_length=4, max_timesteps=6)
Z = np.zeros((7, 3), np.float32)
BODY_REFUSALS = [
    ("extra tensor", _st(Z[:2], [2], extra=np.zeros(1)), 3,
     (422, "unknown_field", ("'extra'", "'sequences'", "'lengths'"),
      ("extra",))),
    ("no sequences", _st(Z[:0], []), 3,
     (422, "empty", ("'sequences'", "no sequences"), ("sequences",))),
    ("negative length", _st(Z[:2], [0, 3, -1]), 3,
     (422, "wrong_lengths", ("sequence 2", "negative length"), ("lengths", 2))),
    ("zero lengths", _st(Z[:2], [2, 0, 0]), 3,
     (422, "empty", ("sequence 1", "no steps"), ("sequences", 1))),
    ("lengths short", _st(Z[:2], [1]), 3,
     (422, "wrong_lengths", ("1 steps", "'sequences'", "2 rows"),
      ("lengths",))),
    ("no features", _st(np.zeros((2, 0), np.float32), [2]), 3,
     (422, "empty", ("sequence 0, step 0", "no features"), ("sequences", 0, 0))),
    ("too many sequences", _st(Z[:4], [1, 1, 1, 1]), 3,
     (413, "too_many_sequences", ("4 sequences", "limit is 3"), ("sequences",))),
    ("first too long", _st(Z[:5], [5]), 3,
     (413, "sequence_too_long", ("sequence 0", "5 steps", "limit is 4"), ("sequences", 0))),
    ("too long", _st(Z[:7], [1, 5, 1]), 3,
     (413, "sequence_too_long", ("sequence 1", "5 steps", "limit is 4"), ("sequences", 1))),
    ("too many steps", _st(Z[:7], [4, 3]), 3,
     (413, "too_many_timesteps", ("7 timesteps", "limit is 6"),
      ("sequences",))),
    ("wrong width", _st(Z[:2], [2]), 5,
     (422, "wrong_feature_count", ("sequence 0, step 0", "3 features", "'m'", "takes 5"),
      ("sequences", 0, 0))),
]  # fmt: skip


@pytest.mark.parametrize(("body", "width", "want"), [c[1:] for c in BODY_REFUSALS],
                         ids=[c[0] for c in BODY_REFUSALS])  # fmt: skip
def test_body_refusals_name_the_place_and_the_limit(
    body: bytes, width: int, want: tuple[int, str, tuple[str, ...], tuple[Any, ...]]
) -> None:
    status, kind, message, loc = _refusal(body, width, SMALL)
    assert (status, kind, loc) == (want[0], want[1], want[3])
    assert mentions(message, *want[2])


@pytest.mark.parametrize(
    ("row", "feature", "loc"), [(3, 1, ("sequences", 1, 1, 1)), (0, 0, ("sequences", 0, 0, 0))]
)
def test_a_non_finite_value_is_kept_for_the_engine_then_located(
    row: int, feature: int, loc: tuple[Any, ...]
) -> None:
    data = _nan_at(5, row, feature)
    decoded = bodies.decode(_st(data, [2, 3]), bodies.SAFETENSORS, "sequences", SMALL)
    assert decoded is not None
    seqs = decoded.sequences(3, "m")
    np.testing.assert_array_equal(seqs.data, data)  # NaN and all: the engine refuses it
    err = bodies.non_finite_error(seqs, "sequences")
    assert (status_of(err.type), err.type, err.loc) == (422, "non_finite", loc)
    assert mentions(err.message, f"sequence {loc[1]}, step {loc[2]}, feature {loc[3]}")


def test_a_body_exactly_at_every_limit_is_accepted() -> None:
    data = np.arange(18, dtype=np.float32).reshape(6, 3)
    decoded = bodies.decode(_st(data, [4, 1, 1]), bodies.SAFETENSORS, "sequences", SMALL)
    assert decoded is not None
    seqs = decoded.sequences(3, "m")
    assert np.array_equal(seqs.data, data)
    assert seqs.lengths.tolist() == [4, 1, 1]


def test_power_of_five_table_is_lemires() -> None:
    # the module computes it once at import; called here, each entry is checked against the
    # definition: the leading 128 bits of 5**q (q >= 0); for q < 0 the reciprocal, rounded up
    # from 128 bits (q >= -27) or taken from 2z + 128 bits, plus one, then truncated
    hi, lo = bodies._power_of_five_table()
    assert hi.dtype == lo.dtype == np.uint64
    assert len(hi) == len(lo) == 651
    assert np.array_equal(hi, bodies._P5_HI)
    assert np.array_equal(lo, bodies._P5_LO)
    table = [(int(h) << 64) | int(v) for h, v in zip(hi, lo, strict=True)]
    for i, c in enumerate(table):
        q = i - 342
        if q >= 0:
            p = 5**q
            s = 128 - p.bit_length()
            want = p << s if s >= 0 else p >> -s
        else:
            p = 5**-q
            z = p.bit_length()
            rounded_up = (1 << (z + 127)) // p + 1
            truncated = ((1 << (2 * z + 128)) // p + 1) >> (z + 1)
            want = rounded_up if q >= -27 else truncated
        assert 1 << 127 <= c < 1 << 128, q
        assert c == want, q
    # entries of fast_float's table (q = -342, -1, 0, 1, 27)
    assert table[0] == 0xEEF453D6923BD65A_113FAA2906A13B3F
    assert table[342 - 1] == 0xCCCCCCCCCCCCCCCC_CCCCCCCCCCCCCCCD
    assert table[342] == 1 << 127
    assert table[342 + 1] == 0xA << 124
    assert table[342 + 27] == 0xCECB8F27F4200F3A << 64


def _double(x: int) -> int:
    return 2 * x


def test_jit_options_and_its_fallback_without_a_cache_location() -> None:
    # _jit runs while the module is imported, where no other test reaches it: called here so
    # that its options and its fallback are checked
    options = {"nogil": True, "boundscheck": False, "error_model": "numpy", "nopython": True}
    cached = bodies._jit(_double, error_model="numpy")
    assert cached.targetoptions == options
    assert type(cached._cache).__name__ == "FunctionCache"  # this file can hold a cache
    scope: dict[str, Any] = {}
    exec("def plus_one(x):\n    return x + 1\n", scope)  # no file: numba cannot cache it
    uncached = bodies._jit(scope["plus_one"], error_model="numpy")
    assert uncached.targetoptions == options
    assert type(uncached._cache).__name__ == "NullCache"
    assert uncached(41) == 42


def test_warm_up_says_when_the_fast_path_refuses_its_own_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies.warm_up()  # the real fast path takes both bodies
    monkeypatch.setattr(bodies, "decode", lambda *args: None)
    with pytest.raises(RuntimeError) as err:
        bodies.warm_up()
    assert mentions(str(err.value), "fast path", "warm-up")


def test_encode_both_formats() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((1, 3), -0.5, np.float32)
    assert orjson.loads(bodies.encode("m", "positions", [a, b], binary=False)) == {
        "model": "m",
        "positions": [a.tolist(), b.tolist()],
    }
    body = bodies.encode("m", "sequences", [a, b], binary=True)
    assert body == bodies.encode_safetensors(
        {"sequences": np.concatenate([a, b]), "lengths": np.array([2, 1], np.int64)},
        {"model": "m"},
    )
    decoded = bodies.decode(body, bodies.SAFETENSORS, "sequences", LIMITS)
    assert decoded is not None
    assert decoded.model == "m"
    seqs = decoded.sequences(3, "m")
    assert np.array_equal(seqs.data, np.concatenate([a, b]))
    assert seqs.lengths.tolist() == [2, 1]


def test_parse_float_refuses_what_is_not_one_json_number() -> None:
    for text in (b"1x", b"", b"01", b"1.", b"--1"):
        with pytest.raises(ValueError, match="not a JSON number") as err:
            bodies.parse_float(text)
        assert repr(text) in str(err.value)


def test_safetensors_parts_any_number_of_tensors_aligned_and_not_copied() -> None:
    from safetensors.numpy import load

    tensors = {
        "a": np.arange(3, dtype=np.float32),  # 12 bytes: what follows is not 8-aligned
        "b": np.arange(4, dtype=np.int64).reshape(2, 2),
        "c": np.full((2, 3), 0.25, np.float32),
    }
    parts = bodies.safetensors_parts(tensors, {"model": "m"})
    raw = b"".join(parts)
    (size,) = struct.unpack_from("<Q", raw)
    assert size % 8 == 0  # the data starts 8-byte aligned
    assert len(parts[1]) == size
    loaded = load(raw)
    assert loaded.keys() == tensors.keys()
    for name, arr in tensors.items():
        assert loaded[name].dtype == arr.dtype
        assert np.array_equal(loaded[name], arr)
    for part, arr in zip(parts[2:], tensors.values(), strict=True):
        assert np.shares_memory(np.frombuffer(part, np.uint8), arr)  # no copy
    header = orjson.loads(parts[1])
    assert header["__metadata__"] == {"model": "m"}
    assert [header[k]["data_offsets"] for k in tensors] == [[0, 12], [12, 44], [44, 68]]


def test_encode_parts_sends_flat_outputs_in_place() -> None:
    from rnnserve.service.interface import FlatSequences

    flat = FlatSequences(np.arange(9, dtype=np.float32).reshape(3, 3), np.array([2, 1]))
    parts = bodies.encode_parts("m", "sequences", flat)
    assert np.shares_memory(np.frombuffer(parts[2], np.uint8), flat.data)
    assert np.shares_memory(np.frombuffer(parts[3], np.uint8), flat.lengths)
    assert b"".join(parts) == bodies.encode("m", "sequences", list(flat), binary=True)


def test_non_finite_error_without_a_place_says_which_field() -> None:
    from rnnserve.service.interface import FlatSequences

    err = bodies.non_finite_error(FlatSequences(np.ones((3, 2), np.float32), np.array([3])), "xs")
    assert (status_of(err.type), err.type, err.loc) == (422, "non_finite", ("xs",))
    assert mentions(err.message, "'xs'", "not finite")


def test_json_runs_again_with_room_for_every_slow_number(monkeypatch: pytest.MonkeyPatch) -> None:
    # numbers of more than 19 significant digits are left to float(); the first pass has room
    # for 64 of them; with more it stops short and runs again with room for every number
    real, rooms = bodies._scan, []

    def recording(buf: Any, key: Any, max_len: int, out: Any, data: Any, lengths: Any,
                  slow: Any, *rest: Any) -> None:  # fmt: skip
        rooms.append((len(slow), int(out[bodies._OK])))
        real(buf, key, max_len, out, data, lengths, slow, *rest)
        rooms[-1] = (len(slow), int(out[bodies._OK]))

    monkeypatch.setattr(bodies, "_scan", recording)
    longs = [f"0.{i:03d}" + "1" * 22 for i in range(70)]  # 70 numbers of 25 digits
    rows = ", ".join(f"[1.5, {x}]" for x in longs)
    body = f'{{"sequences": [[{rows}], [[5, 6]]]}}'.encode()
    decoded = bodies.decode(body, None, "sequences", LIMITS)
    assert decoded is not None
    seqs = decoded.sequences(2, "m")
    want = [[1.5, float(x)] for x in longs] + [[5, 6]]
    assert seqs.data.tolist() == np.array(want, np.float32).tolist()
    assert seqs.lengths.tolist() == [70, 1]
    assert rooms == [(64, bodies._SHORT_OF_ROOM), (len(body) // 2 + 1, 1)]
    rooms.clear()
    few = f'{{"sequences": [[{", ".join(f"[1.5, {x}]" for x in longs[:64])}]]}}'.encode()
    assert bodies.decode(few, None, "sequences", LIMITS) is not None
    assert rooms == [(64, 1)]  # 64 fit: one pass


def test_a_long_json_number_past_float32_is_refused_without_a_warning() -> None:
    big = "1" + "0" * 39 + ".5"  # 1e39, with more digits than the compiled parser takes
    body = f'{{"sequences": [[[1, 2], [3, {big}]]]}}'.encode()
    decoded = bodies.decode(body, None, "sequences", LIMITS)
    assert decoded is not None  # the fast path takes it
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning would be an error here
        with pytest.raises(RequestError) as err:
            decoded.sequences(2, "m")
    e = err.value
    assert (status_of(e.type), e.type, e.message, e.loc) == (
        422, "non_finite", "sequence 0, step 1, feature 1: value is outside float32's range",
        ("sequences", 0, 1, 1),
    )  # fmt: skip


# --- the JSON fast path's own room and its float32 overflow ---


def _json_fast(body: bytes, limits: Limits, width: int = 1) -> Any:
    decoded = bodies.decode(body, "application/json", "sequences", limits)
    assert decoded is not None, "the fast path declined the body"
    return decoded.sequences(width, "m")


@pytest.mark.parametrize("n", [5, 6])
def test_the_fast_path_counts_sequences_to_one_past_the_limit_itself(n: int) -> None:
    # room for the limit and one more: the fast path itself refuses a body with one too many
    body = orjson.dumps({"sequences": [[[1.0]]] * n})
    limits = Limits(max_sequences=5, max_sequence_length=10, max_timesteps=100)
    if n == 5:
        assert _json_fast(body, limits).lengths.tolist() == [1] * 5
    else:
        with pytest.raises(RequestError) as err:
            _json_fast(body, limits)
        assert (status_of(err.value.type), err.value.type) == (413, "too_many_sequences")


def test_the_fast_path_has_room_for_the_densest_body() -> None:
    # "[[1]]," is the fewest bytes a sequence takes: 6
    n = 3000
    body = b'{"sequences":[' + b",".join([b"[[1]]"] * n) + b"]}"
    out = _json_fast(body, Limits(max_sequences=n, max_sequence_length=10, max_timesteps=n))
    assert out.lengths.tolist() == [1] * n
    assert out.data.tolist() == [[1.0]] * n


# 21 significant digits: past what the compiled parser takes, so float() reads it
SLOW_OVERFLOW = b"9.99999999999999999999e38"


def test_a_slow_number_past_float32s_range_is_refused_without_a_warning() -> None:
    body = b'{"sequences": [[[0.5], [' + SLOW_OVERFLOW + b"]]]}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow warning would be an error here
        with pytest.raises(RequestError) as err:
            _json_fast(body, LIMITS)
    assert (status_of(err.value.type), err.value.type) == (422, "non_finite")
    assert err.value.loc == ("sequences", 0, 1, 0)


def test_the_first_value_out_of_range_is_reported_when_it_comes_first() -> None:
    # the compiled parser finds the first (index 0), float() a later one: the first is named
    body = b'{"sequences": [[[1e39], [0.5], [' + SLOW_OVERFLOW + b"]]]}"
    with pytest.raises(RequestError) as err:
        _json_fast(body, LIMITS)
    assert err.value.loc == ("sequences", 0, 0, 0)
    assert err.value.message.startswith("sequence 0, step 0, feature 0: ")
