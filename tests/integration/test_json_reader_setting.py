"""``json_reader``: the precise reader for every JSON body gives the fast reader's answers and
errors; with it the compiled reader is never called."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from rnnserve.service.codec import bodies
from tests.integration.conftest import running_app

BODIES: list[Any] = [
    {"sequences": [[[0.25] * 16, [-1.5] * 16], [[2.0] * 16]]},
    {"inputs": [[[0.5] * 6] * 3]},
    {"sequences": [[[0.25] * 15]]},  # a feature short: 422 with its place
    {"sequences": []},  # no sequences
    {"sequences": [[[0.1] * 16]], "extra": 1},  # an unknown key
]


def path_of(body: dict[str, Any]) -> str:
    return "/rollout" if "inputs" in body else "/smooth"


async def answers(reader: str, calls: list[Any] | None = None) -> list[tuple[int, Any]]:
    out = []
    async with running_app(json_reader=reader) as (_, client):
        if calls is not None:
            calls.clear()  # the start-up's own warm-up reads two bodies with the fast reader
        for body in BODIES:
            r = await client.post(path_of(body), json=body)
            out.append((r.status_code, r.json()))
    return out


async def test_precise_and_fast_readers_answer_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = await answers("fast")
    calls: list[Any] = []
    real = bodies.decode

    def spy(body: bytes, ctype: str | None, *args: Any) -> Any:
        calls.append(ctype)
        return real(body, ctype, *args)

    monkeypatch.setattr(bodies, "decode", spy)
    precise = await answers("precise", calls)
    assert calls == []  # every body went to the precise reader
    assert [status for status, _ in precise] == [200, 200, 422, 422, 422]
    for (fs, fj), (ps, pj) in zip(fast, precise, strict=True):
        assert fs == ps
        if fs == 200:
            field = "positions" if "positions" in fj else "sequences"
            for a, b in zip(fj[field], pj[field], strict=True):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        else:
            assert (fj["type"], fj["loc"]) == (pj["type"], pj["loc"])


async def test_binary_bodies_take_the_codec_whatever_the_setting() -> None:
    x = np.ones((2, 16), np.float32)
    blob = bodies.encode_safetensors({"sequences": x, "lengths": np.array([2], np.int64)}, {})
    async with running_app(json_reader="precise") as (_, client):
        r = await client.post("/smooth", content=blob, headers={"content-type": bodies.SAFETENSORS})
    assert r.status_code == 200
    assert np.asarray(r.json()["sequences"]).shape == (1, 2, 16)
