"""The HTTP layer's helpers: the JSON and buffer responses, the documented request bodies, the
request ids, and which endpoint an unauthorized request is counted under.

``_body_spec`` runs while the module is imported (in the route decorators), before mutmut
picks a mutant: it is called here so that its own code is judged.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from fastapi import FastAPI
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, Gauge
from safetensors.numpy import save

from rnnserve.service import tracing
from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings
from rnnserve.service.http import auth, errors, inference, responses, routes
from rnnserve.service.http.app import create_app
from rnnserve.service.http.responses import BuffersResponse, json_response
from rnnserve.service.http.streaming import NDJSON
from rnnserve.service.http.validation import InferRequest
from rnnserve.service.interface import (
    BatcherClosed,
    EngineUnavailable,
    FlatSequences,
    NonFiniteInput,
    QueueFull,
    RequestError,
    StateMismatch,
)
from tests.integration.conftest import AppClient
from tests.metrics import value


def refused(body: dict[str, Any], kind: str, loc: list[Any], *words: str) -> None:
    """An error body of ``kind`` at ``loc`` whose message says each of ``words``."""
    assert set(body) == {"detail", "type", "loc"}
    assert (body["type"], body["loc"]) == (kind, loc)
    for word in words:
        assert word in body["detail"], (word, body["detail"])


async def _sent(response: Any) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await response({"type": "http"}, None, send)
    return messages


def test_json_response_writes_numpy_arrays_and_keeps_headers() -> None:
    response = json_response({"a": np.arange(3, dtype=np.int64)}, 503, {"Retry-After": "1"})
    assert response.body == b'{"a":[0,1,2]}'
    assert response.status_code == 503
    assert response.headers["retry-after"] == "1"
    assert response.headers["content-type"] == "application/json"


async def test_buffers_response_sends_its_parts_with_their_total_length() -> None:
    parts = [b"head", np.array([1, -2, 3], np.int8), memoryview(b"")]
    response = BuffersResponse(parts, bodies.SAFETENSORS)
    assert response.headers["content-length"] == "7"
    messages = await _sent(response)
    start = messages[0]
    assert start["type"] == "http.response.start"
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-length"] == b"7"
    assert [k for k, _ in start["headers"]].count(b"content-length") == 1
    assert headers[b"content-type"] == bodies.SAFETENSORS.encode()
    sent = [bytes(m["body"]) for m in messages[1:]]
    assert sent == [b"head", bytes(np.array([1, -2, 3], np.int8)), b""]
    assert [m["more_body"] for m in messages[1:]] == [True, True, False]


def test_body_spec_documents_json_and_safetensors_bodies() -> None:
    assert routes._body_spec(InferRequest) == {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": InferRequest.model_json_schema()},
                bodies.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


async def test_unauthorized_requests_are_counted_by_their_endpoint(app_client: AppClient) -> None:
    async with app_client(api_token="s3cret") as (_, client):
        assert (await client.get("/models")).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        r = await client.get("/metrics", headers=wrong)
        assert r.status_code == 401
        refused(orjson.loads(r.content), "unauthorized", [], "bearer token", "wrong")
        auth = {"Authorization": "Bearer s3cret"}
        assert (await client.get("/models", headers=auth)).status_code == 200
        text = (await client.get("/metrics", headers=auth)).text
    counted = "rnnserve_requests_rejected_total"
    assert value(text, counted, endpoint="models", reason="unauthorized") == 1
    assert value(text, counted, endpoint="metrics", reason="unauthorized") == 1
    assert value(text, counted, endpoint="none", reason="unauthorized") == 0


def test_the_default_model_is_resolved_once_per_app_with_its_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    served = {"a": SimpleNamespace(kind="smoother"), "b": SimpleNamespace(kind="smoother")}
    state = SimpleNamespace(
        runtime=SimpleNamespace(models=served), settings=SimpleNamespace(default_smoother="b")
    )
    calls: list[str] = []
    real = inference.defaults.resolve

    def resolve(models: Any, kind: str, settings: Any) -> str:
        calls.append(kind)
        return real(models, kind, settings)

    monkeypatch.setattr(inference.defaults, "resolve", resolve)
    assert inference._default_model(state, "smoother") == "b"  # the setting, not the first served
    assert inference._default_model(state, "smoother") == "b"
    assert calls == ["smoother"]


def test_the_default_model_is_resolved_again_when_a_reload_replaces_the_models() -> None:
    state = SimpleNamespace(
        runtime=SimpleNamespace(models={"a": SimpleNamespace(kind="smoother")}),
        settings=SimpleNamespace(default_smoother=None),
    )
    assert inference._default_model(state, "smoother") == "a"  # the only one of its kind
    state.runtime.models = {"z": SimpleNamespace(kind="smoother")}
    assert inference._default_model(state, "smoother") == "z"


def test_the_byte_budget_takes_up_to_its_limit_exactly() -> None:
    gauge = Gauge("held_bytes", "test", registry=CollectorRegistry())
    budget = auth.ByteBudget(10, gauge)
    assert budget.take(4)
    assert budget.take(6)  # exactly at the limit: still taken
    assert budget.used == 10
    assert gauge._value.get() == 10
    assert not budget.take(1)
    assert budget.used == 10
    budget.give(7)
    assert budget.used == 3
    assert gauge._value.get() == 3
    assert budget.take(7)
    assert not budget.take(1)


@pytest.mark.parametrize(
    ("kind", "status"),
    [("unauthorized", 401), ("invalid_json", 400), ("body_too_large", 413),
     ("overloaded", 503), ("a_parsers_own_kind", 422)],
)  # fmt: skip
def test_error_response_asks_for_a_bearer_token_on_401_only(kind: str, status: int) -> None:
    exc = RequestError(kind, "what went wrong")
    response = responses.error_response(exc)
    assert response.status_code == status
    answered = kind if kind in errors.CATALOGUE else "invalid_request"
    assert orjson.loads(response.body) == {**exc.body(), "type": answered}
    assert response.headers.get("www-authenticate") == ("Bearer" if status == 401 else None)
    assert response.headers.get("retry-after") == ("1" if status == 503 else None)


def _scope(path: str) -> dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "root_path": "", "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000), "server": ("rnnserve", 80),
    }  # fmt: skip


async def _raw_call(
    app: Any, path: str, body: bytes, gone_after: float, headers: list[tuple[bytes, bytes]]
) -> list[dict[str, Any]]:
    """One ASGI request whose body arrives whole and whose client leaves ``gone_after`` seconds
    later; what the app sent."""
    sent: list[dict[str, Any]] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(gone_after)
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {**_scope(path), "headers": headers}
    await asyncio.wait_for(app(scope, receive, send), 30)
    return sent


async def test_a_body_that_stops_arriving_is_answered_408_at_the_setting(
    app_client: AppClient,
) -> None:
    body = orjson.dumps({"sequences": [[[0.5] * 16] * 3]})
    half = body[:20]
    released = asyncio.Event()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if not sent and not released.is_set():
            released.set()
            return {"type": "http.request", "body": half, "more_body": True}
        await asyncio.sleep(30)  # the rest never comes
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    async with app_client(body_timeout_s=1.0) as (app, _):
        gauge = app.state.metrics.registry.get_sample_value
        call = asyncio.ensure_future(app(_scope("/smooth"), receive, send))
        await released.wait()  # reading the body: the request is in flight, by endpoint
        assert gauge("rnnserve_requests_in_flight", {"endpoint": "smooth"}) == 1
        await asyncio.wait_for(call, 10)
        assert gauge("rnnserve_requests_in_flight", {"endpoint": "smooth"}) == 0
    assert sent[0]["status"] == 408
    refused(orjson.loads(sent[1]["body"]), "body_timeout", [], "did not arrive", "1 s", "20 bytes")


async def test_a_server_not_ready_refuses_with_503(app_client: AppClient) -> None:
    async with app_client() as (app, client):
        app.state.ready = False
        r = await client.post("/smooth", json={"sequences": [[[0.5] * 16]]})
        app.state.ready = True
        text = (await client.get("/metrics")).text
    assert r.status_code == 503
    assert r.headers["retry-after"] == "1"
    refused(r.json(), "not_ready", [], "starting or shutting down")
    assert r.json()["detail"] == "the server is starting or shutting down"  # nothing around it
    assert (
        value(text, "rnnserve_requests_rejected_total", endpoint="smooth", reason="not_ready") == 1
    )


async def test_a_request_refused_before_its_model_is_known_is_labelled_unknown(
    app_client: AppClient,
) -> None:
    async with app_client() as (_, client):
        r = await client.post("/models/smoother/infer", content=b'{"inputs": [[[0.5, oops')
        assert r.status_code == 400  # invalid JSON
        text = (await client.get("/metrics")).text
    count = "rnnserve_request_duration_seconds_count"
    assert value(text, count, endpoint="infer", model="unknown", code="400") == 1
    assert value(text, count, endpoint="infer", code="400") == 1  # and under no other label


def test_request_ids_are_32_hex_digits_and_differ() -> None:
    ids = [inference._request_id(None) for _ in range(300)]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert len(set(ids)) == 300
    assert {i[:16] for i in ids} == {inference._ID_PREFIX}  # the process's own prefix


SMOOTH_BODY = {"inputs": [[[0.5] * 16, [0.25] * 16]]}


async def test_the_model_named_in_the_path(app_client: AppClient) -> None:
    async with app_client() as (_, client):
        plain = await client.post("/models/smoother/infer", json=SMOOTH_BODY)
        same = await client.post(
            "/models/smoother/infer", json={**SMOOTH_BODY, "model": "smoother"}
        )
        other = await client.post(
            "/models/smoother/infer", json={**SMOOTH_BODY, "model": "traveller"}
        )
        long_name = "x" * 70
        longer = await client.post(
            f"/models/{'y' * 70}/infer", json={**SMOOTH_BODY, "model": long_name}
        )
        unknown = await client.post("/models/nope/infer", json=SMOOTH_BODY)
        unknown_in_body = await client.post(
            "/smooth", json={"sequences": [[[0.5] * 16]], "model": "nope"}
        )
        text = (await client.get("/metrics")).text
    assert plain.status_code == same.status_code == 200
    assert plain.json()["model"] == same.json()["model"] == "smoother"
    assert plain.json()["outputs"] == same.json()["outputs"]
    assert other.status_code == 422
    refused(other.json(), "invalid_request", ["model"], "'traveller'", "'smoother'", "leave")
    assert longer.status_code == 422
    # the names are cut at 64 characters: the client's text is not echoed at any length
    refused(longer.json(), "invalid_request", ["model"], f"'{'x' * 64}…'", f"'{'y' * 64}…'")
    assert unknown.status_code == 404
    assert (unknown.json()["type"], unknown.json()["loc"]) == ("unknown_model", ["path", "name"])
    assert unknown_in_body.status_code == 404
    assert unknown_in_body.json()["loc"] == ["model"]
    # an unknown model is counted as "unknown", not under the client's text (labels stay few)
    count = "rnnserve_request_duration_seconds_count"
    assert value(text, count, endpoint="smooth", model="unknown", code="404") == 1
    assert value(text, count, endpoint="infer", model="unknown", code="404") == 1
    assert value(text, count, code="404") == 2


async def test_wrong_kind_ragged_rows_and_a_nan_for_a_model_that_does_not_check(
    app_client: AppClient,
) -> None:
    nan_inputs = np.zeros((3, 6), np.float32)
    nan_inputs[2, 4] = np.nan  # sequence 1, step 0
    binary = save({"inputs": nan_inputs, "lengths": np.array([2, 1], np.int64)})
    async with app_client() as (_, client):
        kind = await client.post(
            "/smooth", json={"sequences": [[[0.5] * 16]], "model": "traveller"}
        )
        # rows of different widths: the fast path leaves the body to the precise parser
        ragged = await client.post("/smooth", json={"sequences": [[[0.5] * 16, [0.5] * 15]]})
        nan = await client.post(
            "/rollout", content=binary, headers={"content-type": bodies.SAFETENSORS}
        )
    assert kind.status_code == 422
    refused(kind.json(), "wrong_model_kind", ["model"], "traveller model", "POST /rollout")
    assert ragged.status_code == 422
    assert (ragged.json()["type"], ragged.json()["loc"]) == (
        "wrong_feature_count",
        ["sequences", 0, 1],
    )
    # the Traveller does not look for NaN in its inputs: the route checks them for it
    assert nan.status_code == 422
    refused(nan.json(), "non_finite", ["inputs", 1, 0, 4], "sequence 1, step 0, feature 4")


async def test_a_rollout_without_an_accept_header_is_answered_in_json(
    app_client: AppClient,
) -> None:
    # a raw HTTP client need not send Accept (httpx always does)
    body = orjson.dumps({"inputs": [[[0.1] * 6, [0.2] * 6]]})
    async with app_client() as (app, client):
        sent = await _raw_call(app, "/rollout", body, 30.0, [])
        want = await client.post("/rollout", content=body)
    assert sent[0]["status"] == 200
    assert dict(sent[0]["headers"])[b"content-type"] == b"application/json"
    assert orjson.loads(sent[1]["body"]) == want.json()


@pytest.mark.parametrize(
    ("failure", "status", "kind", "words"),
    [
        (QueueFull("the queue holds 3 requests"), 503, "queue_full", ("queue holds 3",)),
        (BatcherClosed("batcher is closed"), 503, "shutting_down", ("batcher is closed",)),
        (EngineUnavailable("engine went away"), 503, "engine_unavailable", ("engine went away",)),
        (MemoryError(), 503, "out_of_memory", ("out of memory", "r-1")),
        (RuntimeError("boom"), 500, "internal", ("server log", "r-1")),
    ],
)
async def test_each_failure_of_the_model_call_gets_its_answer(
    app_client: AppClient,
    failure: Exception,
    status: int,
    kind: str,
    words: tuple[str, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def infer(name: str, sequences: Any) -> Any:
        raise failure

    async with app_client() as (app, client):
        app.state.runtime.infer = infer
        r = await client.post(
            "/smooth", json={"sequences": [[[0.5] * 16]]}, headers={"x-request-id": "r-1"}
        )
        text = (await client.get("/metrics")).text
    assert r.status_code == status
    refused(r.json(), kind, [], *words)
    assert r.headers["x-request-id"] == "r-1"
    assert r.headers.get("retry-after") == ("1" if status == 503 else None)
    rejected = value(text, "rnnserve_requests_rejected_total", endpoint="smooth", reason=kind)
    assert rejected == (1 if status == 503 else 0)
    count = "rnnserve_request_duration_seconds_count"
    assert value(text, count, endpoint="smooth", model="smoother", code=str(status)) == 1
    failed = [rec for rec in caplog.records if "smooth failed (request r-1)" in rec.getMessage()]
    assert len(failed) == (1 if status == 500 else 0)


async def test_a_state_mismatch_the_model_found_is_located_at_the_states_version(
    app_client: AppClient,
) -> None:
    async def infer(name: str, sequences: Any) -> Any:
        raise StateMismatch("the state is version 1's; the model is at version 2")

    async with app_client() as (app, client):
        app.state.runtime.infer = infer
        r = await client.post("/smooth", json={"sequences": [[[0.5] * 16]]})
    assert r.status_code == 409
    refused(r.json(), "state_mismatch", ["state", "version"], "version 1's")


async def test_a_non_finite_value_the_model_found_is_located(app_client: AppClient) -> None:
    async def infer(name: str, sequences: Any) -> Any:
        raise NonFiniteInput.in_sequence(1)

    body = orjson.dumps({"sequences": [[[0.5] * 16], [[0.25] * 16, [0.5] * 16]]})
    async with app_client() as (app, client):
        app.state.runtime.infer = infer
        r = await client.post("/smooth", content=body)
    # the model's word is checked against the data: here every value is finite
    assert r.status_code == 422
    refused(r.json(), "non_finite", ["sequences"], "not finite")


@pytest.mark.parametrize(
    ("status", "kind", "answered"),
    [
        (422, "a_parsers_own_kind", "invalid_request"),  # undocumented kinds: the few documented
        (413, "too_many_sequences", "too_many_sequences"),
        (422, "wrong_shape", "wrong_shape"),  # a documented kind is kept
        (503, "overloaded", "overloaded"),
    ],
)
async def test_a_request_error_is_answered_with_a_documented_type(
    app_client: AppClient, status: int, kind: str, answered: str
) -> None:
    failure = RequestError(kind, "what went wrong", ("sequences", 0))

    async def infer(name: str, sequences: Any) -> Any:
        raise failure

    async with app_client() as (app, client):
        app.state.runtime.infer = infer
        r = await client.post("/smooth", json={"sequences": [[[0.5] * 16]]})
        text = (await client.get("/metrics")).text
    assert r.status_code == status
    assert r.json() == {**failure.body(), "type": answered}
    assert r.headers.get("retry-after") == ("1" if status == 503 else None)
    rejected = "rnnserve_requests_rejected_total"
    assert value(text, rejected, endpoint="smooth", reason=answered) == 1
    assert value(text, rejected, reason=kind) == (1 if kind == answered else 0)


async def test_a_request_past_its_deadline_while_it_runs_gets_504(app_client: AppClient) -> None:
    async def infer(name: str, sequences: Any) -> Any:
        await asyncio.sleep(30)

    async with app_client() as (app, client):
        app.state.runtime.infer = infer
        started = time.perf_counter()
        r = await client.post(
            "/smooth",
            json={"sequences": [[[0.5] * 16]]},
            headers={"x-request-timeout": "0.2", "x-request-id": "late-1"},
        )
        took = time.perf_counter() - started
        text = (await client.get("/metrics")).text
    assert r.status_code == 504
    assert r.headers["x-request-id"] == "late-1"
    err = r.json()
    assert (err["type"], err["loc"]) == ("deadline_exceeded", [])
    found = re.fullmatch(
        r"the request's deadline passed after (\d+\.\d{3}) s; it was dropped", err["detail"]
    )
    assert found is not None, err["detail"]
    assert 0.2 <= float(found[1]) <= took  # the time it waited, not a clock reading
    assert value(text, "rnnserve_requests_expired_total", endpoint="smooth") == 1
    count = "rnnserve_request_duration_seconds_count"
    assert value(text, count, endpoint="smooth", model="smoother", code="504") == 1


async def test_a_client_that_leaves_while_its_request_runs_is_counted_499(
    app_client: AppClient,
) -> None:
    body = orjson.dumps({"sequences": [[[0.5] * 16]]})
    ran: list[bool] = []

    async def infer(name: str, sequences: Any) -> Any:
        try:
            await asyncio.sleep(30)
        finally:
            ran.append(True)  # cancelled: the request left the model's queue

    async with app_client() as (app, client):
        app.state.runtime.infer = infer
        sent = await _raw_call(app, "/smooth", body, 0.05, [(b"x-request-id", b"gone-1")])
        text = (await client.get("/metrics")).text
        assert app.state.byte_budget.used == 0  # its body's bytes given back
    assert ran == [True]
    assert sent[0]["status"] == 499
    assert dict(sent[0]["headers"])[b"x-request-id"] == b"gone-1"
    assert value(text, "rnnserve_requests_cancelled_total", endpoint="smooth") == 1
    count = "rnnserve_request_duration_seconds_count"
    assert value(text, count, endpoint="smooth", model="smoother", code="499") == 1
    assert value(text, "rnnserve_requests_in_flight", endpoint="smooth") == 0


async def test_no_bearer_token_is_refused_whatever_the_token(app_client: AppClient) -> None:
    # with no Authorization header nothing is compared as if it were a token
    async with app_client(api_token="XXXX") as (_, client):
        bare = await client.post("/smooth", json={"sequences": [[[0.5] * 16]]})
        empty = await client.post(
            "/smooth", json={"sequences": [[[0.5] * 16]]}, headers={"Authorization": "Bearer "}
        )
        good = await client.post(
            "/smooth", json={"sequences": [[[0.5] * 16]]}, headers={"Authorization": "Bearer XXXX"}
        )
    assert bare.status_code == 401
    refused(bare.json(), "unauthorized", [], "needs a bearer token", "no bearer token")
    assert empty.status_code == 401
    assert good.status_code == 200


@pytest.mark.parametrize(
    ("path", "taken"),
    [("/models/x/infer", True), ("/models//infer", False), ("/models/a/b/infer", False)],
)
async def test_the_fast_path_takes_every_model_name_of_one_segment(
    app_client: AppClient, path: str, taken: bool
) -> None:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b'{"inputs": [[[0.5]]]}', "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    async with app_client() as (app, _):
        scope = {**_scope(path), "app": app}
        assert await routes.serve_inference(scope, receive, send) is taken
    if taken:  # a one-letter model name that is not served: answered here, 404
        assert sent[0]["status"] == 404
        assert orjson.loads(sent[1]["body"])["loc"] == ["path", "name"]
    else:
        assert sent == []


async def test_request_durations_are_the_time_each_request_took(app_client: AppClient) -> None:
    """The histogram's sum lies between 0 and the wall time around the requests (a duration
    computed from the wrong clock difference is far outside it)."""
    async with app_client() as (_, client):
        t0 = time.perf_counter()
        for n in (3, 5, 2):
            body = orjson.dumps({"sequences": [[[0.5] * 16] * n]})
            assert (await client.post("/smooth", content=body)).status_code == 200
        wall = time.perf_counter() - t0
        text = (await client.get("/metrics")).text
    labels = {"endpoint": "smooth", "code": "200"}
    assert value(text, "rnnserve_request_duration_seconds_count", **labels) == 3
    total = value(text, "rnnserve_request_duration_seconds_sum", **labels)
    assert 0 < total <= wall


async def test_a_streamed_rollout_is_ndjson_with_its_request_id_counted_under_its_model(
    app_client: AppClient,
) -> None:
    async with app_client() as (_, client):
        r = await client.post(
            "/rollout",
            json={"inputs": [[[0.1] * 6, [0.2] * 6]]},
            headers={"accept": "application/x-ndjson", "x-request-id": "stream-1"},
        )
        text = (await client.get("/metrics")).text
    assert r.status_code == 200
    assert r.headers["content-type"] == NDJSON
    assert r.headers["x-request-id"] == "stream-1"
    assert orjson.loads(r.content.splitlines()[-1]) == {"model": "traveller", "done": True}
    count = "rnnserve_request_duration_seconds_count"
    assert value(text, count, endpoint="rollout", model="traveller", code="200") == 1


async def test_a_request_id_of_1_to_128_printable_characters_is_kept_any_other_replaced(
    app_client: AppClient,
) -> None:
    kept = ["x" * 128, "a", "~!#[]{}"]
    replaced = ["x" * 129, "has space", "tab\there"]
    async with app_client() as (_, client):
        for given in kept + replaced:
            r = await client.post(
                "/models/smoother/infer", json=SMOOTH_BODY, headers={"x-request-id": given}
            )
            assert r.status_code == 200
            answered = r.headers["x-request-id"]
            if given in kept:
                assert answered == given
            else:
                assert re.fullmatch(r"[0-9a-f]{32}", answered), (given, answered)


async def test_only_rollouts_stream_a_smoothing_request_that_accepts_ndjson_gets_json(
    app_client: AppClient,
) -> None:
    async with app_client() as (_, client):
        r = await client.post(
            "/smooth",
            json={"sequences": [[[0.5] * 16]]},
            headers={"accept": "application/x-ndjson"},
        )
    assert r.status_code == 200
    assert r.headers["content-type"] == bodies.JSON
    assert r.json()["model"] == "smoother"
    assert np.asarray(r.json()["sequences"]).shape == (1, 1, 16)


def test_an_answers_json_size_is_estimated_at_12_bytes_a_number() -> None:
    # the estimate decides whether the answer is written on a codec thread
    arrays = [np.zeros((3, 2), np.float32), np.zeros((1, 2), np.float32)]
    assert inference.answer_json_bytes(FlatSequences.from_arrays(arrays)) == 12 * 8
    assert inference.answer_json_bytes(arrays) == 12 * 8  # a plain list of arrays too
    assert inference.answer_json_bytes([]) == 0


@asynccontextmanager
async def traced_app(exporter: InMemorySpanExporter) -> AsyncIterator[FastAPI]:
    """The app with its spans exported to ``exporter``; tracing off again after it."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    app = create_app(Settings(max_delay_ms=5.0), tracer_provider=provider)
    try:
        async with app.router.lifespan_context(app):
            yield app
    finally:
        tracing.use(None)


def server_span(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    [span] = [s for s in exporter.get_finished_spans() if s.name == name]
    return span


async def test_a_client_that_leaves_is_traced_as_client_closed_499() -> None:
    async def infer(name: str, sequences: Any) -> Any:
        await asyncio.sleep(30)

    exporter = InMemorySpanExporter()
    async with traced_app(exporter) as app:
        app.state.runtime.infer = infer
        body = orjson.dumps({"sequences": [[[0.5] * 16]]})
        sent = await _raw_call(app, "/smooth", body, 0.05, [])
    assert sent[0]["status"] == 499
    span = server_span(exporter, "POST /smooth")
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 499
    assert span.attributes["error.type"] == "client_closed"
    assert span.status.status_code is StatusCode.UNSET  # the client's doing, not a failure


async def test_a_failure_of_the_model_is_traced_as_internal_and_fails_the_span() -> None:
    async def infer(name: str, sequences: Any) -> Any:
        raise RuntimeError("boom")

    exporter = InMemorySpanExporter()
    async with traced_app(exporter) as app:
        app.state.runtime.infer = infer
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rnnserve") as client:
            r = await client.post("/smooth", json={"sequences": [[[0.5] * 16]]})
    assert r.status_code == 500
    span = server_span(exporter, "POST /smooth")
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 500
    assert span.attributes["error.type"] == "internal"
    assert (span.status.status_code, span.status.description) == (StatusCode.ERROR, "internal")


async def test_a_streamed_rollouts_span_ends_once_with_the_streams_status() -> None:
    exporter = InMemorySpanExporter()
    async with traced_app(exporter) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rnnserve") as client:
            r = await client.post(
                "/rollout", json={"inputs": [[[0.1] * 6] * 3]}, headers={"accept": NDJSON}
            )
    assert r.status_code == 200
    span = server_span(exporter, "POST /rollout")  # ended by the stream, not left open
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 200
    assert "error.type" not in span.attributes


async def test_a_refused_request_is_traced_with_its_answers_error_type() -> None:
    exporter = InMemorySpanExporter()
    async with traced_app(exporter) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rnnserve") as client:
            r = await client.post("/smooth", json={"sequences": [[[0.5] * 3]]})
    assert r.status_code == 422
    assert r.json()["type"] == "wrong_feature_count"
    span = server_span(exporter, "POST /smooth")
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 422
    assert span.attributes["error.type"] == "wrong_feature_count"
    assert span.status.status_code is StatusCode.UNSET  # the client's error, not the server's


async def test_a_streamed_answer_cannot_carry_the_final_state(app_client: AppClient) -> None:
    async with app_client() as (_, client):
        r = await client.post(
            "/rollout",
            json={"inputs": [[[0.1] * 6]], "return_state": True},
            headers={"accept": NDJSON},
        )
    assert r.status_code == 422
    assert r.json() == {
        "type": "invalid_request",
        "loc": ["return_state"],
        "detail": "a streamed answer (Accept: application/x-ndjson) cannot carry the final "
        "state; ask for JSON or safetensors to have it returned",
    }


async def test_a_served_requests_span_has_a_child_span_for_each_step() -> None:
    exporter = InMemorySpanExporter()
    async with traced_app(exporter) as app:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rnnserve") as client:
            r = await client.post("/smooth", json={"sequences": [[[0.5] * 16]]})
    assert r.status_code == 200
    server = server_span(exporter, "POST /smooth")
    steps = [
        s.name
        for s in exporter.get_finished_spans()
        if s.parent is not None and s.parent.span_id == server.context.span_id
    ]
    assert sorted(steps) == ["decode", "encode", "queue wait", "read body"]
