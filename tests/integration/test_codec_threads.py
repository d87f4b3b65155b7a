"""Large JSON bodies are read and their answers written on codec threads, off the event loop
(``codec_threads``, ``codec_offload_bytes``): the same answers, the same errors, and the event
loop free meanwhile."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import numpy as np
import pytest

from rnnserve.service.codec import bodies
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.http import inference, precise

from .conftest import running_app

pytestmark = pytest.mark.anyio

LOOP_THREAD = threading.main_thread().name


def _smooth(steps: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"sequences": [rng.uniform(-1, 1, (steps, 16)).astype(np.float32).tolist()]}


def _rollout(steps: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"inputs": [rng.uniform(-1, 1, (steps, 6)).astype(np.float32).tolist()]}


REQUESTS: list[tuple[str, Any]] = [
    ("/smooth", _smooth(300, 0)),
    ("/smooth", {"sequences": [[[0.5] * 16] * 3, [[1.0] * 16]], "model": "smoother"}),
    ("/rollout", _rollout(40, 1)),
    ("/models/smoother/infer", {"inputs": _smooth(20, 2)["sequences"]}),
    ("/smooth", {"sequences": [[[1.0] * 15]]}),  # 422 wrong_feature_count
    ("/smooth", b'{"sequences": [[[1, 2,]]]}'),  # 400 invalid_json, with where
    ("/smooth", b'{"sequences": [[[1, "a"]]]}'),  # 422 from the precise parser
    ("/smooth", {"sequences": [[[1.0] * 16], [[1e39] * 16]]}),  # 422 non-finite in float32
    ("/rollout", {"inputs": [[[1] * 6]], "model": "smoother"}),  # 422 wrong_model_kind
]


async def _post(client: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    headers = {"X-Request-Id": "fixed", "content-type": "application/json"}
    if isinstance(body, bytes):
        return await client.post(path, content=body, headers=headers)
    return await client.post(path, json=body, headers=headers)


async def test_on_codec_threads_the_answers_are_the_event_loops() -> None:
    """Every body and answer on a codec thread (offload from 0 bytes) against none: the same
    status and bytes, answers and errors (with where) alike."""
    answers: dict[int, list[tuple[int, bytes]]] = {}
    for threads in (0, 2):
        async with running_app(codec_threads=threads, codec_offload_bytes=0) as (_, client):
            answers[threads] = [
                ((r := await _post(client, path, body)).status_code, r.content)
                for path, body in REQUESTS
            ]
    assert answers[2] == answers[0]
    assert [status for status, _ in answers[2]] == [200, 200, 200, 200, 422, 400, 422, 422, 422]


@pytest.fixture
def where_it_ran(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(function, thread name) of every JSON read and write."""
    seen: list[tuple[str, str]] = []

    def spy(name: str, real: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen.append((name, threading.current_thread().name))
            return real(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(bodies, "decode", spy("decode", bodies.decode))
    monkeypatch.setattr(bodies, "encode", spy("encode", bodies.encode))
    monkeypatch.setattr(precise, "parse_body", spy("parse_body", precise.parse_body))
    monkeypatch.setattr(inference, "to_arrays", spy("to_arrays", inference.to_arrays))
    return seen


async def test_only_bodies_and_answers_over_the_threshold_leave_the_loop(
    where_it_ran: list[tuple[str, str]],
) -> None:
    async with running_app(codec_threads=2, codec_offload_bytes=20_000) as (app, client):
        where_it_ran.clear()  # the warm-up's
        small = await _post(client, "/smooth", _smooth(10, 3))  # ~2 KB in and out
        big = await _post(client, "/smooth", _smooth(400, 4))  # ~70 KB in and out
        # big bodies the fast path declines: the precise parser (and the conversion) go too
        odd = {"sequences": _smooth(400, 5)["sequences"], "extra": 1}
        refused = await _post(client, "/smooth", odd)
        escaped = httpx.Request("POST", "/", json=_smooth(400, 6)).content[:-1]
        escaped += b', "model": "smoo\\u0074her"}'  # an escape: only the precise parser reads it
        precise = await _post(client, "/smooth", escaped)
        # /rollout: 6 inputs a step in (~66 KB), 2 positions out (24 KB by the estimate)
        rolled = await _post(client, "/rollout", _rollout(1_000, 7))
        assert isinstance(app.state.codec, CodecPool)
    assert [r.status_code for r in (small, big, precise, rolled)] == [200, 200, 200, 200]
    assert precise.json()["model"] == "smoother"
    assert len(precise.json()["sequences"][0]) == 400
    assert refused.status_code == 422
    assert refused.json()["loc"] == ["extra"]
    codec = [(name, thread.startswith("rnnserve-codec")) for name, thread in where_it_ran]
    assert codec == [
        ("decode", False),
        ("encode", False),
        ("decode", True),
        ("encode", True),
        ("decode", True),
        ("parse_body", True),
        ("decode", True),
        ("parse_body", True),
        ("to_arrays", True),
        ("encode", True),
        ("decode", True),
        ("encode", True),
    ]
    loop_threads = {thread for (_, thread) in where_it_ran if "codec" not in thread}
    assert loop_threads == {LOOP_THREAD}


async def test_with_no_codec_threads_everything_stays_on_the_loop(
    where_it_ran: list[tuple[str, str]],
) -> None:
    async with running_app(codec_threads=0, codec_offload_bytes=0) as (app, client):
        where_it_ran.clear()
        assert (await _post(client, "/smooth", _smooth(400, 7))).status_code == 200
        assert app.state.codec._pool is None
    assert where_it_ran == [("decode", LOOP_THREAD), ("encode", LOOP_THREAD)]


async def test_a_large_body_being_read_holds_up_no_other_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The big body's read waits, on its codec thread, until a small request sent after it has
    been answered: were the read on the event loop, the small one could never be (the test
    would hang, not pass)."""
    small_done = threading.Event()
    real = bodies.decode

    def decode(body: bytes, *args: Any) -> Any:
        if len(body) > 50_000:
            assert small_done.wait(timeout=60), "the small request was held up"
        return real(body, *args)

    monkeypatch.setattr(bodies, "decode", decode)
    async with running_app(codec_threads=1, codec_offload_bytes=50_000) as (_, client):
        big = asyncio.create_task(_post(client, "/smooth", _smooth(2_000, 8)))
        await asyncio.sleep(0)  # the big one first
        small = await _post(client, "/smooth", _smooth(5, 9))
        small_done.set()
        assert small.status_code == 200
        assert (await big).status_code == 200
        assert len((await big).json()["sequences"][0]) == 2_000


async def test_the_threads_end_with_the_app() -> None:
    async with running_app(codec_threads=2, codec_offload_bytes=0) as (app, client):
        assert (await _post(client, "/smooth", _smooth(20, 10))).status_code == 200
        pool = app.state.codec._pool
        assert pool is not None
        assert any(t.name.startswith("rnnserve-codec") for t in threading.enumerate())
    assert pool._shutdown
    assert not any(t.name.startswith("rnnserve-codec") and t.is_alive() for t in pool._threads)


@pytest.mark.parametrize(("threads", "min_bytes"), [(-1, 0), (65, 0), (2, -1)])
def test_settings_refuse_what_cannot_be(threads: int, min_bytes: int) -> None:
    from pydantic import ValidationError

    from rnnserve.service.config import Settings

    with pytest.raises(ValidationError):
        Settings(codec_threads=threads, codec_offload_bytes=min_bytes)


async def test_binary_bodies_are_read_on_the_loop_whatever_their_size(
    where_it_ran: list[tuple[str, str]],
) -> None:
    """safetensors bytes are read in place: no hand-off, however large (128 KB here)."""
    from safetensors.numpy import save

    rows = np.random.default_rng(11).uniform(-1, 1, (2_000, 16)).astype(np.float32)
    body = save({"sequences": rows, "lengths": np.array([2_000], np.int64)})
    headers = {"content-type": bodies.SAFETENSORS, "accept": bodies.SAFETENSORS}
    async with running_app(codec_threads=2, codec_offload_bytes=20_000) as (_, client):
        where_it_ran.clear()
        r = await client.post("/smooth", content=body, headers=headers)
    assert r.status_code == 200
    assert r.headers["content-type"] == bodies.SAFETENSORS
    assert where_it_ran == [("decode", LOOP_THREAD)]
