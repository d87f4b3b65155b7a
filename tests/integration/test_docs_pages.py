"""Docs pages from bundled assets, the served OpenAPI document and its examples, in-process."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller
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


async def post_every_example(client: httpx.AsyncClient) -> list[str]:
    """POST each request example of /openapi.json: 200, and the answer is exactly the 200
    example of the same name (the model's real answer, not an illustration)."""
    schema = (await client.get("/openapi.json")).json()
    posted = []
    for path, ops in schema["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
            for name, example in content.get("examples", {}).items():
                answers = op["responses"]["200"]["content"]["application/json"]["examples"]
                r = await client.request(method, path, json=example["value"])
                assert r.status_code == 200, (path, name, r.text)
                assert name in answers, (path, name)
                assert r.json() == answers[name]["value"], (path, name)
                posted.append(f"{path} {name}")
    return posted


async def test_every_example_succeeds_as_given_and_answers_as_documented(
    client: httpx.AsyncClient,
) -> None:
    posted = await post_every_example(client)
    # a default and a named example per endpoint, and one per model's own path
    assert len(posted) == 6, posted
    assert "/models/smoother/infer example" in posted
    assert "/models/traveller/infer example" in posted


async def test_every_example_answers_as_documented_with_batch_rollouts(
    app_client: AppClient,
) -> None:
    async with app_client(rollout_scheduling="batch") as (_, client):
        assert len(await post_every_example(client)) == 6


async def test_the_streamed_rollout_example_is_the_real_stream(app_client: AppClient) -> None:
    async with app_client(rollout_chunk_steps=2) as (_, client):
        schema = (await client.get("/openapi.json")).json()
        op = schema["paths"]["/rollout"]["post"]
        request = op["requestBody"]["content"]["application/json"]["examples"]["default model"]
        r = await client.post(
            "/rollout", json=request["value"], headers={"accept": "application/x-ndjson"}
        )
        assert r.status_code == 200, r.text
        documented = op["responses"]["200"]["content"]["application/x-ndjson"]["example"]
        assert r.text == documented
        assert documented.count("\n") == 4  # steps 0-1 of both sequences, step 2, done


async def test_each_model_has_its_own_path_with_its_widths(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    for name, f_in, f_out in (("smoother", 16, 16), ("traveller", 6, 2)):
        op = schema["paths"][f"/models/{name}/infer"]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        step = body["properties"]["inputs"]["items"]["items"]
        assert step["minItems"] == step["maxItems"] == f_in
        assert body["properties"]["model"]["enum"] == [name]
        answer = op["responses"]["200"]["content"]["application/json"]["schema"]
        out_step = answer["properties"]["outputs"]["items"]["items"]
        assert out_step["minItems"] == out_step["maxItems"] == f_out
        assert not [p for p in op.get("parameters", []) if p["in"] == "path"]
        # a wrong width is refused there, naming the model's width
        r = await client.post(f"/models/{name}/infer", json={"inputs": [[[0.5] * (f_in + 1)]]})
        assert r.status_code == 422
        assert r.json()["type"] == "wrong_feature_count"
        assert f"takes {f_in}" in r.json()["detail"]
    ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    generic = schema["paths"]["/models/{name}/infer"]["post"]
    assert "smoother, traveller" in generic["parameters"][0]["description"]


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
