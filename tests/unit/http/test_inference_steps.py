"""The inference steps that need no app: which reader a body takes and what it reads
(``inference._decode``, ``json_reader``); which bodies have their safetensors header checked
on their first bytes (``inference.read_request_body``); a request's carried state, checked
against the model that is to continue it and attached to its sequences
(``inference.carry_state``)."""

from __future__ import annotations

import asyncio
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry, Gauge
from starlette.requests import Request

from rnnserve.service import endpoints
from rnnserve.service.codec import bodies
from rnnserve.service.codec.bodies import StateAsked
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.config import Settings
from rnnserve.service.endpoints import Endpoint
from rnnserve.service.http import auth, inference
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


def _read(body: bytes, ctype: str, reader: str) -> tuple[Any, FlatSequences]:
    """``body`` through the decode step and the sequences step of a smoothing request for a
    model ``m`` of 2 features, with ``json_reader=reader``: what was parsed, and the rows."""
    gauge = Gauge("held", "bytes", registry=CollectorRegistry())
    state = SimpleNamespace(
        metrics=None,
        settings=Settings(json_reader=reader),
        codec=CodecPool(1, 1 << 20),  # a thread, idle: these bodies are read in place
        byte_budget=auth.ByteBudget(1 << 30, gauge),
    )
    scope = {
        "type": "http", "method": "POST", "path": "/smooth", "app": SimpleNamespace(state=state),
        "headers": [(b"content-type", ctype.encode())],
    }  # fmt: skip
    call = inference.Call(Request(scope), endpoints.SMOOTH, None, gauge)

    async def steps() -> tuple[Any, FlatSequences]:
        parsed = await inference._decode(call, body)
        served = SimpleNamespace(input_dim=2)
        return parsed, await inference._arrays(call, body, parsed, "m", served)

    try:
        return asyncio.run(steps())
    finally:
        state.codec.close()


SEQUENCES = [[[0.5, -1.25], [2.0, 0.0]], [[3.5, 1e-3]]]
JSON_BODY = orjson.dumps({"sequences": SEQUENCES, "model": "m"})
BINARY_BODY = bodies.encode_safetensors(
    {
        "sequences": np.asarray([r for s in SEQUENCES for r in s], np.float32),
        "lengths": np.array([2, 1], np.int64),
    },
    {"model": "m", "return_state": "true"},
)


@pytest.fixture
def compiled_reads(monkeypatch: pytest.MonkeyPatch) -> list[str | None]:
    """The content types of the bodies the compiled reader (``bodies.decode``) was given."""
    calls: list[str | None] = []
    real = bodies.decode

    def spy(body: bytes, ctype: str | None, *args: Any) -> Any:
        calls.append(ctype)
        return real(body, ctype, *args)

    monkeypatch.setattr(bodies, "decode", spy)
    return calls


def _as_read(rows: FlatSequences) -> list[Any]:
    return [a.tolist() for a in rows]


@pytest.mark.parametrize(("reader", "compiled"), [("fast", ["application/json"]), ("precise", [])])
def test_a_json_body_reads_alike_with_either_reader_and_only_fast_compiles(
    reader: str, compiled: list[str], compiled_reads: list[str | None]
) -> None:
    parsed, rows = _read(JSON_BODY, "application/json", reader)
    assert compiled_reads == compiled
    assert parsed.model == "m"
    assert parsed.state == StateAsked()
    assert _as_read(rows) == [np.asarray(s, np.float32).tolist() for s in SEQUENCES]


@pytest.mark.parametrize("reader", ["fast", "precise"])
def test_a_safetensors_body_takes_the_compiled_reader_whatever_the_setting(
    reader: str, compiled_reads: list[str | None]
) -> None:
    parsed, rows = _read(BINARY_BODY, bodies.SAFETENSORS, reader)
    assert compiled_reads == [bodies.SAFETENSORS]
    assert parsed.model == "m"
    assert parsed.state == StateAsked(return_state=True)
    assert _as_read(rows) == [np.asarray(s, np.float32).tolist() for s in SEQUENCES]


@pytest.mark.parametrize("reader", ["fast", "precise"])
def test_a_carried_state_and_return_state_are_read_from_a_json_body(reader: str) -> None:
    sent = {"model": "m", "version": "v7", "sequences": [{"s": [1.0, 2.0]}, {"s": [3.0, 4.0]}]}
    body = orjson.dumps({"sequences": SEQUENCES, "state": sent, "return_state": True})
    parsed, rows = _read(body, "application/json", reader)
    assert parsed.model is None
    assert parsed.state == StateAsked(True, "m", "v7", {"s": [[1.0, 2.0], [3.0, 4.0]]})
    assert _as_read(rows) == [np.asarray(s, np.float32).tolist() for s in SEQUENCES]


PAST_ITS_END = struct.pack("<Q", 1 << 20) + b"{}"  # a safetensors header length past the body


def _read_request_body(endpoint: Endpoint, ctype: str) -> bytes:
    """``PAST_ITS_END`` read by the body step of a request to ``endpoint`` with ``ctype``."""
    gauge = Gauge("held", "bytes", registry=CollectorRegistry())
    state = SimpleNamespace(
        metrics=None, settings=Settings(), byte_budget=auth.ByteBudget(1 << 30, gauge)
    )
    headers = [(b"content-type", ctype.encode()), (b"content-length", b"%d" % len(PAST_ITS_END))]
    scope = {
        "type": "http", "method": "POST", "path": endpoint.path, "headers": headers,
        "app": SimpleNamespace(state=state),
    }  # fmt: skip

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": PAST_ITS_END, "more_body": False}

    call = inference.Call(Request(scope, receive), endpoint, None, gauge)
    body: bytes = asyncio.run(inference.read_request_body(call))
    return body


@pytest.mark.parametrize("endpoint", endpoints.INFERENCE)
def test_a_native_safetensors_body_is_refused_on_its_first_8_bytes(endpoint: Endpoint) -> None:
    with pytest.raises(RequestError) as err:
        _read_request_body(endpoint, bodies.SAFETENSORS)
    assert err.value.type == "invalid_safetensors"
    assert "past the end of the body" in err.value.message


@pytest.mark.parametrize(
    ("endpoint", "ctype"),
    [
        (endpoints.SMOOTH, "application/json"),  # not safetensors: read whole, as sent
        (endpoints.KSERVE_INFER, bodies.SAFETENSORS),  # the Open Inference Protocol's own format
    ],
)
def test_other_bodies_are_read_whole_without_a_safetensors_check(
    endpoint: Endpoint, ctype: str
) -> None:
    assert _read_request_body(endpoint, ctype) == PAST_ITS_END


class _Runtime:
    """A runtime serving ``models`` (name -> kind); ``get`` as the real one for a known name."""

    def __init__(self, **models: str) -> None:
        self.models = {n: SimpleNamespace(kind=k) for n, k in models.items()}

    def get(self, name: str) -> Any:
        return self.models[name]


def _choosing(endpoint: Endpoint, runtime: _Runtime, path_model: str | None = None) -> Any:
    state = SimpleNamespace(runtime=runtime, settings=Settings())
    return SimpleNamespace(
        endpoint=endpoint, path_model=path_model, state=state, where=("model",), model_label="?"
    )


@pytest.mark.parametrize(
    ("kind", "other"), [("traveller", "POST /rollout"), ("recurrent", "POST /models/mine/infer")]
)
def test_a_model_of_another_kind_is_refused_with_the_endpoint_that_serves_it(
    kind: str, other: str
) -> None:
    call = _choosing(endpoints.SMOOTH, _Runtime(mine=kind))
    with pytest.raises(RequestError) as err:
        inference.choose_model(call, "mine")
    assert (err.value.type, err.value.loc) == ("wrong_model_kind", ("model",))
    assert err.value.message == f"model 'mine' is a {kind} model; send it to {other}"


def test_the_model_named_in_the_path_is_chosen_and_labels_the_request() -> None:
    call = _choosing(endpoints.INFER, _Runtime(mine="recurrent", other="smoother"), "mine")
    name, served = inference.choose_model(call, None)
    assert (name, served.kind, call.model_label, call.where) == (
        "mine", "recurrent", "mine", ("path", "name")
    )  # fmt: skip
