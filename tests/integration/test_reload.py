"""``POST /admin/reload`` in-process: what the app derives from the served models (the default
model of ``/smooth``, ``/openapi.json``, ``GET /models``) follows each reload."""

from __future__ import annotations

import os
from pathlib import Path

from rnnserve import models
from tests.integration.conftest import AppClient

WIDTH = 4
TOKEN = {"authorization": "Bearer s3cret"}


def write(folder: Path, name: str, alpha: float) -> None:
    aside = folder / f".{name}.partial"
    models.save(models.build("smoother", {"feat_dim": WIDTH, "alpha_smooth": alpha}), aside)
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
