"""The inference endpoints are served before FastAPI's middleware and routing
(``rnnserve.service.http.routes.serve_inference``); FastAPI's own routes serve what the fast path
declines. Both must answer the same bytes, status and headers."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.types import ASGIApp, Receive, Scope, Send

from rnnserve.service.config import Settings
from rnnserve.service.http.app import App, create_app

pytestmark = pytest.mark.anyio


class _Seen:
    """A FastAPI middleware that records the paths FastAPI's own stack was asked to serve."""

    paths: list[str]

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            _Seen.paths.append(scope["path"])
        await self.app(scope, receive, send)


@asynccontextmanager
async def _clients(
    **overrides: Any,
) -> AsyncIterator[tuple[App, httpx.AsyncClient, httpx.AsyncClient]]:
    """One app; a client at its root (fast path) and one behind a proxy's ``root_path``, which
    the fast path declines (FastAPI routes it)."""
    app = create_app(Settings(**{"max_delay_ms": 1.0, **overrides}))
    app.add_middleware(_Seen)
    _Seen.paths = []
    async with app.router.lifespan_context(app):
        root = httpx.ASGITransport(app=app)
        proxied = httpx.ASGITransport(app=app, root_path="/api")
        async with (
            httpx.AsyncClient(transport=root, base_url="http://rnnserve") as fast,
            httpx.AsyncClient(transport=proxied, base_url="http://rnnserve/api") as routed,
        ):
            yield app, fast, routed


def _body(n: int, width: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"sequences" if width == 16 else "inputs": [
        rng.uniform(-1, 1, (t, width)).round(4).tolist() for t in range(1, n + 1)
    ]}  # fmt: skip


CASES: list[tuple[str, Any, dict[str, str]]] = [
    ("/smooth", _body(3, 16, 0), {}),
    ("/rollout", _body(2, 6, 1), {}),
    ("/models/smoother/infer", {"inputs": _body(2, 16, 2)["sequences"]}, {}),
    ("/models/traveller/infer", {"inputs": _body(1, 6, 3)["inputs"]}, {}),
    ("/smooth", {"sequences": [[[1.0] * 15]]}, {}),  # 422 wrong_feature_count
    ("/smooth", b'{"sequences": [[[1, 2,]]]}', {}),  # 400 invalid_json, with where
    ("/rollout", {"inputs": [[[1] * 6]], "model": "smoother"}, {}),  # 422 wrong_model_kind
    ("/models/nope/infer", {"inputs": [[[1]]]}, {}),  # 404 unknown_model
    ("/smooth", _body(1, 16, 4), {"X-Request-Timeout": "-1"}),  # 400 invalid_header
]


async def _post(
    client: httpx.AsyncClient, path: str, body: Any, headers: dict[str, str]
) -> httpx.Response:
    headers = {"X-Request-Id": "fixed-id", **headers}
    if isinstance(body, bytes):
        return await client.post(
            path, content=body, headers={"content-type": "application/json", **headers}
        )
    return await client.post(path, json=body, headers=headers)


@pytest.mark.parametrize(
    ("path", "body", "headers"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
async def test_the_fast_path_answers_as_fastapi_routing_does(
    path: str, body: Any, headers: dict[str, str]
) -> None:
    async with _clients() as (_, fast, routed):
        a = await _post(fast, path, body, headers)
        assert _Seen.paths == []  # served before FastAPI's stack
        b = await _post(routed, path, body, headers)
        assert _Seen.paths == ["/api" + path]  # served by FastAPI's routing
    assert (a.status_code, a.content) == (b.status_code, b.content)
    for name in ("content-type", "x-request-id", "retry-after", "www-authenticate"):
        assert a.headers.get(name) == b.headers.get(name), name
    assert a.headers["x-request-id"] == "fixed-id"


async def test_the_token_is_checked_on_the_fast_path() -> None:
    async with _clients(api_token="s3cret") as (_, fast, routed):
        body = _body(1, 16, 5)
        for auth in (None, "Bearer wrong", "Basic s3cret", "Bearer", "bearer s3cret"):
            headers = {"Authorization": auth} if auth else {}
            a = await fast.post("/smooth", json=body, headers=headers)
            b = await routed.post("/smooth", json=body, headers=headers)
            assert (a.status_code, a.content) == (b.status_code, b.content), auth
            assert a.headers.get("www-authenticate") == b.headers.get("www-authenticate"), auth
            expected = 200 if auth == "bearer s3cret" else 401  # the scheme is case-blind
            assert a.status_code == expected, auth
            if expected == 401:
                assert a.json()["type"] == "unauthorized"
                assert a.headers["www-authenticate"] == "Bearer"
        assert _Seen.paths == ["/api/smooth"] * 5
        # the label is the endpoint, never the client's path (a model name, a proxy's prefix)
        for client in (fast, routed):
            await client.post("/models/smoother/infer", json={"inputs": [[[1.0] * 16]]})
            await client.post("/models/no-such-model/infer", json={"inputs": [[[1.0]]]})
            await client.get("/models")
        rejected = (await fast.get("/metrics", headers={"Authorization": "Bearer s3cret"})).text
    label = 'rnnserve_requests_rejected_total{endpoint="%s",reason="unauthorized"}'
    # four refusals of /smooth on each path; the metric counts both the same way
    assert f"{label % 'smooth'} 8.0" in rejected
    assert f"{label % 'infer'} 4.0" in rejected
    assert f"{label % 'models'} 2.0" in rejected
    assert "no-such-model" not in rejected
    assert "api/" not in rejected


async def test_other_methods_and_paths_go_to_fastapi() -> None:
    async with _clients() as (_, fast, _routed):
        assert (await fast.get("/smooth")).status_code == 405
        assert (await fast.post("/models//infer", json={})).status_code == 404
        assert (await fast.post("/models/a/b/infer", json={})).status_code == 404
        slash = await fast.post("/smooth/", json=_body(1, 16, 6), follow_redirects=False)
        assert (slash.status_code, slash.headers["location"]) == (307, "http://rnnserve/smooth")
        assert (await fast.get("/healthz")).json() == {"status": "ok"}
        assert _Seen.paths == [
            "/smooth",
            "/models//infer",
            "/models/a/b/infer",
            "/smooth/",
            "/healthz",
        ]


async def test_the_extra_header_is_on_every_response() -> None:
    async with _clients() as (app, fast, _routed):
        app.extra_header = (b"x-rnnserve-worker", b"1234")
        for r in (
            await fast.post("/smooth", json=_body(1, 16, 7)),  # fast path
            await fast.post("/smooth", json={"sequences": []}),  # an error on it
            await fast.get("/healthz"),  # FastAPI
        ):
            assert r.headers["x-rnnserve-worker"] == "1234"
