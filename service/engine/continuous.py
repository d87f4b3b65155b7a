"""Continuous (step-level) batching for asyncio: work joins and leaves between chunks of steps.

This layer knows nothing about HTTP or models. Each submitted item is a piece of step-wise work
(a rollout of ``steps`` steps over ``size`` sequences). A background task runs the engine one
chunk at a time; between chunks, waiting items join the running set (up to ``max_active``
sequences) and finished or abandoned ones leave it, so a short item never waits for a long one
to end. The engine owns the per-item state (on the device); the scheduler owns only the order:

``await engine(joins, leaves, unchanged)`` takes the newly admitted ``(key, item)`` pairs and
the keys whose callers went away, advances every active item by one chunk, and returns a
:class:`ChunkOutcome`: the results of the items that finished in that chunk, the progress each
running item made (handed to callers that :meth:`ContinuousBatcher.stream`), and the number of
timesteps it ran. ``unchanged()`` (callable from any thread) stays true while nothing that would
change the running set has happened since the call began (no item queued, no caller gone, not
closing), no running item streams its progress and the call is younger than ``RUN_ON_S``:
while it holds, the engine may run further chunks before it returns, and must return once an
item finishes. That saves the round trip to the event loop between chunks that no join or
leave would have used.

If the engine raises, it must then hold nothing, and every active item fails with that error;
unless ``max_split_depth`` > 0: then the items that ran in the failed chunk with others, and
have not yet streamed any progress, start again from their first step, in two halves, each half
running alone (no other item joins it) until it is done; a half that fails again is split
again, down to single items, so only an item that fails on its own fails. Streamed items that
already received progress fail with the error (their output cannot be taken back).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rnnserve.service.engine.batcher import (
    BatchObserver,
    failure_reason,
    note_logged,
    request_ids,
)
from rnnserve.service.engine.tracing import NO_SPAN, Waiting, batch_span, enabled, waiting
from rnnserve.service.interface import (
    BatcherClosed,
    QueueFull,
    RequestContext,
    current_request,
)

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)

# Longest an engine call goes on by itself (``unchanged()`` turns false after it), so that the
# batch metrics and traces see a lone long rollout at least this often; each hand-back costs a
# round trip to the event loop (tenths of a millisecond), a small share of this much work.
RUN_ON_S = 0.02


@dataclass(frozen=True)
class ChunkOutcome(Generic[R]):
    """What one chunk did: items finished (by key), progress per running item, timesteps run."""

    finished: Mapping[int, R]
    progress: Mapping[int, Any]
    steps: int
    compute_seconds: float | None = None  # the engine's own time, if it measured it


Engine = Callable[[list[tuple[int, T]], list[int], Callable[[], bool]], Awaitable[ChunkOutcome[R]]]


@dataclass(eq=False)
class _Work(Generic[T, R]):
    key: int
    item: T
    size: int
    future: asyncio.Future[R]
    progress: asyncio.Queue[Any] | None = None  # set for streaming callers
    enqueued: float = field(default_factory=time.monotonic)
    request: RequestContext | None = field(default_factory=current_request)
    trace: Waiting | None = field(default_factory=waiting)  # its request's span, when traced
    depth: int = 0  # how many times its chunk failed and it was split off to retry
    group: int | None = None  # a retry group: runs alone, without other items
    sent: bool = False  # progress was handed to its (streaming) caller


class ContinuousBatcher(Generic[T, R]):
    """Runs step-wise items in chunks; items join and leave the running set between chunks.

    The same public surface as :class:`rnnserve.service.engine.batcher.DynamicBatcher`: ``start``,
    ``submit``, ``close`` and ``queue_depth``; the same errors (``QueueFull``,
    ``BatcherClosed``) and the same observer callbacks, one ``on_batch`` per engine call: a
    chunk, or the chunks it ran while nothing changed.
    """

    def __init__(
        self,
        engine: Engine[T, R],
        *,
        max_active: int,
        max_queue_size: int | None = None,
        name: str = "scheduler",
        observer: BatchObserver | None = None,
        max_split_depth: int = 0,
    ) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        if max_queue_size is not None and max_queue_size < 1:
            raise ValueError(f"max_queue_size must be >= 1 or None, got {max_queue_size}")
        if max_split_depth < 0:
            raise ValueError(f"max_split_depth must be >= 0, got {max_split_depth}")
        self.max_split_depth = max_split_depth
        self._groups = itertools.count()
        self._isolating: int | None = None  # the retry group running alone now
        self._engine = engine
        self.max_active = max_active
        self.max_queue_size = max_queue_size
        self.name = name
        self._observer = observer
        self._queue: collections.deque[_Work[T, R]] = collections.deque()
        self._active: dict[int, _Work[T, R]] = {}
        self._keys = itertools.count()
        self._arrived = asyncio.Event()
        # counts what would change the running set (arrivals, callers gone, closing): an engine
        # call may run more chunks while it stands where it stood when the call began
        self._changes = 0
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    # -- public API -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the scheduling task on the running loop (idempotent)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=f"{self.name}-scheduler"
            )

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_sequences(self) -> int:
        return sum(w.size for w in self._active.values())

    async def submit(self, item: T, *, size: int = 1, cost: int = 1) -> R:
        """Queue ``item`` (``size`` sequences) and wait for its result.

        ``cost`` (its timesteps) is taken for the same call as ``DynamicBatcher.submit`` and not
        used: a chunk bounds its own timesteps (``max_active`` x the engine's chunk).

        An item larger than ``max_active`` runs once it can be admitted alone.
        """
        work = self._enqueue(item, size, None)
        return await work.future  # a cancelled caller leaves the running set at the next chunk

    def stream(self, item: T, *, size: int = 1, cost: int = 1) -> AsyncIterator[Any]:
        """Queue ``item`` now and return an iterator of its progress, chunk by chunk.

        Queueing happens at once, so ``QueueFull`` and ``BatcherClosed`` are raised here, before
        anything is streamed. Closing the iterator early (a client that went away) takes the
        item out of the running set at the next chunk. An error of the item's chunk is raised
        from the iterator.
        """
        return self._progress(self._enqueue(item, size, asyncio.Queue()))

    async def _progress(self, work: _Work[T, R]) -> AsyncIterator[Any]:
        progress = work.progress
        assert progress is not None
        try:
            while True:
                if progress.empty() and work.future.done():
                    work.future.result()  # raises the chunk's error, if any
                    return
                getter = asyncio.ensure_future(progress.get())
                try:
                    await asyncio.wait({getter, work.future}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not getter.done():
                        getter.cancel()
                if getter.done() and not getter.cancelled():
                    yield getter.result()
        finally:
            if not work.future.done():
                work.future.cancel()

    def _enqueue(self, item: T, size: int, progress: asyncio.Queue[Any] | None) -> _Work[T, R]:
        if self._closing or self._task is None:
            raise BatcherClosed(f"{self.name} is not accepting work")
        if self.max_queue_size is not None and len(self._queue) >= self.max_queue_size:
            raise QueueFull(f"{self.name} queue is full ({self.max_queue_size} waiting)")
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        future.add_done_callback(self._note_cancelled)
        work = _Work(next(self._keys), item, size, future, progress)
        self._queue.append(work)
        self._changes += 1
        self._notify_depth()
        self._arrived.set()
        return work

    def _note_cancelled(self, future: asyncio.Future[R]) -> None:
        if future.cancelled():  # its caller went away: it leaves at the next chunk
            self._changes += 1

    async def close(self, drain_timeout_s: float | None = None) -> None:
        """Stop taking items, finish queued and running ones, then stop."""
        self._closing = True
        self._changes += 1
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
            exc = BatcherClosed(f"{self.name} stopped")
            for work in [*self._queue, *self._active.values()]:
                if not work.future.done():
                    work.future.set_exception(exc)
            self._queue.clear()
            self._active.clear()
            self._notify_depth()

    # -- the scheduling loop ----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            while not self._queue and not self._active:
                if self._closing:
                    return
                self._arrived.clear()
                await self._arrived.wait()
            joins = self._admit()
            leaves = [k for k, w in self._active.items() if w.future.done()]
            for key in leaves:
                del self._active[key]
            if not self._active and not leaves:
                continue
            await self._run_chunk(joins, leaves)

    def _admit(self) -> list[_Work[T, R]]:
        """Move queued items into the running set while their sequences fit."""
        joins: list[_Work[T, R]] = []
        if self._isolating is not None and not any(
            w.group == self._isolating for w in self._active.values()
        ):
            self._isolating = None  # the retry group running alone is done
        used = self.active_sequences
        while self._queue and self._isolating is None:
            work = self._queue[0]
            if work.future.done():  # the caller went away before it was admitted
                self._queue.popleft()
                continue
            if work.group is not None:  # a retry group: alone, once the running set is empty
                if used:
                    break
                self._isolating = work.group
                while self._queue and self._queue[0].group == work.group:
                    w = self._queue.popleft()
                    if not w.future.done():
                        self._active[w.key] = w
                        joins.append(w)
                break
            if used and used + work.size > self.max_active:
                break
            self._queue.popleft()
            self._active[work.key] = work
            joins.append(work)
            used += work.size
        self._notify_depth()
        return joins

    async def _run_chunk(self, joins: list[_Work[T, R]], leaves: list[int]) -> None:
        started = time.monotonic()
        running = list(self._active.values())
        ok = False
        steps = 0
        compute: float | None = None
        try:
            with self._span(running, joins):
                admitted = [(w.key, w.item) for w in joins]
                outcome = await self._engine(admitted, leaves, self._unchanged_since_now(running))
        except asyncio.CancelledError:
            for work in running:
                work.future.cancel()
            self._active.clear()
            raise
        except Exception as exc:  # a failing chunk fails the items that were running in it
            self._active.clear()
            self._isolating = None
            self._failed(running, exc)
        else:
            ok = True
            steps = outcome.steps
            compute = outcome.compute_seconds
            for key, step in outcome.progress.items():
                runner = self._active.get(key)
                if runner is not None and runner.progress is not None and not runner.future.done():
                    runner.progress.put_nowait(step)
                    runner.sent = True
            for key, result in outcome.finished.items():
                done = self._active.pop(key, None)
                if done is not None and not done.future.done():
                    done.future.set_result(result)
        finally:
            if self._observer is not None:
                wall = time.monotonic() - started
                self._observer.on_batch(
                    self.name,
                    items=len(running),
                    size=sum(w.size for w in running),
                    cost=steps,
                    queue_waits=[started - w.enqueued for w in joins if w.depth == 0],
                    compute_seconds=wall if compute is None else compute,
                    ok=ok,
                    wait_seconds=0.0 if compute is None else max(0.0, wall - compute),
                )

    def _unchanged_since_now(self, running: list[_Work[T, R]]) -> Callable[[], bool]:
        """The engine's ``unchanged()``: read on its worker thread, where reading an int is
        atomic; the count only ever changes on the event loop."""
        mark = self._changes
        streams = any(w.progress is not None for w in running)
        until = time.monotonic() + RUN_ON_S

        def unchanged() -> bool:
            return not streams and self._changes == mark and time.monotonic() < until

        return unchanged

    def _span(self, running: list[_Work[T, R]], joins: list[_Work[T, R]]) -> Any:
        """The engine call's span (a no-op with tracing off), linked to every running item's
        request; the queue waits end for the items that join (a retried item's wait is not
        counted)."""
        if not enabled():
            return NO_SPAN
        attributes = {
            "rnnserve.batch.requests": len(running),
            "rnnserve.batch.sequences": sum(w.size for w in running),
            "rnnserve.batch.joined": len(joins),
        }
        joined = [w.trace for w in joins if w.depth == 0]
        return batch_span(self.name, [w.trace for w in running], joined, attributes)

    def _failed(self, running: list[_Work[T, R]], exc: Exception) -> None:
        """Requeue, in two halves at the front, the failed chunk's items that can start over;
        fail the others."""
        live = [w for w in running if not w.future.done()]
        retry = [w for w in live if not w.sent and w.depth < self.max_split_depth]
        if len(live) < 2:
            retry = []  # it failed on its own
        for work in live:
            if work not in retry:
                work.future.set_exception(exc)
        ids = request_ids(w.request for w in live)
        if not retry:
            log.error(
                "%s: chunk of %d items failed; requests %s",
                self.name, len(live), ids, exc_info=exc,
            )  # fmt: skip
            note_logged(w.request for w in live)
            return
        log.warning(
            "%s: chunk of %d items failed (%s: %s); %d start over in two halves, apart; "
            "requests %s", self.name, len(live), type(exc).__name__, exc, len(retry), ids,
        )  # fmt: skip
        if self._observer is not None:
            self._observer.on_split(self.name, failure_reason(exc))
        half = (len(retry) + 1) // 2
        for part in (retry[half:], retry[:half]):
            group = next(self._groups)
            for work in reversed(part):
                work.group, work.depth = group, work.depth + 1
                self._queue.appendleft(work)
        self._notify_depth()

    def _notify_depth(self) -> None:
        if self._observer is not None:
            self._observer.on_queue_depth(self.name, len(self._queue))
