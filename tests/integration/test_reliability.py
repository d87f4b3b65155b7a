"""Reliability in-process: fault isolation (injected failures), deadlines, request ids, auth,
the memory budget, the error types in the OpenAPI schema and truthful batch metrics."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import torch

from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller
from rnnserve.service.http.errors import ERROR_TYPES
from tests.integration.conftest import AppClient
from tests.metrics import value

ROW16 = [0.5] * 16
ROW6 = [0.1] * 6
POISON = 777.0
ROOT = Path(__file__).resolve().parents[2]


def _smooth(n: int, v: float = 0.5) -> dict[str, Any]:
    return {"sequences": [[[v] * 16] * n]}


def _poison_smoother(monkeypatch: pytest.MonkeyPatch, error: Exception) -> list[int]:
    """The smoother raises ``error`` on any batch holding the value POISON; returns the number
    of rows of each call."""
    calls: list[int] = []
    real = LinearRecursion.smooth_flat

    def flaky(
        self: LinearRecursion, data: np.ndarray, lengths: np.ndarray, *finite: Any
    ) -> np.ndarray:
        calls.append(len(data))
        if (data == POISON).any():
            raise error
        return real(self, data, lengths, *finite)

    monkeypatch.setattr(LinearRecursion, "smooth_flat", flaky)
    return calls


async def test_a_poison_request_fails_alone_and_its_batch_mates_are_served(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async with app_client(max_delay_ms=200.0, max_batch_size=8) as (_, client):
        _poison_smoother(monkeypatch, RuntimeError("simulated kernel fault"))
        bodies = [_smooth(i + 1) for i in range(8)]
        bodies[5] = _smooth(6, POISON)
        with caplog.at_level(logging.WARNING, logger="rnnserve.service.engine.batcher"):
            rs = await asyncio.wait_for(
                asyncio.gather(*(
                    client.post("/smooth", json=b, headers={"X-Request-Id": f"poison-test-{i}"})
                    for i, b in enumerate(bodies)
                )),
                30,
            )  # fmt: skip
        text = (await client.get("/metrics")).text
    codes = [r.status_code for r in rs]
    assert codes == [200] * 5 + [500] + [200] * 2
    assert rs[5].json()["type"] == "internal"
    assert "poison-test-5" in rs[5].json()["detail"]
    assert [r.headers["x-request-id"] for r in rs] == [f"poison-test-{i}" for i in range(8)]
    for i in (0, 7):
        assert len(rs[i].json()["sequences"][0]) == i + 1
    assert value(text, "rnnserve_batch_splits_total", model="smoother", reason="error") >= 3
    assert value(text, "rnnserve_request_duration_seconds_count", code="500") == 1
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "poison-test-5" in logged
    assert "requests poison-test-5" in caplog.records[-1].getMessage()  # the final failure


async def test_out_of_memory_splits_the_batch_and_everyone_is_served(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with app_client(max_delay_ms=200.0, max_batch_size=8) as (_, client):
        real = LinearRecursion.smooth_flat

        def small_device(
            self: LinearRecursion, data: np.ndarray, lengths: Any, *finite: Any
        ) -> np.ndarray:
            if len(lengths) > 2:  # room for two sequences at once
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")
            return real(self, data, lengths, *finite)

        monkeypatch.setattr(LinearRecursion, "smooth_flat", small_device)
        rs = await asyncio.wait_for(
            asyncio.gather(*(client.post("/smooth", json=_smooth(3)) for _ in range(6))), 30
        )
        assert [r.status_code for r in rs] == [200] * 6
        # a request too big for the device alone: 503 out_of_memory, retry later
        r = await client.post("/smooth", json={"sequences": [[ROW16]] * 3})
        assert r.status_code == 503
        assert r.json()["type"] == "out_of_memory"
        assert r.headers["retry-after"] == "1"
        text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_batch_splits_total", reason="out_of_memory") >= 2


async def test_a_poison_rollout_fails_alone_in_the_continuous_batch(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Traveller.rollout_with_state

    def flaky(self: Traveller, packed: Any, state: Any = None) -> Any:
        if (packed.data == POISON).any():
            raise RuntimeError("simulated kernel fault")
        return real(self, packed, state)

    async with app_client(max_delay_ms=5.0, rollout_chunk_steps=4) as (_, client):
        good = client.post("/rollout", json={"inputs": [[ROW6] * 40]})
        monkeypatch.setattr(Traveller, "rollout_with_state", flaky)
        rs = await asyncio.wait_for(
            asyncio.gather(
                good,
                client.post("/rollout", json={"inputs": [[ROW6] * 3 + [[POISON] * 6]]}),
                client.post("/rollout", json={"inputs": [[ROW6] * 9, [ROW6] * 2]}),
            ),
            30,
        )
        assert [r.status_code for r in rs] == [200, 500, 200]
        alone = await client.post("/rollout", json={"inputs": [[ROW6] * 40]})
        # restarted from its first step: the same answer as alone
        assert rs[0].json()["positions"] == alone.json()["positions"]
        text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_batch_splits_total", model="traveller") >= 1


def _slow_smoother(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[int]:
    calls: list[int] = []
    real = LinearRecursion.smooth_flat

    def slow(
        self: LinearRecursion, data: np.ndarray, lengths: np.ndarray, *finite: Any
    ) -> np.ndarray:
        calls.append(len(lengths))
        time.sleep(seconds)
        return real(self, data, lengths, *finite)

    monkeypatch.setattr(LinearRecursion, "smooth_flat", slow)
    return calls


async def test_a_queued_request_past_its_deadline_never_runs(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with app_client(max_delay_ms=0.0, max_batch_size=1) as (_, client):
        calls = _slow_smoother(monkeypatch, 0.5)
        blocker = asyncio.ensure_future(client.post("/smooth", json=_smooth(1)))
        await asyncio.sleep(0.1)  # it runs now; the next one queues behind it
        started = time.monotonic()
        r = await client.post("/smooth", json=_smooth(2), headers={"X-Request-Timeout": "0.1"})
        took = time.monotonic() - started
        assert r.status_code == 504
        assert r.json()["type"] == "deadline_exceeded"
        assert took < 0.45  # at the deadline, not when the blocker's batch ended
        assert (await blocker).status_code == 200
        await asyncio.sleep(0.1)
        assert calls == [1]  # the expired request (2 steps, 1 sequence) never ran
        text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_requests_expired_total", endpoint="smooth") == 1
    assert value(text, "rnnserve_request_duration_seconds_count", code="504") == 1
    assert value(text, "rnnserve_queue_depth", model="smoother") == 0


async def test_the_server_default_deadline_applies(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with app_client(request_timeout_s=0.1) as (_, client):
        _slow_smoother(monkeypatch, 0.4)
        r = await client.post("/smooth", json=_smooth(1))
        assert r.status_code == 504
        # a header can shorten the server's deadline but not lengthen it
        r = await client.post("/smooth", json=_smooth(1), headers={"X-Request-Timeout": "30"})
        assert r.status_code == 504


async def test_a_running_rollout_past_its_deadline_leaves_the_batch(
    app_client: AppClient,
) -> None:
    async with app_client(rollout_chunk_steps=8) as (app, client):
        long = {"inputs": [[ROW6] * 100_000]}
        started = time.monotonic()
        r = await client.post("/rollout", json=long, headers={"X-Request-Timeout": "0.3"})
        assert r.status_code == 504
        assert time.monotonic() - started < 5
        scheduler = app.state.runtime.models["traveller"].batcher
        for _ in range(100):  # it leaves at the next chunk
            if not scheduler.active_sequences:
                break
            await asyncio.sleep(0.02)
        assert scheduler.active_sequences == 0
        # a stream past its deadline ends with an error line
        async with client.stream(
            "POST", "/rollout", json=long,
            headers={"Accept": "application/x-ndjson", "X-Request-Timeout": "0.3"},
        ) as s:  # fmt: skip
            lines = [orjson.loads(x) async for x in s.aiter_lines() if x]
        assert lines[-1]["error"]["type"] == "deadline_exceeded"
        assert s.headers["x-request-id"]
        text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_requests_expired_total", endpoint="rollout") == 2


@pytest.mark.parametrize("header", ["0", "-1", "abc", "nan", "", "1_0"])
async def test_a_bad_timeout_header_is_a_400(app_client: AppClient, header: str) -> None:
    async with app_client() as (_, client):
        r = await client.post("/smooth", json=_smooth(1), headers={"X-Request-Timeout": header})
    assert r.status_code == 400
    assert r.json()["type"] == "invalid_header"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/smooth", _smooth(1)),
        ("/rollout", {"inputs": [[ROW6]]}),
        ("/models/smoother/infer", {"inputs": _smooth(1)["sequences"]}),
    ],
)
async def test_a_compressed_body_is_a_400_not_read_as_sent(
    app_client: AppClient, path: str, body: dict[str, Any]
) -> None:
    async with app_client() as (_, client):
        for encoding in ("gzip", "br"):  # plain JSON labelled compressed: not served as if plain
            headers = {"Content-Encoding": encoding}
            r = await client.post(path, content=orjson.dumps(body), headers=headers)
            assert r.status_code == 400, r.text
            assert r.json()["type"] == "invalid_header"
            assert encoding in r.json()["detail"]
        headers = {"Content-Encoding": "identity"}
        assert (await client.post(path, json=body, headers=headers)).status_code == 200


async def test_request_ids_are_kept_or_made(app_client: AppClient) -> None:
    async with app_client() as (_, client):
        r = await client.post("/smooth", json=_smooth(1), headers={"X-Request-Id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123"
        r = await client.post("/smooth", json={"sequences": []})
        assert r.status_code == 422
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])
        r = await client.post("/smooth", json=_smooth(1), headers={"X-Request-Id": "a b"})
        assert r.headers["x-request-id"] != "a b"  # not printable without spaces: replaced


async def test_the_bearer_token(app_client: AppClient) -> None:
    async with app_client(api_token="s3cret") as (_, client):
        for path in ("/metrics", "/models"):
            r = await client.get(path)
            assert r.status_code == 401
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["type"] == "unauthorized"
        r = await client.post("/smooth", json=_smooth(1), headers={"Authorization": "Bearer x"})
        assert r.status_code == 401
        r = await client.post("/smooth", json=_smooth(1), headers={"Authorization": "Basic x"})
        assert r.status_code == 401
        auth = {"Authorization": "Bearer s3cret"}
        assert (await client.post("/smooth", json=_smooth(1), headers=auth)).status_code == 200
        assert (await client.post("/rollout", json={"inputs": [[ROW6]]})).status_code == 401
        for path in ("/healthz", "/readyz", "/openapi.json"):
            assert (await client.get(path)).status_code == 200
        text = (await client.get("/metrics", headers=auth)).text
    assert value(text, "rnnserve_requests_rejected_total", reason="unauthorized") == 5


# the routes a token leaves open (docs/API.md "Authentication"): probes and the docs
_OPEN_WITH_A_TOKEN = {
    "/healthz", "/readyz", "/v2", "/v2/health/live", "/v2/health/ready", "/docs", "/redoc",
    "/openapi.json",
}  # fmt: skip


async def test_every_described_route_but_the_open_ones_needs_the_token(
    app_client: AppClient,
) -> None:
    async with app_client(api_token="s3cret") as (_, client):
        paths = (await client.get("/openapi.json")).json()["paths"]
        answers = {}
        for path, operations in paths.items():
            if path.endswith("/stream"):  # a WebSocket: its handshake is tested in test_sessions
                continue
            for method in operations:
                r = await client.request(method.upper(), path.replace("{name}", "smoother"))
                answers[f"{method.upper()} {path}"] = r.status_code
        for path in _OPEN_WITH_A_TOKEN:
            assert (await client.get(path)).status_code == 200, path
    guarded = {op for op, code in answers.items() if op.split(" ")[1] not in _OPEN_WITH_A_TOKEN}
    assert {"POST /smooth", "GET /v2/models/{name}", "POST /models/{name}/infer"} <= guarded
    assert {op: answers[op] for op in guarded} == dict.fromkeys(guarded, 401)


async def test_a_token_file(app_client: AppClient, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    async with app_client(api_token_file=token) as (_, client):
        assert (await client.get("/models")).status_code == 401
        auth = {"Authorization": "Bearer from-a-file"}
        assert (await client.get("/models", headers=auth)).status_code == 200


async def test_without_a_token_everything_is_open(client: Any) -> None:
    assert (await client.get("/metrics")).status_code == 200
    assert (await client.post("/smooth", json=_smooth(1))).status_code == 200


async def test_the_memory_budget_refuses_with_503_overloaded(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = orjson.dumps(_smooth(200))
    async with app_client(max_inflight_bytes=len(body) + 100, max_delay_ms=0.0) as (_, client):
        _slow_smoother(monkeypatch, 0.3)
        headers = {"content-type": "application/json"}
        first = asyncio.ensure_future(client.post("/smooth", content=body, headers=headers))
        await asyncio.sleep(0.1)  # it holds its bytes while it runs
        r = await client.post("/smooth", content=body, headers=headers)
        assert r.status_code == 503
        assert r.json()["type"] == "overloaded"
        assert r.headers["retry-after"] == "1"
        assert (await first).status_code == 200
        # the bytes were given back
        assert (await client.post("/smooth", content=body, headers=headers)).status_code == 200
        text = (await client.get("/metrics")).text
    assert value(text, "rnnserve_request_bytes_in_flight") == 0
    assert value(text, "rnnserve_requests_rejected_total", reason="overloaded") == 1


async def test_compute_time_is_the_models_own(
    app_client: AppClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with app_client(max_delay_ms=0.0) as (_, client):
        _slow_smoother(monkeypatch, 0.05)
        for _ in range(3):
            assert (await client.post("/smooth", json=_smooth(2))).status_code == 200
        text = (await client.get("/metrics")).text

    def v(name: str) -> float:
        return value(text, name, model="smoother")

    assert v("rnnserve_batch_compute_seconds_count") == 3
    assert 0.15 <= v("rnnserve_batch_compute_seconds_sum") < 1.0
    assert v("rnnserve_batch_thread_wait_seconds_count") == 3
    assert v("rnnserve_batch_thread_wait_seconds_sum") < 0.15


async def test_every_error_type_is_in_the_schema_and_the_api_doc(client: Any) -> None:
    spec = (await client.get("/openapi.json")).json()
    enum = spec["components"]["schemas"]["ErrorBody"]["properties"]["type"]["enum"]
    assert set(enum) == ERROR_TYPES
    api_doc = (ROOT / "docs" / "API.md").read_text()
    for kind in ERROR_TYPES:
        assert f"`{kind}`" in api_doc, kind
    # every type the code can raise is in the enum
    source = "".join(p.read_text() for p in (ROOT / "service").rglob("*.py"))
    raised = set(re.findall(r'RequestError\(\s*"([a-z_]+)"', source))
    raised |= set(re.findall(r'"type": "([a-z_]+)"', source))
    raised -= {"string", "number", "integer", "object", "array", "boolean"}  # JSON schema types
    assert raised, "the pattern found nothing"
    assert raised <= ERROR_TYPES, raised - ERROR_TYPES
    responses = spec["paths"]["/smooth"]["post"]["responses"]
    for code in ("401", "408", "413", "422", "500", "503", "504"):
        assert code in responses
