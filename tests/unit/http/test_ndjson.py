"""The streamed rollout's lines, metrics and clean-up (``rnnserve.service.http.streaming.ndjson``),
driven directly.

The integration tests (tests/integration/test_streaming.py) stream real rollouts; these feed
the generator pieces by hand, so that each way a stream ends (done, deadline, failure, client
gone, an iterator that fails at once) is checked by its exact lines, its metrics by label, and
the rollout's clean-up by what ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pytest
from prometheus_client import Gauge
from starlette.requests import Request

from rnnserve.service.http import streaming
from rnnserve.service.interface import Piece, open_request
from rnnserve.service.metrics import Metrics

ENDPOINT, MODEL = "rollout", "traveller"


class Rollout:
    """Pieces handed out one chunk at a time; ``hang`` before the chunk of that index (never
    comes), ``fail`` raises that exception there. Records whether its clean-up ran."""

    def __init__(
        self, chunks: list[list[Piece]], hang: int = -1, fail: BaseException | None = None
    ) -> None:
        self.chunks, self.hang, self.fail = chunks, hang, fail
        self.closed = False

    async def run(self) -> AsyncIterator[list[Piece]]:
        try:
            for i, chunk in enumerate(self.chunks):
                if i == self.hang:
                    await asyncio.sleep(30)
                yield chunk
            if self.fail is not None:
                raise self.fail
        finally:
            self.closed = True


def _request(disconnect_after: float | None = None) -> Request:
    async def receive() -> dict[str, Any]:
        if disconnect_after is None:
            await asyncio.sleep(30)
        else:
            await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/rollout", "headers": []}, receive)


def _stream(
    pieces: AsyncIterator[list[Piece]],
    *,
    deadline: float = math.inf,
    disconnect_after: float | None = None,
    rid: str | None = "rid-1",
    rollout: Rollout | None = None,
    failure_logged: bool = False,
) -> tuple[list[bytes], Metrics, Gauge, float]:
    """Every line the stream yields, the metrics, the in-flight gauge, and the time taken;
    checks that ``rollout`` was cleaned up by the time the stream ended (not later, when
    ``asyncio.run`` cancels what is left). ``rid=None``: streamed outside any request."""
    metrics = Metrics()
    in_flight = Gauge("in_flight", "requests", registry=metrics.registry)
    in_flight.inc()

    async def main() -> tuple[list[bytes], float]:
        # a scheduler that logs a failure notes it in the request's context
        if rid is not None:
            open_request(rid).failure_logged = failure_logged
        started = time.perf_counter()
        stream = streaming.ndjson(
            _request(disconnect_after), "m1", pieces, in_flight, metrics, ENDPOINT, MODEL,
            started, started + deadline,
        )  # fmt: skip
        lines = [line async for line in stream]
        took = time.perf_counter() - started
        assert rollout is None or rollout.closed
        return lines, took

    lines, took = asyncio.run(asyncio.wait_for(main(), 10))
    return lines, metrics, in_flight, took


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _durations(metrics: Metrics, code: str) -> tuple[float, float]:
    labels = {"endpoint": ENDPOINT, "model": MODEL, "code": code}
    count = _sample(metrics, "rnnserve_request_duration_seconds_count", **labels)
    total = _sample(metrics, "rnnserve_request_duration_seconds_sum", **labels)
    return count, total


def _piece(i: int, start: int, n: int) -> Piece:
    return i, start, np.arange(2 * n, dtype=np.float32).reshape(n, 2) / 4 + i


CHUNKS = [[_piece(0, 0, 2), _piece(1, 0, 1)], [_piece(0, 2, 1)]]


def _line(i: int, start: int, n: int) -> bytes:
    y = (np.arange(2 * n, dtype=np.float32).reshape(n, 2) / 4 + i).tolist()
    return orjson.dumps({"sequence": i, "start": start, "positions": y}) + b"\n"


def test_a_stream_is_its_chunks_then_done() -> None:
    rollout = Rollout(CHUNKS)
    lines, metrics, in_flight, took = _stream(rollout.run(), rollout=rollout)
    assert lines == [
        _line(0, 0, 2) + _line(1, 0, 1),  # one write per chunk
        _line(0, 2, 1),
        b'{"model":"m1","done":true}\n',
    ]
    count, total = _durations(metrics, "200")
    assert count == 1
    assert 0 <= total <= took
    assert in_flight._value.get() == 0
    assert _sample(metrics, "rnnserve_requests_cancelled_total", endpoint=ENDPOINT) == 0


def test_a_stream_past_its_deadline_ends_with_its_error_and_drops_the_rollout() -> None:
    rollout = Rollout(CHUNKS, hang=1)
    lines, metrics, in_flight, took = _stream(rollout.run(), deadline=0.05, rollout=rollout)
    assert lines == [
        _line(0, 0, 2) + _line(1, 0, 1),
        b'{"error":{"detail":"the request\'s deadline passed; the rollout was dropped",'
        b'"type":"deadline_exceeded"}}\n',
    ]
    assert took < 5  # not the 30 s the next chunk would have taken
    assert _durations(metrics, "504")[0] == 1
    assert _sample(metrics, "rnnserve_requests_expired_total", endpoint=ENDPOINT) == 1
    assert _sample(metrics, "rnnserve_requests_cancelled_total", endpoint=ENDPOINT) == 0
    assert in_flight._value.get() == 0


@pytest.mark.parametrize("logged", [False, True])
def test_a_failing_rollout_ends_the_stream_with_an_internal_error(
    logged: bool, caplog: pytest.LogCaptureFixture
) -> None:
    failure = RuntimeError("the model broke")
    rollout = Rollout(CHUNKS[:1], fail=failure)
    with caplog.at_level(logging.ERROR, logger="rnnserve"):
        lines, metrics, in_flight, _ = _stream(
            rollout.run(), rid="abc-123", rollout=rollout, failure_logged=logged
        )
    assert lines == [
        _line(0, 0, 2) + _line(1, 0, 1),
        b'{"error":{"detail":"internal server error; see the server log (request abc-123)",'
        b'"type":"internal"}}\n',
    ]
    logs = [r.getMessage() for r in caplog.records if "stream failed" in r.getMessage()]
    assert logs == ([] if logged else ["rollout stream failed (request abc-123)"])
    assert _durations(metrics, "500")[0] == 1
    assert _durations(metrics, "200")[0] == 0
    assert in_flight._value.get() == 0


class _Broken:
    """An iterator of pieces that fails as soon as it is asked for one (not a coroutine)."""

    def __aiter__(self) -> _Broken:
        return self

    def __anext__(self) -> Any:
        raise RuntimeError("no rollout")

    async def aclose(self) -> None:
        pass


def test_an_iterator_that_fails_at_once_ends_the_stream_with_an_error() -> None:
    lines, metrics, in_flight, _ = _stream(_Broken(), rid="r9")
    assert lines == [
        b'{"error":{"detail":"internal server error; see the server log (request r9)",'
        b'"type":"internal"}}\n'
    ]
    assert _durations(metrics, "500")[0] == 1
    assert in_flight._value.get() == 0


def test_a_client_that_goes_away_has_its_rollout_dropped() -> None:
    rollout = Rollout(CHUNKS, hang=1)
    lines, metrics, in_flight, took = _stream(rollout.run(), disconnect_after=0.05, rollout=rollout)
    assert lines == [_line(0, 0, 2) + _line(1, 0, 1)]  # and nothing after: no one listens
    assert took < 5
    assert _sample(metrics, "rnnserve_requests_cancelled_total", endpoint=ENDPOINT) == 1
    assert _durations(metrics, "499")[0] == 1
    assert _sample(metrics, "rnnserve_requests_expired_total", endpoint=ENDPOINT) == 0
    assert in_flight._value.get() == 0


def test_an_iterator_that_will_not_close_does_not_break_the_streams_end() -> None:
    # the stream closes the iterator of pieces once it is done with it; one that refuses
    # (yields again on GeneratorExit: RuntimeError from aclose) is left to the collector
    async def stubborn() -> AsyncIterator[list[Piece]]:
        yield CHUNKS[0]
        while True:
            with contextlib.suppress(asyncio.CancelledError):  # ignores the cancel
                await asyncio.sleep(30)
            try:
                yield CHUNKS[1]
            except GeneratorExit:
                yield CHUNKS[1]  # and the close

    lines, metrics, _, _ = _stream(stubborn(), deadline=0.05)
    assert lines[-1].startswith(b'{"error":{"detail":"the request\'s deadline passed')
    assert len(lines) == 2
    assert _durations(metrics, "504")[0] == 1


def _error(line: bytes) -> dict[str, Any]:
    error: dict[str, Any] = orjson.loads(line)["error"]
    return error


def test_a_failure_outside_any_request_is_answered_with_a_dash_for_its_id() -> None:
    rollout = Rollout(CHUNKS[:1], fail=RuntimeError("the model broke"))
    lines, metrics, in_flight, _ = _stream(rollout.run(), rid=None, rollout=rollout)
    assert len(lines) == 2
    error = _error(lines[-1])
    assert error["type"] == "internal"
    assert error["detail"].endswith("(request -)")
    assert _durations(metrics, "500")[0] == 1
    assert in_flight._value.get() == 0


def test_a_stream_whose_deadline_passed_before_its_first_chunk_waits_for_none() -> None:
    # the first chunk comes soon, but after the deadline: the stream does not wait for it
    async def late() -> AsyncIterator[list[Piece]]:
        await asyncio.sleep(0.2)
        yield CHUNKS[0]

    lines, metrics, in_flight, _ = _stream(late(), deadline=-1.0)
    assert len(lines) == 1
    assert _error(lines[0])["type"] == "deadline_exceeded"
    assert _durations(metrics, "504")[0] == 1
    assert in_flight._value.get() == 0
