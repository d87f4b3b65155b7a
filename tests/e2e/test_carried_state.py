"""Carried state between real server processes: a stream's pieces sent to two replicas in
turn (neither keeps anything between requests) equal the whole stream sent to one; and
``--workers N``, which does not carry state yet, refuses it with a 4xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.server import Server, start_server, stop
from tests.integration.test_carried_state import (
    ENDPOINTS,
    PARTS,
    TOLERANCE,
    assert_close,
    cuts,
    random_streams,
    send,
    state_arrays,
    write_models,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    model_dir = write_models(tmp_path_factory.mktemp("models"))
    flags = ("--model-dir", str(model_dir))
    first = start_server(tmp_path_factory.mktemp("a"), *flags)
    try:
        second = start_server(tmp_path_factory.mktemp("b"), *flags)
    except BaseException:
        stop(first)
        raise
    yield first, second
    stop(first)
    stop(second)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "safetensors"])
async def test_pieces_sent_to_two_replicas_in_turn_equal_the_whole(
    replicas: tuple[Server, Server], binary: bool
) -> None:
    rng = np.random.default_rng(7 + binary)
    async with (
        httpx.AsyncClient(base_url=replicas[0].url, timeout=30) as a,
        httpx.AsyncClient(base_url=replicas[1].url, timeout=30) as b,
    ):
        for model in ENDPOINTS:
            xs = random_streams(rng, model, int(rng.integers(1, 4)))
            whole, whole_state = await send(a.post, model, xs, None, binary)
            pieces = int(rng.integers(2, 11))
            ends = [cuts(rng, len(x), pieces) for x in xs]
            outs: list[list[np.ndarray]] = [[] for _ in xs]
            state: Any = None
            for j in range(pieces):
                part = [x[(e[j - 1] if j else 0) : e[j]] for x, e in zip(xs, ends, strict=True)]
                replica = (a, b)[j % 2]  # the other replica each time
                ys, state = await send(replica.post, model, part, state, binary)
                for i, y in enumerate(ys):
                    outs[i].append(y)
            assert_close([np.concatenate(o) for o in outs], whole)
            got, want = state_arrays(state, binary), state_arrays(whole_state, binary)
            assert set(got) == PARTS[model]
            for name in PARTS[model]:
                assert float(np.abs(got[name] - want[name]).max()) <= TOLERANCE


def test_several_workers_refuse_a_carried_state(tmp_path: Path) -> None:
    """Not a 500: a 422 ``cannot_carry_state`` that names ``--workers``."""
    server = start_server(tmp_path, "--workers", "2")
    try:
        x = np.zeros((4, 6), np.float32).tolist()
        for doc, loc in (
            ({"inputs": [x], "return_state": True}, ["return_state"]),
            ({"inputs": [x], "state": {"model": "traveller", "version": "0",
                                       "sequences": [{"h": [[0.0]]}]}}, ["state"]),
        ):  # fmt: skip
            r = httpx.post(f"{server.url}/rollout", json=doc, timeout=30)
            assert r.status_code == 422, r.text
            body = r.json()
            assert (body["type"], body["loc"]) == ("cannot_carry_state", loc)
            assert "--workers" in body["detail"]
        plain = httpx.post(f"{server.url}/rollout", json={"inputs": [x]}, timeout=30)
        assert plain.status_code == 200
    finally:
        stop(server)
