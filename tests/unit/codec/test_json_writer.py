"""rnnserve.service.codec.json_writer writes the bytes orjson writes for the same response, byte for
byte.

Every test compares with the call rnnserve.service.codec.bodies.encode makes (orjson,
OPT_SERIALIZE_NUMPY, on the FlatSequences' per-sequence views). The exhaustive check over all 2**32
float32 bit patterns is scripts/check_jsonwrite.py (minutes); these are the fast ones.
"""

from __future__ import annotations

import threading
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import orjson
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from rnnserve.service.codec import json_writer
from rnnserve.service.codec.json_writer import floats_json, sequences_json
from rnnserve.service.interface import FlatSequences


def reference(model: str, field: str, data: np.ndarray, lengths: np.ndarray) -> bytes:
    seqs = FlatSequences(data, np.asarray(lengths, dtype=np.int64))
    return orjson.dumps({"model": model, field: list(seqs)}, option=orjson.OPT_SERIALIZE_NUMPY)


def check(data: np.ndarray, lengths: list[int] | np.ndarray, model: str = "m",
          field: str = "sequences") -> bytes:  # fmt: skip
    lengths = np.asarray(lengths, dtype=np.int64)
    got = sequences_json(model, field, data, lengths)
    assert isinstance(got, bytes)
    want = reference(model, field, data, lengths)
    assert got == want
    return got


def f32_bits(*bits: int) -> np.ndarray:
    return np.array(bits, dtype=np.uint32).view(np.float32)


EDGES = np.concatenate(
    [
        np.array(
            [
                0.0, -0.0, 1.0, -1.0, 0.1, -0.1, 0.2, 0.3, 1 / 3, 2 / 3, 0.5, 0.25, 0.125,
                1e-7, 1.5e-7, 9.99e-7, 1e-6, 1.0000001e-6, 9.9999994e-7, 1e-5, 1e-4, 1e-3,
                0.001234, 0.999, 0.99999994, 1.0000001, 1.5, 12.34, 100.0, 123456.7,
                1234567.9, 16777216.0, 16777217.0, 1e7, 1.2345678e7, 1e8, 123456789.0, 1e9,
                1e10, 1e11, 1e12, 9.999e12, 1e13, 1.5e13, 1.2345e13, 1e15, 1e16, 2.0**60,
                2.0**64, 1e20, 1e30, 1.1e38, 3.4028235e38, -3.4028235e38, 1.17549435e-38,
                5.877472e-39, 6e-39, 1e-40, 1e-44, 1.4e-45, 1e-10, 1e-20, -1.5e-20,
                np.pi, np.e, 0.7615942, -0.9640276,
            ],
            dtype=np.float32,
        ),
        [np.float32(10.0) ** np.float32(p) for p in range(-45, 39)],
        # subnormals, the normal boundary, powers of two, the largest finite value
        f32_bits(1, 2, 3, 0x7FFFFF, 0x800000, 0x800001, 0x80000001, 0x807FFFFF, 0x7F7FFFFF),
        f32_bits(*(e << 23 for e in range(1, 255))),
        f32_bits(*((e << 23) | 0x7FFFFF for e in range(0, 255))),
        f32_bits(*((e << 23) | 1 for e in range(0, 255))),
    ]
).astype(np.float32)  # fmt: skip


def test_edge_values_one_per_row() -> None:
    check(EDGES.reshape(-1, 1), [len(EDGES)])
    check(-EDGES.reshape(-1, 1), [len(EDGES)])


def test_edge_values_as_a_flat_list() -> None:
    for values in (EDGES, -EDGES):
        assert floats_json(values) == orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)


def test_float_text_examples() -> None:
    # what orjson 3.13 writes for a numpy float32: Ryu's shortest digits, plain decimals for a
    # leading-digit exponent in [-6, 12], "e+" / "e-" otherwise
    assert floats_json(np.array([0.1, 1e-7, 1e-6, 1e12, 1e13], np.float32)) == (
        b"[0.1,1e-7,0.000001,1000000000000.0,1e+13]"
    )
    assert floats_json(np.array([1 / 3, -0.0, 3.4028235e38, 1.4e-45], np.float32)) == (
        b"[0.33333334,-0.0,3.4028235e+38,1e-45]"
    )


def test_non_finite_values_are_null() -> None:
    data = np.array([[np.nan, np.inf], [-np.inf, 1.0]], np.float32)
    assert check(data, [2]) == b'{"model":"m","sequences":[[[null,null],[null,1.0]]]}'
    check(f32_bits(0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF).reshape(2, 2), [1, 1])


def test_typical_response() -> None:
    rng = np.random.default_rng(0)
    data = np.tanh(rng.uniform(-1, 1, (280, 16))).astype(np.float32)
    check(data, [280])
    check(data, [100, 1, 179], model="lstm-small", field="positions")


@pytest.mark.parametrize("width", [1, 2, 3, 16])
def test_shapes_and_lengths(width: int) -> None:
    rng = np.random.default_rng(width)
    data = rng.standard_normal((12, width)).astype(np.float32)
    for lengths in ([12], [1] * 12, [5, 7], [3, 0, 9], [0, 12], [12, 0]):
        check(data, lengths)
    check(np.empty((0, width), np.float32), [])
    check(np.empty((0, width), np.float32), [0])


def test_zero_width_rows() -> None:
    check(np.empty((3, 0), np.float32), [2, 1])


@pytest.mark.parametrize(
    "model",
    ["", "gru", 'quo"te', "back\\slash", "tab\there", "new\nline", "\x00\x1f\x7f",
     "ünïcödé", "emoji \U0001f600", "</script>"],
)  # fmt: skip
def test_names_are_escaped_as_orjson_escapes_them(model: str) -> None:
    data = np.array([[0.5, -0.25]], np.float32)
    check(data, [1], model=model)
    check(data, [1], field=model or "x")


def test_headers_kept_by_name_are_not_mixed_up() -> None:
    data = np.array([[0.5]], np.float32)
    for _ in range(2):
        for model, field in (("a", "b"), ("a", "c"), ("b", "a"), ('a"', "b"), ("a", "b\n")):
            check(data, [1], model=model, field=field)


def test_a_field_named_model_and_other_inputs_go_to_orjson() -> None:
    data = np.array([[0.5, -0.25], [1.0, 2.0]], np.float32)
    check(data, [1, 1], field="model")
    for strided in (
        np.asfortranarray(np.arange(6, dtype=np.float32).reshape(3, 2) / 7),
        np.arange(6, dtype=np.float32).reshape(2, 3)[:, ::2],
    ):  # orjson refuses arrays that are not C-contiguous, and so does this
        with pytest.raises(TypeError, match="not C contiguous"):
            sequences_json("m", "s", strided, np.array([len(strided)]))
    lengths = np.array([1, 1], np.int32)
    assert sequences_json("m", "s", data, lengths) == reference("m", "s", data, lengths)
    wide = data.astype(np.float64)  # not float32: orjson writes float64 text
    want = orjson.dumps(
        {"model": "m", "s": [wide[:1], wide[1:]]}, option=orjson.OPT_SERIALIZE_NUMPY
    )
    assert sequences_json("m", "s", wide, np.array([1, 1])) == want


def test_lengths_that_do_not_add_up_are_refused_as_flat_sequences_refuses_them() -> None:
    with pytest.raises(ValueError, match="do not add up"):
        sequences_json("m", "s", np.zeros((3, 2), np.float32), np.array([1, 1]))
    with pytest.raises(ValueError, match="do not add up"):
        sequences_json("m", "s", np.zeros((3, 2), np.float32), np.array([], np.int64))
    with pytest.raises(ValueError, match="do not add up"):
        sequences_json("m", "s", np.zeros((3, 0), np.float32), np.array([1, 1]))
    # a negative length that FlatSequences lets through: the same bytes, from orjson
    check(np.zeros((3, 1), np.float32), [4, -1])


def test_a_name_orjson_refuses_is_refused() -> None:
    with pytest.raises(orjson.JSONEncodeError):
        sequences_json("\ud800", "s", np.zeros((1, 1), np.float32), np.array([1]))


@pytest.mark.parametrize("scale", [1e-8, 1e-6, 1e-3, 1.0, 1e3, 1e8, 1e13, 1e30])
def test_random_values_at_many_scales(scale: float) -> None:
    rng = np.random.default_rng(int(np.log10(scale) + 100))
    data = (rng.standard_normal((200, 8)) * scale).astype(np.float32)
    check(data, [50, 150])


def test_random_bit_patterns() -> None:
    bits = np.random.default_rng(7).integers(0, 2**32, 200_000, dtype=np.uint64)
    values = bits.astype(np.uint32).view(np.float32)
    assert floats_json(values) == orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)
    check(values.reshape(-1, 16), [12_000, 500])


@settings(max_examples=60, deadline=None)
@given(
    data=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
        elements=st.floats(width=32, allow_nan=True, allow_infinity=True),
    ),
    cuts=st.lists(st.integers(0, 12), max_size=4),
)
def test_hypothesis_bodies(data: np.ndarray, cuts: list[int]) -> None:
    rows = data.shape[0]
    points = sorted({min(c, rows) for c in cuts})
    lengths = np.diff([0, *points, rows])
    check(data, lengths)


# --- the tables built at import, and the compile helper (mutation testing runs these functions
# only when a test calls them: the module's own tables were made before a mutant was chosen) ---


def _floor_log2(x: Fraction) -> int:
    e = x.numerator.bit_length() - x.denominator.bit_length()
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    return e


def test_the_power_of_ten_table_is_exact() -> None:
    hi, lo = json_writer._cache_table()
    assert hi.dtype == lo.dtype == np.int64
    assert len(hi) == len(lo) == 78
    for i, k in enumerate(range(-31, 47)):
        x = Fraction(10) ** k
        scaled = x * Fraction(2) ** (63 - _floor_log2(x))
        want = -(-scaled.numerator // scaled.denominator)  # the ceiling, exactly
        assert (int(hi[i]) << 32 | int(lo[i])) == want, k
        assert 0 <= int(lo[i]) < 1 << 32


def _shortest(value: np.float32) -> tuple[int, int]:
    """(digits, exponent) of the shortest decimal that reads back as ``value``, from orjson's
    own text (ryu), trailing zeros moved into the exponent."""
    digits = Decimal(orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY).decode())
    sign, ds, exp = digits.normalize().as_tuple()
    assert sign == 0
    assert isinstance(exp, int)
    return int("".join(map(str, ds))), exp


@pytest.mark.parametrize("exponent", range(2, 255))
def test_each_power_of_two_takes_its_shortest_decimal(exponent: int) -> None:
    value = f32_bits(exponent << 23)[0]  # a power of two: Dragonbox's shorter interval
    sig, exp = json_writer._shorter_interval(exponent)
    assert (sig, exp) == _shortest(value)
    assert np.float32(Fraction(sig) * Fraction(10) ** exp) == value


def _triple(x: int) -> int:
    return 3 * x


def test_jit_options_and_its_fallback_without_a_cache_location() -> None:
    options = {"nogil": True, "boundscheck": False, "nopython": True}
    cached = json_writer._jit(_triple)
    assert cached.targetoptions == options
    assert type(cached._cache).__name__ == "FunctionCache"  # this file can hold a cache
    inlined = json_writer._jit(_triple, inline="always")
    assert inlined.targetoptions == {**options, "inline": "always"}
    scope: dict[str, Any] = {}
    exec("def plus_one(x):\n    return x + 1\n", scope)  # no file: numba cannot cache it
    uncached = json_writer._jit(scope["plus_one"])
    assert uncached.targetoptions == options
    assert type(uncached._cache).__name__ == "NullCache"
    assert uncached(41) == 42
    inlined_uncached = json_writer._jit(scope["plus_one"], inline="always")  # options kept
    assert inlined_uncached.targetoptions == {**options, "inline": "always"}
    assert type(inlined_uncached._cache).__name__ == "NullCache"
    assert cached(14) == 42


def test_warm_up_runs_the_compiled_writer_not_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    real = json_writer._write_body

    def spy(data: np.ndarray, lengths: np.ndarray, head: np.ndarray, buf: np.ndarray) -> int:
        calls.append((data.dtype, data.shape, lengths.dtype, lengths.tolist()))
        end: int = real(data, lengths, head, buf)
        return end

    def no_fallback(*args: Any) -> bytes:
        raise AssertionError("warm_up fell back to orjson: the compiled writer stayed cold")

    monkeypatch.setattr(json_writer, "_write_body", spy)
    monkeypatch.setattr(json_writer, "_orjson", no_fallback)
    json_writer.warm_up()
    assert calls == [(np.float32, (2, 2), np.int64, [1, 1])]


# --- what sequences_json and floats_json do around the compiled writer: which inputs go to
# orjson, the header cache, the per-thread buffer, and the room they give the writer ---

# float32s whose text is among the longest (16 characters; the writer allows 18 per number)
LONG = f32_bits(0xB725CA13, 0xB725CA1E, 0xB725CA29)


def test_floats_json_of_short_lists_and_of_inputs_read_as_float32() -> None:
    assert floats_json(np.array([], np.float32)) == b"[]"
    for n in range(1, 4):
        values = LONG[:n]
        assert floats_json(values) == orjson.dumps(values, option=orjson.OPT_SERIALIZE_NUMPY)
    # the values are taken as float32 (np.ascontiguousarray(values, np.float32))
    for values in ([0.1, -2.5, 1e-7], np.array([0.1, -2.5, 1e-7]), EDGES[::3]):
        want = np.array(values, np.float32)
        assert floats_json(values) == orjson.dumps(want, option=orjson.OPT_SERIALIZE_NUMPY)


def outcome(call: Any) -> tuple[Any, ...]:
    try:
        return ("bytes", call())
    except Exception as error:  # the error itself is compared
        return (type(error), str(error))


@pytest.mark.parametrize(
    "lengths",
    [np.array([1.0, 1.0]), np.array([[1, 1]]), torch.tensor([1, 1]), [1, 1]],
    ids=["float", "2-D", "tensor", "list"],
)
@pytest.mark.filterwarnings("ignore:__array_wrap__ must accept context:DeprecationWarning")
def test_lengths_that_are_not_a_1d_integer_array_get_the_orjson_answer(lengths: Any) -> None:
    data = np.array([[0.5, -0.25], [1.0, 2.0]], np.float32)

    def want() -> bytes:
        seqs = list(FlatSequences(data, lengths))
        return orjson.dumps({"model": "m", "s": seqs}, option=orjson.OPT_SERIALIZE_NUMPY)

    assert outcome(lambda: sequences_json("m", "s", data, lengths)) == outcome(want)


def test_a_header_is_kept_by_its_names_and_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_writer, "_headers", {})
    data = np.array([[0.5]], np.float32)
    check(data, [1], model="a", field="b")
    head = json_writer._headers["a", "b"]
    assert head.tobytes() == b'{"model":"a","b":['
    check(data, [1], model="a", field="b")
    assert json_writer._headers == {("a", "b"): head}
    assert json_writer._headers["a", "b"] is head  # the same header, not a new one


def test_a_model_that_is_not_a_string_is_written_but_not_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(json_writer, "_headers", {})
    data = np.array([[0.5]], np.float32)
    lengths = np.array([1])
    # 1, True and 1.0 are equal keys, written differently; lists and dicts are not hashable
    for model in (1, True, 1.0, None, [1, 2], {"k": "v"}):
        got = sequences_json(model, "s", data, lengths)  # type: ignore[arg-type]
        assert got == reference(model, "s", data, lengths)  # type: ignore[arg-type]
    assert json_writer._headers == {}


def test_the_header_cache_is_cleared_when_full(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(json_writer, "_headers", {})
    data = np.array([[0.5]], np.float32)
    lengths = np.array([1])
    for i in range(json_writer._HEADERS_MAX + 1):
        sequences_json(f"m{i}", "s", data, lengths)
        assert len(json_writer._headers) == i % json_writer._HEADERS_MAX + 1
    check(data, [1], model=f"m{json_writer._HEADERS_MAX}", field="s")


def test_each_thread_keeps_its_own_buffer() -> None:
    data = np.array([[0.5, -0.25]], np.float32)
    check(data, [1])
    buf = json_writer._scratch.buf
    assert buf.shape == (json_writer._SCRATCH_MAX,)
    check(data, [1])
    assert json_writer._scratch.buf is buf
    theirs: list[Any] = []

    def other() -> None:
        check(data, [1])
        theirs.append(json_writer._scratch.buf)

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert len(theirs) == 1
    assert theirs[0] is not buf
    assert json_writer._scratch.buf is buf


def write_in_a_guarded_thread(bodies: list[tuple[np.ndarray, np.ndarray]]) -> list[bytes]:
    """sequences_json("m", "sequences", data, lengths) for each body, in a new thread whose
    buffer is followed by guard bytes, which must be left as they were."""
    limit = json_writer._SCRATCH_MAX
    got: list[bytes] = []
    guard: list[np.ndarray] = []

    def write() -> None:
        guarded = np.full(limit + 4096, 0xA5, np.uint8)
        json_writer._scratch.buf = guarded[:limit]
        for data, lengths in bodies:
            got.append(sequences_json("m", "sequences", data, lengths))
        guard.append(guarded[limit:])

    thread = threading.Thread(target=write)
    thread.start()
    thread.join()
    assert len(got) == len(bodies)
    assert (guard[0] == 0xA5).all()  # nothing written past the buffer
    return got


def test_a_body_of_the_longest_numbers_just_over_the_thread_buffer() -> None:
    rows = json_writer._SCRATCH_MAX // (16 * 17 + 2) + 1  # rows of 16 numbers of 16 characters
    data = np.resize(LONG, (rows, 16))
    (got,) = write_in_a_guarded_thread([(data, np.array([rows]))])
    assert got == reference("m", "sequences", data, np.array([rows]))
    assert json_writer._SCRATCH_MAX < len(got) < json_writer._SCRATCH_MAX + 1000


def test_bodies_of_empty_sequences_at_the_edge_of_the_thread_buffer() -> None:
    # empty sequences ("[]," each) make the densest bodies for the room asked: bodies from just
    # under to just over _SCRATCH_MAX bytes
    limit = json_writer._SCRATCH_MAX
    data = np.empty((0, 2), np.float32)
    head = len(orjson.dumps({"model": "m", "sequences": []})) - 2  # {"model":"m","sequences":[
    first = (limit - 36 - head) // 3
    counts = range(first, first + 17, 2)
    got = write_in_a_guarded_thread([(data, np.zeros(n, np.int64)) for n in counts])
    for n, body in zip(counts, got, strict=True):
        assert body == orjson.dumps({"model": "m", "sequences": [[]] * n}), n
    assert len(got[0]) < limit - 32
    assert len(got[-1]) > limit + 8


def test_a_view_is_given_only_of_a_buffer_written_for_that_body_alone() -> None:
    rng = np.random.default_rng(3)
    small = rng.uniform(-1, 1, (10, 16)).astype(np.float32)  # in the thread's scratch buffer
    large = rng.uniform(-1, 1, (4000, 16)).astype(np.float32)  # its own buffer (> 1 MiB asked)
    for data in (small, large):
        lengths = np.array([len(data)])
        want = reference("m", "sequences", data, lengths)
        plain = sequences_json("m", "sequences", data, lengths)
        viewed = sequences_json("m", "sequences", data, lengths, view=True)
        assert type(plain) is bytes
        assert plain == want
        assert bytes(viewed) == want
        # a view of the scratch buffer would change under the next body the thread writes
        assert type(viewed) is (memoryview if data is large else bytes)
    first = sequences_json("m", "sequences", large, np.array([4000]), view=True)
    kept = bytes(first)
    sequences_json("m", "sequences", -large, np.array([4000]), view=True)
    sequences_json("m", "sequences", small, np.array([10]))
    assert bytes(first) == kept  # its buffer is its own
