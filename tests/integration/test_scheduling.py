"""Continuous batching of rollouts and per-model worker threads, through the real app."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest
import torch

from rnnserve import models
from tests.integration.conftest import AppClient
from tests.metrics import value
from tests.references import stepwise_rollout


async def _running(client: httpx.AsyncClient) -> None:
    """Wait until the one rollout in flight has left the queue, i.e. is running. In flight
    and not queued is also a body still being parsed: with codec threads (a large body) that
    runs beside this loop, so the tests that use this parse on the loop (codec_threads=0)."""
    for _ in range(500):
        text = (await client.get("/metrics")).text
        in_flight = value(text, "rnnserve_requests_in_flight", endpoint="rollout")
        if in_flight == 1 and value(text, "rnnserve_queue_depth", model="traveller") == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the long rollout never started")


@pytest.mark.parametrize("scheduling", ["continuous", "batch"])
async def test_both_schedulers_answer_every_caller_with_its_own_positions(
    app_client: AppClient, scheduling: str
) -> None:
    rng = np.random.default_rng(11)
    requests = [
        [rng.standard_normal((n, 6)).astype(np.float32) for n in lengths]
        for lengths in ((130,), (3, 70), (1,), (64, 65, 2), (200,))
    ]
    async with app_client(
        rollout_scheduling=scheduling, rollout_chunk_steps=16, max_batch_size=4
    ) as (_, client):
        rs = await asyncio.gather(
            *(client.post("/rollout", json={"inputs": [a.tolist() for a in r]}) for r in requests)
        )
        text = (await client.get("/metrics")).text
    model = models.load("traveller", rollout_backend="eager")
    for req, r in zip(requests, rs, strict=True):
        assert r.status_code == 200, r.text
        for u, y in zip(req, r.json()["positions"], strict=True):
            with torch.inference_mode():
                ref = stepwise_rollout(model.lstm_layers, model.output_layer, model.activation,
                                   torch.from_numpy(u)[:, None])  # fmt: skip
            np.testing.assert_allclose(np.array(y), ref.numpy(), atol=1e-5, rtol=0)
    steps = sum(len(u) for r in requests for u in r)
    assert value(text, "rnnserve_batch_timesteps_sum", model="traveller") == steps
    waits = value(text, "rnnserve_queue_wait_seconds_count", model="traveller")
    assert waits == len(requests)
    batches = value(text, "rnnserve_batch_requests_count", model="traveller")
    if scheduling == "batch":
        assert batches <= len(requests)
    # continuous: one batch per run of chunks in which no request joined, left or finished, a
    # count that depends on when they arrived (the next test shows the chunks' effect)


@pytest.mark.parametrize("scheduling", ["continuous", "batch"])
async def test_a_short_rollout_does_not_wait_for_a_long_one(
    app_client: AppClient, scheduling: str
) -> None:
    long_inputs = np.zeros((30_000, 6), np.float32).tolist()
    async with app_client(
        rollout_scheduling=scheduling, rollout_chunk_steps=32, max_delay_ms=0.0, codec_threads=0
    ) as (_, client):
        finished: list[str] = []

        async def post(name: str, path: str, body: object) -> httpx.Response:
            r = await client.post(path, json=body, timeout=120)
            finished.append(name)
            return r

        long = asyncio.ensure_future(post("long", "/rollout", {"inputs": [long_inputs]}))
        await _running(client)
        short = await post("short", "/rollout", {"inputs": [[[0.1] * 6] * 5]})
        smooth = await post("smooth", "/smooth", {"sequences": [[[0.2] * 16] * 5]})
        assert (await long).status_code == 200
    assert short.status_code == 200
    assert smooth.status_code == 200
    if scheduling == "continuous":
        assert finished == ["short", "smooth", "long"]
    else:  # whole-batch scheduling: the short rollout waits for the long batch to end
        assert finished == ["long", "short", "smooth"]


async def test_a_long_rollout_does_not_block_the_smoother(app_client: AppClient) -> None:
    """Each model has its own worker thread: /smooth runs while a whole rollout batch runs."""
    long_inputs = np.zeros((30_000, 6), np.float32).tolist()
    async with app_client(rollout_scheduling="batch", max_delay_ms=0.0, codec_threads=0) as (
        _,
        client,
    ):
        long = asyncio.ensure_future(
            client.post("/rollout", json={"inputs": [long_inputs]}, timeout=120)
        )
        await _running(client)
        smooth = await client.post("/smooth", json={"sequences": [[[0.2] * 16] * 5]})
        assert smooth.status_code == 200
        assert not long.done()
        assert (await long).status_code == 200
