"""Which answer a request gets from its ``Accept`` header, through the real app: ``q=0``
refuses a type, and media types are matched whatever their case."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from safetensors.numpy import load

from tests.integration.conftest import AppClient

NDJSON = "application/x-ndjson"
ST = "application/x-safetensors"
JSON = "application/json"
ROLLOUT = {"inputs": [[[0.1] * 6] * 5]}


async def _rollout(app_client: AppClient, accept: str) -> tuple[str, Any]:
    """The content type of /rollout's answer to ``accept``, and its positions."""
    async with app_client() as (_, client):
        r = await client.post("/rollout", json=ROLLOUT, headers={"accept": accept})
    assert r.status_code == 200, r.text
    ctype = r.headers["content-type"]
    if ctype.startswith(NDJSON):
        lines = [orjson.loads(line) for line in r.content.splitlines()]
        assert lines[-1] == {"model": "traveller", "done": True}
        return NDJSON, lines[0]["positions"]
    if ctype.startswith(ST):
        return ST, load(r.content)["positions"].tolist()
    assert ctype.startswith(JSON)
    return JSON, r.json()["positions"][0]


@pytest.mark.parametrize(
    ("accept", "answer"),
    [
        (f"{NDJSON};q=0, {JSON}", JSON),
        (f"{NDJSON};q=0", JSON),
        ("APPLICATION/X-NDJSON", NDJSON),
        (f"{JSON};q=0.5, {NDJSON}", NDJSON),
        (f"{NDJSON};q=0.5, {JSON}", JSON),
        (f"{ST};q=0, {JSON}", JSON),
        ("Application/X-Safetensors", ST),
        (f"{JSON};q=0.9, {ST}", ST),
        (f"{ST};q=0.5, */*", JSON),
    ],
)
async def test_rollout_answers_the_type_the_accept_header_prefers(
    app_client: AppClient, accept: str, answer: str
) -> None:
    got, positions = await _rollout(app_client, accept)
    assert got == answer
    whole = (await _rollout(app_client, JSON))[1]
    assert np.array_equal(
        np.asarray(positions, np.float32).reshape(-1), np.asarray(whole, np.float32).reshape(-1)
    )
