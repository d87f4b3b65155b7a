"""The JSON fast path against the precise path (pydantic + to_arrays), and the codec's pieces.

The fast path may decline any body (then the precise path runs); when it accepts one, its
float32 arrays, or its error, must be exactly what the precise path gives.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rnnserve.service.codec import bodies
from rnnserve.service.http.errors import status as status_of
from rnnserve.service.http.validation import (
    RolloutRequest,
    SmoothRequest,
    parse_body,
    parse_state,
    to_arrays,
)
from rnnserve.service.interface import Limits, RequestError

LIMITS = Limits(256, 100_000, 1_000_000)
WS = st.text(alphabet=" \t\r\n", max_size=3)


def precise(body: bytes, width: int, limits: Limits = LIMITS) -> Any:
    """What the precise path gives: (model, data, lengths, state, return_state) or the
    RequestError."""
    try:
        name, seqs = parse_body(body, SmoothRequest, "sequences")
        arrays = to_arrays(seqs, "sequences", width, limits, name or "smoother")
    except RequestError as exc:
        return exc
    lengths = [len(a) for a in arrays]
    state, asked = getattr(seqs, "state", None), getattr(seqs, "return_state", False)
    return name, np.concatenate(arrays).tobytes(), lengths, state, asked


def fast(body: bytes, width: int, limits: Limits = LIMITS) -> Any:
    """What the fast path gives, its ``state`` read as the server reads it (alone, precisely);
    None when it declines, or when that state has an error (the server then reads the whole
    body precisely)."""
    decoded = bodies.decode(body, None, "sequences", limits)
    if decoded is None:
        return None
    state = None
    if decoded.state_span is not None:
        begin, end = decoded.state_span
        try:
            state = parse_state(b'{"state":' + body[begin:end] + b"}")
        except RequestError:
            return None
    try:
        seqs = decoded.sequences(width, decoded.model or "smoother")
    except RequestError as exc:
        return exc
    asked = decoded.state.return_state
    return decoded.model, seqs.data.tobytes(), seqs.lengths.tolist(), state, asked


def same(a: Any, b: Any) -> bool:
    if isinstance(a, RequestError) and isinstance(b, RequestError):
        return a.body() == b.body() and status_of(a.type) == status_of(b.type)
    return bool(a == b)


# -- numbers ------------------------------------------------------------------------------------


def _digits(draw: st.DrawFn, lo: int, hi: int) -> str:
    return draw(st.text(alphabet="0123456789", min_size=lo, max_size=hi))


@st.composite
def json_number(draw: st.DrawFn) -> str:
    """A JSON number text whose magnitude stays below 1e308 (so the fast path must take it)."""
    kind = draw(st.integers(0, 5))
    if kind == 0:  # any finite double, as Python writes it
        x = draw(
            st.floats(allow_nan=False, allow_infinity=False, max_value=1e300, min_value=-1e300)
        )
        return repr(x).replace("inf", "0")
    if kind == 1:  # a float32, as orjson writes it
        x = draw(st.floats(width=32, allow_nan=False, allow_infinity=False))
        return orjson.dumps(np.float32(x), option=orjson.OPT_SERIALIZE_NUMPY).decode()
    if kind == 2:  # an integer, up to many digits
        body = draw(st.sampled_from(["0", "-0"])) if draw(st.booleans()) else None
        return body or (draw(st.sampled_from(["", "-"])) + "1" + _digits(draw, 0, 30))
    sign = draw(st.sampled_from(["", "-"]))
    head = draw(st.sampled_from(["0", "1", "9"])) + (
        "" if draw(st.booleans()) else _digits(draw, 0, 25)
    )
    if head.startswith("0"):
        head = "0"
    frac = "." + _digits(draw, 1, 30) if draw(st.booleans()) or kind == 3 else ""
    text = sign + head + frac
    if kind >= 4:  # exponents, down to the subnormals and below
        int_digits = len(head) if head != "0" else 0
        exp = draw(st.integers(-400, 300 - int_digits))
        text += (
            draw(st.sampled_from(["e", "E"]))
            + draw(st.sampled_from(["", "+", "-"]) if exp >= 0 else st.just("-"))
            + str(abs(exp))
        )
    return text


@settings(max_examples=3000, deadline=None)
@given(json_number())
def test_numbers_parse_like_python_float(text: str) -> None:
    want = float(text)
    got = bodies.parse_float(text.encode())
    assert struct.pack("<d", got) == struct.pack("<d", want) or (
        # an integer literal is an int to the precise path: -0 is 0
        "." not in text and "e" not in text.lower() and got == want == 0
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(json_number(), min_size=1, max_size=40), st.sampled_from([",", ", ", ",\n  "]))
def test_numbers_in_a_body_read_like_python_float(texts: list[str], sep: str) -> None:
    """The body's own number loop (digits after the point read eight at a time where 16 bytes
    follow, one at a time near the end): each number as float32(float(text))."""
    # as the precise path reads them: an integer literal is an int (-0 is 0)
    values = [float(int(t)) if t.lstrip("-").isdigit() else float(t) for t in texts]
    with np.errstate(over="ignore"):
        want = np.array(values, np.float64).astype(np.float32)
    assume(np.isfinite(want).all())  # past float32's range: an error, tested apart
    rows = sep.join(f"[{t}]" for t in texts)
    body = f'{{"sequences": [[{rows}]]}}'.encode()
    decoded = bodies.decode(body, bodies.JSON, "sequences", LIMITS)
    if decoded is None:  # near or past float64's range: the precise path's, not this test's
        assert any(abs(float(t)) > 1e300 or "e" in t.lower() for t in texts)
        return
    got = decoded.sequences(1, "m").data.ravel()
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@st.composite
def usual_number(draw: st.DrawFn) -> str:
    """The shape the reader takes first (-?d+.d+, then ',' or ']'), and its near misses: signs,
    leading zeros, points and ends it must leave to the rest of the reader."""
    sign = draw(st.sampled_from(["", "", "-", "-", "--", "+"]))
    head = draw(st.sampled_from(["0", "00", "01", "", "7"]))
    if draw(st.booleans()):
        head = draw(st.sampled_from("123456789")) + _digits(draw, 0, 9)
    point = draw(st.sampled_from([".", ".", ".", "", ".."]))
    frac = _digits(draw, 0, 16)
    tail = draw(st.sampled_from(["", "", "", "e5", "E-3", "e", " ", "\n", "."]))
    return sign + head + point + frac + tail


def _is_number(text: str) -> bool:
    try:
        return isinstance(orjson.loads(text), int | float)
    except orjson.JSONDecodeError:
        return False


@settings(max_examples=600, deadline=None)
@given(st.lists(usual_number(), min_size=1, max_size=24), st.integers(1, 3))
def test_numbers_of_the_usual_shape_and_its_near_misses(texts: list[str], rows: int) -> None:
    """Numbers far from the body's end (trailing spaces keep 16 bytes after each), each
    ending with ',' or ']': read as the precise path reads them, or declined where it refuses."""
    row = "[" + ",".join(texts) + "]"
    body = ('{"sequences": [[' + ",".join([row] * rows) + "]]}" + " " * 40).encode()
    got = fast(body, len(texts))
    if all(_is_number(t.strip()) for t in texts):
        assert got is not None, body
    if got is not None:
        assert same(got, precise(body, len(texts))), body


@pytest.mark.parametrize("ints", range(1, 9))
@pytest.mark.parametrize("fracs", range(1, 17))
def test_every_length_of_the_usual_shape(ints: int, fracs: int) -> None:
    """-?d+.d+ of every count of digits on either side of the point (those the shape's two
    words hold and those past them), signed and not, with ',' and ']' after it."""
    rng = np.random.default_rng(ints * 100 + fracs)
    texts = []
    for sign in ("", "-", "", "-"):
        lead = str(rng.integers(1, 10)) if ints > 1 else str(rng.integers(0, 10))
        texts.append(
            sign + lead + "".join(map(str, rng.integers(0, 10, ints - 1)))
            + "." + "".join(map(str, rng.integers(0, 10, fracs)))
        )  # fmt: skip
    body = ('{"sequences": [[[' + ",".join(texts) + "]]]}" + " " * 40).encode()
    with np.errstate(over="ignore"):
        want = np.array([float(t) for t in texts]).astype(np.float32)
    got = fast(body, len(texts))
    assert got is not None
    np.testing.assert_array_equal(np.frombuffer(got[1], np.float32).view(np.uint32),
                                  want.view(np.uint32))  # fmt: skip


@pytest.mark.parametrize("digits", range(0, 20))
@pytest.mark.parametrize(("suffix", "space"), [("", ""), ("e-3", ""), ("E+2", ""), ("", " ")])
def test_every_count_of_fraction_digits(digits: int, suffix: str, space: str) -> None:
    """0 to 19 digits after the point (0 is invalid JSON: declined), with or without an
    exponent or a space after them, far from the body's end (30 numbers follow) and at it."""
    frac = "".join(str((7 * i + 3) % 10) for i in range(digits))
    number = f"-12.{frac}{suffix}"
    for following in (0, 30):
        rows = ",".join([f"[{number}{space}]"] + ["[0.5]"] * following)
        body = f'{{"sequences": [[{rows}]]}}'.encode()
        decoded = bodies.decode(body, bodies.JSON, "sequences", LIMITS)
        if digits == 0:
            assert decoded is None
            continue
        assert decoded is not None, body
        data = decoded.sequences(1, "m").data.ravel()
        want = np.float32(float(number))
        assert data[0].view(np.uint32) == want.view(np.uint32), number
        assert (data[1:] == np.float32(0.5)).all()


@pytest.mark.parametrize(
    "text",
    [
        "0", "-0", "-0.0", "0.0e-5", "1", "-1", "9007199254740993", "18446744073709551615",
        "18446744073709551616", "123456789012345678901234567890", "0.1", "1e22", "1e23",
        "2.2250738585072011e-308", "2.2250738585072014e-308", "4.9406564584124654e-324",
        "2.4703282292062328e-324", "2.4703282292062327e-324", "1e-400", "1.7976931348623157e300",
        "3.4028235e38", "3.4028236e38", "0.30000001192092896", "7.038531e-26",
        "9.109383632044e-31", "1.00000000000000011102230246251565404236316680908203125",
    ],
)  # fmt: skip
def test_hard_numbers(text: str) -> None:
    got = bodies.parse_float(text.encode())
    want = float(text) if ("." in text or "e" in text) else float(int(text))
    assert struct.pack("<d", got) == struct.pack("<d", want)


# -- whole bodies -------------------------------------------------------------------------------


@st.composite
def state_text(draw: st.DrawFn) -> str:
    """A carried state's JSON, in the request schema's shape (not checked against a model):
    names that hold brackets and braces, parts of any nesting it allows."""

    def row(n: int) -> str:
        return "[" + ",".join(draw(WS) + draw(json_number()) for _ in range(n)) + draw(WS) + "]"

    def one_sequence() -> str:
        layers = "[" + ",".join(row(draw(st.integers(0, 3))) for _ in range(2)) + "]"
        parts = draw(st.sampled_from([{"s": row(3)}, {"h": layers, "p": row(2)}, {}]))
        return "{" + ",".join(f'"{k}":{draw(WS)}{v}' for k, v in parts.items()) + "}"

    name = draw(st.sampled_from(['"smoother"', '"a}]{["', '"x\\u0041"', '""']))
    sequences = "[" + ",".join(one_sequence() for _ in range(draw(st.integers(1, 3)))) + "]"
    fields = [f'"model":{draw(WS)}{name}', '"version":"v1"', f'"sequences":{sequences}']
    return "{" + draw(WS) + ",".join(draw(st.permutations(fields))) + draw(WS) + "}"


@st.composite
def valid_body(draw: st.DrawFn) -> tuple[bytes, int]:
    width = draw(st.integers(1, 4))
    n_seq = draw(st.integers(1, 4))
    seqs = []
    for _ in range(n_seq):
        steps = []
        for _ in range(draw(st.integers(1, 4))):
            nums = [draw(json_number()) for _ in range(width)]
            steps.append("[" + ",".join(draw(WS) + x + draw(WS) for x in nums) + "]")
        seqs.append("[" + draw(WS) + ("," + draw(WS)).join(steps) + draw(WS) + "]")
    field = '"sequences"' + draw(WS) + ":" + draw(WS) + "[" + ",".join(seqs) + "]"
    parts = [field]
    model = draw(st.sampled_from([None, "null", '"smoother"', '"smöother"', '""']))
    if model is not None:
        parts.append('"model"' + draw(WS) + ":" + draw(WS) + model)
    asked = draw(st.sampled_from([None, "true", "false"]))
    if asked is not None:
        parts.append('"return_state"' + draw(WS) + ":" + draw(WS) + asked)
    state = draw(st.one_of(st.none(), st.just("null"), state_text()))
    if state is not None:
        parts.append('"state"' + draw(WS) + ":" + draw(WS) + state)
    parts = draw(st.permutations(parts))
    body = draw(WS) + "{" + draw(WS) + ("," + draw(WS)).join(parts) + draw(WS) + "}" + draw(WS)
    return body.encode(), width


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_body())
def test_fast_path_equals_precise_path(case: tuple[bytes, int]) -> None:
    body, width = case
    want = precise(body, width)
    got = fast(body, width)
    if b"\\" not in body:  # an escape in the state's strings sends the body to the precise path
        assert got is not None, body  # every other such body is on the happy path
    if got is not None:
        assert same(got, want), (body, got, want)


JUNK = [b"", b",", b"]", b"[", b"{", b'"', b"\\", b"-", b".", b"e", b"0", b"null", b"true"]
JUNK += [b"NaN", b"x", b"\x00", b"\xff"]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(valid_body(), st.data())
def test_mangled_bodies_are_declined_or_agree(case: tuple[bytes, int], data: st.DataObject) -> None:
    body, width = case
    i = data.draw(st.integers(0, len(body)))
    junk = data.draw(st.sampled_from(JUNK))
    cut = data.draw(st.integers(0, 2))
    mangled = body[:i] + junk + body[i + cut :]
    got = fast(mangled, width)
    if got is not None:  # accepted: then it must be exactly what the precise path says
        assert same(got, precise(mangled, width)), mangled


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_random_bytes_never_crash(body: bytes) -> None:
    got = fast(body, 2)
    if got is not None:
        assert same(got, precise(body, 2))


ROW = "[1.5, 2]"


@pytest.mark.parametrize(
    "body",
    [
        b"", b"[]", b"{}", b"null", b'{"sequences": []}', b'{"sequences": [[]]}',
        b'{"sequences": [[[]]]}', b'{"sequences": [[1, 2]]}', b'{"sequences": [[[[1]]]]}',
        b'{"sequences": [[[1, 2], [3]]]}', b'{"sequences": [[[1]], [[2, 3]]]}',
        b'{"sequences": [[[1, "2"]]]}', b'{"sequences": [[[true]]]}', b'{"sequences": [[[null]]]}',
        b'{"sequences": [[[NaN]]]}', b'{"sequences": [[[-Infinity]]]}',
        b'{"sequences": [[[1e999]]]}',
        b'{"sequences": [[[1e308]]]}', b'{"sequences": [[[01]]]}', b'{"sequences": [[[1.]]]}',
        b'{"sequences": [[[.5]]]}', b'{"sequences": [[[+1]]]}', b'{"sequences": [[[1e]]]}',
        b'{"sequences": [[[1,]]]}', b'{"sequences": [[[1]],]}', b'{"sequences": [[[1]]],}',
        b'{"sequences": [[[1]]]', b'{"sequences": [[[1]]]} x',
        b'\xef\xbb\xbf{"sequences": [[[1]]]}', b'{"sequences": [[[1]]], "sequences": [[[1]]]}',
        b'{"sequences": [[[1]]], "model": null, "model": null}',
        b'{"sequences": [[[1]]], "extra": 1}', b'{"sequence\\u0073": [[[1]]]}',
        b'{"sequences": [[[1]]], "model": "a\\"b"}', b'{"sequences": [[[1]]], "model": 3}',
        b'{"sequences": [[[1]]], "model": "\xff"}', b'{"sequences": [[[1]]], "model": "a\nb"}',
        b'{"sequences": [[[1]]], "model": nul}', b'{"sequences": [[[1\x0c]]]}',
        b'{"sequences" [[[1]]]}', b'{sequences: [[[1]]]}', b'{"inputs": [[[1]]]}',
    ],
)  # fmt: skip
def test_off_the_happy_path_declines(body: bytes) -> None:
    assert bodies.decode(body, None, "sequences", LIMITS) is None
    assert bodies.decode(body, "application/json", "sequences", LIMITS) is None


def test_field_name_follows_the_endpoint() -> None:
    body = b'{"model": "traveller", "inputs": [[[1, 2, 3, 4, 5, 6]]]}'
    decoded = bodies.decode(body, None, "inputs", LIMITS)
    assert decoded is not None
    assert decoded.model == "traveller"
    ref = to_arrays(parse_body(body, RolloutRequest, "inputs")[1], "inputs", 6, LIMITS, "t")
    assert decoded.sequences(6, "traveller").data.tobytes() == ref[0].tobytes()


@pytest.mark.parametrize(
    ("body", "width", "limits"),
    [
        (b'{"sequences": [[[1e39, 1]], [[2, -1e39]]]}', 2, LIMITS),  # float32 overflow
        (b'{"sequences": [[[1, 2]], [[2, 3], [4, 3.5e38]]]}', 2, LIMITS),
        (b'{"sequences": [[[1, 2]], [[2, 3]]]}', 3, LIMITS),  # wrong width
        (b'{"sequences": [[[1]], [[2]], [[3]]]}', 1, Limits(2, 10, 10)),
        (b'{"sequences": [[[1]], [[2], [2], [2]], [[3], [3], [3]]]}', 1, Limits(5, 2, 10)),
        (b'{"sequences": [[[1]], [[2], [2]], [[3], [3]]]}', 1, Limits(5, 5, 4)),
        (b'{"sequences": [[[1e39]], [[2], [2]], [[3], [3]]]}', 1, Limits(5, 5, 4)),  # 413 first
        (b'{"sequences": [[[1e39]]]}', 3, LIMITS),  # width first
        (b'{"sequences": [[[1, 12345678901234567890123456789e20]]]}', 2, LIMITS),  # long, big
    ],
)
def test_errors_equal_the_precise_path(body: bytes, width: int, limits: Limits) -> None:
    got = fast(body, width, limits)
    want = precise(body, width, limits)
    assert isinstance(want, RequestError)
    assert isinstance(got, RequestError), got
    assert got.body() == want.body()
    assert status_of(got.type) == status_of(want.type)


def test_big_body_with_long_numbers() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 30, 4))
    text = orjson.dumps({"sequences": x.tolist()}).decode()
    text = text.replace("1,", "1000000000000000000000001,")  # some > 19 digits
    body = text.encode()
    assert same(fast(body, 4), precise(body, 4))


# -- safetensors, content negotiation -----------------------------------------------------------


def test_encode_safetensors_is_read_by_the_library() -> None:
    from safetensors.numpy import load

    data = np.arange(12, dtype=np.float32).reshape(6, 2)
    lengths = np.array([1, 5], np.int64)
    raw = bodies.encode_safetensors({"sequences": data, "lengths": lengths}, {"model": "m"})
    loaded = load(raw)
    assert np.array_equal(loaded["sequences"], data)
    assert np.array_equal(loaded["lengths"], lengths)
    decoded = bodies.decode(raw, bodies.SAFETENSORS, "sequences", LIMITS)
    assert decoded is not None
    assert decoded.model == "m"
    assert np.array_equal(decoded.sequences(2, "m").data, data)


def test_content_type() -> None:
    assert bodies.is_safetensors("application/x-safetensors")
    assert bodies.is_safetensors("Application/X-Safetensors; charset=binary")
    assert not bodies.is_safetensors("application/json")
    assert not bodies.is_safetensors(None)


def test_first_non_finite_finds_the_first_nan_or_infinity() -> None:
    from rnnserve.service.codec.bodies import _first_non_finite

    x = np.random.default_rng(3).standard_normal(20_000).astype(np.float32)
    assert _first_non_finite(x) == -1
    for bad in (np.nan, np.inf, -np.inf):
        for at in (0, 4095, 4096, 12_345, 19_999):
            y = x.copy()
            y[at] = bad
            y[min(at + 7, 19_999)] = np.nan  # a later one does not hide the first
            assert _first_non_finite(y) == at


def test_a_read_body_holds_only_its_numbers_and_finishing_copies_nothing() -> None:
    """The numbers are cut out of the room the reader had (one float per two bytes of body)
    where the body is read, on a codec thread for a large one; the model's checks on the event
    loop then copy nothing."""
    rows = ",".join(f"[{i}.5, -{i}.25]" for i in range(300))
    decoded = bodies.decode(f'{{"sequences": [[{rows}]]}}'.encode(), None, "sequences", LIMITS)
    assert decoded is not None
    first = decoded.sequences(2, "m").data
    assert first.shape == (300, 2)
    base = first.base if first.base is not None else first
    assert base.nbytes == first.nbytes  # not the ~3,000 floats of room
    assert np.shares_memory(first, decoded.sequences(2, "m").data)
    np.testing.assert_array_equal(first[7], [7.5, -7.25])
