"""The process boundary: frames, and a RemoteRuntime talking to an EngineServer over a socket.

The engine side runs a fake runtime held on events, so the tests can see requests in flight,
cancelled, or failing; one test puts the real ModelRuntime behind the socket.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Tracer

from rnnserve.service import tracing
from rnnserve.service.cli import settings_environment
from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.http.app import create_app
from rnnserve.service.interface import (
    BatcherClosed,
    CarriedState,
    EngineUnavailable,
    FlatSequences,
    ModelChanged,
    Piece,
    QueueFull,
    ReloadReport,
    StateMismatch,
    StreamingUnavailable,
    UnknownModel,
    current_request,
    open_request,
)
from rnnserve.service.ipc.engine_side import EngineServer
from rnnserve.service.ipc.frames import (
    HEADER,
    PREFIX,
    EngineError,
    Frame,
    FrameError,
    Op,
    decode,
    error_frame,
    frame_error,
    progress_frame,
    progress_pieces,
    request_frame,
    request_of,
    result_frame,
    result_of,
)
from rnnserve.service.ipc.worker_side import RemoteRuntime

# -- frames ------------------------------------------------------------------------------------


def roundtrip(frame: Frame) -> Frame:
    data = frame.encode()
    (size,) = PREFIX.unpack_from(data)
    assert size == len(data) - PREFIX.size
    return decode(data[PREFIX.size :])


@pytest.mark.parametrize(
    ("rows", "ints"),
    [
        (np.empty((0, 0), np.float32), np.empty(0, np.int64)),
        (np.arange(48, dtype=np.float32).reshape(3, 16), np.array([2, 1])),
        (np.random.default_rng(0).standard_normal((100_000, 6)).astype(np.float32), np.ones(7)),
    ],
)
def test_frames_round_trip(rows: np.ndarray, ints: np.ndarray) -> None:
    frame = Frame(Op.INFER, 2**40 + 3, 0, "smoother ✓".encode(), ints.astype(np.int64), rows)
    back = roundtrip(frame)
    assert (back.op, back.id, back.code, back.text) == (Op.INFER, 2**40 + 3, 0, frame.text)
    np.testing.assert_array_equal(back.ints, frame.ints)
    assert back.rows.dtype == np.float32
    assert back.rows.shape == rows.shape
    np.testing.assert_array_equal(back.rows, rows)


def test_the_rows_are_not_copied_on_either_side() -> None:
    rows = np.ones((1000, 16), np.float32)
    buffers = Frame(Op.RESULT, 1, ints=np.array([1000]), rows=rows).buffers()
    assert any(isinstance(b, memoryview) and id(b.obj) == id(rows) for b in buffers)
    body = b"".join(buffers)[PREFIX.size :]
    assert decode(body).rows.base is not None  # a view of the received bytes


@pytest.mark.parametrize(
    "body",
    [
        b"\x01\x00",  # shorter than the header
        HEADER.pack(Op.INFER, 0, 0, 1, 0, 1, 2, 2, 0) + b"\x00" * 8,  # floats missing
        HEADER.pack(Op.INFER, 0, 0, 1, 3, 0, 0, 0, 0) + b"abcdef",  # bytes left over
        HEADER.pack(99, 0, 0, 1, 0, 0, 0, 0, 0),  # unknown op
    ],
)
def test_bad_frames_are_refused(body: bytes) -> None:
    with pytest.raises(FrameError):
        decode(body)


def test_progress_round_trips() -> None:
    pieces: list[Piece] = [
        (0, 64, np.full((3, 2), 0.5, np.float32)),
        (2, 0, np.arange(10, dtype=np.float32).reshape(5, 2)),
    ]
    back = progress_pieces(roundtrip(progress_frame(9, pieces)))
    assert [(i, t) for i, t, _ in back] == [(0, 64), (2, 0)]
    for (_, _, y), (_, _, z) in zip(pieces, back, strict=True):
        np.testing.assert_array_equal(y, z)


@pytest.mark.parametrize(
    "exc",
    [
        UnknownModel("no model named 'x' (served: smoother)"),
        QueueFull("smoother queue is full (1024 waiting)"),
        BatcherClosed("smoother is not accepting work"),
        StreamingUnavailable("model 'smoother' cannot stream"),
        StateMismatch("the state was made by model 'smoother' version 'a'"),
        ModelChanged.width("smoother", "0123456789ab", 6, 4),
    ],
)
def test_errors_come_back_as_the_same_exception(exc: Exception) -> None:
    again = frame_error(roundtrip(error_frame(5, exc, logged=False)))
    assert type(again) is type(exc)
    assert str(again) == str(exc)


def test_other_errors_come_back_as_engine_errors() -> None:
    frame = roundtrip(error_frame(5, ZeroDivisionError("boom"), logged=False))
    again = frame_error(frame)
    assert isinstance(again, EngineError)
    assert "ZeroDivisionError: boom" in str(again)
    assert frame.flags == 0


def test_an_error_the_engine_logged_is_flagged_as_logged() -> None:
    frame = roundtrip(error_frame(5, ZeroDivisionError("boom"), logged=True))
    assert frame.flags == 1


TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize("request_id", ["abc-123", None])
@pytest.mark.parametrize("traceparent", [TRACEPARENT, None], ids=["traced", "not-traced"])
def test_requests_carry_the_http_request_id_and_the_traceparent(
    request_id: str | None, traceparent: str | None
) -> None:
    sent = request_frame(Op.INFER, 7, "smoother", flat(3, 1), request_id, traceparent)
    frame = roundtrip(sent)
    name, got_id, got_traceparent, sequences = request_of(frame)
    assert (name, got_id, got_traceparent) == ("smoother", request_id, traceparent)
    assert sequences.lengths.tolist() == [3, 1]
    if traceparent is None:  # not traced: the field is there, empty
        assert frame.text == f"smoother\0{request_id or ''}\0".encode()


@pytest.mark.parametrize(
    ("text", "fields"),
    [(b"smoother", ("smoother", None, None)), (b"smoother\0abc", ("smoother", "abc", None))],
    ids=["model-alone", "no-traceparent"],
)
def test_a_request_frame_of_fewer_fields_reads_as_empty_ones(
    text: bytes, fields: tuple[str, str | None, str | None]
) -> None:
    frame = roundtrip(Frame(Op.INFER, 7, text=text, ints=np.array([1]), rows=np.ones((1, 4))))
    assert tuple(request_of(frame))[:3] == fields


def test_a_request_frame_whose_text_is_not_utf8_is_a_frame_error() -> None:
    with pytest.raises(FrameError):
        request_of(Frame(Op.INFER, 7, text=b"\xff\0abc"))


TRAVELLER_SHAPES = {"h": (2, 8), "c": (2, 8), "p": (2,)}


def a_state(sequences: int, shapes: dict[str, tuple[int, ...]], seed: int = 1) -> CarriedState:
    rng = np.random.default_rng(seed)
    tensors = {
        p: rng.standard_normal((sequences, *s)).astype(np.float32) for p, s in shapes.items()
    }
    return CarriedState("traveller", "0123456789ab", tensors)


def assert_same_state(got: CarriedState | None, want: CarriedState) -> None:
    assert got is not None
    assert (got.model, got.version, list(got.tensors)) == (
        want.model,
        want.version,
        list(want.tensors),
    )
    for part, tensor in want.tensors.items():
        assert got.tensors[part].dtype == np.float32
        np.testing.assert_array_equal(got.tensors[part], tensor)


@pytest.mark.parametrize("op", [Op.INFER, Op.STREAM])
@pytest.mark.parametrize("return_state", [False, True])
@pytest.mark.parametrize(
    ("lengths", "shapes"),
    [((5,), {"s": (4,)}), ((3, 1, 7), TRAVELLER_SHAPES)],
    ids=["one-sequence-one-part", "three-sequences-three-parts"],
)
def test_a_request_carries_its_start_state_and_return_state(
    op: Op, return_state: bool, lengths: tuple[int, ...], shapes: dict[str, tuple[int, ...]]
) -> None:
    state = a_state(len(lengths), shapes)
    sent = dataclasses.replace(flat(*lengths), state=state, return_state=return_state)
    name, request_id, traceparent, got = request_of(
        roundtrip(request_frame(op, 7, "traveller", sent, "abc", TRACEPARENT))
    )
    assert (name, request_id, traceparent) == ("traveller", "abc", TRACEPARENT)
    np.testing.assert_array_equal(got.data, sent.data)
    assert got.lengths.tolist() == list(lengths)
    assert got.return_state is return_state
    assert_same_state(got.state, state)


@pytest.mark.parametrize("return_state", [False, True])
def test_a_request_without_a_state_sends_none(return_state: bool) -> None:
    sent = dataclasses.replace(flat(3, 2), return_state=return_state)
    frame = roundtrip(request_frame(Op.INFER, 7, "smoother", sent, "abc", None))
    assert frame.text == b"smoother\0abc\0"  # as before: no state fields
    _, _, _, got = request_of(frame)
    assert got.state is None
    assert got.return_state is return_state


def test_a_result_carries_the_final_state_of_each_sequence() -> None:
    state = a_state(3, TRAVELLER_SHAPES, seed=4)
    out = FlatSequences(np.arange(22, dtype=np.float32).reshape(11, 2), np.array([3, 1, 7]), state)
    got = result_of(roundtrip(result_frame(9, out)))
    np.testing.assert_array_equal(got.data, out.data)
    assert got.lengths.tolist() == [3, 1, 7]
    assert_same_state(got.state, state)


def test_a_result_without_a_state_has_none() -> None:
    out = FlatSequences(np.ones((4, 2), np.float32), np.array([4]))
    frame = roundtrip(result_frame(9, out))
    assert (frame.text, frame.flags, frame.state) == (b"", 0, ())
    assert result_of(frame).state is None


def test_a_state_whose_parts_do_not_fill_its_section_is_a_frame_error() -> None:
    state = a_state(2, {"s": (4,)})
    sent = dataclasses.replace(flat(3, 2), state=state)
    good = request_frame(Op.INFER, 7, "smoother", sent)
    short = dataclasses.replace(good, state=(state.tensors["s"][:1],))
    with pytest.raises(FrameError, match="ends inside part 's'"):
        request_of(roundtrip(short))
    long = dataclasses.replace(good, state=(state.tensors["s"], np.ones(3, np.float32)))
    with pytest.raises(FrameError, match="3 floats after"):
        request_of(roundtrip(long))


# -- a fake engine ------------------------------------------------------------------------------


@dataclass
class FakeModel:
    name: str
    kind: str = "smoother"
    input_dim: int = 4
    info: dict[str, Any] = field(default_factory=lambda: {"kind": "smoother"})
    version: str = "0123456789ab"
    loaded_at: float = 1.0e9


class FakeRuntime:
    """Doubles every number; ``gate`` holds calls; records what started and was cancelled."""

    def __init__(self) -> None:
        self.models = {"m": FakeModel("m")}
        self.available = True
        self.gate = asyncio.Event()
        self.gate.set()
        self.started: list[int] = []  # rows of each call that started
        self.request_ids: list[str] = []  # the request id as each call saw it
        self.spans: list[tuple[str, str] | None] = []  # the current span as each call saw it
        self.cancelled = 0
        self.closed_streams = 0
        self.fail: Exception | None = None
        self.log_failures = False
        self.listeners: list[Callable[[], None]] = []
        self.next_models: dict[str, FakeModel] | None = None  # what the next reload serves

    async def start(self) -> None: ...

    def on_models_changed(self, callback: Callable[[], None]) -> None:
        self.listeners.append(callback)

    async def reload(self) -> ReloadReport:
        """Serve ``next_models``: names new to it loaded, the others' versions changed."""
        if self.fail is not None:
            raise self.fail
        new, self.next_models = self.next_models or {}, None
        report = ReloadReport(
            loaded=[n for n in new if n not in self.models],
            changed=[n for n in new if n in self.models],
            removed=[n for n in self.models if n not in new],
            failed={"bad": "bad.safetensors: not a valid safetensors file"},
        )
        if new:
            self.models = new
            for callback in self.listeners:
                callback()
        return report

    def _note_request(self) -> None:
        request = current_request()
        assert request is not None  # the engine opens one per call
        self.request_ids.append(request.request_id)
        self.spans.append(tracing.current_ids())
        request.failure_logged = self.log_failures  # as a batcher notes what it logged

    async def stop(self) -> None: ...

    def get(self, name: str) -> FakeModel:
        if name not in self.models:
            raise UnknownModel(f"no model named '{name}' (served: m)")
        return self.models[name]

    async def infer(self, name: str, sequences: FlatSequences) -> FlatSequences:
        self.get(name)
        self.started.append(sequences.total)
        self._note_request()
        if self.fail is not None:
            raise self.fail
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return FlatSequences(sequences.data * 2, sequences.lengths)

    async def open_stream(self, name: str, sequences: FlatSequences) -> AsyncIterator[list[Piece]]:
        self.get(name)
        self._note_request()
        if self.fail is not None:
            raise self.fail
        return self._chunks(sequences)

    async def _chunks(self, sequences: FlatSequences) -> AsyncIterator[list[Piece]]:
        try:
            for start in range(0, int(sequences.lengths.max()), 2):
                yield [(i, start, s[start : start + 2, :2]) for i, s in enumerate(sequences)
                       if start < len(s)]  # fmt: skip
                await self.gate.wait()
        finally:
            self.closed_streams += 1


@asynccontextmanager
async def engine(
    tmp_path: Path, runtime: Any, on_lost: Callable[[], None] | None = None
) -> AsyncIterator[tuple[EngineServer, RemoteRuntime]]:
    path = str(tmp_path / "engine.sock")
    server = EngineServer(runtime, path)
    await server.start()
    runtime.on_models_changed(server.announce_models)  # as the engine process does
    remote = RemoteRuntime(path, on_lost)
    await remote.start()
    try:
        yield server, remote
    finally:
        await remote.stop()
        await server.close()


def flat(*lengths: int, width: int = 4, seed: int = 0) -> FlatSequences:
    rng = np.random.default_rng(seed)
    return FlatSequences.from_arrays(
        [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]
    )


async def until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async def poll() -> None:
        while not check():  # noqa: ASYNC110 (the fakes' state has no event of its own)
            await asyncio.sleep(0.002)

    await asyncio.wait_for(poll(), timeout_s)


# -- the two sides together ----------------------------------------------------------------------


async def test_hello_lists_the_models_and_the_socket_is_private(tmp_path: Path) -> None:
    async with engine(tmp_path, FakeRuntime()) as (server, remote):
        assert remote.available
        assert remote.engine_pid == os.getpid()
        m = remote.get("m")
        assert (m.name, m.kind, m.input_dim, m.info) == ("m", "smoother", 4, {"kind": "smoother"})
        assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
        assert server.connections == 1
        with pytest.raises(UnknownModel, match="no model named 'x' \\(served: m\\)"):
            remote.get("x")


async def test_many_calls_share_one_connection(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.gate.clear()
    async with engine(tmp_path, fake) as (_, remote):
        inputs = [flat(*range(1, k + 2), seed=k) for k in range(20)]
        calls = [asyncio.ensure_future(remote.infer("m", x)) for x in inputs]
        await until(lambda: len(fake.started) == 20)  # all in the engine at once
        assert not any(c.done() for c in calls)
        fake.gate.set()
        outputs = await asyncio.gather(*calls)
    for x, y in zip(inputs, outputs, strict=True):
        np.testing.assert_array_equal(y.lengths, x.lengths)
        np.testing.assert_array_equal(y.data, x.data * 2)


async def test_cancelling_a_call_cancels_it_in_the_engine(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.gate.clear()
    async with engine(tmp_path, fake) as (_, remote):
        call = asyncio.ensure_future(remote.infer("m", flat(3)))
        await until(lambda: len(fake.started) == 1)
        call.cancel()
        await until(lambda: fake.cancelled == 1)
        # the connection goes on serving
        fake.gate.set()
        out = await remote.infer("m", flat(2))
        assert out.total == 2


async def test_streams_arrive_chunk_by_chunk_and_closing_one_cancels_it(tmp_path: Path) -> None:
    fake = FakeRuntime()
    async with engine(tmp_path, fake) as (_, remote):
        x = flat(5, 2)
        chunks = [c async for c in await remote.open_stream("m", x)]
        assert [[(i, t, len(y)) for i, t, y in c] for c in chunks] == [
            [(0, 0, 2), (1, 0, 2)], [(0, 2, 2)], [(0, 4, 1)],
        ]  # fmt: skip
        np.testing.assert_array_equal(chunks[1][0][2], x[0][2:4, :2])
        await until(lambda: fake.closed_streams == 1)

        fake.gate.clear()
        stream = await remote.open_stream("m", flat(9))
        first = await anext(stream)
        assert first[0][:2] == (0, 0)
        await stream.aclose()  # type: ignore[attr-defined]
        await until(lambda: fake.closed_streams == 2)  # the engine's generator was closed


@pytest.mark.parametrize(
    "exc",
    [
        QueueFull("m queue is full (1 waiting)"),
        BatcherClosed("m is not accepting work"),
        StreamingUnavailable("model 'm' cannot stream"),
        UnknownModel("no model named 'm'"),
    ],
)
async def test_engine_errors_are_raised_again_in_the_worker(tmp_path: Path, exc: Exception) -> None:
    fake = FakeRuntime()
    fake.fail = exc
    async with engine(tmp_path, fake) as (_, remote):
        with pytest.raises(type(exc), match=str(exc).replace("(", r"\(").replace(")", r"\)")):
            await remote.infer("m", flat(2))
        with pytest.raises(type(exc)):
            await remote.open_stream("m", flat(2))  # raised before anything streams


async def test_a_failing_model_is_an_engine_error(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.fail = RuntimeError("the model broke")
    async with engine(tmp_path, fake) as (_, remote):
        with pytest.raises(EngineError, match="RuntimeError: the model broke"):
            await remote.infer("m", flat(2))
        fake.fail = None
        assert (await remote.infer("m", flat(2))).total == 2


async def test_the_engine_sees_each_calls_http_request_id(tmp_path: Path) -> None:
    fake = FakeRuntime()

    async def call(request_id: str | None, stream: bool) -> None:
        if request_id is not None:  # as the HTTP layer opens one, in this task's own context
            open_request(request_id)
        if stream:
            async for _ in await remote.open_stream("m", flat(3)):
                pass
        else:
            await remote.infer("m", flat(2))

    async with engine(tmp_path, fake) as (_, remote):
        await asyncio.gather(call("req-a", False), call(None, False), call("req-s", True))
    assert sorted(fake.request_ids) == ["-", "req-a", "req-s"]


@pytest.fixture
def tracer() -> Iterator[Tracer]:
    """This process traced (both sides of the socket), spans kept nowhere."""
    traced = TracerProvider().get_tracer("test")
    tracing.use(traced)
    yield traced
    tracing.use(None)


async def test_the_engine_continues_the_span_current_in_the_worker(
    tmp_path: Path, tracer: Tracer
) -> None:
    fake = FakeRuntime()
    async with engine(tmp_path, fake) as (_, remote):
        with tracer.start_as_current_span("engine call") as span:
            await remote.infer("m", flat(2))
            async for _ in await remote.open_stream("m", flat(3)):
                pass
        await remote.infer("m", flat(1))  # no span current: none continued
    context = span.get_span_context()
    ids = (f"{context.trace_id:032x}", f"{context.span_id:016x}")
    assert fake.spans == [ids, ids, None]


async def test_with_tracing_off_a_call_runs_no_opentelemetry_code_on_either_side(
    tmp_path: Path,
) -> None:
    called: set[str] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        module = frame.f_globals.get("__name__", "")
        if event == "call" and module.startswith("opentelemetry"):
            called.add(f"{module}.{frame.f_code.co_name}")

    fake = FakeRuntime()
    assert tracing.tracer() is None
    async with engine(tmp_path, fake) as (_, remote):
        open_request("req-off")  # as the HTTP layer opens one
        sys.setprofile(profile)  # both sides run on this thread's loop
        try:
            await remote.infer("m", flat(2))
            async for _ in await remote.open_stream("m", flat(3)):
                pass
        finally:
            sys.setprofile(None)
    assert fake.request_ids == ["req-off", "req-off"]
    assert fake.spans == [None, None]
    assert called == set()


@pytest.mark.parametrize("logged", [True, False])
async def test_the_worker_learns_whether_the_engine_logged_a_failure(
    tmp_path: Path, logged: bool
) -> None:
    fake = FakeRuntime()
    fake.fail, fake.log_failures = RuntimeError("the model broke"), logged
    async with engine(tmp_path, fake) as (_, remote):
        for stream in (False, True):
            request = open_request("req-x")
            call = remote.open_stream if stream else remote.infer
            with pytest.raises(EngineError):
                await call("m", flat(3))
            assert request.failure_logged is logged  # so the HTTP layer logs it only if not


async def test_engine_gone_fails_calls_and_later_ones_at_once(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.gate.clear()
    lost: list[bool] = []
    async with engine(tmp_path, fake, on_lost=lambda: lost.append(True)) as (server, remote):
        call = asyncio.ensure_future(remote.infer("m", flat(3)))
        stream = await remote.open_stream("m", flat(9))
        await until(lambda: len(fake.started) == 1)
        await server.close()  # the engine goes away
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(call, 5)
        with pytest.raises(EngineUnavailable):
            async for _ in stream:
                pass
        assert not remote.available
        assert lost == [True]
        with pytest.raises(EngineUnavailable):
            await remote.infer("m", flat(1))


async def test_connecting_to_no_engine_fails(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable):
        await RemoteRuntime(str(tmp_path / "none.sock")).start(timeout_s=0.2)


async def test_the_worker_app_answers_503_once_the_engine_is_gone(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.models = {"smoother": FakeModel("smoother", input_dim=16)}
    path = str(tmp_path / "engine.sock")
    server = EngineServer(fake, path)
    await server.start()
    app = create_app(Settings(), engine_socket=path)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
            body = {"sequences": [[[1.0] * 16] * 3]}
            r = await client.post("/smooth", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["sequences"] == [[[2.0] * 16] * 3]
            assert (await client.get("/readyz")).status_code == 200
            await server.close()
            await until(lambda: not app.state.runtime.available)
            assert (await client.get("/readyz")).status_code == 503
            r = await client.post("/smooth", json=body)
            assert r.status_code == 503
            assert r.json()["type"] == "engine_unavailable"
            assert r.headers["retry-after"] == "1"


# -- reloads ---------------------------------------------------------------------------------


async def test_a_reload_asked_by_a_worker_returns_the_engines_report(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.next_models = {"m": FakeModel("m", version="bbbbbbbbbbbb"), "n": FakeModel("n")}
    async with engine(tmp_path, fake) as (_, remote):
        report = await remote.reload()
        assert report == ReloadReport(
            loaded=["n"],
            changed=["m"],
            failed={"bad": "bad.safetensors: not a valid safetensors file"},
        )
        # the new list arrived before the answer
        assert {n: m.version for n, m in remote.models.items()} == {
            "m": "bbbbbbbbbbbb",
            "n": "0123456789ab",
        }


async def test_every_worker_learns_the_models_a_reload_changed(tmp_path: Path) -> None:
    fake = FakeRuntime()
    async with engine(tmp_path, fake) as (server, remote):
        other = RemoteRuntime(server.path)
        await other.start()
        heard: list[list[str]] = []
        other.on_models_changed(lambda: heard.append(sorted(other.models)))
        try:
            assert other.models["m"].loaded_at == 1.0e9
            fake.next_models = {"n": FakeModel("n", kind="traveller", input_dim=6)}
            await remote.reload()  # asked by one worker, told to both
            await until(lambda: heard == [["n"]])
            assert other.models["n"].kind == "traveller"
            assert other.models["n"].input_dim == 6
            with pytest.raises(UnknownModel):
                other.get("m")
        finally:
            await other.stop()


async def test_a_reload_that_raises_in_the_engine_raises_in_the_worker(tmp_path: Path) -> None:
    fake = FakeRuntime()
    fake.fail = RuntimeError("disk on fire")
    async with engine(tmp_path, fake) as (_, remote):
        with pytest.raises(EngineError, match="disk on fire"):
            await remote.reload()
        assert sorted(remote.models) == ["m"]


def test_a_reload_report_survives_json() -> None:
    report = ReloadReport(["a"], ["b"], ["c"], ["d"], {"": "the folder is empty", "e": "bad"})
    doc = report.as_json()
    assert doc["failed"] == [
        {"model": None, "error": "the folder is empty"},
        {"model": "e", "error": "bad"},
    ]
    assert ReloadReport.from_json(doc) == report


async def test_the_real_runtime_answers_the_same_through_the_socket(tmp_path: Path) -> None:
    runtime = ModelRuntime(Settings(max_delay_ms=1.0))
    await runtime.start()
    try:
        async with engine(tmp_path, runtime) as (_, remote):
            assert {m.name: (m.info, m.version, m.loaded_at) for m in remote.models.values()} == {
                m.name: (m.info, m.version, m.loaded_at) for m in runtime.models.values()
            }
            for name, width in (("smoother", 16), ("traveller", 6)):
                x = flat(30, 7, 1, width=width)
                direct, remote_out = await runtime.infer(name, x), await remote.infer(name, x)
                np.testing.assert_array_equal(remote_out.data, direct.data)
                np.testing.assert_array_equal(remote_out.lengths, direct.lengths)
            x = flat(150, 20, width=6)
            there = [c async for c in await remote.open_stream("traveller", x)]
            here = [c async for c in await runtime.open_stream("traveller", x)]
            assert len(there) == len(here) == 3  # 64 steps a chunk
            for a, b in zip(there, here, strict=True):
                assert [(i, t) for i, t, _ in a] == [(i, t) for i, t, _ in b]
                for (_, _, y), (_, _, z) in zip(a, b, strict=True):
                    np.testing.assert_array_equal(y, z)
    finally:
        await runtime.stop()


async def test_a_carried_state_crosses_the_socket_both_ways(tmp_path: Path) -> None:
    """The worker learns each model's state shapes; a sequence in two pieces, the second from
    the first's final state, equals it whole; a state of another version is a StateMismatch."""
    runtime = ModelRuntime(Settings(max_delay_ms=1.0))
    await runtime.start()
    try:
        async with engine(tmp_path, runtime) as (_, remote):
            for name, width in (("smoother", 16), ("traveller", 6)):
                assert remote.get(name).state_shapes == runtime.get(name).state_shapes != {}
                x = flat(30, 7, width=width)
                whole = await runtime.infer(name, dataclasses.replace(x, return_state=True))
                assert whole.state is not None
                heads = FlatSequences.from_arrays([s[:4] for s in x])
                tails = FlatSequences.from_arrays([s[4:] for s in x])
                first = await remote.infer(name, dataclasses.replace(heads, return_state=True))
                assert first.state is not None
                assert (first.state.model, first.state.version) == (name, remote.get(name).version)
                again = dataclasses.replace(tails, state=first.state, return_state=True)
                second = await remote.infer(name, again)
                rows = [np.concatenate([a, b]) for a, b in zip(first, second, strict=True)]
                np.testing.assert_allclose(np.concatenate(rows), whole.data, atol=1e-5)
                assert second.state is not None
                for part, tensor in whole.state.tensors.items():
                    np.testing.assert_allclose(second.state.tensors[part], tensor, atol=1e-5)
                stale = dataclasses.replace(first.state, version="0" * 12)
                with pytest.raises(StateMismatch, match="version"):
                    await remote.infer(name, dataclasses.replace(tails, state=stale))
            x = flat(150, 20, width=6)
            head = FlatSequences.from_arrays([s[:9] for s in x], 6)
            tail = FlatSequences.from_arrays([s[9:] for s in x], 6)
            start = await remote.infer("traveller", dataclasses.replace(head, return_state=True))
            streamed = dataclasses.replace(tail, state=start.state)
            there = [c async for c in await remote.open_stream("traveller", streamed)]
            here = [c async for c in await runtime.open_stream("traveller", streamed)]
            assert [[(i, t) for i, t, _ in c] for c in there] == [
                [(i, t) for i, t, _ in c] for c in here
            ]
            for a, b in zip(there, here, strict=True):
                for (_, _, y), (_, _, z) in zip(a, b, strict=True):
                    np.testing.assert_array_equal(y, z)
    finally:
        await runtime.stop()


def test_settings_reach_the_workers_through_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    settings = Settings(
        port=0, access_log=True, model_dir=tmp_path, max_delay_ms=7.5, workers=3,
        rollout_scheduling="batch",
    )  # fmt: skip
    for key in [k for k in os.environ if k.startswith("RNNSERVE_")]:
        monkeypatch.delenv(key)
    for key, text in settings_environment(settings).items():
        monkeypatch.setenv(key, text)
    assert Settings().model_dump() == settings.model_dump()
