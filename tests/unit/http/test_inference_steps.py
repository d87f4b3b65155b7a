"""The inference steps that need no app: a request's carried state, checked against the model
that is to continue it and attached to its sequences (``inference.carry_state``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from rnnserve.service.codec.bodies import StateAsked
from rnnserve.service.http import inference
from rnnserve.service.interface import FlatSequences, RequestError

# two sequences of 3 features: the state (when one is carried) has one row each
ROWS = [np.arange(6, dtype=np.float32).reshape(2, 3), np.full((1, 3), 0.5, np.float32)]
CARRIES = SimpleNamespace(kind="traveller", version="v7", state_shapes={"h": (2,), "p": (1,)})
STATELESS = SimpleNamespace(kind="smoother", version="v1", state_shapes={})
UNSAID = SimpleNamespace(kind="smoother", version="v1")  # a served object without state_shapes
STATE = {"h": [[0.5, -1.0], [2.0, 0.25]], "p": [[3.0], [4.0]]}


def _sequences() -> FlatSequences:
    return FlatSequences.from_arrays(ROWS)


def _same_rows(got: Any) -> None:
    assert [a.tolist() for a in got] == [a.tolist() for a in ROWS]


@pytest.mark.parametrize("served", [CARRIES, STATELESS, UNSAID])
def test_a_request_that_asks_nothing_of_the_state_goes_on_as_it_is(served: Any) -> None:
    got = inference.carry_state(_sequences(), StateAsked(), "m", served)
    _same_rows(got)
    assert got.state is None
    assert got.return_state is False


@pytest.mark.parametrize("return_state", [True, False])
def test_a_carried_state_is_attached_to_the_sequences_with_the_models_version(
    return_state: bool,
) -> None:
    asked = StateAsked(return_state=return_state, model="m", version="v7", parts=STATE)
    got = inference.carry_state(_sequences(), asked, "m", CARRIES)
    _same_rows(got)
    assert got.return_state is return_state
    assert (got.state.model, got.state.version) == ("m", "v7")
    assert {k: v.tolist() for k, v in got.state.tensors.items()} == STATE
    assert {k: v.dtype for k, v in got.state.tensors.items()} == {"h": np.float32, "p": np.float32}


def test_asking_for_the_final_state_alone_starts_from_the_models_own() -> None:
    got = inference.carry_state(_sequences(), StateAsked(return_state=True), "m", CARRIES)
    _same_rows(got)
    assert got.return_state is True
    assert got.state is None


def test_a_carried_state_is_checked_against_the_sequences_it_continues() -> None:
    asked = StateAsked(model="m", version="v7", parts={"h": STATE["h"][:1], "p": STATE["p"][:1]})
    with pytest.raises(RequestError) as err:
        inference.carry_state(_sequences(), asked, "m", CARRIES)
    assert (err.value.type, err.value.loc) == ("wrong_shape", ("state", "sequences"))
    assert err.value.message == "'state.sequences' holds 1 states; the request has 2 sequences"


@pytest.mark.parametrize(
    ("asked", "loc"),
    [
        (StateAsked(model="m", version="v1", parts={"s": [[1.0], [2.0]]}), ("state",)),
        (StateAsked(return_state=True), ("return_state",)),
    ],
)
@pytest.mark.parametrize("served", [STATELESS, UNSAID])
def test_a_model_that_carries_no_state_refuses_one_where_it_was_asked(
    asked: StateAsked, loc: tuple[str, ...], served: Any
) -> None:
    with pytest.raises(RequestError) as err:
        inference.carry_state(_sequences(), asked, "m", served)
    assert (err.value.type, err.value.loc) == ("cannot_carry_state", loc)
    assert err.value.message == "model 'm' (smoother) carries no state between requests"
