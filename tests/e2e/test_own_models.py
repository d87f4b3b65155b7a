"""A real ``rnnserve --model-dir`` serving your own exported GRU encoder next to a smoother."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from examples.gru_encoder import gru_cell_loop, make, make_packed
from rnnserve import models
from rnnserve.client import AsyncClient, BadRequest, Client, ModelNotFound
from rnnserve.models import export
from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e


def test_exported_gru_encoder_is_served(tmp_path: Path) -> None:
    encoder = make().eval()
    torch.save(encoder.state_dict(), tmp_path / "gru_encoder.pt")
    model_dir = tmp_path / "models"
    # the documented command, as a user runs it
    done = subprocess.run(
        [str(Path(sys.executable).with_name("rnnserve")), "export",
         "--checkpoint", str(tmp_path / "gru_encoder.pt"),
         "--name", "gru_encoder", "--out-dir", str(model_dir), "--activation", "l2_normalize"],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    shutil.copy(models.DEFAULT_MODEL_DIR / "smoother.safetensors", model_dir)

    server = start_server(tmp_path, "--model-dir", str(model_dir))
    try:
        listed = httpx.get(f"{server.url}/models", timeout=10).json()["models"]
        assert sorted(m["name"] for m in listed) == ["gru_encoder", "smoother"]
        assert next(m for m in listed if m["name"] == "gru_encoder")["kind"] == "recurrent"
        rng = np.random.default_rng(7)
        xs = [rng.standard_normal((n, 6)).astype(np.float32) for n in (25, 1, 8)]
        r = httpx.post(
            f"{server.url}/models/gru_encoder/infer",
            json={"inputs": [x.tolist() for x in xs]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "gru_encoder"
        for got, x in zip(r.json()["outputs"], xs, strict=True):
            want = gru_cell_loop(encoder, torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(np.array(got), want, atol=1e-5, rtol=0)
        r = httpx.post(f"{server.url}/models/gru_encoder/infer", json={"inputs": [[[1.0] * 5]]})
        assert r.status_code == 422
        assert r.json()["type"] == "wrong_feature_count"
        r = httpx.post(f"{server.url}/smooth", json={"sequences": [[[0.5] * 16]]}, timeout=30)
        assert r.status_code == 200
        _the_client_calls_it_by_name(server.url, encoder, xs)
    finally:
        stop(server)


def _the_client_calls_it_by_name(url: str, encoder: torch.nn.Module, xs: list[np.ndarray]) -> None:
    """The Python client's ``infer``: both formats, sync and async, one sequence or several."""
    want = [gru_cell_loop(encoder, torch.from_numpy(x)).numpy() for x in xs]
    for binary in ("always", "never"):
        with Client(url, binary=binary) as client:
            got = client.infer("gru_encoder", xs)
            for g, w in zip(got, want, strict=True):
                np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)
            one = client.infer("gru_encoder", xs[0])  # one [T, F] array in, one out
            np.testing.assert_allclose(one, want[0], atol=1e-5, rtol=0)
            with pytest.raises(ModelNotFound) as err:
                client.infer("nosuch", xs)
            assert err.value.status == 404
            with pytest.raises(BadRequest) as bad:
                client.infer("gru_encoder", [np.zeros((3, 5), np.float32)])
            assert bad.value.type == "wrong_feature_count"

    async def concurrently() -> list[Any]:
        async with AsyncClient(url) as client:
            return await asyncio.gather(*(client.infer("gru_encoder", [x]) for x in xs))

    for [g], w in zip(asyncio.run(concurrently()), want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0)


def test_a_torchscript_model_is_served_only_when_trusted(tmp_path: Path) -> None:
    model_dir = tmp_path / "models"
    root = Path(__file__).resolve().parents[2]
    # the documented command, as a user runs it
    done = subprocess.run(
        [str(Path(sys.executable).with_name("rnnserve")), "export", "--torchscript",
         "--factory", "examples.gru_encoder:make_packed", "--name", "gru_ts",
         "--out-dir", str(model_dir)],
        capture_output=True, text=True, timeout=240, check=False, cwd=root,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    path = model_dir / "gru_ts.torchscript.pt"
    assert path.is_file()
    # without the opt-in: the server does not start, and says why in one line
    env = {k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")}
    refused = subprocess.run(
        [str(Path(sys.executable).with_name("rnnserve")), "--port", "0", "--model-dir",
         str(model_dir)],
        capture_output=True, text=True, timeout=120, check=False, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert refused.returncode != 0
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith(f"rnnserve: {path}: ")
    assert "RNNSERVE_TRUST_TORCHSCRIPT=true" in line
    # with it: served, answering like the original module sequence by sequence
    server = start_server(
        tmp_path, "--model-dir", str(model_dir), env={"RNNSERVE_TRUST_TORCHSCRIPT": "true"}
    )
    try:
        listed = httpx.get(f"{server.url}/models", timeout=10).json()["models"]
        assert [(m["name"], m["kind"]) for m in listed] == [("gru_ts", "torchscript")]
        rng = np.random.default_rng(8)
        xs = [rng.standard_normal((n, 6)).astype(np.float32) for n in (13, 1, 6)]
        r = httpx.post(
            f"{server.url}/models/gru_ts/infer",
            json={"inputs": [x.tolist() for x in xs]},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        original = make_packed().eval()
        for got, x in zip(r.json()["outputs"], xs, strict=True):
            with torch.no_grad():
                want = export.one_sequence(original, torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(np.array(got), want, atol=1e-5, rtol=0)
    finally:
        stop(server)
