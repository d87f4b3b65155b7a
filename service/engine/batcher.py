"""Dynamic batching for asyncio: gather concurrent submissions, run them as one batch.

This layer knows nothing about HTTP or models. ``await batcher.submit(item, size, cost)``
returns that item's result. A background task takes waiting items until ``max_batch_size``
(sum of ``size``), ``max_batch_cost`` (sum of ``cost``) or ``max_delay_s`` after the first
item is reached, awaits ``handler(items)`` and hands each caller its result. The handler must
return exactly one result per item; a mismatch or an exception fails every caller of that batch
and nobody else's. With ``max_split_depth`` > 0 a failing batch is first split in two and each
half retried (bisection, at most ``max_split_depth`` levels), so that only the items that fail
on their own fail: one poison request in a batch of 64 costs about 2 x 6 extra handler calls.

Each item carries its caller's request (:class:`RequestContext`, read when it is submitted) so
that a failure is logged once, with the ids of the requests it hit; and, with tracing on, the
request's span, which each batch's span links to (:mod:`rnnserve.service.engine.tracing`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from rnnserve.service.engine.tracing import NO_SPAN, Waiting, batch_span, enabled, waiting
from rnnserve.service.interface import (
    BatcherClosed,
    BatcherError,
    QueueFull,
    RequestContext,
    current_request,
    is_out_of_memory,
)

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)


def failure_reason(exc: BaseException) -> str:
    """The ``reason`` label of a split: ``out_of_memory`` or ``error``."""
    return "out_of_memory" if is_out_of_memory(exc) else "error"


def request_ids(requests: Iterable[RequestContext | None]) -> str:
    """Request ids for a log line: ``a1,b2,-`` (``-`` for an item submitted outside a request)."""
    return ",".join(r.request_id if r is not None else "-" for r in requests)


def note_logged(requests: Iterable[RequestContext | None]) -> None:
    """Their failure is in the log with their ids: the layers that answer them need not log it."""
    for r in requests:
        if r is not None:
            r.failure_logged = True


class TimedResults(list[R]):
    """A handler's results with the model's own compute time, measured where it ran.

    A handler that runs the model on another thread returns this, so that the batcher can
    report the model's time apart from the time spent waiting for the thread and the loop.
    """

    def __init__(self, results: Iterable[R], compute_seconds: float) -> None:
        super().__init__(results)
        self.compute_seconds = compute_seconds


@dataclass(frozen=True)
class ItemError:
    """A handler's result for one item that failed on its own, not with its batch.

    The caller of that item gets ``error`` raised; the rest of the batch gets its results,
    with no split and no retry (the error is the item's, e.g. its input, found while the
    batch ran).
    """

    error: Exception


class HandlerResultMismatch(BatcherError):
    """The handler returned a different number of results than it was given items."""


class BatchObserver(Protocol):
    """Callbacks for metrics; called on the event loop, must not block."""

    def on_queue_depth(self, name: str, depth: int) -> None: ...

    def on_batch(
        self,
        name: str,
        *,
        items: int,
        size: int,
        cost: int,
        queue_waits: Sequence[float],
        compute_seconds: float,
        ok: bool,
        wait_seconds: float = 0.0,
    ) -> None: ...

    def on_split(self, name: str, reason: str) -> None:
        """A failed batch was split in two to retry (``reason``: error or out_of_memory)."""


@dataclass(eq=False)
class _Pending(Generic[T, R]):
    item: T
    size: int
    cost: int
    future: asyncio.Future[R]
    enqueued: float = field(default_factory=time.monotonic)
    request: RequestContext | None = field(default_factory=current_request)
    trace: Waiting | None = field(default_factory=waiting)


class DynamicBatcher(Generic[T, R]):
    """Gathers items submitted concurrently into batches for one async handler."""

    def __init__(
        self,
        handler: Callable[[list[T]], Awaitable[Sequence[R | ItemError]]],
        *,
        max_batch_size: int,
        max_delay_s: float,
        max_batch_cost: int | None = None,
        max_queue_size: int | None = None,
        name: str = "batcher",
        observer: BatchObserver | None = None,
        max_split_depth: int = 0,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_delay_s < 0:
            raise ValueError(f"max_delay_s must be >= 0, got {max_delay_s}")
        if max_batch_cost is not None and max_batch_cost < 1:
            raise ValueError(f"max_batch_cost must be >= 1 or None, got {max_batch_cost}")
        if max_queue_size is not None and max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1 or None, got {max_queue_size}")
        if max_split_depth < 0:
            raise ValueError(f"max_split_depth must be >= 0, got {max_split_depth}")
        self.max_split_depth = max_split_depth
        self._handler = handler
        self.max_batch_size = max_batch_size
        self.max_batch_cost = max_batch_cost
        self.max_delay_s = max_delay_s
        self.max_queue_size = max_queue_size
        self.name = name
        self._observer = observer
        self._queue: collections.deque[_Pending[T, R]] = collections.deque()
        self._arrived = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    # -- public API -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the batching task on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"{self.name}-batcher"
            )

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    async def submit(self, item: T, *, size: int = 1, cost: int = 1) -> R:
        """Queue ``item`` and wait for its result.

        ``size`` counts against ``max_batch_size`` and ``cost`` against ``max_batch_cost``;
        an item larger than either limit runs in a batch of its own.
        """
        if self._closing or self._task is None:
            raise BatcherClosed(f"{self.name} is not accepting work")
        if self.max_queue_size is not None and len(self._queue) >= self.max_queue_size:
            raise QueueFull(f"{self.name} queue is full ({self.max_queue_size} waiting)")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Pending(item, size, cost, future))
        self._notify_depth()
        self._arrived.set()
        return await future  # cancelling the caller cancels the future; the loop skips it

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking items, finish queued ones, then stop; cancel after ``drain_timeout_s``."""
        self._closing = True
        self._arrived.set()
        if self._task is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self._task), drain_timeout_s)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        finally:
            self._fail_queued(BatcherClosed(f"{self.name} stopped"))

    # -- the batching loop ------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            while not self._queue:
                if self._closing:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            await self._wait_for_batch()
            batch = self._take_batch()
            if batch:
                await self._run_batch(batch)

    async def _wait_for_batch(self) -> None:
        """Wait until a full batch is queued or the oldest item's delay has passed."""
        deadline = self._queue[0].enqueued + self.max_delay_s
        while not self._closing and not self._full():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), remaining)

    def _full(self) -> bool:
        size = cost = 0
        for p in self._queue:
            size += p.size
            cost += p.cost
            if size >= self.max_batch_size:
                return True
            if self.max_batch_cost is not None and cost >= self.max_batch_cost:
                return True
        return False

    def _take_batch(self) -> list[_Pending[T, R]]:
        batch: list[_Pending[T, R]] = []
        size = cost = 0
        while self._queue:
            p = self._queue[0]
            if p.future.done():  # the caller went away (cancelled) before its turn
                self._queue.popleft()
                continue
            over_size = size + p.size > self.max_batch_size
            over_cost = self.max_batch_cost is not None and cost + p.cost > self.max_batch_cost
            if batch and (over_size or over_cost):
                break
            self._queue.popleft()
            batch.append(p)
            size += p.size
            cost += p.cost
        self._notify_depth()
        return batch

    async def _run_batch(self, batch: list[_Pending[T, R]], depth: int = 0) -> None:
        started = time.monotonic()
        # queue waits are counted once per request, in its first batch (not in retries)
        waits = [started - p.enqueued for p in batch] if depth == 0 else []
        ok = False
        failure: Exception | None = None
        compute: float | None = None
        span = self._span(batch, depth)
        try:
            with span:
                results = await self._handler([p.item for p in batch])
                compute = getattr(results, "compute_seconds", None)
                if len(results) != len(batch):
                    raise HandlerResultMismatch(
                        f"{self.name} handler returned {len(results)} results "
                        f"for {len(batch)} items"
                    )
        except asyncio.CancelledError:
            for p in batch:
                p.future.cancel()
            raise
        except Exception as exc:  # one failing batch fails its own callers only
            failure = exc
        else:
            ok = True
            for p, r in zip(batch, results, strict=True):
                if p.future.done():
                    continue
                if isinstance(r, ItemError):
                    p.future.set_exception(r.error)
                else:
                    p.future.set_result(r)
        finally:
            if self._observer is not None:
                wall = time.monotonic() - started
                self._observer.on_batch(
                    self.name,
                    items=len(batch),
                    size=sum(p.size for p in batch),
                    cost=sum(p.cost for p in batch),
                    queue_waits=waits,
                    compute_seconds=wall if compute is None else compute,
                    ok=ok,
                    wait_seconds=0.0 if compute is None else max(0.0, wall - compute),
                )
        if failure is not None:
            await self._failed(batch, failure, depth)

    def _span(self, batch: list[_Pending[T, R]], depth: int) -> Any:
        """The batch's span (a no-op with tracing off); a retry's requests waited no longer."""
        if not enabled():
            return NO_SPAN
        traces = [p.trace for p in batch]
        attributes = {
            "rnnserve.batch.requests": len(batch),
            "rnnserve.batch.sequences": sum(p.size for p in batch),
            "rnnserve.batch.timesteps": sum(p.cost for p in batch),
            "rnnserve.batch.split_depth": depth,
        }
        return batch_span(self.name, traces, traces if depth == 0 else (), attributes)

    async def _failed(self, batch: list[_Pending[T, R]], exc: Exception, depth: int) -> None:
        """Bisect: retry each half of a failed batch, or fail its callers."""
        live = [p for p in batch if not p.future.done()]
        ids = request_ids(p.request for p in live)
        if len(live) > 1 and depth < self.max_split_depth:
            reason = failure_reason(exc)
            log.warning(
                "%s: batch of %d requests failed (%s: %s); retrying each half apart; "
                "requests %s", self.name, len(live), type(exc).__name__, exc, ids,
            )  # fmt: skip
            if self._observer is not None:
                self._observer.on_split(self.name, reason)
            half = len(live) // 2
            await self._run_batch(live[:half], depth + 1)
            await self._run_batch(live[half:], depth + 1)
            return
        if live:
            log.error(
                "%s: batch of %d requests failed; requests %s",
                self.name, len(live), ids, exc_info=exc,
            )  # fmt: skip
            note_logged(p.request for p in live)
        for p in live:
            p.future.set_exception(exc)

    def _fail_queued(self, exc: BaseException) -> None:
        while self._queue:
            p = self._queue.popleft()
            if not p.future.done():
                p.future.set_exception(exc)
        self._notify_depth()

    def _notify_depth(self) -> None:
        if self._observer is not None:
            self._observer.on_queue_depth(self.name, len(self._queue))
