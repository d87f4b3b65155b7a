"""Request parsing and input checks for the HTTP layer.

Every problem becomes a :class:`RequestError` with a type and a message that says what is
wrong and where (sequence, step, feature), never echoing the input back.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from rnnserve.service.codec import bodies
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH, Endpoint
from rnnserve.service.interface import FlatSequences, Limits, RequestError, quote

# Strict: no strings or booleans posing as numbers; NaN and Infinity literals are refused.
Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
Step = Annotated[list[Number], Field(min_length=1, fail_fast=True)]
Sequence = Annotated[list[Step], Field(min_length=1, fail_fast=True)]
Sequences = Annotated[list[Sequence], Field(min_length=1, fail_fast=True)]


class SmoothRequest(BaseModel):
    """``POST /smooth``: N sequences of T_i steps of F features each."""

    model_config = ConfigDict(extra="forbid")
    sequences: Sequences = Field(description="N sequences, each [T_i][F] numbers")
    model: str | None = Field(None, description="model name (default: smoother)")


class RolloutRequest(BaseModel):
    """``POST /rollout``: N sequences of T_i steps of num_inputs exogenous inputs each."""

    model_config = ConfigDict(extra="forbid")
    inputs: Sequences = Field(description="N sequences, each [T_i][num_inputs] numbers")
    model: str | None = Field(None, description="model name (default: traveller)")


class SmoothResponse(BaseModel):
    model: str
    sequences: list[list[list[float]]]


class RolloutResponse(BaseModel):
    model: str
    positions: list[list[list[float]]]


class InferRequest(BaseModel):
    """``POST /models/{name}/infer``: N sequences of T_i steps of the model's input features."""

    model_config = ConfigDict(extra="forbid")
    inputs: Sequences = Field(description="N sequences, each [T_i][input features] numbers")
    model: str | None = Field(None, description="optional; if given, must equal the path's name")


class InferResponse(BaseModel):
    model: str
    outputs: list[list[list[float]]] = Field(description="N sequences, each [T_i][outputs]")


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
    return fields["model"], fields[field]


def _from_pydantic(exc: pydantic.ValidationError, field: str) -> RequestError:
    err = exc.errors(include_url=False, include_input=False, include_context=False)[0]
    # a key of the body's (an unknown field) is the client's text: quoted in short
    loc = tuple(quote(p) if isinstance(p, str) else p for p in err["loc"])
    kind = err["type"]
    if kind == "json_invalid":
        msg = str(err["msg"])
        return RequestError("invalid_json", f"body is not valid JSON: {msg}")
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


@dataclass
class FlatNumbers:
    """A body's sequences as three flat arrays: every number in order (float64, as parsed),
    the steps of each sequence and the numbers of each step. Compact where nested lists of
    Python floats take tens of bytes a number, and cheap to send between processes."""

    numbers: np.ndarray  # float64 [total numbers]
    steps: np.ndarray  # int64 [N]
    widths: np.ndarray  # int64 [sum T_i]

    @classmethod
    def of(cls, sequences: list[list[list[float]]]) -> FlatNumbers:
        steps = np.fromiter((len(seq) for seq in sequences), np.int64, len(sequences))
        all_steps = list(itertools.chain.from_iterable(sequences))
        widths = np.fromiter((len(step) for step in all_steps), np.int64, len(all_steps))
        numbers = np.fromiter(
            itertools.chain.from_iterable(all_steps), np.float64, int(widths.sum())
        )
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
