"""Carried state between real server processes: a stream's pieces sent to two replicas in
turn (neither keeps anything between requests) equal the whole stream sent to one; and the
same through a server with ``--workers 2``, where each piece's state crosses the socket
between an HTTP worker and the engine process both ways."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.e2e.server import Server, start_server, stop
from tests.e2e.test_workers import one_client_per_worker
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


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model_dir = write_models(tmp_path_factory.mktemp("models"))
    server = start_server(tmp_path_factory.mktemp("w"), "--model-dir", str(model_dir),
                          "--workers", "2")  # fmt: skip
    yield server
    stop(server)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "safetensors"])
async def test_pieces_carried_through_several_workers_equal_the_whole(
    workers: Server, binary: bool
) -> None:
    """Each piece goes to the other HTTP worker: the state one worker's answer carried is
    continued by the other, through the one engine process."""
    rng = np.random.default_rng(17 + binary)
    async with one_client_per_worker(workers.url) as pinned:
        client = pinned[0]
        for model in ("smoother", "traveller"):
            xs = random_streams(rng, model, int(rng.integers(2, 4)))
            whole, whole_state = await send(client.post, model, xs, None, binary)
            pieces = int(rng.integers(3, 11))
            ends = [cuts(rng, len(x), pieces) for x in xs]
            outs: list[list[np.ndarray]] = [[] for _ in xs]
            state: Any = None
            for j in range(pieces):
                part = [x[(e[j - 1] if j else 0) : e[j]] for x, e in zip(xs, ends, strict=True)]
                ys, state = await send(pinned[j % 2].post, model, part, state, binary)
                for i, y in enumerate(ys):
                    outs[i].append(y)
            assert_close([np.concatenate(o) for o in outs], whole)
            got, want = state_arrays(state, binary), state_arrays(whole_state, binary)
            assert set(got) == PARTS[model]
            for name in PARTS[model]:
                assert got[name].shape == want[name].shape
                assert float(np.abs(got[name] - want[name]).max()) <= TOLERANCE


async def test_a_carried_state_starts_a_stream_through_several_workers(workers: Server) -> None:
    x = random_streams(np.random.default_rng(5), "traveller", 1)[0]
    async with httpx.AsyncClient(base_url=workers.url, timeout=30) as client:
        whole, _ = await send(client.post, "traveller", [x], None, False)
        _, state = await send(client.post, "traveller", [x[:7]], None, False)
        doc = {"inputs": [x[7:].tolist()], "state": state}
        r = await client.post("/rollout", json=doc, headers={"accept": "application/x-ndjson"})
        assert r.status_code == 200, r.text
        rest = np.full((len(x) - 7, 2), np.nan, np.float32)
        for line in map(orjson.loads, r.text.splitlines()):
            if "positions" in line:
                rest[line["start"] : line["start"] + len(line["positions"])] = line["positions"]
        assert_close([rest], [whole[0][7:]])


async def test_several_workers_refuse_a_state_of_another_version(workers: Server) -> None:
    """A 409 ``state_mismatch`` at the version, as a single-process server answers."""
    xs = random_streams(np.random.default_rng(3), "smoother", 2)
    async with httpx.AsyncClient(base_url=workers.url, timeout=30) as client:
        _, state = await send(client.post, "smoother", xs, None, False)
        stale = {**state, "version": "0" * len(state["version"])}
        doc = {"sequences": [x.tolist() for x in xs], "state": stale, "return_state": True}
        r = await client.post("/smooth", json=doc)
        assert r.status_code == 409, r.text
        body = r.json()
        assert (body["type"], body["loc"]) == ("state_mismatch", ["state", "version"])
