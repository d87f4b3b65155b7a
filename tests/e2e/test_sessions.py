"""Streaming sessions (WebSocket ``/models/{name}/stream``) against real server processes: a
sequence sent in random chunks is answered as the whole of it is over HTTP, the state given on
request continues on another server, the limits close sessions with their codes, and sessions
opened and dropped leave the server's descriptors and memory as they were."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.e2e.server import Server, start_server, stop

pytestmark = pytest.mark.e2e

TOLERANCE = 1e-5
MODELS = ("smoother", "traveller")
TOKEN = "session-test-token"
# over uvicorn's own WebSocket limit (ws_max_size, 16 MiB unless told): the frame limit must be
# max_chunk_bytes, not uvicorn's
BIG_LIMIT = 17 * 1024 * 1024
HEADER_TIMEOUT_S = 3  # the limited server's: a request head's limit, not a session's


def ws_url(server: Server, model: str) -> str:
    return server.url.replace("http://", "ws://") + f"/models/{model}/stream"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    first = start_server(
        tmp_path_factory.mktemp("a"),
        "--max-request-bytes", str(BIG_LIMIT),
        "--max-chunk-bytes", str(BIG_LIMIT),
    )  # fmt: skip
    try:
        second = start_server(tmp_path_factory.mktemp("b"))
    except BaseException:
        stop(first)
        raise
    yield first, second
    stop(first)
    stop(second)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("workers"),
        "--workers", "2",
        "--max-request-bytes", str(BIG_LIMIT),
        "--max-chunk-bytes", str(BIG_LIMIT),
    )  # fmt: skip
    yield server
    stop(server)


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("limited"),
        "--max-sessions", "2",
        "--session-idle-timeout-s", "1",
        "--max-request-bytes", "20000",  # max_chunk_bytes follows it
        "--header-timeout-s", str(HEADER_TIMEOUT_S),
        env={"RNNSERVE_API_TOKEN": TOKEN},
    )  # fmt: skip
    yield server
    stop(server)


def input_dim(server: Server, model: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    listed = httpx.get(f"{server.url}/models", headers=headers).json()["models"]
    return int(next(m for m in listed if m["name"] == model)["shapes"]["input"][1])


def whole_answer(server: Server, model: str, xs: list[np.ndarray]) -> list[np.ndarray]:
    body = {"inputs": [x.tolist() for x in xs]}
    answer = httpx.post(f"{server.url}/models/{model}/infer", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return [np.asarray(o, np.float32) for o in answer.json()["outputs"]]


def chunk(ws: ClientConnection, pieces: list[np.ndarray], **extra: Any) -> list[np.ndarray]:
    ws.send(json.dumps({"inputs": [p.tolist() for p in pieces], **extra}))
    answer = json.loads(ws.recv(timeout=60))
    assert "outputs" in answer, answer
    return [np.asarray(o, np.float32) for o in answer["outputs"]]


def cuts(rng: np.random.Generator, length: int, pieces: int) -> list[int]:
    inner = sorted(rng.choice(np.arange(1, length), size=pieces - 1, replace=False).tolist())
    return [0, *inner, length]


def stream_in_chunks(
    ws: ClientConnection, xs: list[np.ndarray], ends: list[int], first: dict[str, Any]
) -> list[np.ndarray]:
    """Send ``xs`` cut at ``ends`` (the same cuts for every sequence), one chunk a piece."""
    outs: list[list[np.ndarray]] = [[] for _ in xs]
    for k, (a, b) in enumerate(itertools.pairwise(ends)):
        got = chunk(ws, [x[a:b] for x in xs], **(first if k == 0 else {}))
        for i, o in enumerate(got):
            outs[i].append(o)
    return [np.concatenate(o) for o in outs]


@pytest.mark.parametrize("model", MODELS)
def test_a_sequence_sent_in_random_chunks_is_answered_as_the_whole(
    servers: tuple[Server, Server], model: str
) -> None:
    server = servers[0]
    rng = np.random.default_rng(11)
    width = input_dim(server, model)
    for n in (1, 3):
        xs = [rng.uniform(-1, 1, (60, width)).astype(np.float32) for _ in range(n)]
        whole = whole_answer(server, model, xs)
        with connect(ws_url(server, model)) as ws:
            pieces = stream_in_chunks(ws, xs, cuts(rng, 60, int(rng.integers(2, 12))), {})
        for got, want in zip(pieces, whole, strict=True):
            np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_binary_chunks_are_answered_in_safetensors(servers: tuple[Server, Server]) -> None:
    from safetensors.numpy import load, save

    server = servers[0]
    rng = np.random.default_rng(3)
    x = rng.uniform(-1, 1, (30, input_dim(server, "traveller"))).astype(np.float32)
    whole = whole_answer(server, "traveller", [x])[0]
    outs = []
    with connect(ws_url(server, "traveller")) as ws:
        for a, b in ((0, 7), (7, 30)):
            ws.send(save({"inputs": x[a:b], "lengths": np.array([b - a], np.int64)}))
            answer = ws.recv(timeout=60)
            assert isinstance(answer, bytes)
            outs.append(load(answer)["outputs"])
    np.testing.assert_allclose(np.concatenate(outs), whole, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("model", MODELS)
def test_the_state_given_on_request_continues_on_another_server(
    servers: tuple[Server, Server], model: str
) -> None:
    first, second = servers
    rng = np.random.default_rng(5)
    width = input_dim(first, model)
    xs = [rng.uniform(-1, 1, (40, width)).astype(np.float32) for _ in range(2)]
    whole = whole_answer(first, model, xs)
    with connect(ws_url(first, model)) as ws:
        head = stream_in_chunks(ws, [x[:25] for x in xs], [0, 10, 25], {})
        ws.send(json.dumps({"get_state": True}))
        state = json.loads(ws.recv(timeout=60))["state"]
    assert state["model"] == model
    assert len(state["sequences"]) == 2
    with connect(ws_url(second, model)) as ws:
        tail = stream_in_chunks(ws, [x[25:] for x in xs], [0, 15], {"state": state})
    for i, want in enumerate(whole):
        got = np.concatenate([head[i], tail[i]])
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


def test_bad_input_in_a_chunk_is_an_error_and_the_session_goes_on(
    servers: tuple[Server, Server],
) -> None:
    server = servers[0]
    width = input_dim(server, "traveller")
    x = np.zeros((5, width), np.float32)
    with connect(ws_url(server, "traveller")) as ws:
        first = chunk(ws, [x])
        ws.send(json.dumps({"inputs": [[[1.0] * (width + 1)]]}))
        error = json.loads(ws.recv(timeout=60))
        assert error["status"] == 422
        assert error["error"]["type"] == "wrong_feature_count"
        ws.send(json.dumps({"inputs": [x.tolist(), x.tolist()]}))  # the session carries one
        error = json.loads(ws.recv(timeout=60))
        assert error["error"]["type"] == "wrong_shape", error
        ws.send("not json")
        assert json.loads(ws.recv(timeout=60))["error"]["type"] == "invalid_json"
        again = chunk(ws, [x])  # continues from the first chunk's state: not its answer again
    assert not np.allclose(again[0], first[0], atol=TOLERANCE)
    whole = whole_answer(server, "traveller", [np.concatenate([x, x])])[0]
    np.testing.assert_allclose(np.concatenate([first[0], again[0]]), whole, atol=TOLERANCE)


def closed_with(ws: ClientConnection) -> tuple[int, dict[str, Any]]:
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=30)
    received = closed.value.rcvd
    assert received is not None
    return received.code, json.loads(received.reason)


def authed() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


def test_a_session_without_the_token_is_refused_with_1008(limited: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with connect(ws_url(limited, "traveller"), additional_headers=headers) as ws:
            code, reason = closed_with(ws)
        assert (code, reason["type"]) == (1008, "unauthorized")


def test_a_session_over_max_sessions_is_closed_with_1013(limited: Server) -> None:
    url = ws_url(limited, "traveller")
    width = input_dim(limited, "traveller", TOKEN)
    x = [np.zeros((2, width), np.float32)]
    with (
        connect(url, additional_headers=authed()) as a,
        connect(url, additional_headers=authed()) as b,
    ):
        chunk(a, x)
        chunk(b, x)  # both are open and served
        with connect(url, additional_headers=authed()) as third:
            code, reason = closed_with(third)
        assert (code, reason["type"]) == (1013, "too_many_sessions")
    for _ in range(50):  # the slots are free once the server has seen both closes
        with connect(url, additional_headers=authed()) as again:
            again.send(json.dumps({"inputs": [x[0].tolist()]}))
            try:
                answer = json.loads(again.recv(timeout=30))
            except ConnectionClosed:
                continue
        assert "outputs" in answer
        break
    else:
        raise AssertionError("no session was admitted after the others closed")


def test_an_idle_session_is_closed_with_4408(limited: Server) -> None:
    with connect(ws_url(limited, "smoother"), additional_headers=authed()) as ws:
        code, reason = closed_with(ws)  # sends nothing; the server's timeout is 1 s
    assert (code, reason["type"]) == (4408, "idle_timeout")


def test_a_session_lives_past_the_header_timeout(limited: Server) -> None:
    x = [np.zeros((2, input_dim(limited, "traveller", TOKEN)), np.float32)]
    with connect(ws_url(limited, "traveller"), additional_headers=authed()) as ws:
        for _ in range(HEADER_TIMEOUT_S * 4):  # a chunk each half second: never idle
            chunk(ws, x)
            time.sleep(0.5)


def test_a_chunk_over_max_chunk_bytes_closes_with_1009(limited: Server) -> None:
    width = input_dim(limited, "traveller", TOKEN)
    big = [[[0.5] * width] * 1000]  # over the server's 20000 bytes
    with connect(ws_url(limited, "traveller"), additional_headers=authed()) as ws:
        ws.send(json.dumps({"inputs": big}))
        code, reason = closed_with(ws)
    assert (code, reason["type"]) == (1009, "body_too_large")


def test_an_unknown_model_is_closed_with_4404(servers: tuple[Server, Server]) -> None:
    with connect(ws_url(servers[0], "nope")) as ws:
        code, reason = closed_with(ws)
    assert (code, reason["type"]) == (4404, "unknown_model")


def open_descriptors(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def resident_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def metric(server: Server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        if (line.startswith(name + "{") and want in line) or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


DROPPED = 500  # the proof: 500 sessions opened and dropped, after the warm-up ones


def test_sessions_opened_and_dropped_leave_descriptors_and_memory_as_they_were(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path)
    try:
        pid = server.proc.pid
        width = input_dim(server, "traveller")
        x = np.zeros((4, width), np.float32)

        def drop_sessions(count: int) -> None:
            for i in range(count):
                with connect(ws_url(server, "traveller"), close_timeout=0.1) as ws:
                    if i % 2 == 0:
                        chunk(ws, [x])
                    else:  # a chunk sent, then gone before its answer is read
                        ws.send(json.dumps({"inputs": [x.tolist()]}))
                    ws.socket.close()  # vanishes: no close handshake

        drop_sessions(20)  # the first sessions warm up what stays (imports, caches)
        fds, rss = open_descriptors(pid), resident_kib(pid)
        chunks_before = metric(server, "rnnserve_session_chunks_total", outcome="ok")
        drop_sessions(DROPPED)
        for _ in range(100):  # the server sees the last hang-ups a moment later
            if metric(server, "rnnserve_sessions_open", model="traveller") == 0:
                break
            httpx.get(f"{server.url}/healthz")
        assert metric(server, "rnnserve_sessions_open", model="traveller") == 0
        # a few sockets may still be closing after their sessions ended; a descriptor kept by
        # each dropped session would be DROPPED more
        assert open_descriptors(pid) <= fds + 5
        # room for the allocator's retained pages and the objects of connections still being
        # torn down; a leak of 16 KiB or more a session (its protocol objects, reader task,
        # queue and frame) would be over it
        assert resident_kib(pid) <= rss + DROPPED * 16
        chunks = metric(server, "rnnserve_session_chunks_total", outcome="ok") - chunks_before
        # each even session waited for its chunk's answer; an odd one's chunk ran or was
        # cancelled when its client vanished
        assert DROPPED // 2 <= chunks <= DROPPED
        observed = metric(server, "rnnserve_session_chunk_duration_seconds_count")
        assert observed >= DROPPED // 2
    finally:
        stop(server)


def test_sessions_carry_the_state_on_a_server_with_workers(workers: Server) -> None:
    rng = np.random.default_rng(2)
    width = input_dim(workers, "traveller")
    xs = [rng.uniform(-1, 1, (30, width)).astype(np.float32) for _ in range(2)]
    whole = whole_answer(workers, "traveller", xs)
    with connect(ws_url(workers, "traveller")) as ws:
        pieces = stream_in_chunks(ws, xs, [0, 4, 17, 30], {})
    for got, want in zip(pieces, whole, strict=True):
        np.testing.assert_allclose(got, want, atol=TOLERANCE, rtol=0)


# -- frames over max_chunk_bytes, refused by the WebSocket layer ------------------------------


def big_limit_server(request: pytest.FixtureRequest, mode: str) -> Server:
    """A server whose max_chunk_bytes is BIG_LIMIT, in one process or with workers."""
    if mode == "workers":
        return request.getfixturevalue("workers")  # type: ignore[no-any-return]
    servers: tuple[Server, Server] = request.getfixturevalue("servers")
    return servers[0]


@pytest.mark.parametrize("mode", ["one process", "workers"])
@pytest.mark.parametrize("compression", [None, "deflate"])
def test_a_frame_of_the_limit_is_answered_and_one_byte_more_closes_with_1009(
    request: pytest.FixtureRequest, mode: str, compression: str | None
) -> None:
    server = big_limit_server(request, mode)
    x = np.full((3, input_dim(server, "traveller")), 0.25, np.float32)
    body = json.dumps({"inputs": [x.tolist()]})
    at_limit = body + " " * (BIG_LIMIT - len(body))  # JSON's white space: the same chunk
    # deflate: the frame is small on the wire and refused as it is inflated past the limit;
    # none: refused from the length in its header
    with connect(ws_url(server, "traveller"), compression=compression) as ws:
        ws.send(at_limit)
        assert "outputs" in json.loads(ws.recv(timeout=60))
        with contextlib.suppress(ConnectionClosed):  # the server may be gone before the end
            ws.send(at_limit + " ")
        code, reason = closed_with(ws)
    detail = f"a frame is over {BIG_LIMIT} bytes (max_chunk_bytes)"
    assert (code, reason) == (1009, {"type": "body_too_large", "detail": detail})


def masked_text_head(length: int) -> bytes:
    """A client's text frame header declaring ``length`` payload bytes (a zero mask)."""
    return bytes([0x81, 0x80 | 127]) + struct.pack("!Q", length) + b"\0\0\0\0"


@pytest.mark.parametrize("mode", ["one process", "workers"])
def test_a_frame_declared_far_over_the_limit_is_refused_from_its_header(
    request: pytest.FixtureRequest, mode: str
) -> None:
    server = big_limit_server(request, mode)
    with connect(ws_url(server, "traveller"), compression=None) as ws:
        ws.socket.sendall(masked_text_head(2**40))  # 1 TiB declared: none of it ever comes
        code, reason = closed_with(ws)
    assert (code, reason["type"]) == (1009, "body_too_large")


# -- the Python client's sessions -------------------------------------------------------------


def test_the_clients_session_streams_chunks_and_continues_from_its_state(
    servers: tuple[Server, Server],
) -> None:
    from rnnserve.client import BadRequest, Client

    first, second = servers
    rng = np.random.default_rng(9)
    x = rng.uniform(-1, 1, (40, input_dim(first, "traveller"))).astype(np.float32)
    with Client(first.url) as rnn:
        whole = rnn.rollout(x)
        with rnn.session("traveller") as session:
            head = [session.send(x[:9]), session.send(x[9:20])]
            with pytest.raises(BadRequest) as refused:
                session.send(np.zeros((3, x.shape[1] + 1), np.float32))
            assert refused.value.type == "wrong_feature_count"
            state = session.get_state()
    with Client(second.url) as rnn, rnn.session("traveller", state=state) as session:
        tail = session.send(x[20:])
    np.testing.assert_allclose(np.concatenate([*head, tail]), whole, atol=TOLERANCE, rtol=0)


async def test_the_async_clients_session_answers_as_the_whole(
    servers: tuple[Server, Server],
) -> None:
    from rnnserve.client import AsyncClient

    server = servers[0]
    rng = np.random.default_rng(4)
    xs = rng.uniform(-1, 1, (2, 30, input_dim(server, "smoother"))).astype(np.float32)
    async with AsyncClient(server.url) as rnn:
        whole = await rnn.smooth(xs)
        async with rnn.session("smoother") as session:
            pieces = [await session.send(xs[:, a:b]) for a, b in ((0, 11), (11, 12), (12, 30))]
    assert isinstance(pieces[0], np.ndarray)
    assert pieces[0].shape == (2, 11, xs.shape[2])
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), whole, atol=TOLERANCE, rtol=0)


async def test_a_clients_session_interrupted_before_its_answer_cannot_go_on(
    servers: tuple[Server, Server],
) -> None:
    """A send cancelled after its chunk went out (a timeout around it) leaves that chunk's
    answer on the way: the next send must not take it for its own."""
    import asyncio

    from rnnserve.client import AsyncClient, ConnectionFailed

    server = servers[0]
    width = input_dim(server, "traveller")
    long = np.zeros((50_000, width), np.float32)  # a rollout of a good part of a second
    async with AsyncClient(server.url) as rnn, rnn.session("traveller") as session:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(session.send(long), 0.05)
        with pytest.raises(ConnectionFailed, match="interrupted"):
            await session.send(np.ones((3, width), np.float32))


def test_a_clients_session_closed_for_idling_raises_connection_failed(limited: Server) -> None:
    from rnnserve.client import Client, ConnectionFailed

    x = np.zeros((2, input_dim(limited, "traveller", TOKEN)), np.float32)
    with Client(limited.url, headers=authed()) as rnn, rnn.session("traveller") as session:
        session.send(x)
        time.sleep(2.5)  # past the server's 1 s session_idle_timeout_s
        with pytest.raises(ConnectionFailed):
            session.send(x)


def test_the_clients_session_raises_what_the_close_code_says(limited: Server) -> None:
    from rnnserve.client import BadRequest, Client, Overloaded

    x = np.zeros((2, input_dim(limited, "traveller", TOKEN)), np.float32)
    with Client(limited.url) as rnn, rnn.session("traveller") as session:
        with pytest.raises(BadRequest) as refused:
            session.send(x)
        assert (refused.value.status, refused.value.type) == (401, "unauthorized")
    with Client(limited.url, headers=authed()) as rnn:
        with rnn.session("traveller") as a, rnn.session("traveller") as b:
            a.send(x)
            b.send(x)
            with rnn.session("traveller") as third, pytest.raises(Overloaded) as full:
                third.send(x)
        assert full.value.type == "too_many_sessions"


# -- a client that never reads its answers ----------------------------------------------------

WRITE_TIMEOUT_S = 1


@pytest.fixture(scope="module")
def write_limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_server(
        tmp_path_factory.mktemp("write-limited"), "--write-timeout-s", str(WRITE_TIMEOUT_S)
    )
    yield server
    stop(server)


def unread_session(server: Server, model: str) -> socket.socket:
    """A session opened by hand on a socket whose receive buffer is small, never to be read
    past the handshake's answer."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sticks
    sock.settimeout(30)
    sock.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET /models/{model}/stream HTTP/1.1\r\nHost: test\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        .encode()
    )  # fmt: skip
    answer = b""
    while not answer.endswith(b"\r\n\r\n"):  # byte by byte: not one byte of a frame is read
        got = sock.recv(1)
        assert got, f"closed during the handshake: {answer!r}"
        answer += got
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return sock


def masked_binary_frame(payload: bytes) -> bytes:
    return bytes([0x82, 0x80 | 127]) + struct.pack("!Q", len(payload)) + b"\0\0\0\0" + payload


def send_until_reset(sock: socket.socket, frame: bytes, count: int) -> threading.Thread:
    """Send ``frame`` ``count`` times from a thread (the server soon reads no more: the sends
    block), until done or the connection is reset."""

    def send() -> None:
        with contextlib.suppress(OSError):
            for _ in range(count):
                sock.sendall(frame)

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    return sender


def wait_until(check: Any, what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_session_whose_client_reads_nothing_is_reset_and_frees_what_it_held(
    write_limited: Server,
) -> None:
    from safetensors.numpy import save

    server = write_limited
    width = input_dim(server, "smoother")
    rows = np.random.default_rng(8).uniform(-1, 1, (64 * 1000, width)).astype(np.float32)
    # answers of 4 MiB each: a few of them are more than the kernel's buffers take
    chunk_body = save({"inputs": rows, "lengths": np.full(64, 1000, np.int64)})
    sock = unread_session(server, "smoother")
    sender = send_until_reset(sock, masked_binary_frame(chunk_body), 12)
    wait_until(
        lambda: metric(server, "rnnserve_request_bytes_in_flight") > len(chunk_body),
        "the stalled session's frames and unsent answer were not counted",
    )
    assert metric(server, "rnnserve_sessions_open", model="smoother") == 1
    # meanwhile a normal session is answered
    x = rows[:50]
    with connect(ws_url(server, "smoother")) as ws:
        np.testing.assert_allclose(
            chunk(ws, [x])[0], whole_answer(server, "smoother", [x])[0], atol=TOLERANCE, rtol=0
        )
    wait_until(
        lambda: metric(server, "rnnserve_write_timeouts_total") == 1,
        "the session whose client reads nothing was never reset",
    )
    wait_until(
        lambda: metric(server, "rnnserve_sessions_open", model="smoother") == 0,
        "the reset session kept its slot",
    )
    wait_until(
        lambda: metric(server, "rnnserve_request_bytes_in_flight") == 0,
        "the reset session's bytes were not given back",
    )
    sender.join(timeout=30)
    assert not sender.is_alive()  # the reset ended the client's blocked sends
    got = 0
    with contextlib.suppress(ConnectionResetError):  # unless the sender saw the reset first
        while piece := sock.recv(1 << 20):
            got += len(piece)
    assert got < len(chunk_body)  # the first answer was cut off: what the kernel held dropped
    sock.close()
    with connect(ws_url(server, "smoother")) as ws:  # and the server serves sessions on
        assert len(chunk(ws, [x])[0]) == len(x)
