"""service/routes.py's helpers, from its (partial) mutation run: the JSON and buffer responses,
the documented request bodies, and which endpoint an unauthorized request is counted under.

``_body_spec`` runs while the module is imported (in the route decorators), before mutmut
picks a mutant: it is called here so that its own code is judged.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import CollectorRegistry, Gauge

from service import routes, wire
from service.routes import BuffersResponse, InferRequest, json_response
from tests.integration.conftest import AppClient
from tests.metrics import value


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
    response = BuffersResponse(parts, wire.SAFETENSORS)
    assert response.headers["content-length"] == "7"
    messages = await _sent(response)
    start = messages[0]
    assert start["type"] == "http.response.start"
    assert start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-length"] == b"7"
    assert [k for k, _ in start["headers"]].count(b"content-length") == 1
    assert headers[b"content-type"] == wire.SAFETENSORS.encode()
    bodies = [bytes(m["body"]) for m in messages[1:]]
    assert bodies == [b"head", bytes(np.array([1, -2, 3], np.int8)), b""]
    assert [m["more_body"] for m in messages[1:]] == [True, True, False]


def test_body_spec_documents_json_and_safetensors_bodies() -> None:
    assert routes._body_spec(InferRequest) == {
        "requestBody": {
            "required": True,
            "content": {
                "application/json": {"schema": InferRequest.model_json_schema()},
                wire.SAFETENSORS: {"schema": {"type": "string", "format": "binary"}},
            },
        }
    }


async def test_unauthorized_requests_are_counted_by_their_endpoint(app_client: AppClient) -> None:
    async with app_client(api_token="s3cret") as (_, client):
        assert (await client.get("/models")).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        r = await client.get("/metrics", headers=wrong)
        assert r.status_code == 401
        assert orjson.loads(r.content)["detail"] == (
            "this endpoint needs a bearer token; got a wrong bearer token"
        )
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
    real = routes.defaults.resolve

    def resolve(models: Any, kind: str, settings: Any) -> str:
        calls.append(kind)
        return real(models, kind, settings)

    monkeypatch.setattr(routes.defaults, "resolve", resolve)
    assert routes._default_model(state, "smoother") == "b"  # the setting, not the first served
    assert routes._default_model(state, "smoother") == "b"
    assert calls == ["smoother"]
    assert state.default_models == {"smoother": "b"}


def test_the_byte_budget_takes_up_to_its_limit_exactly() -> None:
    gauge = Gauge("held_bytes", "test", registry=CollectorRegistry())
    budget = routes.ByteBudget(10, gauge)
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


@pytest.mark.parametrize("status", [401, 400, 403, 413, 503])
def test_error_response_asks_for_a_bearer_token_on_401_only(status: int) -> None:
    exc = routes.RequestError(status, "some_type", "what went wrong")
    response = routes.error_response(exc)
    assert response.status_code == status
    assert orjson.loads(response.body) == exc.body()
    assert response.headers.get("www-authenticate") == ("Bearer" if status == 401 else None)
