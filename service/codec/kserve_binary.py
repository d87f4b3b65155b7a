"""Bodies of the Open Inference Protocol (KServe v2, Triton's HTTP/REST): the inference request
and answer in JSON, with the binary tensor data extension.

A binary request is ``Inference-Header-Content-Length`` bytes of JSON, then the raw
little-endian data of each input whose ``parameters`` has ``binary_data_size``, one after
another in the order of ``inputs``. An answer is binary the same way for each output asked
for with ``binary_data`` (or all, with the request's ``binary_data_output``).

A carried state is the optional FP32 inputs and outputs ``state.<part>`` (``[N, *shape]``, the
native binary format's names), tied to the model version that made it by the request's and the
answer's ``parameters`` ``state_model`` and ``state_version``.

docs/KSERVE.md says which inputs and outputs each model kind has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from rnnserve.service.codec import bodies
from rnnserve.service.codec.bodies import STATE_PREFIX, StateAsked
from rnnserve.service.interface import CarriedState, FlatSequences, Limits, RequestError, quote

HEADER_LENGTH = "Inference-Header-Content-Length"
LENGTHS = "lengths"
FP32, INT64 = "FP32", "INT64"
DATATYPES: dict[str, np.dtype[Any]] = {FP32: np.dtype("<f4"), INT64: np.dtype("<i8")}
# the largest size of one dimension: any more is no tensor a body can hold, and numpy's shapes
# must fit its index type
MAX_DIM = 2**31 - 1
# the numpy dtype kinds a JSON ``data`` list may hold for each datatype (no strings, bools)
_JSON_KINDS = {FP32: "iuf", INT64: "iu"}


@dataclass
class Tensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    array: np.ndarray = field(repr=False)


@dataclass
class Request:
    """A decoded inference request: its inputs by name, and how to answer."""

    id: str | None
    inputs: dict[str, Tensor]
    # the outputs asked for, with their own binary_data (None: the request's default); None: all
    outputs: dict[str, bool | None] | None
    binary_output: bool
    parameters: dict[str, Any] = field(default_factory=dict)  # the request's own


def _bad(kind: str, message: str, *loc: str | int) -> RequestError:
    return RequestError(kind, message, loc)


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad("invalid_body", f"{where} must be a JSON object")
    return value


def _split(body: bytes, header_length: str | None) -> tuple[bytes, memoryview]:
    """The JSON header and the binary data after it."""
    if header_length is None:
        return body, memoryview(b"")
    text = header_length.strip()
    if not (text.isascii() and text.isdigit()) or int(text) > len(body):  # not '²'
        raise _bad(
            "invalid_header",
            f"{HEADER_LENGTH} must be a whole number of bytes, at most the body's {len(body)}",
        )
    n = int(text)
    return body[:n], memoryview(body)[n:]


def decode_request(body: bytes, header_length: str | None) -> Request:
    """Read an inference request; the binary data is read in place (copied when unaligned)."""
    header, data = _split(body, header_length)
    try:
        doc = _object(orjson.loads(header), "the inference request")
    except orjson.JSONDecodeError:
        raise _bad("invalid_json", "the inference request header is not JSON") from None
    unknown = set(doc) - {"id", "parameters", "inputs", "outputs"}
    if unknown:
        raise _bad("unknown_field", f"unknown field '{quote(min(unknown))}'", quote(min(unknown)))
    rid = doc.get("id")
    if rid is not None and not isinstance(rid, str):
        raise _bad("string_type", "'id' must be a string", "id")
    params = _object(doc.get("parameters") or {}, "'parameters'")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise _bad("missing", "'inputs' must be a non-empty list of tensors", "inputs")
    inputs: dict[str, Tensor] = {}
    offset = 0
    # numpy reads a JSON true or false among numbers as 1 or 0: looked for where one may be
    bools = b"true" in header or b"false" in header
    for i, raw in enumerate(raw_inputs):
        tensor, offset = _input(_object(raw, f"inputs[{i}]"), i, data, offset, bools)
        if tensor.name in inputs:
            raise _bad(
                "invalid_request", f"input '{quote(tensor.name)}' is given twice", "inputs", i
            )
        inputs[tensor.name] = tensor
    if offset != len(data):
        raise _bad(
            "invalid_request",
            f"the binary data has {len(data)} bytes; the inputs' binary_data_size add to {offset}",
        )  # fmt: skip
    binary_output = params.get("binary_data_output") is True
    return Request(rid, inputs, _outputs(doc.get("outputs")), binary_output, params)


def _input(
    raw: dict[str, Any], i: int, data: memoryview, offset: int, bools: bool
) -> tuple[Tensor, int]:
    name, datatype, shape = raw.get("name"), raw.get("datatype"), raw.get("shape")
    if not isinstance(name, str):
        raise _bad("missing", f"inputs[{i}] needs a 'name' string", "inputs", i, "name")
    if datatype not in DATATYPES:
        raise _bad(
            "wrong_dtype", f"input '{quote(name)}': datatype must be FP32 or INT64", "inputs", i
        )
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DIM for d in shape
    ):
        raise _bad(
            "wrong_shape",
            f"input '{quote(name)}': shape must be a list of sizes up to {MAX_DIM}",
            "inputs",
            i,
        )
    dims = tuple(shape)
    count = math.prod(dims)  # exact: numpy's product of large sizes wraps around
    params = _object(raw.get("parameters") or {}, f"inputs[{i}].parameters")
    size = params.get("binary_data_size")
    if size is not None:
        if "data" in raw:
            raise _bad("invalid_request", f"input '{quote(name)}' has data and binary_data_size")
        array, offset = _binary(name, DATATYPES[datatype], count, size, data, offset)
    elif "data" in raw:
        array = _json_data(name, datatype, count, raw["data"], bools)
    else:
        raise _bad("missing", f"input '{quote(name)}' has neither data nor binary_data_size")
    return Tensor(name, datatype, dims, array.reshape(dims)), offset


def _binary(
    name: str, dtype: np.dtype[Any], count: int, size: Any, data: memoryview, offset: int
) -> tuple[np.ndarray, int]:
    if not isinstance(size, int) or isinstance(size, bool) or size != count * dtype.itemsize:
        raise _bad(
            "wrong_shape",
            f"input '{quote(name)}': binary_data_size must be {count * dtype.itemsize} bytes "
            "for its shape and datatype",
        )  # fmt: skip
    if offset + size > len(data):
        raise _bad("invalid_request", f"input '{quote(name)}': the binary data is cut short")
    array = np.frombuffer(data, dtype, count, offset)
    if not array.flags.aligned:  # the JSON header's length puts it anywhere
        array = array.copy()
    return array, offset + size


def _json_data(name: str, datatype: str, count: int, data: Any, bools: bool) -> np.ndarray:
    """``data``'s numbers (``bools``: the body may hold a JSON true or false somewhere)."""
    bad = _bad("not_a_number", f"input '{quote(name)}': data must be {datatype} numbers")
    try:
        array = np.asarray(data)
    except (ValueError, OverflowError):  # ragged nesting, or an integer past 64 bits
        raise bad from None
    if array.size != count:
        raise _bad(
            "wrong_shape",
            f"input '{quote(name)}': data has {array.size} values; its shape holds {count}",
        )  # fmt: skip
    if count and array.dtype.kind not in _JSON_KINDS[datatype]:
        raise bad
    if bools and _holds_a_bool(data):
        raise bad
    with np.errstate(over="ignore"):  # beyond float32's range: found as non-finite later
        return array.astype(DATATYPES[datatype]).reshape(-1)


def _holds_a_bool(data: Any) -> bool:
    """Whether ``data`` (a number or nested lists, as numpy took them) holds a bool."""
    if not isinstance(data, list):
        return type(data) is bool
    if data and isinstance(data[0], list):
        return any(map(_holds_a_bool, data))
    return bool in set(map(type, data))


def _outputs(raw: Any) -> dict[str, bool | None] | None:
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise _bad("invalid_request", "'outputs' must be a list", "outputs")
    asked: dict[str, bool | None] = {}
    for i, out in enumerate(raw):
        out = _object(out, f"outputs[{i}]")
        name = out.get("name")
        if not isinstance(name, str):
            raise _bad("missing", f"outputs[{i}] needs a 'name' string", "outputs", i, "name")
        binary = _object(out.get("parameters") or {}, f"outputs[{i}].parameters").get("binary_data")
        asked[name] = binary if isinstance(binary, bool) else None
    return asked


# -- the request's tensors as sequences -----------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How the sequences came, so that the answer comes the same way: ``[N, T, F]`` (batched)
    or ``[sum T, F]`` with ``lengths``."""

    batched: bool
    steps: int = 0  # T of a batched request


def sequences(
    request: Request, input_name: str, input_dim: int, limits: Limits, model: str
) -> tuple[FlatSequences, Layout]:
    """The request's sequences for a model taking ``input_dim`` features under ``input_name``
    (its state inputs are :func:`state_asked`'s)."""
    extra = {n for n in request.inputs if not n.startswith(STATE_PREFIX)} - {input_name, LENGTHS}
    if extra:
        name = quote(min(extra))
        raise _bad("unknown_field", f"model '{model}' has no input '{name}'", "inputs", name)
    x = request.inputs.get(input_name)
    if x is None:
        raise _bad("missing", f"model '{model}' needs the input '{input_name}'", "inputs")
    if x.datatype != FP32:
        raise _bad("wrong_dtype", f"input '{input_name}' must be FP32", "inputs", input_name)
    lengths = request.inputs.get(LENGTHS)
    if lengths is None:
        seqs, layout = _batched(x, input_name)
    else:
        seqs, layout = _flat(x, lengths, input_name), Layout(batched=False)
    _check(seqs, input_name, input_dim, limits, model)
    return seqs, layout


def _batched(x: Tensor, input_name: str) -> tuple[FlatSequences, Layout]:
    if len(x.shape) != 3:
        raise _bad(
            "wrong_shape",
            f"input '{input_name}' must be [N, T, F] (or [sum T, F] with a '{LENGTHS}' input)",
            "inputs", input_name,
        )  # fmt: skip
    n, t, f = x.shape
    lengths = np.full(n, t, np.int64)
    return FlatSequences(x.array.reshape(n * t, f), lengths), Layout(batched=True, steps=t)


def _flat(x: Tensor, lengths: Tensor, input_name: str) -> FlatSequences:
    if len(x.shape) != 2:
        raise _bad(
            "wrong_shape", f"with '{LENGTHS}', input '{input_name}' must be [sum T, F]",
            "inputs", input_name,
        )  # fmt: skip
    if lengths.datatype != INT64 or len(lengths.shape) != 1:
        raise _bad(
            "wrong_dtype", f"input '{LENGTHS}' must be INT64 of shape [N]", "inputs", LENGTHS
        )
    steps = lengths.array
    if (steps < 0).any() or int(steps.sum()) != x.shape[0]:
        raise _bad(
            "wrong_lengths",
            f"'{LENGTHS}' must be non-negative and add up to the {x.shape[0]} rows of "
            f"'{input_name}'", "inputs", LENGTHS,
        )  # fmt: skip
    return FlatSequences(x.array, steps)


def _check(seqs: FlatSequences, field: str, input_dim: int, limits: Limits, model: str) -> None:
    steps = seqs.lengths
    if not len(steps) or (steps == 0).any() or seqs.data.shape[1] == 0:
        raise _bad("empty", "no sequences, a sequence without steps or a step without features")
    over = np.flatnonzero(steps > limits.max_sequence_length)
    too_long = (int(over[0]), int(steps[over[0]])) if len(over) else (-1, 0)
    bodies.check_limits(len(steps), too_long, seqs.total, field, limits)
    if seqs.data.shape[1] != input_dim:
        raise _bad(
            "wrong_feature_count",
            f"input '{field}' has {seqs.data.shape[1]} features; model '{model}' takes {input_dim}",
            "inputs", field,
        )  # fmt: skip
    if not seqs.all_finite():
        raise bodies.non_finite_error(seqs, field)


# -- the carried state ----------------------------------------------------------------------------

STATE_MODEL, STATE_VERSION, RETURN_STATE = "state_model", "state_version", "return_state"


def state_asked(request: Request) -> StateAsked:
    """What the request asks of the carried state: the inputs ``state.<part>`` it starts from,
    with the parameters ``state_model`` and ``state_version`` that tie them to the model
    version that made them; the final state, when the parameter ``return_state`` is true or
    an output ``state.<part>`` is asked for. The state itself is checked against the model by
    the native steps (``inference.carry_state``)."""
    return_state = _flag(request.parameters, RETURN_STATE) or any(
        name.startswith(STATE_PREFIX) for name in request.outputs or ()
    )
    parts: dict[str, np.ndarray] = {}
    for name, tensor in request.inputs.items():
        if not name.startswith(STATE_PREFIX):
            continue
        if tensor.datatype != FP32:
            raise _bad("wrong_dtype", f"input '{quote(name)}' must be FP32", "inputs", name)
        parts[name.removeprefix(STATE_PREFIX)] = tensor.array
    if not parts:
        return StateAsked(return_state)
    model = _tie(request.parameters, STATE_MODEL)
    version = _tie(request.parameters, STATE_VERSION)
    return StateAsked(return_state, model, version, parts, binary=True)


def _flag(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key, False)
    if not isinstance(value, bool):
        raise _bad("invalid_request", f"parameter '{key}' must be true or false", "parameters", key)
    return value


def _tie(params: Mapping[str, Any], key: str) -> str:
    value = params.get(key)
    if value is None:
        raise _bad(
            "missing", f"parameter '{key}' is required with the state inputs", "parameters", key
        )
    if not isinstance(value, str):
        raise _bad("string_type", f"parameter '{key}' must be a string", "parameters", key)
    return value


def state_parameters(state: CarriedState | None) -> dict[str, str] | None:
    """An answer's ``parameters`` with a final state: the tie the next request sends back."""
    if state is None:
        return None
    return {STATE_MODEL: state.model, STATE_VERSION: state.version}


# -- the answer -----------------------------------------------------------------------------------


def answer_tensors(outputs: FlatSequences, layout: Layout, output_name: str) -> list[Tensor]:
    """The model's outputs in the layout its inputs came in, then its final state's parts
    ``state.<part>`` ``[N, *shape]`` when it returned one."""
    data = outputs.data
    if layout.batched:
        n, width = len(outputs), data.shape[1]
        shape: tuple[int, ...] = (n, layout.steps, width)
        tensors = [Tensor(output_name, FP32, shape, data)]
    else:
        lengths = np.ascontiguousarray(outputs.lengths, np.int64)
        tensors = [
            Tensor(output_name, FP32, data.shape, data),
            Tensor(LENGTHS, INT64, lengths.shape, lengths),
        ]
    if outputs.state is not None:
        for part, rows in outputs.state.tensors.items():
            tensors.append(Tensor(STATE_PREFIX + part, FP32, tuple(rows.shape), rows))
    return tensors


def chosen_outputs(request: Request, tensors: list[Tensor]) -> list[tuple[Tensor, bool]]:
    """The outputs the request asked for (all when it named none; the final state's too when
    its ``return_state`` is true), each with whether it goes as binary data."""
    by_name = {t.name: t for t in tensors}
    asked: dict[str, bool | None] = dict(request.outputs or dict.fromkeys(by_name))
    if request.outputs and _flag(request.parameters, RETURN_STATE):
        for name in by_name:
            if name.startswith(STATE_PREFIX):
                asked.setdefault(name, None)
    for name in asked:
        if name not in by_name:
            raise _bad("unknown_field", f"no output '{quote(name)}'; there are {sorted(by_name)}")
    return [
        (by_name[name], request.binary_output if binary is None else binary)
        for name, binary in asked.items()
    ]


def encode_answer(
    model: str,
    version: str,
    rid: str | None,
    outputs: list[tuple[Tensor, bool]],
    parameters: dict[str, str] | None = None,
) -> tuple[list[Any], int | None]:
    """The answer's parts (to send one after another), and its JSON header's length when any
    output is binary (``None``: the answer is JSON alone)."""
    entries, blobs = [], []
    for tensor, binary in outputs:
        entry: dict[str, Any] = {
            "name": tensor.name,
            "datatype": tensor.datatype,
            "shape": list(tensor.shape),
        }
        array = np.ascontiguousarray(tensor.array, DATATYPES[tensor.datatype])
        if binary:
            entry["parameters"] = {"binary_data_size": array.nbytes}
            blobs.append(array.reshape(-1))
        else:
            entry["data"] = array.reshape(-1)
        entries.append(entry)
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if rid is not None:
        doc["id"] = rid
    if parameters:
        doc["parameters"] = parameters
    header = orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY)
    return [header, *blobs], (len(header) if blobs else None)
