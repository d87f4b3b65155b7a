"""``POST /admin/reload`` in-process: what the app derives from the served models (the default
model of ``/smooth``, ``/openapi.json``, ``GET /models``) follows each reload; a request checked
against a width a reload changed before it ran is answered 409 ``model_changed``."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from fastapi import FastAPI

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.interface import FlatSequences, Piece, ReloadReport
from tests.integration.conftest import AppClient

WIDTH = 4
TOKEN = {"authorization": "Bearer s3cret"}


def write(folder: Path, name: str, alpha: float, width: int = WIDTH) -> None:
    aside = folder / f".{name}.partial"
    models.save(models.build("smoother", {"feat_dim": width, "alpha_smooth": alpha}), aside)
    os.replace(aside, folder / f"{name}.safetensors")


async def test_the_default_model_and_the_description_follow_each_reload(
    app_client: AppClient, tmp_path: Path
) -> None:
    write(tmp_path, "a", 0.5)
    body = {"sequences": [[[1.0] * WIDTH] * 3]}
    async with app_client(model_dir=tmp_path, device="cpu", api_token="s3cret") as (_, client):
        r = await client.post("/smooth", json=body, headers=TOKEN)
        assert r.json()["model"] == "a"  # the only smoother
        assert (await client.post("/admin/reload")).status_code == 401
        write(tmp_path, "b", 0.3)
        r = await client.post("/admin/reload", headers=TOKEN)
        assert r.status_code == 200
        listed = (await client.get("/models", headers=TOKEN)).json()["models"]
        assert r.json() == {
            "loaded": ["b"], "changed": [], "removed": [], "unchanged": ["a"], "failed": [],
            "models": {m["name"]: m["version"] for m in listed},
        }  # fmt: skip
        assert (
            "- `b`: smoother, 4 input features"
            in ((await client.get("/openapi.json")).json()["info"]["description"])
        )
        r = await client.post("/smooth", json=body, headers=TOKEN)
        assert r.status_code == 422  # two smoothers, neither the default: name one
        assert r.json()["type"] == "missing"
        (tmp_path / "a.safetensors").unlink()
        r = await client.post("/admin/reload", headers=TOKEN)
        assert r.json()["removed"] == ["a"]
        r = await client.post("/smooth", json=body, headers=TOKEN)
        assert r.json()["model"] == "b"
        paths = (await client.get("/openapi.json")).json()["paths"]
        assert "/models/b/infer" in paths
        assert "/models/a/infer" not in paths


def smoother_answer(alpha: float, width: int, sequences: list[list[list[float]]]) -> np.ndarray:
    module = models.build("smoother", {"feat_dim": width, "alpha_smooth": alpha}).eval()
    assert isinstance(module, LinearRecursion)
    data = np.array([step for s in sequences for step in s], np.float32)
    return module.smooth_flat(data, np.array([len(s) for s in sequences], np.int64))


def steps_of(answer: list[list[list[float]]]) -> np.ndarray:
    return np.array([step for s in answer for step in s], np.float32)


def reload_before_the_run(app: FastAPI) -> list[ReloadReport]:
    """Have the next request reach the runtime only after a reload: what the HTTP layer checked
    it against (the served model's width) is then the version the reload replaced. The
    reports, once it has run."""
    runtime: ModelRuntime = app.state.runtime
    checked_then_run = runtime.infer
    reports: list[ReloadReport] = []

    async def infer(name: str, sequences: FlatSequences) -> FlatSequences:
        if not reports:
            reports.append(await runtime.reload())
        return await checked_then_run(name, sequences)

    runtime.infer = infer  # type: ignore[method-assign]  # this app's runtime only
    return reports


@pytest.mark.parametrize(
    ("path", "field", "loc"),
    [("/smooth", "sequences", ["model"]), ("/models/a/infer", "inputs", ["path", "name"])],
)
async def test_a_reload_that_widens_the_model_after_the_check_is_409_model_changed(
    app_client: AppClient, tmp_path: Path, path: str, field: str, loc: list[str]
) -> None:
    write(tmp_path, "a", 0.5)
    narrow = [[[0.5, -1.0, 2.0, 0.25]] * 3, [[1.0, 0.0, -0.5, 3.0]] * 2]
    wide = [[[0.5, -1.0, 2.0, 0.25, 4.0, -2.0]] * 3]
    async with app_client(model_dir=tmp_path, device="cpu") as (app, client):
        before = (await client.get("/models")).json()["models"][0]["version"]
        write(tmp_path, "a", 0.9, width=6)
        reports = reload_before_the_run(app)
        r = await client.post(path, json={field: narrow})
        assert [report.changed for report in reports] == [["a"]]
        after = app.state.runtime.models["a"].version
        assert after != before
        assert r.status_code == 409, r.text
        assert r.json() == {
            "type": "model_changed",
            "detail": f"model 'a' changed while this request was on its way: version "
            f"'{after}' takes 6 input features per step, the request's steps have 4",
            "loc": loc,
        }
        # sent again, it is checked against the new version
        r = await client.post(path, json={field: narrow})
        assert r.status_code == 422, r.text
        assert r.json()["type"] == "wrong_feature_count"
        r = await client.post(path, json={field: wide})
        assert r.status_code == 200, r.text
        got = steps_of(r.json()["sequences" if path == "/smooth" else "outputs"])
        np.testing.assert_allclose(got, smoother_answer(0.9, 6, wide), atol=1e-6, rtol=0)


def write_traveller(folder: Path, name: str, inputs: int) -> None:
    aside = folder / f".{name}.partial"
    config = {"num_inputs": inputs, "hidden_size": 8, "num_layers": 1}
    models.save(models.build("traveller", config), aside)
    os.replace(aside, folder / f"{name}.safetensors")


def reload_before_the_stream(app: FastAPI) -> list[ReloadReport]:
    """As :func:`reload_before_the_run`, for a streamed rollout (``open_stream``)."""
    runtime: ModelRuntime = app.state.runtime
    checked_then_opened = runtime.open_stream
    reports: list[ReloadReport] = []

    async def open_stream(name: str, sequences: FlatSequences) -> AsyncIterator[list[Piece]]:
        if not reports:
            reports.append(await runtime.reload())
        return await checked_then_opened(name, sequences)

    runtime.open_stream = open_stream  # type: ignore[method-assign]  # this app's runtime only
    return reports


async def test_a_streamed_rollout_checked_against_a_width_a_reload_changed_is_409(
    app_client: AppClient, tmp_path: Path
) -> None:
    write_traveller(tmp_path, "t", 3)
    stream = {"accept": "application/x-ndjson"}
    narrow = {"inputs": [[[0.5, -1.0, 2.0]] * 4]}
    async with app_client(model_dir=tmp_path, device="cpu") as (app, client):
        assert (await client.post("/rollout", json=narrow, headers=stream)).status_code == 200
        write_traveller(tmp_path, "t", 5)
        reports = reload_before_the_stream(app)
        r = await client.post("/rollout", json=narrow, headers=stream)
        assert [report.changed for report in reports] == [["t"]]
        version = app.state.runtime.models["t"].version
        assert r.status_code == 409, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.json() == {
            "type": "model_changed",
            "detail": f"model 't' changed while this request was on its way: version "
            f"'{version}' takes 5 input features per step, the request's steps have 3",
            "loc": ["model"],
        }
        r = await client.post("/rollout", json={"inputs": [[[0.5] * 5] * 4]}, headers=stream)
        assert r.status_code == 200, r.text
        assert r.headers["content-type"].startswith("application/x-ndjson")
