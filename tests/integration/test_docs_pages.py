"""Docs pages from bundled assets, the served OpenAPI document and its examples, in-process."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

import models
from models.smoothing import LinearRecursion
from models.traveller import Traveller
from tests.integration.conftest import AppClient


def local_urls(html: str) -> list[str]:
    urls = re.findall(r"""(?:src|href)\s*=\s*["']([^"']+)["']""", html)
    urls += re.findall(r"""url:\s*["']([^"']+)["']""", html)
    urls += re.findall(r"""spec-url\s*=\s*["']([^"']+)["']""", html)
    return urls


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_docs_pages_use_only_local_assets(client: httpx.AsyncClient, page: str) -> None:
    r = await client.get(page)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    html = r.text
    assert "http://" not in html
    assert "https://" not in html  # no CDN, no Google fonts
    urls = local_urls(html)
    assert "/openapi.json" in urls
    assets = [u for u in urls if u.startswith("/docs/assets/")]
    assert len(assets) >= (3 if page == "/docs" else 2), urls
    for url in urls:
        assert url.startswith("/"), url
        got = await client.get(url)
        assert got.status_code == 200, url
        assert len(got.content) > 1000, url


async def test_every_example_succeeds_as_given(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    posted = 0
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            for name, example in content.get("examples", {}).items():
                r = await client.request(method, path, json=example["value"])
                assert r.status_code == 200, (path, name, r.text)
                posted += 1
    assert posted >= 4  # a default and a named example per endpoint


async def test_openapi_document_reflects_the_loaded_models(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert schema["openapi"].startswith("3.")
    seqs = schema["paths"]["/smooth"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]["sequences"]  # fmt: skip
    assert seqs["items"]["items"]["maxItems"] == 16
    assert "smoother" in schema["info"]["description"]


async def test_docs_are_open_when_a_token_is_set(app_client: AppClient) -> None:
    async with app_client(api_token="s3cret-token-value") as (_, client):
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"):
            assert (await client.get(path)).status_code == 200, path
        assert (await client.get("/models")).status_code == 401
        auth = {"Authorization": "Bearer s3cret-token-value"}
        listed = await client.get("/models", headers=auth)
        assert listed.status_code == 200
        assert "s3cret-token-value" not in listed.text
        assert "s3cret-token-value" not in (await client.get("/openapi.json")).text


def write_models(tmp_path: Path, **mods: LinearRecursion | Traveller) -> Path:
    for name, module in mods.items():
        models.save(module, tmp_path / f"{name}.safetensors")
    return tmp_path


async def test_the_only_smoother_is_the_default(app_client: AppClient, tmp_path: Path) -> None:
    where = write_models(tmp_path, mine=LinearRecursion(4))
    async with app_client(model_dir=where) as (_, client):
        r = await client.post("/smooth", json={"sequences": [[[0.1, 0.2, 0.3, 0.4]]]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "mine"
        listed = (await client.get("/models")).json()
        assert listed["defaults"] == {"/smooth": "mine", "/rollout": None}
        assert listed["settings"]["model_dir"] == str(where)
        r = await client.post("/rollout", json={"inputs": [[[0.0] * 6]]})
        assert r.status_code == 404
        assert r.json()["type"] == "unknown_model"
        schema = (await client.get("/openapi.json")).json()
        step = schema["paths"]["/smooth"]["post"]["requestBody"]["content"]["application/json"][
            "schema"]["properties"]["sequences"]["items"]["items"]  # fmt: skip
        assert step["minItems"] == step["maxItems"] == 4


async def test_several_smoothers_need_a_name_or_a_default(
    app_client: AppClient, tmp_path: Path
) -> None:
    where = write_models(tmp_path, a=LinearRecursion(4), b=LinearRecursion(2))
    async with app_client(model_dir=where) as (_, client):
        r = await client.post("/smooth", json={"sequences": [[[0.1, 0.2]]]})
        assert r.status_code == 422
        err = r.json()
        assert err["type"] == "missing"
        assert err["loc"] == ["model"]
        assert "a, b" in err["detail"]
        r = await client.post("/smooth", json={"sequences": [[[0.1, 0.2]]], "model": "b"})
        assert r.status_code == 200
    async with app_client(model_dir=where, default_smoother="b") as (_, client):
        r = await client.post("/smooth", json={"sequences": [[[0.1, 0.2]]]})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "b"
        schema = (await client.get("/openapi.json")).json()
        for name, example in schema["paths"]["/smooth"]["post"]["requestBody"]["content"][
            "application/json"]["examples"].items():  # fmt: skip
            got = await client.post("/smooth", json=example["value"])
            assert got.status_code == 200, (name, got.text)
