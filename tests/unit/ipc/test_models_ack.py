"""A new model is listed once every HTTP worker has its name: the engine sends each connected
worker a MODELS frame with the model staged, and lists it only when every worker acknowledged
that frame (or left), or after ``models_ack_timeout_s``.

Real sockets: the real ModelRuntime behind an EngineServer, the real worker app (its
RemoteRuntime) on one connection, and on another a worker that speaks the frames itself and
acknowledges a MODELS frame only when the test says so (a worker whose event loop is busy).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.http.app import create_app
from rnnserve.service.interface import UnknownModel
from rnnserve.service.ipc.engine_side import EngineServer
from rnnserve.service.ipc.frames import STREAM_LIMIT, Frame, Op, read_frame
from rnnserve.service.ipc.worker_side import RemoteRuntime

WIDTH = 4
WAIT_S = 30.0  # the longest wait for anything; a failure, never a measure
ROWS = [[[0.5, -1.0, 2.0, 0.25]] * 3, [[1.0, 0.0, -0.5, 3.0]] * 2]


def write(folder: Path, name: str, alpha: float) -> None:
    aside = folder / f".{name}.partial"
    models.save(models.build("smoother", {"feat_dim": WIDTH, "alpha_smooth": alpha}), aside)
    os.replace(aside, folder / f"{name}.safetensors")


def assert_answered_by(r: httpx.Response, name: str, alpha: float) -> None:
    """``r`` is model ``name``'s 200 answer to ``ROWS``, computed by smoother ``alpha``."""
    assert r.status_code == 200, r.text
    assert r.json()["model"] == name
    module = models.build("smoother", {"feat_dim": WIDTH, "alpha_smooth": alpha}).eval()
    assert isinstance(module, LinearRecursion)
    data = np.array([step for s in ROWS for step in s], np.float32)
    lengths = np.array([len(s) for s in ROWS], np.int64)
    want = module.smooth_flat(data, lengths)
    got = np.array([step for s in r.json()["outputs"] for step in s], np.float32)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)


def names(models_doc: list[dict[str, Any]]) -> list[str]:
    return sorted(m["name"] for m in models_doc)


class FramedWorker:
    """A worker on its own connection that acknowledges MODELS frames only when told to."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, path: str) -> FramedWorker:
        reader, writer = await asyncio.open_unix_connection(path, limit=STREAM_LIMIT)
        writer.writelines(Frame(Op.HELLO).buffers())
        hello = await asyncio.wait_for(read_frame(reader), WAIT_S)
        assert hello is not None
        assert hello.op == Op.HELLO
        return cls(reader, writer)

    async def next_list(self) -> tuple[Frame, dict[str, Any]]:
        """The next MODELS frame the engine sends, and its document; not acknowledged."""
        frame = await asyncio.wait_for(read_frame(self.reader), WAIT_S)
        assert frame is not None
        assert frame.op == Op.MODELS
        return frame, orjson.loads(frame.text)

    async def acknowledge(self, frame: Frame) -> None:
        self.writer.writelines(Frame(Op.MODELS, frame.id).buffers())
        await self.writer.drain()

    async def leave(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


@asynccontextmanager
async def engine(
    tmp_path: Path, models_ack_timeout_s: float
) -> AsyncIterator[tuple[ModelRuntime, EngineServer, httpx.AsyncClient, RemoteRuntime]]:
    """The engine on a socket, serving smoothers ``a`` and ``b`` from ``tmp_path / "models"``,
    and an HTTP worker's app connected to it (a client of it, and its runtime)."""
    folder = tmp_path / "models"
    folder.mkdir()
    write(folder, "a", 0.5)
    write(folder, "b", 0.3)
    runtime = ModelRuntime(Settings(model_dir=folder, device="cpu", max_delay_ms=1.0))
    await runtime.start()
    server = EngineServer(runtime, str(tmp_path / "engine.sock"), models_ack_timeout_s)
    await server.start()
    runtime.on_models_changed(server.announce_models)  # as the engine process does
    app = create_app(Settings(), engine_socket=server.path)
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
                yield runtime, server, client, app.state.runtime
    finally:
        await server.close()
        await runtime.stop()


async def listed(client: httpx.AsyncClient) -> list[str]:
    r = await client.get("/models")
    assert r.status_code == 200, r.text
    return sorted(m["name"] for m in r.json()["models"])


async def infer(client: httpx.AsyncClient, name: str) -> httpx.Response:
    return await client.post(f"/models/{name}/infer", json={"inputs": ROWS})


async def until_known(remote: RemoteRuntime, name: str) -> None:
    """Until the worker's runtime has ``name``, listed or staged (it read the MODELS frame)."""

    def known() -> bool:
        try:
            remote.get(name)
        except UnknownModel:
            return False
        return True

    async with asyncio.timeout(WAIT_S):
        while not known():  # noqa: ASYNC110 (the runtime's list has no event of its own)
            await asyncio.sleep(0.005)


async def until_listed(client: httpx.AsyncClient, name: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while name not in await listed(client):  # noqa: ASYNC110 (asked over HTTP)
            await asyncio.sleep(0.01)


async def test_a_worker_that_acknowledges_late_holds_the_new_name_unlisted_until_it_does(
    tmp_path: Path,
) -> None:
    async with engine(tmp_path, WAIT_S * 10) as (runtime, server, client, remote):
        late = await FramedWorker.connect(server.path)
        write(tmp_path / "models", "c", 0.2)
        reload = asyncio.ensure_future(runtime.reload())
        staging, doc = await late.next_list()
        assert (names(doc["models"]), names(doc["staged"])) == (["a", "b"], ["c"])
        # the worker app has the staged list too: it answers for c, and does not list it
        await until_known(remote, "c")
        assert_answered_by(await infer(client, "c"), "c", 0.2)
        assert await listed(client) == ["a", "b"]
        # the worker app acknowledged before that request reached the engine: only the late
        # worker holds the reload now
        assert "c" not in runtime.models
        assert not reload.done()
        await late.acknowledge(staging)
        listing, doc = await late.next_list()  # sent once every worker has the staged list
        assert listing.id > staging.id
        assert (names(doc["models"]), names(doc["staged"])) == (["a", "b", "c"], [])
        assert sorted(runtime.models) == ["a", "b", "c"]
        assert runtime.staged == {}
        # the reload (POST /admin/reload's answer) waits for every worker to have the listing
        assert not reload.done()
        await late.acknowledge(listing)
        report = await asyncio.wait_for(reload, WAIT_S)
        assert report.loaded == ["c"]
        await until_listed(client, "c")
        assert_answered_by(await infer(client, "c"), "c", 0.2)
        await late.leave()


async def test_a_worker_that_never_acknowledges_delays_the_listing_only_up_to_the_timeout(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with engine(tmp_path, 0.05) as (runtime, server, client, _):
        stuck = await FramedWorker.connect(server.path)
        write(tmp_path / "models", "c", 0.2)
        with caplog.at_level(logging.WARNING, logger="rnnserve.service.ipc.engine_side"):
            report = await asyncio.wait_for(runtime.reload(), WAIT_S)
        assert report.loaded == ["c"]
        assert sorted(runtime.models) == ["a", "b", "c"]
        staging, doc = await stuck.next_list()
        assert names(doc["staged"]) == ["c"]
        listing, doc = await stuck.next_list()
        assert (names(doc["models"]), names(doc["staged"])) == (["a", "b", "c"], [])
        # both lists waited for the stuck worker, each for the timeout, then went on (the
        # worker app, on this same event loop, may be late for one of them too)
        warned = [r.getMessage() for r in caplog.records]
        assert len(warned) == 2, warned
        for n, line in zip((staging.id, listing.id), warned, strict=True):
            assert re.fullmatch(
                rf"model list {n}: [12] worker\(s\) did not acknowledge it in 0.05 s; going on",
                line,
            ), line
        await until_listed(client, "c")
        assert_answered_by(await infer(client, "c"), "c", 0.2)
        await stuck.leave()


async def test_a_worker_that_leaves_without_acknowledging_holds_nothing(tmp_path: Path) -> None:
    async with engine(tmp_path, WAIT_S * 10) as (runtime, server, client, _):
        going = await FramedWorker.connect(server.path)
        write(tmp_path / "models", "c", 0.2)
        reload = asyncio.ensure_future(runtime.reload())
        _, doc = await going.next_list()
        assert names(doc["staged"]) == ["c"]
        assert not reload.done()
        await going.leave()  # its connection's end is its answer
        report = await asyncio.wait_for(reload, WAIT_S)
        assert report.loaded == ["c"]
        await until_listed(client, "c")


def test_the_ack_timeout_is_the_one_given_else_the_settings_default(tmp_path: Path) -> None:
    path = str(tmp_path / "engine.sock")
    runtime = ModelRuntime(Settings(device="cpu"))
    assert EngineServer(runtime, path, 2.0).models_ack_timeout_s == 2.0
    assert EngineServer(runtime, path).models_ack_timeout_s == 10.0
    flagged = Settings(_cli_parse_args=["--models-ack-timeout-s", "0.5"])  # type: ignore[call-arg]
    assert flagged.models_ack_timeout_s == 0.5
    with pytest.raises(ValueError, match="greater than 0"):
        Settings(models_ack_timeout_s=0)
