"""rnnserve.client against a real ``rnnserve`` process, and the example script."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from rnnserve import models
from rnnserve.client import AsyncClient, BadRequest, Client, DeadlineExceeded, ModelNotFound
from rnnserve.models.packing import pack, unpack
from tests.e2e import rawhttp
from tests.e2e.server import Server, start_server, stop
from tests.metrics import value

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
CHUNK = 16
rng = np.random.default_rng(11)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(
        tmp_path_factory.mktemp("client"),
        "--rollout-chunk-steps",
        str(CHUNK),
        "--max-delay-ms",
        "1",
    )
    yield srv
    stop(srv)


@pytest.fixture
def client(server: Server) -> Iterator[Client]:
    with Client(server.url, timeout=60) as c:
        yield c


def seqs(width: int, *lengths: int) -> list[np.ndarray]:
    return [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]


_LOADED: dict[str, torch.nn.Module] = {}


def reference(name: str, xs: list[np.ndarray]) -> list[np.ndarray]:
    """The model's own answer, computed here with models.load and rnnserve.models.packing."""
    model = _LOADED.setdefault(name, models.load(name))
    with torch.inference_mode():
        packed = pack([torch.from_numpy(x) for x in xs])
        out = model(packed) if name == "smoother" else model.rollout(packed)  # type: ignore[operator]
    return [t.numpy() for t in unpack(out)]


def server_json(server: Server, path: str, field: str, xs: list[np.ndarray]) -> list[np.ndarray]:
    """The server's own JSON answer, asked for without the client."""
    body = {"sequences" if path == "/smooth" else "inputs": [x.tolist() for x in xs]}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return [np.asarray(s, dtype=np.float32) for s in r.json()[field]]


def metric(server: Server, name: str, **labels: str) -> float:
    return value(httpx.get(f"{server.url}/metrics", timeout=10).text, name, **labels)


def same(got: list[Any], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        g = g.numpy() if isinstance(g, torch.Tensor) else g
        assert g.dtype == np.float32
        assert g.shape == w.shape
        assert g.tobytes() == w.tobytes()


def close(got: list[Any], want: list[np.ndarray]) -> None:
    """Equal to float32 rounding: for rollouts batched with different company (concurrent
    calls, a sequence alone), whose steps may take BLAS's GEMM or the kernel's one-row loop."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float32
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)


def test_numpy_in_numpy_out_equals_the_models(server: Server, client: Client) -> None:
    xs, us = seqs(16, 40, 1, 9), seqs(6, 33, 5)
    smoothed = client.smooth(xs)
    positions = client.rollout(us)
    same(smoothed, server_json(server, "/smooth", "sequences", xs))  # bit for bit
    same(positions, server_json(server, "/rollout", "positions", us))
    expected = reference("smoother", xs) + reference("traveller", us)
    for got, want in zip(smoothed + positions, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    one = client.rollout(us[0])  # a single array in, a single array out
    assert isinstance(one, np.ndarray)
    close([one], positions[:1])  # alone, not batched with the second sequence


def test_torch_in_torch_out(server: Server, client: Client) -> None:
    us = seqs(6, 20, 3)
    out = client.rollout([torch.from_numpy(u) for u in us])
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in out)
    same(out, server_json(server, "/rollout", "positions", us))
    stacked = client.smooth(torch.from_numpy(np.stack(seqs(16, 6, 6, 6))))
    assert isinstance(stacked, torch.Tensor)
    assert stacked.shape == (3, 6, 16)


def test_binary_and_json_give_identical_answers(server: Server) -> None:
    xs, us = seqs(16, 50, 2, 17), seqs(6, 12, 30)
    answers = {}
    for mode in ("always", "never", "auto"):
        with Client(server.url, binary=mode) as c:
            answers[mode] = c.smooth(xs) + c.rollout(us)
            assert c._core.binary_ok is (mode != "never")  # the real server took the binary format
    same(answers["never"], answers["always"])
    same(answers["auto"], answers["always"])
    for answer in answers.values():  # as CLIENT.md says: writable arrays that own their memory
        assert all(a.flags.owndata and a.flags.writeable for a in answer)


def test_streamed_chunks_reassemble_into_the_whole_rollout(client: Client) -> None:
    us = seqs(6, 70, 5, 33)
    whole = client.rollout(us)
    got: list[list[np.ndarray]] = [[] for _ in us]
    with client.stream_rollout(us) as stream:
        for i, start, positions in stream:
            assert start == sum(len(p) for p in got[i])  # in order, without gaps
            assert 1 <= len(positions) <= CHUNK
            got[i].append(positions)
    assert stream.model == "traveller"
    same([np.concatenate(parts) for parts in got], whole)


def test_closing_a_stream_early_drops_the_rollout(server: Server, client: Client) -> None:
    steps = 50_000
    cancelled = metric(server, "rnnserve_requests_cancelled_total", endpoint="rollout")
    ran = metric(server, "rnnserve_batch_timesteps_sum", model="traveller")
    with client.stream_rollout(np.full((steps, 6), 0.1, dtype=np.float32)) as stream:
        i, start, positions = next(stream)
        assert (i, start, positions.shape) == (0, 0, (CHUNK, 2))
    deadline = time.monotonic() + 30
    while metric(server, "rnnserve_requests_in_flight", endpoint="rollout") > 0:
        assert time.monotonic() < deadline, "the rollout still runs after the stream was closed"
        time.sleep(0.02)
    assert metric(server, "rnnserve_requests_cancelled_total", endpoint="rollout") == cancelled + 1
    assert metric(server, "rnnserve_batch_timesteps_sum", model="traveller") - ran < steps / 2


def dropped_rollouts(server: Server) -> float:
    """Rollouts the server dropped: past their deadline (504) or with their client gone (499)."""
    expired = metric(server, "rnnserve_requests_expired_total", endpoint="rollout")
    return expired + metric(server, "rnnserve_requests_cancelled_total", endpoint="rollout")


def test_a_deadline_stops_a_long_rollout(server: Server, client: Client) -> None:
    dropped = dropped_rollouts(server)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        client.rollout(np.full((100_000, 6), 0.1, dtype=np.float32), timeout=0.5)
    assert time.monotonic() - started < 3
    # the server dropped the rollout: at the deadline the client sent it (X-Request-Timeout),
    # or when the client closed its connection at the same moment
    deadline = time.monotonic() + 30
    while dropped_rollouts(server) == dropped:
        assert time.monotonic() < deadline, "the server still runs a rollout nobody waits for"
        time.sleep(0.02)


def test_errors_models_and_readiness(client: Client) -> None:
    with pytest.raises(ModelNotFound) as missing:
        client.smooth(np.ones((3, 16)), model="nope")
    assert missing.value.status == 404
    assert missing.value.loc == ("model",)
    with pytest.raises(BadRequest) as bad:
        client.smooth([np.ones((3, 16)), np.ones((4, 15))])
    assert (bad.value.status, bad.value.type) == (422, "wrong_feature_count")
    assert bad.value.loc[:2] == ("sequences", 1)
    assert {m.name: (m.kind, m.input_dim) for m in client.models()} == {
        "smoother": ("smoother", 16),
        "traveller": ("traveller", 6),
    }
    assert client.ready()


async def test_async_client_concurrent_calls_and_stream(server: Server) -> None:
    batches = [seqs(6, n, 3) for n in (5, 18, 40, 2)]
    async with AsyncClient(server.url, timeout=60) as c:
        answers = await asyncio.gather(*(c.rollout(b) for b in batches))
        for batch, answer in zip(batches, answers, strict=True):
            close(answer, server_json(server, "/rollout", "positions", batch))  # batched apart
        got: list[list[np.ndarray]] = [[], []]
        async with c.stream_rollout(batches[2]) as stream:
            async for i, _, positions in stream:
                got[i].append(positions)
        close([np.concatenate(parts) for parts in got], answers[2])
        assert await c.ready()


def test_the_example_script_runs(server: Server) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "client_example.py"), "--url", server.url],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert "smooth: (100, 16); rollout: [(50, 2), (7, 2)]" in done.stdout
    assert "streamed by model traveller" in done.stdout


class RecordingProxy:
    """A TCP proxy in front of the server that keeps every byte the client sent."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.sent = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = rawhttp.connect(self.upstream)
            threading.Thread(target=self._pump, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def timeouts_sent(self) -> list[float]:
        """The X-Request-Timeout values of every request the client sent, in order."""
        return [float(v) for v in re.findall(rb"(?i)\r\nx-request-timeout: *([0-9.]+)", self.sent)]

    def close(self) -> None:
        self.listener.close()


def test_the_client_sends_its_deadline_and_the_server_drops_the_work(server: Server) -> None:
    proxy = RecordingProxy(server.url)
    try:
        with Client(proxy.url, timeout=60) as c:
            xs = seqs(16, 30)
            same(c.smooth(xs), server_json(server, "/smooth", "sequences", xs))
            sent = proxy.timeouts_sent()
            assert len(sent) == 1
            assert 0 < sent[0] <= 60  # what was left of the call's 60 s: accepted (no 400)
            dropped = dropped_rollouts(server)
            with pytest.raises(DeadlineExceeded):
                c.rollout(np.full((100_000, 6), 0.1, dtype=np.float32), timeout=0.5)
            sent = proxy.timeouts_sent()
            assert len(sent) == 2
            assert 0 < sent[1] <= 0.5
    finally:
        proxy.close()
    # the server dropped the rollout: at its own deadline (504), or when the client hung up
    # at the same moment (499), whichever it saw first; it never ran to the end
    deadline = time.monotonic() + 30
    while metric(server, "rnnserve_requests_in_flight", endpoint="rollout") > 0:
        assert time.monotonic() < deadline, "the server still runs a rollout nobody waits for"
        time.sleep(0.02)
    assert dropped_rollouts(server) - dropped == 1
