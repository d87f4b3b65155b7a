"""rnnserve.client against the real app in-process, and against scripted failures.

The real app (``rnnserve.service.http.app.create_app``, models loaded and warmed by its lifespan)
runs once for the module on an event loop of its own thread, behind ``httpx.ASGITransport``; small
bridge transports let both the sync :class:`Client` and the :class:`AsyncClient` (on the test's own
loop) call it. Failure cases (503 then success, 422, deadlines, broken streams) use
``httpx.MockTransport`` or a socket that never answers.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch

from rnnserve import _sync_client, models
from rnnserve._core import _parse_retry_after
from rnnserve.client import (
    AsyncClient,
    BadRequest,
    Client,
    ConnectionFailed,
    DeadlineExceeded,
    ModelNotFound,
    Overloaded,
    ProtocolError,
    RnnserveError,
    ServerError,
)
from rnnserve.models.packing import pack, unpack
from rnnserve.service.config import Settings
from rnnserve.service.http.app import create_app

URL = "http://rnnserve"
SAFETENSORS = "application/x-safetensors"
NDJSON_HEADERS = {"content-type": "application/x-ndjson"}
rng = np.random.default_rng(7)


# -- the real app on a thread of its own --------------------------------------------------------


class InProcessApp:
    """The app's lifespan and requests run on one background event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.app = create_app(Settings(max_delay_ms=1.0, rollout_chunk_steps=4))
        self.asgi = httpx.ASGITransport(app=self.app)
        self.lifespan = self.app.router.lifespan_context(self.app)
        self.run(self.lifespan.__aenter__()).result(timeout=120)

    def run(self, coro: Coroutine[Any, Any, Any]) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def handle(self, request: httpx.Request) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        response = await self.asgi.handle_async_request(request)
        body = await response.aread()
        return response.status_code, response.headers.raw, body

    def close(self) -> None:
        self.run(self.lifespan.__aexit__(None, None, None)).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


def _copy(request: httpx.Request, body: bytes) -> httpx.Request:
    return httpx.Request(request.method, request.url, headers=request.headers, content=body)


class SyncBridge(httpx.BaseTransport):
    def __init__(self, app: InProcessApp) -> None:
        self.app = app

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        future = self.app.run(self.app.handle(_copy(request, request.read())))
        status, headers, body = future.result(timeout=60)
        return httpx.Response(status, headers=headers, content=body)


class AsyncBridge(httpx.AsyncBaseTransport):
    def __init__(self, app: InProcessApp) -> None:
        self.app = app

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = await request.aread()
        future = self.app.run(self.app.handle(_copy(request, body)))
        status, headers, content = await asyncio.wrap_future(future)
        return httpx.Response(status, headers=headers, content=content)


@pytest.fixture(scope="module")
def app() -> Iterator[InProcessApp]:
    served = InProcessApp()
    yield served
    served.close()


@pytest.fixture
def client(app: InProcessApp) -> Iterator[Client]:
    with Client(URL, transport=SyncBridge(app)) as c:
        yield c


# -- references ---------------------------------------------------------------------------------

_MODELS: dict[str, torch.nn.Module] = {}


def reference(name: str, seqs: list[np.ndarray]) -> list[np.ndarray]:
    model = _MODELS.setdefault(name, models.load(name))
    with torch.inference_mode():
        packed = pack([torch.from_numpy(np.asarray(s, dtype=np.float32)) for s in seqs])
        out = model(packed) if name == "smoother" else model.rollout(packed)  # type: ignore[operator]
    return [t.numpy() for t in unpack(out)]


def seqs(width: int, *lengths: int) -> list[np.ndarray]:
    return [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]


def close(got: Any, want: Any) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


# -- values through the real app ----------------------------------------------------------------


def test_numpy_in_numpy_out_matches_the_models(client: Client) -> None:
    xs = seqs(16, 12, 1, 30)
    one = client.smooth(xs[0])
    assert isinstance(one, np.ndarray)
    assert one.dtype == np.float32
    assert one.shape == (12, 16)
    many = client.smooth(xs)
    assert isinstance(many, list)
    assert [m.shape for m in many] == [(12, 16), (1, 16), (30, 16)]
    for got, want in zip(many, reference("smoother", xs), strict=True):
        close(got, want)
    close(one, many[0])
    us = seqs(6, 9, 2)
    positions = client.rollout(us)
    assert [p.shape for p in positions] == [(9, 2), (2, 2)]
    for got, want in zip(positions, reference("traveller", us), strict=True):
        close(got, want)


def test_torch_in_torch_out_and_other_input_forms(client: Client) -> None:
    us = [torch.from_numpy(u) for u in seqs(6, 5, 3)]
    out = client.rollout(us)
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 for t in out)
    want = reference("traveller", [u.numpy() for u in us])
    for got, w in zip(out, want, strict=True):
        close(got.numpy(), w)
    single = client.rollout(us[0].double())  # float64 is sent as float32
    assert isinstance(single, torch.Tensor)
    assert single.shape == (5, 2)
    stacked = client.smooth(torch.from_numpy(np.stack(seqs(16, 4, 4))))
    assert isinstance(stacked, torch.Tensor)
    assert stacked.shape == (2, 4, 16)
    assert client.smooth(np.zeros((3, 4, 16))).shape == (3, 4, 16)
    nested = client.smooth([[0.5] * 16, [1.0] * 16])  # one sequence as nested lists
    assert isinstance(nested, np.ndarray)
    assert nested.shape == (2, 16)
    batch = client.smooth([[[0.5] * 16], [[1.0] * 16, [2.0] * 16]])
    assert [b.shape for b in batch] == [(1, 16), (2, 16)]
    mixed = client.smooth([np.ones((2, 16)), torch.ones(1, 16)])  # each output mirrors its input
    assert isinstance(mixed[0], np.ndarray)
    assert isinstance(mixed[1], torch.Tensor)


def test_binary_and_json_give_identical_answers(app: InProcessApp) -> None:
    xs, us = seqs(16, 20, 3), seqs(6, 7, 11)
    answers = []
    for mode in ("always", "never", "auto"):
        with Client(URL, transport=SyncBridge(app), binary=mode) as c:
            answers.append((c.smooth(xs), c.rollout(us)))
            assert c._core.binary_ok is (mode != "never")
    for smoothed, positions in answers[1:]:
        for a, b in zip(smoothed + positions, answers[0][0] + answers[0][1], strict=True):
            assert a.tobytes() == b.tobytes()


def test_stream_reassembled_equals_the_whole_rollout(client: Client) -> None:
    us = seqs(6, 10, 3, 6)
    whole = client.rollout(us)
    got: list[list[np.ndarray]] = [[] for _ in us]
    with client.stream_rollout(us) as stream:
        for i, start, chunk in stream:
            assert start == sum(len(c) for c in got[i])
            assert 1 <= len(chunk) <= 4  # rollout_chunk_steps
            got[i].append(chunk)
    assert stream.model == "traveller"
    for parts, w in zip(got, whole, strict=True):
        assert np.concatenate(parts).tobytes() == w.tobytes()


def test_errors_carry_the_servers_type_and_location(client: Client) -> None:
    with pytest.raises(BadRequest) as bad:
        client.smooth([np.ones((3, 16)), np.ones((2, 15))])
    assert bad.value.status == 422
    assert bad.value.type == "wrong_feature_count"
    assert bad.value.loc[:2] == ("sequences", 1)
    assert "15 features" in bad.value.detail
    assert "15 features" in str(bad.value)
    with pytest.raises(BadRequest) as non_finite:
        client.smooth(np.full((2, 16), np.inf))
    assert non_finite.value.type == "non_finite"
    with pytest.raises(ModelNotFound) as missing:
        client.rollout(np.ones((2, 6)), model="nope")
    assert (missing.value.status, missing.value.type, missing.value.loc) == (
        404,
        "unknown_model",
        ("model",),
    )
    with pytest.raises(BadRequest) as kind:
        client.rollout(np.ones((2, 16)), model="smoother")
    assert kind.value.type == "wrong_model_kind"


def test_models_and_ready(client: Client) -> None:
    served = {m.name: m for m in client.models()}
    assert served["smoother"].kind == "smoother"
    assert served["smoother"].input_dim == 16
    assert served["traveller"].input_dim == 6
    assert served["traveller"].output_dim == 2
    assert served["traveller"].config["hidden_size"] == 128
    assert client.ready() is True
    client.wait_ready(timeout=5)


def test_inputs_that_are_not_sequences_fail_before_sending(client: Client) -> None:
    with pytest.raises(ValueError, match="no sequences"):
        client.smooth([])
    with pytest.raises(ValueError, match=r"\[T, F\]"):
        client.smooth(np.ones(16))
    with pytest.raises(ValueError, match="sequence 1"):
        client.smooth([np.ones((2, 16)), [[1.0, "x"]]])
    with pytest.raises(TypeError):
        client.smooth("not an array")


# -- the async client through the same app ------------------------------------------------------


async def test_async_client_values_stream_and_errors(app: InProcessApp) -> None:
    us = seqs(6, 8, 5)
    async with AsyncClient(URL, transport=AsyncBridge(app)) as c:
        positions = await c.rollout(us)
        for answer, want in zip(positions, reference("traveller", us), strict=True):
            close(answer, want)
        tensor = await c.smooth(torch.ones(3, 16))
        assert isinstance(tensor, torch.Tensor)
        assert tensor.shape == (3, 16)
        got: list[list[np.ndarray]] = [[] for _ in us]
        async with c.stream_rollout(us) as stream:
            async for i, start, chunk in stream:
                assert start == sum(len(p) for p in got[i])
                got[i].append(chunk)
        for parts, w in zip(got, positions, strict=True):
            assert np.concatenate(parts).tobytes() == w.tobytes()
        assert [m.name for m in await c.models()] == ["smoother", "traveller"]
        assert await c.ready()
        with pytest.raises(BadRequest) as bad:
            await c.rollout(np.ones((2, 5)))
        assert bad.value.type == "wrong_feature_count"


# -- scripted failures --------------------------------------------------------------------------

Handler = Callable[[httpx.Request], httpx.Response]


def scripted(*answers: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    """A MockTransport handler that gives ``answers`` in order (the last one from then on)."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return handler, seen


def busy(retry_after: str = "0", type_: str = "queue_full") -> httpx.Response:
    body = {"detail": "the queue is full", "type": type_, "loc": []}
    return httpx.Response(503, json=body, headers={"Retry-After": retry_after})


def ok_smooth(n: int = 2) -> httpx.Response:
    return httpx.Response(200, json={"model": "smoother", "sequences": [[[0.5] * 16] * n]})


def mock(handler: Handler, **options: Any) -> Client:
    return Client(URL, transport=httpx.MockTransport(handler), **options)


@pytest.fixture
def waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds the sync client waits between attempts (it still waits them)."""
    asked: list[float] = []
    real = _sync_client.sleep

    def recording(seconds: float) -> None:
        asked.append(seconds)
        real(seconds)

    monkeypatch.setattr(_sync_client, "sleep", recording)
    return asked


def test_503_with_retry_after_is_retried_then_succeeds(waits: list[float]) -> None:
    handler, seen = scripted(busy("0.1"), busy("0.1", "not_ready"), ok_smooth())
    out = mock(handler, binary="never").smooth(np.zeros((2, 16)))
    assert len(seen) == 3
    assert len(waits) == 2
    assert all(wait >= 0.1 for wait in waits)  # honoured Retry-After, twice
    assert out.shape == (2, 16)
    assert (out == np.float32(0.5)).all()


def test_repeated_503_raises_overloaded_after_the_retries() -> None:
    handler, seen = scripted(busy("0"))
    with pytest.raises(Overloaded) as exc:
        mock(handler, retries=2).smooth(np.zeros((2, 16)))
    assert len(seen) == 3  # the first try and two retries
    assert (exc.value.status, exc.value.type, exc.value.retry_after) == (503, "queue_full", 0)
    handler, seen = scripted(httpx.Response(429, json={"detail": "slow down", "type": "rate"}))
    with pytest.raises(Overloaded):
        mock(handler, retries=1).smooth(np.zeros((2, 16)))
    assert len(seen) == 2


def test_retry_after_is_capped(waits: list[float]) -> None:
    handler, seen = scripted(busy("120"), ok_smooth())
    mock(handler, max_retry_wait=0.05).smooth(np.zeros((2, 16)))
    assert len(seen) == 2
    (wait,) = waits
    assert 0.05 <= wait <= 0.05 * 1.5  # the cap, with its jitter; not the 120 s asked


def test_4xx_and_500_are_not_retried() -> None:
    body = {"detail": "sequence 0, step 1: has 15 features", "type": "wrong_feature_count"}
    handler, seen = scripted(httpx.Response(422, json={**body, "loc": ["sequences", 0, 1]}))
    with pytest.raises(BadRequest) as bad:
        mock(handler).smooth(np.zeros((2, 16)))
    assert len(seen) == 1
    assert (bad.value.status, bad.value.type, bad.value.loc) == (
        422,
        "wrong_feature_count",
        ("sequences", 0, 1),
    )
    handler, seen = scripted(httpx.Response(500, json={"detail": "boom", "type": "internal"}))
    with pytest.raises(ServerError) as failed:
        mock(handler).rollout(np.zeros((2, 6)))
    assert len(seen) == 1
    assert failed.value.type == "internal"
    handler, _ = scripted(httpx.Response(404, text="no such route"))
    with pytest.raises(BadRequest) as nowhere:  # a wrong URL is not an unknown model
        mock(handler).smooth(np.zeros((2, 16)))
    assert not isinstance(nowhere.value, ModelNotFound)
    assert nowhere.value.detail == "no such route"


def test_connection_errors_are_retried_for_gets_only_unless_asked() -> None:
    models_body = {"models": [{"name": "m", "kind": "smoother", "shapes": {"input": ["T", 3]}}]}
    refused = httpx.ConnectError("connection refused")
    handler, seen = scripted(refused, httpx.Response(200, json=models_body))
    assert [m.input_dim for m in mock(handler).models()] == [3]
    assert len(seen) == 2
    handler, seen = scripted(refused, ok_smooth())
    with pytest.raises(ConnectionFailed):
        mock(handler).smooth(np.zeros((2, 16)))
    assert len(seen) == 1
    handler, seen = scripted(refused, ok_smooth())
    mock(handler, retry_posts=True).smooth(np.zeros((2, 16)))
    assert len(seen) == 2
    handler, _ = scripted(refused)
    assert mock(handler).ready() is False
    handler, _ = scripted(busy())
    assert mock(handler).ready() is False


def test_auto_falls_back_to_json_once_and_remembers() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.headers["content-type"] == SAFETENSORS:
            return httpx.Response(415, json={"detail": "JSON only", "type": "unsupported"})
        return ok_smooth()

    seen: list[str] = []

    def recording(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["content-type"])
        return handler(request)

    c = mock(recording)
    c.smooth(np.zeros((2, 16)))
    c.smooth(np.zeros((2, 16)))
    assert seen == [SAFETENSORS, "application/json", "application/json"]
    with pytest.raises(BadRequest):  # "always" does not fall back
        mock(handler, binary="always").smooth(np.zeros((2, 16)))


async def test_concurrent_first_calls_all_fall_back_to_json() -> None:
    """Calls gathered before any answer all go binary; each 415 falls back, not only the
    first one learnt."""
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["content-type"])
        await asyncio.sleep(0.01)  # every call is sent before the first answer
        if request.headers["content-type"] == SAFETENSORS:
            return httpx.Response(415, json={"detail": "JSON only", "type": "unsupported"})
        return ok_smooth()

    async with AsyncClient(URL, transport=httpx.MockTransport(handler)) as c:
        outs = await asyncio.gather(*(c.smooth(np.zeros((2, 16))) for _ in range(5)))
        assert seen == [SAFETENSORS] * 5 + ["application/json"] * 5
        await c.smooth(np.zeros((2, 16)))
    assert seen[-1] == "application/json"  # and remembered
    assert all((out == np.float32(0.5)).all() for out in outs)


def test_a_session_that_cannot_open_raises_connection_failed_on_entry(silent_server: str) -> None:
    """Made, it opens nothing; entered with nothing listening, or where no session is served,
    it raises the client's ConnectionFailed, not the WebSocket library's error."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{free.getsockname()[1]}"
    with Client(nobody, timeout=2.0) as c:
        session = c.session("traveller")  # not entered: nothing is opened
        with pytest.raises(ConnectionFailed, match="cannot open a session"), session:
            pass
    with (
        Client(silent_server, timeout=0.3) as c,
        pytest.raises(ConnectionFailed),
        c.session("traveller"),
    ):
        pass


def test_an_infinite_timeout_is_no_deadline_and_nan_is_refused() -> None:
    seen: list[dict[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(dict(request.headers))
        return ok_smooth()

    out = mock(handler, timeout=float("inf")).smooth(np.zeros((2, 16)))
    assert (out == np.float32(0.5)).all()
    assert "x-request-timeout" not in seen[0]  # as with timeout=None
    with pytest.raises(ValueError, match="NaN"):
        mock(handler).smooth(np.zeros((2, 16)), timeout=float("nan"))


def test_deadline_covers_the_retries(waits: list[float]) -> None:
    handler, seen = scripted(busy("0.2"))
    with pytest.raises(DeadlineExceeded) as exc:
        mock(handler, retries=100).smooth(np.zeros((2, 16)), timeout=0.5)
    assert 2 <= len(seen) <= 3  # not the 101 attempts the retries allow
    assert 0.2 <= sum(waits) <= 0.5  # the waits fitted in the deadline
    assert exc.value.status == 503
    assert isinstance(exc.value, TimeoutError)
    waits.clear()
    handler, seen = scripted(busy("5"), ok_smooth())  # a wait that cannot fit: give up now
    with pytest.raises(DeadlineExceeded):
        mock(handler, timeout=1.0).smooth(np.zeros((2, 16)))
    assert len(seen) == 1
    assert waits == []  # gave up without waiting


def test_each_attempt_tells_the_server_the_deadline_left() -> None:
    handler, seen = scripted(busy("0.2"), ok_smooth())
    mock(handler, timeout=5.0).smooth(np.zeros((2, 16)))
    first, second = (float(r.headers["x-request-timeout"]) for r in seen)
    assert 0 < first <= 5.0
    assert second <= first - 0.2  # the retry sends what is left after its 0.2 s wait
    handler, seen = scripted(ok_smooth())
    mock(handler, timeout=None).smooth(np.zeros((2, 16)))
    assert "x-request-timeout" not in seen[0].headers  # no deadline: nothing to send
    mock(handler, timeout=None).smooth(np.zeros((2, 16)), timeout=0.25)
    assert 0 < float(seen[1].headers["x-request-timeout"]) <= 0.25


async def test_the_async_client_and_streams_send_the_deadline_left() -> None:
    handler, seen = scripted(ok_smooth())
    async with AsyncClient(URL, transport=httpx.MockTransport(handler), timeout=3.0) as c:
        await c.smooth(np.zeros((2, 16)))
    assert 0 < float(seen[0].headers["x-request-timeout"]) <= 3.0
    lines = [{"model": "traveller", "done": True}]
    handler, seen = scripted(httpx.Response(200, stream=Body(lines), headers=NDJSON_HEADERS))
    with mock(handler) as c, c.stream_rollout(np.zeros((2, 6)), timeout=7.0) as stream:
        assert list(stream) == []
    assert 0 < float(seen[0].headers["x-request-timeout"]) <= 7.0


def test_the_servers_504_for_the_deadline_is_deadline_exceeded() -> None:
    body = {"detail": "the request's deadline passed after 0.500 s", "type": "deadline_exceeded"}
    handler, _ = scripted(httpx.Response(504, json={**body, "loc": []}))
    with pytest.raises(DeadlineExceeded) as exc:
        mock(handler).smooth(np.zeros((2, 16)), timeout=0.5)
    assert (exc.value.status, exc.value.type) == (504, "deadline_exceeded")
    lines = [{"error": {"detail": "the request's deadline passed", "type": "deadline_exceeded"}}]
    handler, _ = scripted(httpx.Response(200, stream=Body(lines), headers=NDJSON_HEADERS))
    with mock(handler) as c, pytest.raises(DeadlineExceeded):
        list(c.stream_rollout(np.zeros((2, 6))))
    handler, _ = scripted(httpx.Response(504, text="gateway timeout"))  # a proxy's: not ours
    with pytest.raises(ServerError):
        mock(handler).smooth(np.zeros((2, 16)))


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A socket that accepts connections and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def dripping_server() -> Iterator[str]:
    """A server that answers 200 at once, then its body a byte every 50 ms (~6 s in all)."""
    body = orjson.dumps({"model": "smoother", "sequences": [[[0.5] * 16] * 2]})
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
    stop = threading.Event()

    def serve(sock: socket.socket) -> None:
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(1 << 20)  # the request (small: one read)
                conn.sendall(head % len(body))
                for byte in body:
                    if stop.wait(0.05):
                        return
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:  # the client gave up: what the test wants
                        break

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        thread = threading.Thread(target=serve, args=(sock,), daemon=True)
        thread.start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        stop.set()
    thread.join(timeout=5)


async def test_the_deadline_bounds_an_answer_sent_a_byte_at_a_time(dripping_server: str) -> None:
    """httpx's timeout bounds each read; the call's deadline bounds them all (each byte comes
    well within the timeout, the whole body long after it)."""
    with Client(dripping_server, timeout=0.5, binary="never") as c, pytest.raises(DeadlineExceeded):
        c.smooth(np.zeros((2, 16)))
    async with AsyncClient(dripping_server, timeout=0.5, binary="never") as ac:
        with pytest.raises(DeadlineExceeded):
            await ac.smooth(np.zeros((2, 16)))


def test_deadline_when_the_server_never_answers(silent_server: str) -> None:
    started = time.monotonic()
    with Client(silent_server, timeout=0.3) as c, pytest.raises(DeadlineExceeded):
        c.smooth(np.zeros((2, 16)))
    assert time.monotonic() - started < 2


async def test_async_deadline_and_retries(silent_server: str) -> None:
    started = time.monotonic()
    async with AsyncClient(silent_server) as c:
        with pytest.raises(DeadlineExceeded):
            await c.rollout(np.zeros((2, 6)), timeout=0.3)
    assert time.monotonic() - started < 2
    handler, seen = scripted(busy("0.05"), ok_smooth(3))
    async with AsyncClient(URL, transport=httpx.MockTransport(handler)) as mocked:
        out = await mocked.smooth(np.zeros((3, 16)))
    assert out.shape == (3, 16)
    assert len(seen) == 2
    handler, seen = scripted(busy("0"))
    async with AsyncClient(URL, transport=httpx.MockTransport(handler), retries=1) as mocked:
        with pytest.raises(Overloaded):
            await mocked.smooth(np.zeros((3, 16)))
    assert len(seen) == 2


class Body(httpx.SyncByteStream):
    """A streamed body that records whether the client closed it."""

    def __init__(self, lines: list[Any]) -> None:
        self.lines, self.closed = lines, False

    def __iter__(self) -> Iterator[bytes]:
        for line in self.lines:
            yield orjson.dumps(line) + b"\n"

    def close(self) -> None:
        self.closed = True


def chunk(i: int, start: int, n: int) -> dict[str, Any]:
    return {"sequence": i, "start": start, "positions": [[0.25, -0.5]] * n}


def stream_client(body: Body) -> Client:
    headers = {"content-type": "application/x-ndjson"}
    handler, _ = scripted(httpx.Response(200, headers=headers, stream=body))
    return mock(handler)


def test_stream_closed_early_closes_the_connection() -> None:
    body = Body([chunk(0, 0, 4), chunk(0, 4, 4), {"model": "traveller", "done": True}])
    stream = stream_client(body).stream_rollout(torch.zeros(8, 6))
    i, start, positions = next(stream)
    assert (i, start) == (0, 0)
    assert isinstance(positions, torch.Tensor)
    assert not body.closed
    stream.close()
    assert body.closed


def test_stream_error_line_and_truncated_stream() -> None:
    failed = Body([chunk(0, 0, 2), {"error": {"detail": "model failed", "type": "internal"}}])
    with pytest.raises(ServerError, match="model failed"):
        list(stream_client(failed).stream_rollout(np.zeros((4, 6))))
    assert failed.closed
    cut = Body([chunk(0, 0, 2)])
    with pytest.raises(ProtocolError, match="ended"):
        list(stream_client(cut).stream_rollout(np.zeros((4, 6))))


@pytest.mark.parametrize("line", [42, "x", None, {"error": "boom"}, {"error": [1]}])
def test_a_stream_line_of_another_shape_is_a_protocol_error(line: Any) -> None:
    with pytest.raises(ProtocolError, match="unreadable stream line"):
        list(stream_client(Body([line])).stream_rollout(np.zeros((4, 6))))


def test_a_streams_deadline_counts_from_its_request_not_its_making() -> None:
    """The request is sent when iteration starts; so does its deadline."""
    lines = [chunk(0, 0, 2), {"model": "traveller", "done": True}]
    handler, seen = scripted(httpx.Response(200, stream=Body(lines), headers=NDJSON_HEADERS))
    with mock(handler) as c:
        stream = c.stream_rollout(np.zeros((2, 6)), timeout=0.5)
        time.sleep(0.6)  # made, not yet iterated: past the deadline were it counted from here
        assert len(list(stream)) == 1
    assert float(seen[0].headers["x-request-timeout"]) > 0.25


def test_retry_after_parsing_and_error_text() -> None:
    assert _parse_retry_after("2") == 2.0
    assert _parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past
    assert _parse_retry_after("soon") is None
    err = BadRequest("step 1: bad", status=422, type="wrong_shape", loc=["inputs", 0, 1])
    assert str(err) == "422 wrong_shape: step 1: bad (at inputs.0.1)"
    assert isinstance(err, RnnserveError)
