"""The HTTP API in-process: answers, batching, errors, metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import rnnserve.service.engine.runtime
from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.config import Settings
from rnnserve.service.http.app import create_app
from tests.integration.conftest import AppClient
from tests.metrics import samples, value
from tests.references import smoother_reference, stepwise_rollout

ROW16 = [0.5] * 16
ROW6 = [0.1] * 6


async def test_health_ready_models(client: httpx.AsyncClient) -> None:
    assert (await client.get("/healthz")).json() == {"status": "ok"}
    assert (await client.get("/readyz")).status_code == 200
    served = {m["name"]: m for m in (await client.get("/models")).json()["models"]}
    assert served["smoother"]["shapes"]["input"] == ["T", 16]
    assert served["traveller"]["config"]["hidden_size"] == 128
    assert served["traveller"]["parameters"] == 203010


async def test_not_ready_before_startup() -> None:
    app = create_app(Settings())
    transport = httpx.ASGITransport(app=app)  # no lifespan: models never loaded
    async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
        assert (await c.get("/readyz")).status_code == 503
        assert (await c.get("/healthz")).status_code == 200
        r = await c.post("/smooth", json={"sequences": [[ROW16]]})
        assert r.status_code == 503
        assert r.json()["type"] == "not_ready"


async def test_smooth_matches_reference(client: httpx.AsyncClient) -> None:
    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (5, 40, 1)]
    r = await client.post(
        "/smooth", content=orjson.dumps({"sequences": [s.tolist() for s in seqs]})
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "smoother"
    model = models.load("smoother")
    alpha, wx = model.alpha_smooth.detach().numpy(), model.wx.detach().numpy()
    for s, y in zip(seqs, body["sequences"], strict=True):
        np.testing.assert_allclose(np.array(y), smoother_reference(s, alpha, wx), atol=1e-5)


async def test_rollout_matches_seed_loop(client: httpx.AsyncClient) -> None:
    rng = np.random.default_rng(1)
    seqs = [rng.standard_normal((n, 6)).astype(np.float32) for n in (3, 25)]
    r = await client.post(
        "/rollout", json={"inputs": [s.tolist() for s in seqs], "model": "traveller"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    model = models.load("traveller")
    for s, y in zip(seqs, body["positions"], strict=True):
        with torch.inference_mode():
            ref = stepwise_rollout(model.lstm_layers, model.output_layer, model.activation,
                               torch.from_numpy(s)[:, None, :])  # fmt: skip
        np.testing.assert_allclose(np.array(y), ref.numpy(), atol=1e-5)


def _smooth_ref(model: torch.nn.Module, seq: np.ndarray) -> np.ndarray:
    alpha, wx = model.alpha_smooth.detach().numpy(), model.wx.detach().numpy()
    return smoother_reference(seq, alpha, wx)


def _rollout_ref(model: torch.nn.Module, seq: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        ref = stepwise_rollout(model.lstm_layers, model.output_layer, model.activation,
                           torch.from_numpy(seq)[:, None, :])  # fmt: skip
    return ref.numpy()


async def test_concurrent_requests_are_batched(app_client: AppClient) -> None:
    rng = np.random.default_rng(5)
    # distinct values and lengths per caller: a mixed-up split cannot pass by shape alone
    seqs = [rng.standard_normal((i % 7 + 1, 16)).astype(np.float32) for i in range(24)]
    async with app_client(max_delay_ms=50.0) as (_, client):
        rs = await asyncio.gather(
            *(client.post("/smooth", json={"sequences": [s.tolist()]}) for s in seqs)
        )
        assert all(r.status_code == 200 for r in rs)
        text = (await client.get("/metrics")).text
    model = models.load("smoother")
    for s, r in zip(seqs, rs, strict=True):
        (y,) = r.json()["sequences"]
        np.testing.assert_allclose(np.array(y), _smooth_ref(model, s), atol=1e-5)
    assert value(text, "rnnserve_batch_requests_sum", model="smoother") == 24
    # some batch held more than one request
    assert value(text, "rnnserve_batch_requests_count", model="smoother") < 24


async def test_concurrent_multi_sequence_rollouts_get_their_own_positions(
    app_client: AppClient,
) -> None:
    rng = np.random.default_rng(6)
    requests = [
        [rng.standard_normal((int(n), 6)).astype(np.float32) for n in rng.integers(1, 9, k)]
        for k in (3, 1, 2, 4, 1, 2)
    ]
    async with app_client(max_delay_ms=50.0) as (_, client):
        bodies = [{"inputs": [s.tolist() for s in req]} for req in requests]
        rs = await asyncio.gather(*(client.post("/rollout", json=b) for b in bodies))
    model = models.load("traveller", rollout_backend="eager")
    for req, r in zip(requests, rs, strict=True):
        assert r.status_code == 200, r.text
        positions = r.json()["positions"]
        assert len(positions) == len(req)
        for s, y in zip(req, positions, strict=True):
            np.testing.assert_allclose(np.array(y), _rollout_ref(model, s), atol=1e-5)


def _steps(n: int, row: list[float]) -> list[list[float]]:
    return [list(row) for _ in range(n)]


BAD_SMOOTH: list[tuple[str, Any, int, str, str]] = [
    (
        "ragged",
        {"sequences": [_steps(2, ROW16), [ROW16, [0.5] * 15]]},
        422,
        "wrong_feature_count",
        "sequence 1, step 1: has 15 features; model 'smoother' takes 16",
    ),
    (
        "wrong width",
        {"sequences": [_steps(3, [1.0] * 4)]},
        422,
        "wrong_feature_count",
        "sequence 0, step 0: has 4 features",
    ),
    ("no sequences", {"sequences": []}, 422, "empty", "'sequences' holds no sequences"),
    ("empty sequence", {"sequences": [[ROW16], []]}, 422, "empty", "sequence 1 has no steps"),
    (
        "empty step",
        {"sequences": [[ROW16, []]]},
        422,
        "empty",
        "sequence 0, step 1 has no features",
    ),
    (
        "string",
        {"sequences": [[ROW16, [*ROW16[:3], "1.5", *ROW16[4:]]]]},
        422,
        "not_a_number",
        "sequence 0, step 1, feature 3: value is not a number",
    ),
    (
        "bool",
        {"sequences": [[[True, *ROW16[1:]]]]},
        422,
        "not_a_number",
        "sequence 0, step 0, feature 0",
    ),
    ("null", {"sequences": [[[None, *ROW16[1:]]]]}, 422, "not_a_number", "feature 0"),
    (
        "float32 overflow",
        {"sequences": [[ROW16, [1e39, *ROW16[1:]]]]},
        422,
        "non_finite",
        "sequence 0, step 1, feature 0: value is outside float32's range",
    ),
    ("not a list", {"sequences": 5}, 422, "wrong_shape", "must be a list of sequences"),
    (
        "2-d sequence",
        {"sequences": [[1.0, 2.0]]},
        422,
        "wrong_shape",
        "sequence 0, step 0: expected a list of features",
    ),
    ("missing", {}, 422, "missing", "'sequences' is required"),
    ("extra field", {"sequences": [[ROW16]], "sequence": 1}, 422, "unknown_field", "'sequence'"),
    ("model not str", {"sequences": [[ROW16]], "model": 3}, 422, "string_type", "model"),
    ("array body", [1, 2], 422, "invalid_body", "must be a JSON object"),
    (
        "unknown model",
        {"sequences": [[ROW16]], "model": "gru"},
        404,
        "unknown_model",
        "no model named 'gru' (served: smoother, traveller)",
    ),
    (
        "wrong kind",
        {"sequences": [[ROW16]], "model": "traveller"},
        422,
        "wrong_model_kind",
        "send it to POST /rollout",
    ),
]


@pytest.mark.parametrize(("body", "status", "kind", "message"),
                         [c[1:] for c in BAD_SMOOTH], ids=[c[0] for c in BAD_SMOOTH])  # fmt: skip
async def test_bad_smooth_input(
    client: httpx.AsyncClient, body: Any, status: int, kind: str, message: str
) -> None:
    r = await client.post("/smooth", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == kind
    assert message in err["detail"]


async def test_the_root_points_to_the_docs_and_the_models(client: httpx.AsyncClient) -> None:
    r = await client.get("/")
    assert r.status_code == 200
    links = r.json()
    assert (links["docs"], links["models"]) == ("/docs", "/models")
    assert (await client.get(links["models"])).status_code == 200
    assert (await client.get(links["docs"])).status_code == 200


RAW_BAD: list[tuple[str, bytes, int, str, str]] = [
    (
        "NaN literal",
        b'{"inputs": [[[0.1, 0.1, NaN, 0.1, 0.1, 0.1]]]}',
        422,
        "non_finite",
        "sequence 0, step 0, feature 2: value is not a finite number",
    ),
    (
        "Infinity literal",
        b'{"inputs": [[[0.1, 0.1, 0.1, 0.1, 0.1, 0.1], [0, 0, 0, -Infinity, 0, 0]]]}',
        422,
        "non_finite",
        "sequence 0, step 1, feature 3: value is not a finite number",
    ),
    (
        "huge exponent",
        b'{"inputs": [[[0.1, 0.1, 0.1, 0.1, 0.1, 0.1]], [[0, 1e999, 0, 0, 0, 0]]]}',
        422,
        "non_finite",
        "sequence 1, step 0, feature 1: value is not a finite number",
    ),
    ("not json", b"{inputs: [", 400, "invalid_json", "body is not valid JSON"),
    ("truncated", b'{"inputs": [[[0.1, 0.1', 400, "invalid_json", "body is not valid JSON"),
    ("empty body", b"", 400, "invalid_json", "body is not valid JSON"),
]


@pytest.mark.parametrize(("body", "status", "kind", "message"),
                         [c[1:] for c in RAW_BAD], ids=[c[0] for c in RAW_BAD])  # fmt: skip
async def test_bad_raw_rollout_body(
    client: httpx.AsyncClient, body: bytes, status: int, kind: str, message: str
) -> None:
    r = await client.post("/rollout", content=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == kind
    assert message in err["detail"]
    assert len(r.content) < 300  # the input is not echoed back


async def test_limits_give_413(app_client: AppClient) -> None:
    async with app_client(
        max_sequences_per_request=2,
        max_sequence_length=5,
        max_request_timesteps=8,
        max_request_bytes=20_000,
    ) as (_, c):
        cases = [
            ({"inputs": [[ROW6]] * 3}, "too_many_sequences", "3 sequences; the limit is 2"),
            ({"inputs": [[ROW6], _steps(6, ROW6)]}, "sequence_too_long", "sequence 1 has 6 steps"),
            ({"inputs": [_steps(5, ROW6), _steps(4, ROW6)]}, "too_many_timesteps", "9 timesteps"),
            ({"inputs": [_steps(5, [0.123456789] * 6)] * 80}, "body_too_large", "over 20000"),
        ]
        for body, kind, message in cases:
            r = await c.post("/rollout", json=body)
            assert r.status_code == 413, r.text
            assert r.json()["type"] == kind
            assert message in r.json()["detail"]
        assert (await c.post("/rollout", json={"inputs": [_steps(5, ROW6)]})).status_code == 200
        text = (await c.get("/metrics")).text
    rejected = {
        s.labels["reason"]: s.value for s in samples(text, "rnnserve_requests_rejected_total")
    }
    assert rejected == {
        "too_many_sequences": 1,
        "sequence_too_long": 1,
        "too_many_timesteps": 1,
        "body_too_large": 1,
    }


def _fail_on_steps(monkeypatch: pytest.MonkeyPatch, steps: int) -> None:
    """Make the model fail for any batch of exactly ``steps`` timesteps."""
    real = rnnserve.service.engine.runtime.run_model

    def flaky(module: torch.nn.Module, packed: Any) -> Any:
        if packed.data.shape[0] == steps:
            raise RuntimeError("simulated device failure")
        return real(module, packed)

    monkeypatch.setattr(rnnserve.service.engine.runtime, "run_model", flaky)
    real_flat = LinearRecursion.smooth_flat  # the smoother's CPU path, which skips packing

    def flaky_flat(self: LinearRecursion, data: Any, lengths: Any, *finite: Any) -> Any:
        if data.shape[0] == steps:
            raise RuntimeError("simulated device failure")
        return real_flat(self, data, lengths, *finite)

    monkeypatch.setattr(LinearRecursion, "smooth_flat", flaky_flat)


async def test_model_failure_is_a_500_for_that_batch_only(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_on_steps(monkeypatch, 3)  # the poisoned request has 3 steps
    r = await asyncio.wait_for(client.post("/smooth", json={"sequences": [_steps(3, ROW16)]}), 10)
    assert r.status_code == 500
    assert r.json()["type"] == "internal"
    r = await asyncio.wait_for(client.post("/smooth", json={"sequences": [_steps(2, ROW16)]}), 10)
    assert r.status_code == 200
    text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_batch_failures_total", model="smoother") == 1
    codes = {
        s.labels["code"]: s.value
        for s in samples(text, "rnnserve_request_duration_seconds_count")
        if s.labels["endpoint"] == "smooth"
    }
    assert codes == {"500": 1, "200": 1}


async def test_every_caller_of_a_failing_batch_gets_the_error(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # without fault isolation (test_reliability.py has it on: there, both succeed)
    async with app_client(max_delay_ms=200.0, max_batch_size=2, batch_split_depth=0) as (_, client):
        _fail_on_steps(monkeypatch, 3)  # 1 + 2 steps: only the two requests together fail
        both = asyncio.gather(
            client.post("/smooth", json={"sequences": [_steps(1, ROW16)]}),
            client.post("/smooth", json={"sequences": [_steps(2, ROW16)]}),
        )
        rs = await asyncio.wait_for(both, 10)  # a stranded caller fails here, fast
        assert [r.status_code for r in rs] == [500, 500]
        assert all(r.json()["type"] == "internal" for r in rs)
        text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_batch_failures_total", model="smoother") == 1
    assert value(text, "rnnserve_batch_requests_sum", model="smoother") == 2
    assert value(text, "rnnserve_requests_in_flight", endpoint="smooth") == 0


async def test_batch_metrics_count_what_ran(app_client: AppClient) -> None:
    async with app_client(max_delay_ms=5.0) as (_, client):
        # one request at a time, so each is a batch of its own: (sequences, timesteps)
        for lengths in ([2, 4, 1], [5], [3, 3]):
            body = {"sequences": [_steps(n, ROW16) for n in lengths]}
            assert (await client.post("/smooth", json=body)).status_code == 200
        text = (await client.get("/metrics")).text

    def v(name: str, **labels: str) -> float:
        return value(text, name, model="smoother", **labels)

    assert v("rnnserve_batch_requests_count") == 3
    assert v("rnnserve_batch_requests_sum") == 3
    assert v("rnnserve_batch_sequences_count") == 3
    assert v("rnnserve_batch_sequences_sum") == 6  # 3 + 1 + 2
    buckets = {le: v("rnnserve_batch_sequences_bucket", le=le) for le in ("1.0", "2.0", "4.0")}
    assert buckets == {"1.0": 1, "2.0": 2, "4.0": 3}
    assert v("rnnserve_batch_timesteps_sum") == 18  # 7 + 5 + 6
    assert v("rnnserve_batch_active_fraction_sum") == pytest.approx(7 / 12 + 1 + 1)
    assert v("rnnserve_batch_failures_total") == 0
    assert v("rnnserve_queue_depth") == 0
    assert v("rnnserve_queue_wait_seconds_count") == 3
    assert v("rnnserve_batch_compute_seconds_count") == 3
    # alone in its batch, each request waited out the whole delay; ratios, not wall time
    waited = v("rnnserve_queue_wait_seconds_sum")
    assert waited >= 3 * 0.005
    durations = value(text, "rnnserve_request_duration_seconds_sum", endpoint="smooth")
    assert waited + v("rnnserve_batch_compute_seconds_sum") < durations
    assert value(text, "rnnserve_request_duration_seconds_count", endpoint="smooth",
                 model="smoother", code="200") == 3  # fmt: skip
    assert value(text, "rnnserve_requests_in_flight", endpoint="smooth") == 0


async def test_metrics_exposition(client: httpx.AsyncClient) -> None:
    await client.post("/rollout", json={"inputs": [[ROW6, ROW6], [ROW6]]})
    await client.post("/rollout", json={"inputs": []})
    r = await client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    names = {fam.name for fam in text_string_to_metric_families(r.text)}
    for name in (
        "rnnserve_request_duration_seconds",
        "rnnserve_queue_wait_seconds",
        "rnnserve_batch_compute_seconds",
        "rnnserve_batch_requests",
        "rnnserve_batch_sequences",
        "rnnserve_batch_timesteps",
        "rnnserve_batch_active_fraction",
        "rnnserve_queue_depth",
        "rnnserve_requests_in_flight",
        "rnnserve_requests_rejected",
    ):
        assert name in names, name
    durations = {
        (s.labels["endpoint"], s.labels["model"], s.labels["code"]): s.value
        for s in samples(r.text, "rnnserve_request_duration_seconds_count")
    }
    assert durations[("rollout", "traveller", "200")] == 1
    assert durations[("rollout", "traveller", "422")] == 1  # no model named: the default
    assert value(r.text, "rnnserve_batch_timesteps_sum", model="traveller") == 3.0
    assert value(r.text, "rnnserve_batch_active_fraction_sum", model="traveller") == 0.75


async def test_openapi_documents_the_bodies(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    body = spec["paths"]["/smooth"]["post"]["requestBody"]["content"]["application/json"]
    assert "sequences" in body["schema"]["properties"]
    assert "422" in spec["paths"]["/rollout"]["post"]["responses"]
