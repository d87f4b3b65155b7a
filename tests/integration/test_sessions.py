"""Streaming sessions in-process (Starlette's test client over the app's WebSocket route): the
control message, what a chunk may and may not send, a reload under an open session, the
session metrics after a run, frames held in the byte budget while they wait, and the chunk
limit."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.testclient import WebSocketTestSession
from starlette.websockets import WebSocketDisconnect

from rnnserve import models
from rnnserve.service.config import Settings
from rnnserve.service.http import sessions
from rnnserve.service.http.app import create_app
from rnnserve.service.http.auth import byte_budget

PATH = "/models/traveller/stream"


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[FastAPI, TestClient]]:
    app = create_app(Settings(max_delay_ms=1.0))
    with TestClient(app) as client:
        yield app, client


def width(client: TestClient) -> int:
    models = client.get("/models").json()["models"]
    return int(next(m for m in models if m["name"] == "traveller")["shapes"]["input"][1])


def send_chunk(ws: WebSocketTestSession, rows: list[list[float]], **extra: Any) -> Any:
    ws.send_json({"inputs": [rows], **extra})
    return ws.receive_json()


def sample(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if re.match(rf"{name}\{{{want}}} ", line) or line.startswith(f"{name}{{{want},"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_get_state_answers_null_before_the_first_chunk_then_the_models_state(
    served: tuple[FastAPI, TestClient],
) -> None:
    _, client = served
    rows = [[0.1] * width(client)] * 3
    version = next(m for m in client.get("/models").json()["models"] if m["name"] == "traveller")
    with client.websocket_connect(PATH) as ws:
        ws.send_json({"get_state": True})
        assert ws.receive_json() == {"state": None}
        send_chunk(ws, rows)
        ws.send_json({"get_state": True})
        state = ws.receive_json()["state"]
    assert (state["model"], state["version"]) == ("traveller", version["version"])
    assert sorted(state["sequences"][0]) == ["c", "h", "p"]


def test_a_later_chunk_may_not_send_a_state(served: tuple[FastAPI, TestClient]) -> None:
    _, client = served
    rows = [[0.1] * width(client)] * 3
    with client.websocket_connect(PATH) as ws:
        send_chunk(ws, rows)
        ws.send_json({"get_state": True})
        state = ws.receive_json()["state"]
        error = send_chunk(ws, rows, state=state)
        assert error["error"]["type"] == "invalid_request"
        assert error["error"]["loc"] == ["state"]
        assert "outputs" in send_chunk(ws, rows)  # still open


def test_a_chunk_naming_another_model_is_refused(served: tuple[FastAPI, TestClient]) -> None:
    _, client = served
    rows = [[0.1] * width(client)] * 2
    with client.websocket_connect(PATH) as ws:
        error = send_chunk(ws, rows, model="smoother")
        assert (error["status"], error["error"]["loc"]) == (422, ["model"])


def test_a_first_state_of_another_version_is_an_error_and_the_session_stays_open(
    served: tuple[FastAPI, TestClient],
) -> None:
    _, client = served
    rows = [[0.1] * width(client)] * 2
    with client.websocket_connect(PATH) as ws:
        send_chunk(ws, rows)
        ws.send_json({"get_state": True})
        state = ws.receive_json()["state"]
    with client.websocket_connect(PATH) as ws:
        error = send_chunk(ws, rows, state={**state, "version": "0" * 12})
        assert (error["status"], error["error"]["type"]) == (409, "state_mismatch")
        assert error["error"]["loc"] == ["state", "version"]
        assert "outputs" in send_chunk(ws, rows, state=state)


def test_a_session_to_an_unknown_model_is_closed_with_4404(
    served: tuple[FastAPI, TestClient],
) -> None:
    _, client = served
    with (
        client.websocket_connect("/models/nope/stream") as ws,
        pytest.raises(WebSocketDisconnect) as closed,
    ):
        ws.receive_json()
    assert closed.value.code == 4404


def test_the_session_metrics_count_chunks_by_outcome(served: tuple[FastAPI, TestClient]) -> None:
    _, client = served
    before = client.get("/metrics").text
    rows = [[0.2] * width(client)] * 4
    with client.websocket_connect(PATH) as ws:
        for _ in range(3):
            send_chunk(ws, rows)
        send_chunk(ws, [[0.2]])  # one feature: wrong_feature_count
        during = client.get("/metrics").text
    after = client.get("/metrics").text

    def moved(text: str, name: str, **labels: str) -> float:
        return sample(text, name, **labels) - sample(before, name, **labels)

    assert sample(during, "rnnserve_sessions_open", model="traveller") == 1
    assert sample(after, "rnnserve_sessions_open", model="traveller") == 0
    chunks = "rnnserve_session_chunks_total"
    assert moved(after, chunks, model="traveller", outcome="ok") == 3
    assert moved(after, chunks, model="traveller", outcome="wrong_feature_count") == 1
    durations = "rnnserve_session_chunk_duration_seconds_count"
    assert moved(after, durations, model="traveller") == 3
    assert moved(after, "rnnserve_session_chunk_duration_seconds_sum", model="traveller") > 0


def test_closed_and_dropped_sessions_leave_nothing_behind(
    served: tuple[FastAPI, TestClient],
) -> None:
    app, client = served
    rows = [[0.3] * width(client)] * 5
    for i in range(30):
        with client.websocket_connect(PATH) as ws:
            if i % 3 == 0:
                send_chunk(ws, rows)
            elif i % 3 == 1:  # a chunk sent, the session closed before its answer is read
                ws.send_json({"inputs": [rows]})
    gc.collect()
    assert [o for o in gc.get_objects() if isinstance(o, sessions._Session)] == []
    assert sessions.sessions_of(app.state).open == 0
    assert byte_budget(app.state).used == 0


# -- a reload under an open session -------------------------------------------------------------

WIDTH = 4


def write_smoother(folder: Path, alpha: float) -> None:
    aside = folder / ".s.partial"
    models.save(models.build("smoother", {"feat_dim": WIDTH, "alpha_smooth": alpha}), aside)
    os.replace(aside, folder / "s.safetensors")


def test_a_reload_under_a_session_closes_it_with_4409_and_a_first_old_state_is_an_error(
    tmp_path: Path,
) -> None:
    write_smoother(tmp_path, 0.5)
    rows = [[0.4] * WIDTH] * 3
    app = create_app(Settings(model_dir=tmp_path, device="cpu", max_delay_ms=1.0))
    with TestClient(app) as client:
        with client.websocket_connect("/models/s/stream") as ws:
            assert "outputs" in send_chunk(ws, rows)
            ws.send_json({"get_state": True})
            old_state = ws.receive_json()["state"]
            write_smoother(tmp_path, 0.3)  # other weights: another version
            assert client.post("/admin/reload").json()["changed"] == ["s"]
            ws.send_json({"inputs": [rows]})
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
        assert closed.value.code == 4409
        assert len(closed.value.reason.encode()) <= 123
        reason = json.loads(closed.value.reason)
        assert reason["type"] == "state_mismatch"
        made_by = f"the state was made by model 's' version '{old_state['version']}'"
        assert reason["detail"].startswith(made_by)  # shortened to fit the frame after that
        # the same old state as a new session's first chunk: an error message, and it stays open
        with client.websocket_connect("/models/s/stream") as ws:
            error = send_chunk(ws, rows, state=old_state)
            assert (error["status"], error["error"]["type"]) == (409, "state_mismatch")
            assert error["error"]["loc"] == ["state", "version"]
            assert "outputs" in send_chunk(ws, rows)
        metrics = client.get("/metrics").text
    chunks = "rnnserve_session_chunks_total"
    assert sample(metrics, chunks, model="s", outcome="state_mismatch") == 2
    assert sample(metrics, chunks, model="s", outcome="ok") == 2


def test_a_client_that_vanishes_while_its_chunk_runs_frees_its_slot_without_waiting(
    served: tuple[FastAPI, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, client = served
    started, cancelled = threading.Event(), threading.Event()

    async def never_done(name: str, sequences: Any) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()  # a chunk that would run for ever
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(app.state.runtime, "infer", never_done)
    rows = [[0.1] * width(client)] * 2
    with client.websocket_connect(PATH) as ws:
        ws.send_json({"inputs": [rows]})
        assert started.wait(30)
        assert sample(client.get("/metrics").text, "rnnserve_sessions_open", model="traveller") == 1
        ws.close()  # the client's disconnect, while its chunk runs
        # the session ended although its chunk never would: the chunk was cancelled, and the
        # slot, the gauge and the bytes the chunk held are free
        assert cancelled.wait(30)
        for _ in range(100):  # the session's finally runs just after the chunk's cancel
            if sessions.sessions_of(app.state).open == 0:
                break
            time.sleep(0.01)
        assert sessions.sessions_of(app.state).open == 0
        metrics = client.get("/metrics").text
        assert sample(metrics, "rnnserve_sessions_open", model="traveller") == 0
        assert byte_budget(app.state).used == 0


def test_chunks_of_sessions_are_batched_with_each_other_and_with_requests() -> None:
    # a long batching delay: what arrives together is run together
    app = create_app(Settings(max_delay_ms=500.0, rollout_scheduling="batch"))
    with TestClient(app) as client:
        rows = [[0.5] * width(client)] * 4
        before = client.get("/metrics").text
        barrier = threading.Barrier(4)
        answers: list[Any] = []

        def session() -> None:
            with client.websocket_connect(PATH) as ws:
                barrier.wait()
                answers.append(send_chunk(ws, rows))

        def request() -> None:
            barrier.wait()
            answers.append(client.post("/rollout", json={"inputs": [rows]}).json())

        threads = [threading.Thread(target=session) for _ in range(3)]
        threads.append(threading.Thread(target=request))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        after = client.get("/metrics").text
    assert len(answers) == 4
    assert all("outputs" in a or "positions" in a for a in answers), answers

    def moved(name: str) -> float:
        return sample(after, name, model="traveller") - sample(before, name, model="traveller")

    assert moved("rnnserve_batch_requests_sum") == 4  # three chunks and one request
    assert moved("rnnserve_batch_requests_count") < 4  # in fewer batches than items


# -- frames in the byte budget, the chunk limit ---------------------------------------------------


def chunk_text(client: TestClient, steps: int, value: float) -> str:
    return json.dumps({"inputs": [[[value] * width(client)] * steps]})


def wait_for(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("the condition never held")


def test_frames_count_in_the_budget_from_the_moment_the_session_takes_them(
    served: tuple[FastAPI, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    app, client = served
    budget = byte_budget(app.state)
    release = threading.Event()
    real_infer = app.state.runtime.infer

    async def held_back(name: str, sequences: Any) -> Any:
        await asyncio.to_thread(release.wait, 60)  # the chunk runs until the test lets it go
        return await real_infer(name, sequences)

    monkeypatch.setattr(app.state.runtime, "infer", held_back)
    first, second, third = (chunk_text(client, steps, 0.1) for steps in (3, 5, 7))
    with client.websocket_connect(PATH) as ws:
        ws.send_text(first)
        wait_for(lambda: budget.used == len(first))  # running: its frame is held
        ws.send_text(second)
        wait_for(lambda: budget.used == len(first) + len(second))  # waiting: held too
        ws.send_text(third)
        time.sleep(0.2)  # room for a reader that would take a second frame ahead
        assert budget.used == len(first) + len(second)  # one frame waits, no more
        release.set()
        answers = [ws.receive_json() for _ in range(3)]
        assert [len(a["outputs"][0]) for a in answers] == [3, 5, 7]
        wait_for(lambda: budget.used == 0)


def test_a_frame_the_budget_cannot_take_is_answered_overloaded_and_the_session_goes_on(
    served: tuple[FastAPI, TestClient],
) -> None:
    app, client = served
    budget = byte_budget(app.state)
    rows = [[0.1] * width(client)] * 3
    with client.websocket_connect(PATH) as ws:
        assert "outputs" in send_chunk(ws, rows)
        ws.send_json({"get_state": True})
        state = ws.receive_json()["state"]
        full = budget.room()
        budget.hold(full)  # what other requests hold: no room left
        try:
            refused = send_chunk(ws, rows)
        finally:
            budget.give(full)
        assert (refused["status"], refused["error"]["type"]) == (503, "overloaded")
        ws.send_json({"get_state": True})
        assert ws.receive_json()["state"] == state  # the refused chunk did not move it
        assert len(send_chunk(ws, rows)["outputs"][0]) == 3
    assert budget.used == 0


def test_a_frame_over_max_chunk_bytes_closes_with_1009_naming_the_setting() -> None:
    limit = 2000
    app = create_app(Settings(max_delay_ms=1.0, max_chunk_bytes=limit))
    with TestClient(app) as client:
        body = chunk_text(client, 3, 0.25)
        at_limit = body + " " * (limit - len(body))  # JSON's white space: the same chunk
        with client.websocket_connect(PATH) as ws:
            ws.send_text(at_limit)
            assert len(ws.receive_json()["outputs"][0]) == 3
            ws.send_text(at_limit + " ")
            with pytest.raises(WebSocketDisconnect) as closed:
                ws.receive_json()
        assert closed.value.code == 1009
        detail = f"a frame is over {limit} bytes (max_chunk_bytes)"
        assert json.loads(closed.value.reason) == {"type": "body_too_large", "detail": detail}
        assert byte_budget(app.state).used == 0


def test_a_client_lost_with_a_frame_waiting_frees_its_slot_on_the_servers_word(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With a frame waiting behind the running chunk the session reads nothing more, so the
    disconnect behind it is not read; rnnserve's WebSocket protocol says the connection is lost
    (the scope's extension, stood in for here), and the session ends at once."""
    app = create_app(Settings(max_delay_ms=1.0))
    lost = asyncio.Event()

    async def with_lost(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            extensions = {**scope.get("extensions", {}), sessions.CONNECTION_LOST: lost}
            scope = {**scope, "extensions": extensions}
        await app(scope, receive, send)

    started, cancelled = threading.Event(), threading.Event()

    async def never_done(name: str, sequences: Any) -> Any:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with TestClient(with_lost) as client:
        monkeypatch.setattr(app.state.runtime, "infer", never_done)
        budget = byte_budget(app.state)
        first, second = chunk_text(client, 3, 0.1), chunk_text(client, 4, 0.1)
        with client.websocket_connect(PATH) as ws:
            ws.send_text(first)
            assert started.wait(30)
            ws.send_text(second)
            wait_for(lambda: budget.used == len(first) + len(second))  # one running, one waiting
            ws.portal.call(lost.set)  # the connection is lost; no disconnect is read
            assert cancelled.wait(30)
            wait_for(lambda: sessions.sessions_of(app.state).open == 0)
            wait_for(lambda: budget.used == 0)  # the waiting frame's bytes are given back
