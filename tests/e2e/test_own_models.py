"""A real ``rnnserve --model-dir`` serving your own exported GRU encoder next to a smoother."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import models
from examples.gru_encoder import gru_cell_loop, make
from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e


def test_exported_gru_encoder_is_served(tmp_path: Path) -> None:
    encoder = make().eval()
    torch.save(encoder.state_dict(), tmp_path / "gru_encoder.pt")
    model_dir = tmp_path / "models"
    # the documented command, as a user runs it
    done = subprocess.run(
        [sys.executable, "-m", "models.export", "--checkpoint", str(tmp_path / "gru_encoder.pt"),
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
    finally:
        stop(server)
