"""Request parsing and input checks for the HTTP layer.

Every problem becomes a :class:`RequestError` with a type and a message that says what is
wrong and where (sequence, step, feature), never echoing the input back.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from rnnserve.service.codec import bodies
from rnnserve.service.codec.bodies import StateAsked
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH, Endpoint
from rnnserve.service.interface import (
    CarriedState,
    FlatSequences,
    Limits,
    RequestError,
    quote,
)

# Strict: no strings or booleans posing as numbers; NaN and Infinity literals are refused.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Step = Annotated[list[Number], Field(min_length=1, fail_fast=True)]
Sequence = Annotated[list[Step], Field(min_length=1, fail_fast=True)]
Sequences = Annotated[list[Sequence], Field(min_length=1, fail_fast=True)]
Row = Annotated[list[Number], Field(fail_fast=True)]
Layers = Annotated[list[Row], Field(fail_fast=True)]


class SequenceState(BaseModel):
    """One sequence's carried state: the parts its model has (docs/API.md, "Carried state")."""

    model_config = ConfigDict(extra="forbid")
    h: Layers | None = Field(
        None, description="Traveller and recurrent models: every layer's h, [layers][hidden]"
    )
    c: Layers | None = Field(
        None, description="Traveller and LSTM models: every layer's c, [layers][hidden]"
    )
    p: Row | None = Field(None, description="Traveller: the last position [x, y]")
    s: Row | None = Field(None, description="smoother: the smoothed value of each feature, [F]")


class State(BaseModel):
    """Where each sequence starts: the final state an earlier answer of the same model version
    returned (``"return_state": true``), sent back as it came."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(description="the model that made the state")
    version: str = Field(description="that model's version (GET /models): its fingerprint")
    sequences: list[SequenceState] = Field(
        min_length=1, description="one state per sequence of the request, in its order"
    )


STATE_FIELD = Field(None, description="start each sequence from this state (docs/API.md)")
RETURN_STATE_FIELD = Field(False, strict=True, description="answer each sequence's final state too")


def _inline(node: Any, defs: Mapping[str, Any]) -> Any:
    """``node`` with every ``{"$ref": "#/$defs/X"}`` replaced by ``X`` itself."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/$defs/"):
            return _inline(defs[ref.removeprefix("#/$defs/")], defs)
        return {k: _inline(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, defs) for v in node]
    return node


class _Inlined(BaseModel):
    """A request schema without ``$defs``: the routes put it inside the OpenAPI document, where
    ``#/$defs/...`` would point at the document's root, not at the schema's own."""

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        schema = super().model_json_schema(*args, **kwargs)
        defs = schema.pop("$defs", {})
        inlined: dict[str, Any] = _inline(schema, defs)
        return inlined


class SmoothRequest(_Inlined):
    """``POST /smooth``: N sequences of T_i steps of F features each."""

    model_config = ConfigDict(extra="forbid")
    sequences: Sequences = Field(description="N sequences, each [T_i][F] numbers")
    model: str | None = Field(None, description="model name (default: smoother)")
    state: State | None = STATE_FIELD
    return_state: bool = RETURN_STATE_FIELD


class RolloutRequest(_Inlined):
    """``POST /rollout``: N sequences of T_i steps of num_inputs exogenous inputs each."""

    model_config = ConfigDict(extra="forbid")
    inputs: Sequences = Field(description="N sequences, each [T_i][num_inputs] numbers")
    model: str | None = Field(None, description="model name (default: traveller)")
    state: State | None = STATE_FIELD
    return_state: bool = RETURN_STATE_FIELD


class SmoothResponse(BaseModel):
    model: str
    sequences: list[list[list[float]]]
    state: State | None = Field(None, description="with return_state: the final states")


class RolloutResponse(BaseModel):
    model: str
    positions: list[list[list[float]]]
    state: State | None = Field(None, description="with return_state: the final states")


class InferRequest(_Inlined):
    """``POST /models/{name}/infer``: N sequences of T_i steps of the model's input features."""

    model_config = ConfigDict(extra="forbid")
    inputs: Sequences = Field(description="N sequences, each [T_i][input features] numbers")
    model: str | None = Field(None, description="optional; if given, must equal the path's name")
    state: State | None = STATE_FIELD
    return_state: bool = RETURN_STATE_FIELD


class InferResponse(BaseModel):
    model: str
    outputs: list[list[list[float]]] = Field(description="N sequences, each [T_i][outputs]")
    state: State | None = Field(None, description="with return_state: the final states")


# each inference endpoint's request and answer schemas
SCHEMAS: dict[Endpoint, tuple[type[BaseModel], type[BaseModel]]] = {
    SMOOTH: (SmoothRequest, SmoothResponse),
    ROLLOUT: (RolloutRequest, RolloutResponse),
    INFER: (InferRequest, InferResponse),
}


def _where(loc: tuple[str | int, ...]) -> str:
    """``('sequences', 3, 17, 2)`` -> ``'sequence 3, step 17, feature 2'``."""
    parts = []
    for name, value in zip(("sequence", "step", "feature"), loc[1:], strict=False):
        parts.append(f"{name} {value}")
    return ", ".join(parts)


_EMPTY = {1: "holds no sequences", 2: "has no steps", 3: "has no features"}


def parse_body(body: bytes, schema: type[BaseModel], field: str) -> tuple[str | None, Any]:
    """Parse and type-check a JSON body; returns ``(model name, nested lists of floats)``."""
    try:
        req = schema.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise _from_pydantic(exc, field) from None
    fields = vars(req)
    sequences = fields[field]
    state, asked = fields.get("state"), fields.get("return_state", False)
    if state is not None or asked:
        sequences = WithState(sequences)
        sequences.state = None if state is None else state.model_dump()
        sequences.return_state = asked
    return fields["model"], sequences


class StateBody(BaseModel):
    """A body's ``state`` alone (``{"state": ...}``), read precisely when the fast reader took
    the rest of the body."""

    model_config = ConfigDict(extra="forbid")
    state: State


def parse_state(body: bytes) -> dict[str, Any]:
    """The ``state`` of a ``{"state": ...}`` body, as ``parse_body`` gives it (State's
    fields), or the :class:`RequestError` that says what is wrong with it."""
    try:
        doc = StateBody.model_validate_json(body)
    except pydantic.ValidationError as exc:
        raise _from_pydantic(exc, "state") from None
    return doc.state.model_dump()


class WithState(list[Any]):
    """Parsed sequences that come with the body's carried-state fields (``FlatNumbers.of``
    keeps them)."""

    state: dict[str, Any] | None = None
    return_state: bool = False


def _from_pydantic(exc: pydantic.ValidationError, field: str) -> RequestError:
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    # a key of the body's (an unknown field) is the client's text: quoted in short
    loc = tuple(quote(p) if isinstance(p, str) else p for p in err["loc"])
    kind = err["type"]
    if kind == "json_invalid":
        msg = str(err["msg"])
        return RequestError("invalid_json", f"body is not valid JSON: {msg}")
    if loc[:1] == ("state",) and kind in _STATE_KINDS:
        return _state_error(kind, loc)
    where = _where(loc) if loc[:1] == (field,) else ""
    path = (
        "".join(
            f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(loc)
        )
        or "body"
    )
    if kind == "too_short" and loc[:1] == (field,):
        what = f"'{field}'" if len(loc) == 1 else where
        return RequestError("empty", f"{what} {_EMPTY[len(loc)]}", loc)
    if kind == "finite_number":
        return RequestError("non_finite", f"{where}: value is not a finite number", loc)
    if kind in ("float_type", "float_parsing") and where:
        return RequestError("not_a_number", f"{where}: value is not a number", loc)
    if kind == "list_type" and where:
        shape = ["a list of sequences", "a list of steps", "a list of features"][len(loc) - 1]
        return RequestError("wrong_shape", f"{where or field}: expected {shape}", loc)
    if kind == "list_type":
        return RequestError("wrong_shape", f"'{field}' must be a list of sequences", loc)
    if kind == "model_type" and not loc:
        return RequestError(
            "invalid_body",
            f'the body must be a JSON object such as {{"{field}": [...]}}, not a list or a '
            "single value",
            loc,
        )
    if kind == "missing":
        return RequestError("missing", f"'{path}' is required", loc)
    if kind == "extra_forbidden":
        return RequestError("unknown_field", f"unknown field '{path}'", loc)
    return RequestError(kind, f"{path}: {err['msg']}", loc)


_STATE_KINDS = {
    "finite_number": ("non_finite", "value is not a finite number"),
    "float_type": ("not_a_number", "value is not a number"),
    "float_parsing": ("not_a_number", "value is not a number"),
    "list_type": ("wrong_shape", "expected a list"),
}


def _state_error(kind: str, loc: tuple[str | int, ...]) -> RequestError:
    error_type, what = _STATE_KINDS[kind]
    return RequestError(error_type, f"{_dotted(loc)}: {what}", loc)


def _dotted(loc: tuple[str | int, ...]) -> str:
    """``('state', 'sequences', 1, 'h', 0)`` -> ``'state.sequences[1].h[0]'``."""
    return "".join(
        f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(loc)
    )


@dataclass
class FlatNumbers:
    """A body's sequences as three flat arrays: every number in order (float64, as parsed),
    the steps of each sequence and the numbers of each step. Compact where nested lists of
    Python floats take tens of bytes a number, and cheap to send between processes."""

    numbers: np.ndarray  # float64 [total numbers]
    steps: np.ndarray  # int64 [N]
    widths: np.ndarray  # int64 [sum T_i]
    state: dict[str, Any] | None = None  # the body's "state", as parsed (State's fields)
    return_state: bool = False

    @classmethod
    def of(cls, sequences: list[list[list[float]]]) -> FlatNumbers:
        steps = np.fromiter((len(seq) for seq in sequences), np.int64, len(sequences))
        all_steps = list(itertools.chain.from_iterable(sequences))
        widths = np.fromiter((len(step) for step in all_steps), np.int64, len(all_steps))
        numbers = np.fromiter(
            itertools.chain.from_iterable(all_steps), np.float64, int(widths.sum())
        )
        if isinstance(sequences, WithState):
            return cls(numbers, steps, widths, sequences.state, sequences.return_state)
        return cls(numbers, steps, widths)


def to_arrays(
    sequences: list[list[list[float]]] | FlatNumbers,
    field: str,
    feat_dim: int,
    limits: Limits,
    model: str,
) -> FlatSequences:
    """Check counts and shapes and return the sequences as float32 ``[T_i, feat_dim]`` rows.
    Errors name the first sequence at fault: its wrong width before its non-finite value."""
    flat = sequences if isinstance(sequences, FlatNumbers) else FlatNumbers.of(sequences)
    over = np.flatnonzero(flat.steps > limits.max_sequence_length)
    too_long = (int(over[0]), int(flat.steps[over[0]])) if over.size else (-1, 0)
    bodies.check_limits(len(flat.steps), too_long, int(flat.steps.sum()), field, limits)
    starts = np.concatenate(([0], np.cumsum(flat.steps)))  # each sequence's first step
    wrong = np.flatnonzero(flat.widths != feat_dim)
    # sequences before the first wrong width are all feat_dim wide: their numbers line up
    first_wrong_seq = len(flat.steps)
    if wrong.size:
        first_wrong_seq = int(np.searchsorted(starts, wrong[0], side="right")) - 1
    good_steps = int(starts[first_wrong_seq])
    with np.errstate(over="ignore"):  # overflow to inf is reported just below
        data = flat.numbers[: good_steps * feat_dim].astype(np.float32).reshape(-1, feat_dim)
    bad = np.flatnonzero(~np.isfinite(data).all(axis=1))
    if bad.size:  # finite in JSON (float64) but out of float32's range
        row = int(bad[0])
        i = int(np.searchsorted(starts, row, side="right")) - 1
        f = int(np.flatnonzero(~np.isfinite(data[row]))[0])
        raise RequestError(
            "non_finite",
            f"sequence {i}, step {row - starts[i]}, feature {f}: value is outside float32's "
            "range",
            (field, i, int(row - starts[i]), f),
        )  # fmt: skip
    if wrong.size:
        t = int(wrong[0] - starts[first_wrong_seq])
        raise RequestError(
            "wrong_feature_count",
            f"sequence {first_wrong_seq}, step {t}: has {int(flat.widths[wrong[0]])} features; "
            f"model '{model}' takes {feat_dim}",
            (field, first_wrong_seq, t),
        )  # fmt: skip
    return FlatSequences(data, flat.steps)


# -- carried state -------------------------------------------------------------------------------


def state_from_json(doc: Mapping[str, Any] | None, return_state: bool) -> StateAsked:
    """The parsed ``state`` field (pydantic's dump of :class:`State`)."""
    if doc is None:
        return StateAsked(return_state)
    sequences = doc["sequences"]
    names = [k for k in ("h", "c", "p", "s") if any(seq.get(k) is not None for seq in sequences)]
    parts = {name: [seq.get(name) for seq in sequences] for name in names}
    return StateAsked(return_state, doc["model"], doc["version"], parts, binary=False)


def carried_state(
    asked: StateAsked,
    model: str,
    version: str,
    shapes: Mapping[str, tuple[int, ...]],
    n_sequences: int,
) -> CarriedState | None:
    """The state a request sends, checked against the model that is to continue it: made by
    it (else ``state_mismatch``), one per sequence, every part of the model's shape, finite."""
    if asked.parts is None:
        return None
    if asked.model != model or asked.version != version:
        raise RequestError(
            "state_mismatch",
            f"the state was made by model '{quote(asked.model)}' version "
            f"'{quote(asked.version)}'; this request goes to '{model}' version '{version}': a "
            "state continues only on the model version that made it",
            ("state", "model" if asked.model != model else "version"),
        )  # fmt: skip
    tensors = {}
    for name, part in asked.parts.items():
        if name not in shapes:
            raise RequestError(
                "unknown_field",
                f"model '{model}' carries no state part '{quote(name)}' (its parts: "
                f"{', '.join(shapes)})",
                _part_loc(name, part, asked.binary),
            )  # fmt: skip
    for name, shape in shapes.items():
        if asked.binary:
            tensors[name] = _binary_part(asked.parts.get(name), name, shape, n_sequences, model)
        else:
            tensors[name] = _json_part(asked.parts.get(name), name, shape, n_sequences, model)
    return CarriedState(model, version, tensors)


def _part_loc(name: str, part: Any, binary: bool) -> tuple[str | int, ...]:
    """Where a state part is: its tensor, or the first sequence whose state holds it."""
    if binary:
        return (quote(bodies.STATE_PREFIX + name),)
    first = next(i for i, row in enumerate(part) if row is not None)
    return ("state", "sequences", first, quote(name))


def _json_part(
    rows: list[Any] | None, name: str, shape: tuple[int, ...], n: int, model: str
) -> np.ndarray:
    if rows is not None and len(rows) != n:
        raise RequestError(
            "wrong_shape",
            f"'state.sequences' holds {len(rows)} states; the request has {n} sequences",
            ("state", "sequences"),
        )  # fmt: skip
    out = np.empty((n, *shape), np.float32)
    for i in range(n):
        row = None if rows is None else rows[i]
        loc: tuple[str | int, ...] = ("state", "sequences", i, name)
        if row is None:
            raise RequestError(
                "missing", f"{_dotted(loc)} is required: model '{model}' carries it", loc
            )
        _check_nested(row, shape, loc)
        with np.errstate(over="ignore"):
            out[i] = np.asarray(row, np.float64).astype(np.float32)
        _check_finite(out[i], loc)
    return out


def _check_nested(row: Any, shape: tuple[int, ...], loc: tuple[str | int, ...]) -> None:
    """``row`` nests lists of exactly ``shape``; else where it does not."""
    if len(row) != shape[0]:
        raise RequestError(
            "wrong_shape", f"{_dotted(loc)}: has {len(row)} entries; expected {shape[0]}", loc
        )
    if len(shape) > 1:
        for j, inner in enumerate(row):
            if not isinstance(inner, list):
                raise RequestError("wrong_shape", f"{_dotted((*loc, j))}: expected a list", loc)
            _check_nested(inner, shape[1:], (*loc, j))


def _check_finite(values: np.ndarray, loc: tuple[str | int, ...]) -> None:
    bad = np.flatnonzero(~np.isfinite(values.reshape(-1)))
    if bad.size:
        at = tuple(int(k) for k in np.unravel_index(int(bad[0]), values.shape))
        where = (*loc, *at)
        raise RequestError("non_finite", f"{_dotted(where)}: value is not finite in float32", where)


def _binary_part(
    tensor: np.ndarray | None, name: str, shape: tuple[int, ...], n: int, model: str
) -> np.ndarray:
    key = "state." + name
    if tensor is None:
        raise RequestError(
            "missing", f"tensor '{key}' is required: model '{model}' carries it", (key,)
        )
    want = (n, *shape)
    if tuple(tensor.shape) != want:
        raise RequestError(
            "wrong_shape",
            f"tensor '{key}' must have shape {list(want)} (one row per sequence), not "
            f"{list(tensor.shape)}",
            (key,),
        )  # fmt: skip
    bad = np.flatnonzero(~np.isfinite(tensor.reshape(n, -1)).all(axis=1))
    if bad.size:
        i = int(bad[0])
        raise RequestError(
            "non_finite", f"tensor '{key}', sequence {i}: holds a value that is not finite",
            (key, i),
        )  # fmt: skip
    return tensor
