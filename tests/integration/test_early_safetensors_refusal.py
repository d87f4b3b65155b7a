"""The real app under a real uvicorn (rnnserve's httptools protocol) on a thread: a safetensors
body whose 8-byte header length the decoder would refuse is answered 400 from those 8 bytes,
while most of its body is still unsent, holding none of the byte budget; and the answer reaches
the client, an httpx one that sends its whole body before it reads, or a raw socket that reads
first and sends the rest after."""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import uvicorn
from safetensors.numpy import save

from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings
from rnnserve.service.http import auth
from rnnserve.service.http.app import create_app
from rnnserve.service.http.protocol import HttpToolsHeaderTimeout
from rnnserve.service.interface import Limits, RequestError
from tests.e2e import rawhttp
from tests.e2e.server import free_port

pytestmark = pytest.mark.slow  # the real app loads and warms its models first (~15 s)

MiB = 1 << 20
DECLARED = 32 * MiB  # far more than the kernel's socket buffers hold
HEADER = 16 * MiB  # the hostile client's header: within the body, over the limit
BODY_TIMEOUT_S = 5.0  # what a body that is waited for in full gets instead of the 400


@contextlib.contextmanager
def _serving(app: Any) -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(
        app, port=port, http=HttpToolsHeaderTimeout, lifespan="on", log_level="warning"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive(), "uvicorn stopped while starting"
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    settings = Settings(max_delay_ms=5.0, body_timeout_s=BODY_TIMEOUT_S)
    with _serving(create_app(settings)) as served:
        yield served


@pytest.fixture
def peak(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The most bytes the byte budget held while the test ran (the server is in this process)."""
    most = [0]
    take = auth.ByteBudget.take

    def counted(self: auth.ByteBudget, n: int) -> bool:
        taken = take(self, n)
        most[0] = max(most[0], self.used)
        return taken

    monkeypatch.setattr(auth.ByteBudget, "take", counted)
    return most


def _hostile_body() -> bytes:
    return struct.pack("<Q", HEADER) + b"m" * (DECLARED - 8)


def _decoder_error(body: bytes, field: str) -> dict[str, Any]:
    """The error the decoder gives on the whole body: what the early refusal must answer."""
    with pytest.raises(RequestError) as err:
        bodies.decode(body, bodies.SAFETENSORS, field, Limits(256, 100_000, 1_000_000))
    return err.value.body()


def _head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: {bodies.SAFETENSORS}\r\n"
        f"content-length: {length}\r\n\r\n"
    ).encode()


PATHS = [("/smooth", "sequences"), ("/rollout", "inputs"), ("/models/smoother/infer", "inputs")]


@pytest.mark.parametrize(("path", "field"), PATHS)
def test_an_httpx_client_reads_the_400_after_sending_its_whole_body(
    url: str, peak: list[int], path: str, field: str
) -> None:
    body = _hostile_body()
    want = _decoder_error(body, field)
    with httpx.Client(timeout=30) as client:
        for _ in range(3):  # and again on the same connection
            r = client.post(url + path, content=body, headers={"content-type": bodies.SAFETENSORS})
            assert (r.status_code, r.json()) == (400, want)
    assert peak[0] == 0  # refused before a byte of it was held


def test_a_raw_client_reads_the_400_with_most_of_its_body_unsent(url: str, peak: list[int]) -> None:
    body = _hostile_body()
    sent = 64 * 1024
    sock = rawhttp.connect(url, timeout_s=2 * BODY_TIMEOUT_S)
    sock.sendall(_head("/smooth", len(body)) + body[:sent])
    status, _, answer = rawhttp.read_response(sock)  # the rest not sent yet
    assert (status, orjson.loads(answer)) == (400, _decoder_error(body, "sequences"))
    assert peak[0] == 0
    # the client that keeps sending its body is read to its end, and its connection serves on
    sock.sendall(body[sent:])
    assert rawhttp.get(sock, "/healthz")[0] == 200
    sock.close()


def test_a_valid_safetensors_body_sent_in_small_pieces_is_served(url: str) -> None:
    rows = np.zeros((5, 16), np.float32)
    body = bytes(save({"sequences": rows, "lengths": np.array([5], np.int64)}))
    sock = rawhttp.connect(url)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.sendall(_head("/smooth", len(body)))
    for a, b in itertools.pairwise([0, 3, 5, 40, len(body)]):  # the length split in two
        sock.sendall(body[a:b])
        time.sleep(0.01)  # apart, most likely in reads of their own
    status, _, answer = rawhttp.read_response(sock)
    as_json = httpx.post(url + "/smooth", json={"sequences": [rows.tolist()]}, timeout=30)
    assert (status, orjson.loads(answer)) == (200, as_json.json())
    sock.close()
