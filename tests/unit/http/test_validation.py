"""Request parsing and checks, without HTTP: each refusal's status, type, location and message."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from rnnserve.service.http.errors import status as status_of
from rnnserve.service.http.validation import RolloutRequest, SmoothRequest, parse_body, to_arrays
from rnnserve.service.interface import Limits, RequestError

LIMITS = Limits(max_sequences=3, max_sequence_length=4, max_timesteps=6)


def refused(body: bytes, schema: type = RolloutRequest, field: str = "inputs") -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body, schema, field)
    return info.value


def test_parse_body_returns_the_model_and_the_numbers() -> None:
    name, seqs = parse_body(b'{"inputs": [[[1, 2.5]], [[3, 4], [5, 6]]]}', RolloutRequest, "inputs")
    assert name is None
    assert seqs == [[[1.0, 2.5]], [[3.0, 4.0], [5.0, 6.0]]]
    name, seqs = parse_body(b'{"sequences": [[[0.5]]], "model": "s2"}', SmoothRequest, "sequences")
    assert (name, seqs) == ("s2", [[[0.5]]])


@pytest.mark.parametrize(
    ("literal", "loc"),
    [("NaN", ("inputs", 0, 1, 0)), ("Infinity", ("inputs", 0, 1, 0)),
     ("-Infinity", ("inputs", 0, 1, 0)), ("1e999", ("inputs", 0, 1, 0))],
)  # fmt: skip
def test_non_finite_numbers_are_refused_while_parsing(literal: str, loc: tuple[object]) -> None:
    # parse_body itself refuses them: the float32 range check later is a second line, not the first
    err = refused(b'{"inputs": [[[1], [%s]]]}' % literal.encode())
    assert (status_of(err.type), err.type, err.loc) == (422, "non_finite", loc)
    assert err.message == "sequence 0, step 1, feature 0: value is not a finite number"


@pytest.mark.parametrize(
    ("body", "status", "kind", "loc", "message"),
    [
        (b"{", 400, "invalid_json", (), "body is not valid JSON: "),
        (b'{"inputs": []}', 422, "empty", ("inputs",), "'inputs' holds no sequences"),
        (b'{"inputs": [[[1]], []]}', 422, "empty", ("inputs", 1), "sequence 1 has no steps"),
        (b'{"inputs": [[[1], []]]}', 422, "empty", ("inputs", 0, 1),
         "sequence 0, step 1 has no features"),
        (b'{"inputs": [[[1, "2"]]]}', 422, "not_a_number", ("inputs", 0, 0, 1),
         "sequence 0, step 0, feature 1: value is not a number"),
        (b'{"inputs": [[[1, true]]]}', 422, "not_a_number", ("inputs", 0, 0, 1),
         "sequence 0, step 0, feature 1: value is not a number"),
        (b'{"inputs": 1}', 422, "wrong_shape", ("inputs",), "'inputs' must be a list of sequences"),
        (b'{"inputs": [1]}', 422, "wrong_shape", ("inputs", 0),
         "sequence 0: expected a list of steps"),
        (b'{"inputs": [[1]]}', 422, "wrong_shape", ("inputs", 0, 0),
         "sequence 0, step 0: expected a list of features"),
        (b"{}", 422, "missing", ("inputs",), "'inputs' is required"),
        (b'{"inputs": [[[1]]], "x": {}}', 422, "unknown_field", ("x",), "unknown field 'x'"),
        (b'{"inputs": [[[1]]], "model": 1}', 422, "string_type", ("model",),
         "model: Input should be a valid string"),
        (b"[]", 422, "invalid_body", (),
         'the body must be a JSON object such as {"inputs": [...]}, not a list or a single value'),
    ],
)  # fmt: skip
def test_each_refusal_says_what_and_where(
    body: bytes, status: int, kind: str, loc: tuple[object, ...], message: str
) -> None:
    err = refused(body)
    assert (status_of(err.type), err.type, err.loc) == (status, kind, loc)
    assert err.message.startswith(message), err.message
    assert err.body() == {"detail": err.message, "type": kind, "loc": list(loc)}
    assert str(err) == err.message


def test_invalid_json_says_where_the_parser_stopped() -> None:
    err = refused(b'{"inputs": [1,]}')
    assert err.message == "body is not valid JSON: Invalid JSON: trailing comma at line 1 column 15"


def test_refusals_do_not_echo_the_input() -> None:
    secret = "9" * 40
    for body in (b'{"inputs": [[[1, "%s"]]]}', b'{"inputs": [[[1], [%s, "x"]]]}'):
        err = refused(body % secret.encode())
        assert secret not in err.message


def test_to_arrays_gives_float32_copies_of_the_values() -> None:
    seqs = [[[1.0, 2.0], [3.0, 4.0]], [[0.1, -0.2]]]
    arrays = to_arrays(seqs, "inputs", 2, LIMITS, "m")
    assert [a.dtype for a in arrays] == [np.float32, np.float32]
    np.testing.assert_array_equal(arrays[0], np.array(seqs[0], np.float32))
    np.testing.assert_array_equal(arrays[1], np.array(seqs[1], np.float32))


def test_limits_allow_exactly_the_limit() -> None:
    at_limit = [[[0.0]] * 4, [[0.0]] * 1, [[0.0]] * 1]  # 3 sequences, longest 4, 6 steps
    assert [len(a) for a in to_arrays(at_limit, "inputs", 1, LIMITS, "m")] == [4, 1, 1]


@pytest.mark.parametrize(
    ("seqs", "kind", "loc", "message"),
    [
        ([[[0.0]]] * 4, "too_many_sequences", ("inputs",),
         "request has 4 sequences; the limit is 3"),
        ([[[0.0]], [[0.0]] * 5], "sequence_too_long", ("inputs", 1),
         "sequence 1 has 5 steps; the limit is 4"),
        ([[[0.0]] * 4, [[0.0]] * 3], "too_many_timesteps", ("inputs",),
         "request has 7 timesteps in all; the limit is 6"),
    ],
)  # fmt: skip
def test_one_over_a_limit_is_a_413(
    seqs: list[list[list[float]]], kind: str, loc: tuple[object, ...], message: str
) -> None:
    with pytest.raises(RequestError) as info:
        to_arrays(seqs, "inputs", 1, LIMITS, "m")
    err = info.value
    assert (status_of(err.type), err.type, err.loc, err.message) == (413, kind, loc, message)


@pytest.mark.parametrize(
    ("seqs", "loc", "message"),
    [
        ([[[1.0, 2.0]], [[1.0, 2.0], [1.0]]], ("inputs", 1, 1),
         "sequence 1, step 1: has 1 features; model 'm' takes 2"),
        ([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]], ("inputs", 0, 0),
         "sequence 0, step 0: has 3 features; model 'm' takes 2"),
        ([[[1.0, 2.0], [1.0, 2.0], [1.0, 2.0, 3.0]]], ("inputs", 0, 2),
         "sequence 0, step 2: has 3 features; model 'm' takes 2"),
    ],
)  # fmt: skip
def test_wrong_feature_counts_name_the_step(
    seqs: list[list[list[float]]], loc: tuple[object, ...], message: str
) -> None:
    with pytest.raises(RequestError) as info:
        to_arrays(seqs, "inputs", 2, LIMITS, "m")
    err = info.value
    assert (status_of(err.type), err.type) == (422, "wrong_feature_count")
    assert (err.loc, err.message) == (loc, message)


@pytest.mark.parametrize("bad", [1e39, -1e39, math.inf, math.nan])
def test_values_outside_float32_are_refused(bad: float) -> None:
    seqs = [[[0.0, 0.0]], [[0.0, 0.0], [0.0, bad]]]
    with pytest.raises(RequestError) as info:
        to_arrays(seqs, "inputs", 2, LIMITS, "m")
    err = info.value
    assert (status_of(err.type), err.type, err.loc) == (422, "non_finite", ("inputs", 1, 1, 1))
    assert err.message == "sequence 1, step 1, feature 1: value is outside float32's range"


def test_float32_overflow_is_refused_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # client input must not make the server warn
        with pytest.raises(RequestError, match="outside float32's range"):
            to_arrays([[[1e39]]], "inputs", 1, LIMITS, "m")


def test_largest_float32_passes() -> None:
    big = float(np.finfo(np.float32).max)
    (arr,) = to_arrays([[[big, -big]]], "inputs", 2, LIMITS, "m")
    assert arr.tolist() == [[big, -big]]
