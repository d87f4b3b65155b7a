"""A large JSON body the compiled reader declines (an escaped key) through the app: read in the
precise reader's child process, not the serving one, with the same answer as its plain twin;
its parse's memory held in the byte budget (413 when it could never fit, given back after)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from rnnserve.service.http import precise
from tests.metrics import value

from .conftest import running_app

HEADERS = {"content-type": "application/json"}


def _bodies(steps: int) -> tuple[bytes, bytes]:
    """A plain body and the same with its key escaped (the compiled reader declines that)."""
    rows = np.random.default_rng(3).uniform(-1, 1, (steps, 16)).round(5).tolist()
    plain = orjson.dumps({"sequences": [rows]})
    escaped = plain.replace(b'"sequences"', b'"s\\u0065quences"', 1)
    assert escaped != plain
    return plain, escaped


@pytest.fixture
def parsed_here(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the precise parses run in this (the serving) process."""
    calls: list[int] = []
    parse = precise.parse_body

    def counted(*args: Any) -> Any:
        calls.append(len(args[0]))
        return parse(*args)

    monkeypatch.setattr(precise, "parse_body", counted)
    return calls


async def test_a_large_escaped_body_is_read_in_the_child_with_the_plain_answer(
    parsed_here: list[int],
) -> None:
    plain, escaped = _bodies(5_000)
    assert len(escaped) > precise.CHILD_MIN_BYTES
    async with running_app() as (_, client):
        want = await client.post("/smooth", content=plain, headers=HEADERS)
        got = await client.post("/smooth", content=escaped, headers=HEADERS)
        text = (await client.get("/metrics")).text
    assert (want.status_code, got.status_code) == (200, 200)
    assert got.content == want.content
    assert parsed_here == []  # read in the child
    assert value(text, "rnnserve_request_bytes_in_flight") == 0  # the parse's share given back


async def test_a_body_whose_precise_parse_could_never_fit_the_budget_is_a_413(
    parsed_here: list[int],
) -> None:
    plain, escaped = _bodies(5_000)
    cost = precise.precise_cost(escaped)
    budget = (len(escaped) + cost) // 2  # the body fits; its precise parse does not
    async with running_app(max_inflight_bytes=budget, max_request_bytes=budget) as (_, client):
        ok = await client.post("/smooth", content=plain, headers=HEADERS)
        refused = await client.post("/smooth", content=escaped, headers=HEADERS)
        text = (await client.get("/metrics")).text
    assert ok.status_code == 200
    assert refused.status_code == 413
    error = refused.json()
    assert error["type"] == "body_too_large"
    assert f"about {cost} bytes" in error["detail"]
    assert f"max_inflight_bytes ({budget})" in error["detail"]
    assert len(refused.content) < 400  # short, no echo
    assert parsed_here == []  # refused before any parse
    assert value(text, "rnnserve_request_bytes_in_flight") == 0


async def test_a_small_escaped_body_is_read_in_place(parsed_here: list[int]) -> None:
    plain, escaped = _bodies(20)
    async with running_app() as (_, client):
        want = await client.post("/smooth", content=plain, headers=HEADERS)
        got = await client.post("/smooth", content=escaped, headers=HEADERS)
    assert got.content == want.content
    assert parsed_here == [len(escaped)]
