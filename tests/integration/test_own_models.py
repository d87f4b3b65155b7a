"""``POST /models/{name}/infer`` in-process: your own exported GRU encoder next to a smoother."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from examples.gru_encoder import GRUEncoder, gru_cell_loop, make, make_packed
from rnnserve import models
from rnnserve.models import export
from rnnserve.service.codec import bodies
from tests.integration.conftest import AppClient


@pytest.fixture(scope="module")
def encoder() -> GRUEncoder:
    return make().eval()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, encoder: GRUEncoder) -> Path:
    d = tmp_path_factory.mktemp("own")
    found = export.find_in_module(encoder)
    cfg = export.config_of(found, "l2_normalize", {})
    export.export(found, cfg, "gru_encoder", d)
    shutil.copy(models.DEFAULT_MODEL_DIR / "smoother.safetensors", d)
    return d


def sequences(seed: int, lengths: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, 6)).astype(np.float32) for n in lengths]


def expected(encoder: GRUEncoder, xs: list[np.ndarray]) -> list[np.ndarray]:
    return [gru_cell_loop(encoder, torch.from_numpy(x)).numpy() for x in xs]


async def test_infer_answers_like_a_gru_cell_loop(
    app_client: AppClient, model_dir: Path, encoder: GRUEncoder
) -> None:
    async with app_client(model_dir=model_dir, max_delay_ms=20) as (_, client):
        listed = (await client.get("/models")).json()["models"]
        mine = next(m for m in listed if m["name"] == "gru_encoder")
        assert mine["kind"] == "recurrent"
        assert mine["shapes"] == {"input": ["T", 6], "output": ["T", 4]}
        assert mine["config"]["activation"] == "l2_normalize"
        # concurrent requests are batched together; each gets its own answer
        batches = [sequences(i, (3 + i, 1, 17)) for i in range(6)]
        replies = await asyncio.gather(
            *(
                client.post("/models/gru_encoder/infer", json={"inputs": [x.tolist() for x in b]})
                for b in batches
            )
        )
        for body, r in zip(batches, replies, strict=True):
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "gru_encoder"
            outs = r.json()["outputs"]
            for got, want in zip(outs, expected(encoder, body), strict=True):
                np.testing.assert_allclose(np.array(got), want, atol=1e-5, rtol=0)
        # the binary format, both ways
        xs = sequences(9, (4, 2))
        flat = {"inputs": np.concatenate(xs), "lengths": np.array([4, 2], np.int64)}
        r = await client.post(
            "/models/gru_encoder/infer",
            content=bodies.encode_safetensors(flat, {}),
            headers={"content-type": bodies.SAFETENSORS, "accept": bodies.SAFETENSORS},
        )
        assert r.status_code == 200, r.text
        from safetensors.numpy import load

        out = load(r.content)
        np.testing.assert_allclose(
            out["outputs"], np.concatenate(expected(encoder, xs)), atol=1e-5, rtol=0
        )
        # the smoother answers there too, like at /smooth
        smooth = [[[0.5] * 16, [1.0] * 16]]
        a = await client.post("/models/smoother/infer", json={"inputs": smooth})
        b = await client.post("/smooth", json={"sequences": smooth})
        assert a.json()["outputs"] == b.json()["sequences"]


async def test_infer_errors(app_client: AppClient, model_dir: Path) -> None:
    async with app_client(model_dir=model_dir) as (_, client):
        bad = [[[0.0] * 6, [0.0] * 6], [[0.0] * 6, [0.0] * 5]]
        r = await client.post("/models/gru_encoder/infer", json={"inputs": bad})
        assert r.status_code == 422
        assert r.json()["type"] == "wrong_feature_count"
        assert r.json()["loc"] == ["inputs", 1, 1]
        assert "sequence 1, step 1" in r.json()["detail"]
        r = await client.post("/models/nope/infer", json={"inputs": [[[0.0] * 6]]})
        assert r.status_code == 404
        assert r.json()["type"] == "unknown_model"
        assert r.json()["loc"] == ["path", "name"]
        r = await client.post(
            "/models/gru_encoder/infer", json={"inputs": [[[0.0] * 6]], "model": "smoother"}
        )
        assert r.status_code == 422
        assert r.json()["loc"] == ["model"]
        r = await client.post("/models/gru_encoder/infer", json={"inputs": [[[0.0] * 6]], "x": 1})
        assert r.status_code == 422
        assert r.json()["type"] == "unknown_field"
        r = await client.post("/models/gru_encoder/infer", json={"inputs": [[[1e39] + [0.0] * 5]]})
        assert r.status_code == 422
        assert r.json()["type"] == "non_finite"
        # a recurrent model is not a smoother: /smooth says where to send it
        r = await client.post("/smooth", json={"sequences": [[[0.0] * 6]], "model": "gru_encoder"})
        assert r.status_code == 422
        assert r.json()["type"] == "wrong_model_kind"
        assert "/models/gru_encoder/infer" in r.json()["detail"]
        # the schema documents the route with its body model
        spec = (await client.get("/openapi.json")).json()
        op = spec["paths"]["/models/{name}/infer"]["post"]
        assert "inputs" in op["requestBody"]["content"]["application/json"]["schema"]["properties"]


@pytest.fixture(scope="module")
def torchscript_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("own_ts")
    export.export_torchscript(make_packed(), 6, "gru_ts", d)
    shutil.copy(models.DEFAULT_MODEL_DIR / "smoother.safetensors", d)
    return d


async def test_a_trusted_torchscript_model_answers_like_the_original(
    app_client: AppClient, torchscript_dir: Path, encoder: GRUEncoder
) -> None:
    original = make_packed().eval()
    async with app_client(model_dir=torchscript_dir, trust_torchscript=True, max_delay_ms=20) as (
        _,
        client,
    ):
        listed = (await client.get("/models")).json()["models"]
        mine = next(m for m in listed if m["name"] == "gru_ts")
        assert mine["kind"] == "torchscript"
        assert mine["shapes"] == {"input": ["T", 6], "output": ["T", 4]}
        batches = [sequences(20 + i, (2 + i, 11, 1)) for i in range(5)]
        replies = await asyncio.gather(
            *(
                client.post("/models/gru_ts/infer", json={"inputs": [x.tolist() for x in b]})
                for b in batches
            )
        )
        for body, r in zip(batches, replies, strict=True):
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "gru_ts"
            for got, x in zip(r.json()["outputs"], body, strict=True):
                with torch.no_grad():
                    want = export.one_sequence(original, torch.from_numpy(x)).numpy()
                np.testing.assert_allclose(np.array(got), want, atol=1e-5, rtol=0)
                ref = gru_cell_loop(encoder, torch.from_numpy(x)).numpy()
                np.testing.assert_allclose(np.array(got), ref, atol=1e-5, rtol=0)
        # bad input is a 4xx naming where, as for every model
        r = await client.post("/models/gru_ts/infer", json={"inputs": [[[0.0] * 6, [0.0] * 7]]})
        assert r.status_code == 422
        assert (r.json()["type"], r.json()["loc"]) == ("wrong_feature_count", ["inputs", 0, 1])
        r = await client.post("/smooth", json={"sequences": [[[0.0] * 6]], "model": "gru_ts"})
        assert r.status_code == 422
        assert r.json()["type"] == "wrong_model_kind"
        # its own OpenAPI path: widths, and an example whose documented answer is the real one
        spec = (await client.get("/openapi.json")).json()
        op = spec["paths"]["/models/gru_ts/infer"]["post"]
        body = op["requestBody"]["content"]["application/json"]
        step = body["schema"]["properties"]["inputs"]["items"]["items"]
        assert step["minItems"] == step["maxItems"] == 6
        r = await client.post("/models/gru_ts/infer", json=body["examples"]["example"]["value"])
        assert r.status_code == 200
        documented = op["responses"]["200"]["content"]["application/json"]["examples"]
        assert r.json() == documented["example"]["value"]
