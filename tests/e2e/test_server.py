"""A real ``rnnserve`` process on a free loopback port, driven by 64 concurrent clients."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from rnnserve import models
from tests.e2e.server import Server, start_server, stop
from tests.metrics import value
from tests.references import smoother_reference, stepwise_rollout

pytestmark = pytest.mark.e2e
CLIENTS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("e2e")
    srv = start_server(tmp, env={"RNNSERVE_MAX_DELAY_MS": "20"})
    yield srv
    stop(srv)


def batched_requests(text: str, model: str) -> tuple[float, float]:
    """(requests served, batches run) for ``model`` from the exposition text."""
    return (
        value(text, "rnnserve_batch_requests_sum", model=model),
        value(text, "rnnserve_batch_requests_count", model=model),
    )


async def _post_all(url: str, path: str, bodies: list[dict[str, object]]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        return await asyncio.gather(*(client.post(path, json=b) for b in bodies))


def assert_smoothed(seqs: list[np.ndarray], responses: list[httpx.Response]) -> None:
    """Each answer is 200 and its sequence the bundled smoother's reference output."""
    model = models.load("smoother")
    alpha, wx = model.alpha_smooth.detach().numpy(), model.wx.detach().numpy()
    for s, r in zip(seqs, responses, strict=True):
        assert r.status_code == 200, r.text
        (y,) = r.json()["sequences"]
        np.testing.assert_allclose(np.array(y), smoother_reference(s, alpha, wx), atol=1e-5)


def test_64_concurrent_smooth_clients(server: Server) -> None:
    rng = np.random.default_rng(42)
    seqs = [rng.standard_normal((int(n), 16)).astype(np.float32)
            for n in rng.integers(1, 120, CLIENTS)]  # fmt: skip
    responses = asyncio.run(
        _post_all(server.url, "/smooth", [{"sequences": [s.tolist()]} for s in seqs])
    )
    assert_smoothed(seqs, responses)
    served, batches = batched_requests(httpx.get(f"{server.url}/metrics").text, "smoother")
    assert served >= CLIENTS
    assert batches < served, "every batch held a single request: nothing was batched"


def test_large_json_bodies_on_codec_threads_beside_small_ones(server: Server) -> None:
    """16 bodies of 4,000 steps (~0.7 MB each: read and answered on the server's codec threads)
    sent with 48 small ones, all at once: every answer equals the reference (which thread read
    what is checked in-process: tests/integration/test_codec_threads.py)."""
    rng = np.random.default_rng(11)
    lengths = [4000 if i % 4 == 0 else int(rng.integers(1, 120)) for i in range(CLIENTS)]
    seqs = [rng.uniform(-1, 1, (n, 16)).astype(np.float32) for n in lengths]
    responses = asyncio.run(
        _post_all(server.url, "/smooth", [{"sequences": [s.tolist()]} for s in seqs])
    )
    assert_smoothed(seqs, responses)


def test_64_concurrent_rollout_clients(server: Server) -> None:
    rng = np.random.default_rng(7)
    seqs = [rng.standard_normal((int(n), 6)).astype(np.float32)
            for n in rng.integers(1, 60, CLIENTS)]  # fmt: skip
    responses = asyncio.run(
        _post_all(server.url, "/rollout", [{"inputs": [s.tolist()]} for s in seqs])
    )
    model = models.load("traveller", rollout_backend="eager")
    for s, r in zip(seqs, responses, strict=True):
        assert r.status_code == 200, r.text
        (y,) = r.json()["positions"]
        with torch.inference_mode():
            ref = stepwise_rollout(model.lstm_layers, model.output_layer, model.activation,
                               torch.from_numpy(s)[:, None, :])  # fmt: skip
        np.testing.assert_allclose(np.array(y), ref.numpy(), atol=1e-5)
    served, batches = batched_requests(httpx.get(f"{server.url}/metrics").text, "traveller")
    assert served >= CLIENTS
    assert batches < served, "every batch held a single request: nothing was batched"


def test_binds_loopback_by_default(server: Server) -> None:
    # started without --host: uvicorn's start-up line names the address it bound
    port = server.url.rsplit(":", 1)[1]
    log = server.log.read_text()
    assert f"Uvicorn running on http://127.0.0.1:{port}" in log, log
    assert "0.0.0.0" not in log


def test_bad_input_does_not_hurt_the_process(server: Server) -> None:
    r = httpx.post(f"{server.url}/rollout", content=b'{"inputs": [[[1, 2, NaN]]]}')
    assert r.status_code == 422
    r = httpx.post(f"{server.url}/smooth", content=b"\xff\xfe garbage")
    assert r.status_code == 400
    assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_flags_and_environment_configure_the_server(tmp_path: Path) -> None:
    srv = start_server(
        tmp_path,
        "--rollout-backend",
        "eager",
        env={"RNNSERVE_ROLLOUT_BACKEND": "torchscript", "RNNSERVE_MAX_SEQUENCE_LENGTH": "3"},
    )
    try:
        info = {m["name"]: m for m in httpx.get(f"{srv.url}/models").json()["models"]}
        assert info["traveller"]["config"]["rollout_backend"] == "eager"  # the flag wins
        r = httpx.post(f"{srv.url}/rollout", json={"inputs": [[[0.0] * 6] * 4]})
        assert r.status_code == 413  # the environment applies
    finally:
        stop(srv)


def test_help_lists_the_settings() -> None:
    exe = Path(sys.executable).with_name("rnnserve")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, check=True)
    for flag in ("--host", "--port", "--max-batch-size", "--max-delay-ms", "--device"):
        assert flag in out.stdout


def _in_flight(url: str, endpoint: str) -> float:
    return value(httpx.get(f"{url}/metrics").text, "rnnserve_requests_in_flight", endpoint=endpoint)


def test_sigterm_finishes_accepted_requests(tmp_path: Path) -> None:
    # one-step chunks: the first rollouts must still be running when the twelfth request
    # arrives, however slowly a loaded machine lets this client send them
    srv = start_server(tmp_path, "--max-batch-size", "2", "--rollout-chunk-steps", "1")
    inputs = np.random.default_rng(3).standard_normal((2000, 6)).round(3).tolist()

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
            tasks = [
                asyncio.ensure_future(client.post("/rollout", json={"inputs": [inputs]}))
                for _ in range(12)
            ]
            deadline = time.monotonic() + 30
            while _in_flight(srv.url, "rollout") < 12:  # all 12 accepted, most still queued
                assert time.monotonic() < deadline, "requests never arrived"
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 12
    first = np.asarray(responses[0].json()["positions"])
    for r in responses:  # the same input, batched with different company: float32 rounding
        np.testing.assert_allclose(np.asarray(r.json()["positions"]), first, atol=1e-6, rtol=0)
    assert srv.proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert "Application shutdown complete" in srv.log.read_text()
