"""The Open Inference Protocol's codec: JSON and binary tensors in, the layouts of sequences,
and the answer's parts."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest

from rnnserve.service.codec import kserve_binary as kb
from rnnserve.service.interface import FlatSequences, Limits, RequestError

LIMITS = Limits(max_sequences=4, max_sequence_length=10, max_timesteps=20)


def _binary(doc: dict[str, Any], *blobs: bytes) -> tuple[bytes, str]:
    header = orjson.dumps(doc)
    return header + b"".join(blobs), str(len(header))


def _entry(name: str, datatype: str, shape: list[int], size: int) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape,
            "parameters": {"binary_data_size": size}}  # fmt: skip


def test_binary_tensors_are_little_endian_and_read_in_order() -> None:
    body, n = _binary(
        {"inputs": [_entry("x", "FP32", [2], 8), _entry("lengths", "INT64", [1], 8)]},
        struct.pack("<2f", 1.5, -2.0),
        struct.pack("<q", 2),
    )
    request = kb.decode_request(body, n)
    np.testing.assert_array_equal(request.inputs["x"].array, [1.5, -2.0])
    np.testing.assert_array_equal(request.inputs["lengths"].array, [2])
    assert request.inputs["x"].array.flags.aligned


def test_nested_and_flat_json_data_read_the_same() -> None:
    flat = {"name": "x", "datatype": "FP32", "shape": [1, 2, 2], "data": [1, 2, 3, 4]}
    nested = {**flat, "data": [[[1, 2], [3, 4]]]}
    a = kb.decode_request(orjson.dumps({"inputs": [flat]}), None).inputs["x"].array
    b = kb.decode_request(orjson.dumps({"inputs": [nested]}), None).inputs["x"].array
    np.testing.assert_array_equal(a, b)
    assert (a.dtype, a.shape) == (np.float32, (1, 2, 2))


@pytest.mark.parametrize(
    ("data", "datatype"),
    [("[true, false]", "FP32"), ('["1", "2"]', "FP32"), ("[null, 1]", "FP32"),
     ("[1.5, 2]", "INT64"), ("[[1], [2, 3]]", "FP32"), ("[1180591620717411303424, 1]", "INT64"),
     # numpy would read a bool among numbers as 1 or 0
     ("[0.5, true]", "FP32"), ("[[false], [1.5]]", "FP32"), ("[true, 1]", "INT64")],
)  # fmt: skip
def test_json_data_of_another_type_is_refused(data: str, datatype: str) -> None:
    tensor = f'{{"name": "x", "datatype": "{datatype}", "shape": [2], "data": {data}}}'
    with pytest.raises(RequestError) as err:
        kb.decode_request(f'{{"inputs": [{tensor}]}}'.encode(), None)
    assert err.value.type == "not_a_number"


@pytest.mark.parametrize(
    ("header_length", "kind"),
    [("x", "invalid_header"), ("-1", "invalid_header"), ("99999", "invalid_header"),
     ("\u00b2", "invalid_header"), ("1\u00b9", "invalid_header")],  # digits, not ASCII ones
)  # fmt: skip
def test_a_bad_header_length_is_an_invalid_header(header_length: str, kind: str) -> None:
    with pytest.raises(RequestError) as err:
        kb.decode_request(b"{}", header_length)
    assert err.value.type == kind


def test_binary_size_must_match_shape_and_datatype() -> None:
    body, n = _binary({"inputs": [_entry("x", "FP32", [3], 8)]}, b"\0" * 8)
    with pytest.raises(RequestError, match="12 bytes"):
        kb.decode_request(body, n)


def _request(*tensors: kb.Tensor) -> kb.Request:
    return kb.Request(None, {t.name: t for t in tensors}, None, False)


def _fp32(name: str, shape: tuple[int, ...]) -> kb.Tensor:
    array = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    return kb.Tensor(name, "FP32", shape, array)


def test_batched_input_is_n_sequences_of_t_steps() -> None:
    seqs, layout = kb.sequences(_request(_fp32("x", (2, 3, 4))), "x", 4, LIMITS, "m")
    assert layout == kb.Layout(batched=True, steps=3)
    assert seqs.lengths.tolist() == [3, 3]
    np.testing.assert_array_equal(seqs[1], np.arange(12, 24, dtype=np.float32).reshape(3, 4))


def test_flat_input_follows_its_lengths() -> None:
    lengths = kb.Tensor("lengths", "INT64", (2,), np.array([1, 4], np.int64))
    seqs, layout = kb.sequences(_request(_fp32("x", (5, 4)), lengths), "x", 4, LIMITS, "m")
    assert not layout.batched
    assert [len(s) for s in seqs] == [1, 4]


@pytest.mark.parametrize(
    ("shape", "lengths", "kind"),
    [((1, 11, 4), None, "sequence_too_long"), ((5, 3, 4), None, "too_many_sequences"),
     ((3, 4), [3, 0], "empty"), ((3, 4), [2, 2], "wrong_lengths"), ((1, 3, 5), None,
     "wrong_feature_count"), ((3, 4), None, "wrong_shape")],
)  # fmt: skip
def test_sequences_are_checked_like_the_native_bodies(
    shape: tuple[int, ...], lengths: list[int] | None, kind: str
) -> None:
    tensors = [_fp32("x", shape)]
    if lengths is not None:
        tensors.append(kb.Tensor("lengths", "INT64", (len(lengths),), np.array(lengths)))
    with pytest.raises(RequestError) as err:
        kb.sequences(_request(*tensors), "x", 4, LIMITS, "m")
    assert err.value.type == kind


def test_an_answer_with_binary_outputs_is_a_header_then_the_raw_data() -> None:
    out = FlatSequences(np.arange(6, dtype=np.float32).reshape(3, 2), np.array([1, 2], np.int64))
    tensors = kb.answer_tensors(out, kb.Layout(batched=False), "y")
    request = kb.Request("r", {}, {"y": True, "lengths": False}, False)
    parts, header_length = kb.encode_answer("m", "v1", "r", kb.chosen_outputs(request, tensors))
    header = orjson.loads(parts[0])
    assert header_length == len(parts[0])
    assert header["id"] == "r"
    assert header["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}},
        {"name": "lengths", "datatype": "INT64", "shape": [2], "data": [1, 2]},
    ]
    assert bytes(parts[1]) == struct.pack("<6f", *range(6))


def test_a_json_answer_has_no_header_length() -> None:
    out = FlatSequences(np.ones((2, 1), np.float32), np.array([2], np.int64))
    tensors = kb.answer_tensors(out, kb.Layout(batched=True, steps=2), "y")
    parts, header_length = kb.encode_answer("m", "v1", None, kb.chosen_outputs(_request(), tensors))
    assert header_length is None
    assert orjson.loads(parts[0])["outputs"] == [
        {"name": "y", "datatype": "FP32", "shape": [1, 2, 1], "data": [1.0, 1.0]}
    ]


@pytest.mark.parametrize("shape", [[2**32, 2**32, 0], [0, 2**40], [-1, 2], [1.5], [True]])
def test_a_shape_of_impossible_sizes_is_refused_without_wrapping_around(shape: list[Any]) -> None:
    body, n = _binary({"inputs": [_entry("x", "FP32", shape, 0)]})
    with pytest.raises(RequestError) as err:
        kb.decode_request(body, n)
    assert err.value.type == "wrong_shape"


def test_a_shape_whose_sizes_multiply_past_64_bits_is_no_empty_tensor() -> None:
    body, n = _binary({"inputs": [_entry("x", "FP32", [2**31 - 1] * 3, 0)]})
    with pytest.raises(RequestError, match="binary_data_size must be"):
        kb.decode_request(body, n)


# -- the carried state ----------------------------------------------------------------------------

TIE = {"state_model": "m", "state_version": "v1"}


def _with(params: dict[str, Any], *tensors: kb.Tensor, outputs: Any = None) -> kb.Request:
    return kb.Request(None, {t.name: t for t in tensors}, outputs, False, params)


def test_state_inputs_and_their_tie_are_the_state_asked_and_not_sequences() -> None:
    x, s = _fp32("x", (2, 3, 4)), _fp32("state.s", (2, 4))
    request = _with({**TIE, "return_state": True}, x, s)
    seqs, _ = kb.sequences(request, "x", 4, LIMITS, "m")  # state.s is no unknown input
    assert len(seqs) == 2
    asked = kb.state_asked(request)
    assert (asked.return_state, asked.model, asked.version, asked.binary) == (True, "m", "v1", True)
    assert list(asked.parts or {}) == ["s"]
    np.testing.assert_array_equal(asked.parts["s"], s.array)  # type: ignore[index]
    with pytest.raises(RequestError, match="no input 'y'"):
        kb.sequences(_with({}, x, _fp32("y", (2,))), "x", 4, LIMITS, "m")


@pytest.mark.parametrize(
    ("params", "outputs", "returned"),
    [({}, None, False), ({"return_state": True}, None, True), ({"return_state": False}, None,
     False), ({}, {"y": None}, False), ({}, {"state.h": True}, True)],
)  # fmt: skip
def test_the_final_state_is_asked_by_the_parameter_or_by_naming_its_outputs(
    params: dict[str, Any], outputs: Any, returned: bool
) -> None:
    asked = kb.state_asked(_with(params, _fp32("x", (1, 2, 4)), outputs=outputs))
    assert (asked.return_state, asked.parts) == (returned, None)


@pytest.mark.parametrize(
    ("params", "kind", "words"),
    [({"state_version": "v1"}, "missing", "'state_model' is required"),
     ({"state_model": "m"}, "missing", "'state_version' is required"),
     ({**TIE, "state_model": 3}, "string_type", "'state_model' must be a string"),
     ({**TIE, "return_state": "true"}, "invalid_request", "true or false")],
)  # fmt: skip
def test_a_state_without_its_tie_or_with_bad_parameters_is_refused(
    params: dict[str, Any], kind: str, words: str
) -> None:
    with pytest.raises(RequestError, match=words) as err:
        kb.state_asked(_with(params, _fp32("x", (1, 2, 4)), _fp32("state.s", (1, 4))))
    assert err.value.type == kind


def test_an_int64_state_input_is_a_wrong_dtype() -> None:
    s = kb.Tensor("state.s", "INT64", (1, 4), np.zeros((1, 4), np.int64))
    with pytest.raises(RequestError) as err:
        kb.state_asked(_with(TIE, _fp32("x", (1, 2, 4)), s))
    assert err.value.type == "wrong_dtype"


def _answer_with_state() -> FlatSequences:
    from rnnserve.service.interface import CarriedState

    h = np.arange(12, dtype=np.float32).reshape(2, 3, 2)
    state = CarriedState("m", "v2", {"h": h, "p": np.ones((2, 2), np.float32)})
    return FlatSequences(np.zeros((3, 1), np.float32), np.array([1, 2], np.int64), state)


def test_the_final_state_is_named_outputs_and_its_tie_the_answers_parameters() -> None:
    out = _answer_with_state()
    tensors = kb.answer_tensors(out, kb.Layout(batched=False), "y")
    assert [(t.name, t.shape) for t in tensors] == [
        ("y", (3, 1)), ("lengths", (2,)), ("state.h", (2, 3, 2)), ("state.p", (2, 2)),
    ]  # fmt: skip
    request = _with({"return_state": True}, outputs={"y": False})
    chosen = kb.chosen_outputs(request, tensors)  # named y: the state comes too, as asked
    assert [(t.name, binary) for t, binary in chosen] == [
        ("y", False), ("state.h", False), ("state.p", False),
    ]  # fmt: skip
    params = kb.state_parameters(out.state)
    parts, _ = kb.encode_answer("m", "v2", None, chosen, params)
    doc = orjson.loads(parts[0])
    assert doc["parameters"] == {"state_model": "m", "state_version": "v2"}
    assert doc["outputs"][1]["data"] == list(range(12))
    assert kb.state_parameters(None) is None
    plain, _ = kb.encode_answer("m", "v2", None, chosen[:1])
    assert "parameters" not in orjson.loads(plain[0])
