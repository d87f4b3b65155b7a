"""The streamed rollout's answer: NDJSON lines as the chunks of steps arrive."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator

import orjson
from fastapi import Request
from prometheus_client import Gauge

from rnnserve.service.http.tracing import OFF, Trace
from rnnserve.service.interface import Piece, current_request
from rnnserve.service.metrics import Metrics

log = logging.getLogger(__name__)
NDJSON = "application/x-ndjson"
# how a stream that did not end well ended, as the error type its trace records
_ERROR_TYPES = {"499": "client_closed", "504": "deadline_exceeded", "500": "internal"}


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body has been read, so only that can arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def ndjson(
    request: Request,
    model: str,
    pieces: AsyncIterator[list[Piece]],
    in_flight: Gauge,
    metrics: Metrics,
    endpoint: str,
    model_label: str,
    started: float,
    deadline: float,
    trace: Trace = OFF,
) -> AsyncIterator[bytes]:
    """The streamed rollout: one line per sequence per chunk, then a closing line.

    ``{"sequence": i, "start": t, "positions": [[x, y], ...]}`` for steps ``t..``; the last
    line is ``{"model": ..., "done": true}``, or ``{"error": {...}}`` if the rollout failed or
    its deadline passed (``"type": "deadline_exceeded"``; counted with code 504). A client
    that goes away while a chunk runs, or whose stream is closed, has its rollout dropped at
    the next chunk; so has a stream whose deadline passed. ``trace``: the request's, whose
    server span ends with the stream.
    """
    code = "499"  # until the stream ends one way or another
    watcher = asyncio.ensure_future(disconnected(request))
    step: asyncio.Future[list[Piece]] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(pieces))
            left = deadline - time.perf_counter()
            await asyncio.wait(
                {step, watcher},
                timeout=None if math.isinf(left) else max(left, 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if watcher.done():  # the client went away
                return
            if not step.done():  # the deadline passed
                code = "504"
                metrics.expired.labels(endpoint).inc()
                error = {"detail": "the request's deadline passed; the rollout was dropped",
                         "type": "deadline_exceeded"}  # fmt: skip
                yield orjson.dumps({"error": error}, option=orjson.OPT_APPEND_NEWLINE)
                return
            try:
                chunk = step.result()
            except StopAsyncIteration:
                break
            yield b"".join(
                orjson.dumps(
                    {"sequence": i, "start": start, "positions": y},
                    option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE,
                )
                for i, start, y in chunk
            )
        code = "200"
        yield orjson.dumps({"model": model, "done": True}, option=orjson.OPT_APPEND_NEWLINE)
    except Exception:
        code = "500"
        context = current_request()
        rid = context.request_id if context is not None else "-"
        if context is None or not context.failure_logged:  # logged once, with the ids
            log.exception("%s stream failed (request %s)", endpoint, rid)
        error = {"detail": f"internal server error; see the server log (request {rid})",
                 "type": "internal"}  # fmt: skip
        yield orjson.dumps({"error": error}, option=orjson.OPT_APPEND_NEWLINE)
    finally:
        # also when the server cancels us (the client went away): account first, then make
        # sure the rollout is dropped, i.e. the progress iterator is closed
        in_flight.dec()
        if code == "499":
            metrics.cancelled.labels(endpoint).inc()
        elapsed = time.perf_counter() - started
        metrics.request_duration.labels(endpoint, model_label, code).observe(elapsed)
        trace.end(int(code), _ERROR_TYPES.get(code))
        watcher.cancel()
        if step is not None and not step.done():
            step.cancel()  # its iterator's own cleanup cancels the rollout
            with contextlib.suppress(BaseException):
                await step
        with contextlib.suppress(RuntimeError):
            await pieces.aclose()  # type: ignore[attr-defined]
