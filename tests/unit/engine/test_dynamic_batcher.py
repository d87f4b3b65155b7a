"""The dynamic batcher with fake handlers: no HTTP, no models."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from rnnserve.service.engine.batcher import (
    DynamicBatcher,
    HandlerResultMismatch,
    ItemError,
    TimedResults,
    request_ids,
)
from rnnserve.service.interface import BatcherClosed, QueueFull, RequestContext, open_request


class Recorder:
    """A handler that records its batches and can be held on an event."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.release = asyncio.Event()
        self.release.set()
        self.entered = asyncio.Event()

    async def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.entered.set()
        await self.release.wait()
        return [i * 10 for i in items]


class Observer:
    def __init__(self) -> None:
        self.batches: list[dict[str, object]] = []
        self.depths: list[int] = []
        self.names: set[str] = set()
        self.splits: list[str] = []

    def on_queue_depth(self, name: str, depth: int) -> None:
        self.names.add(name)
        self.depths.append(depth)

    def on_batch(self, name: str, **kw: object) -> None:
        self.names.add(name)
        self.batches.append(kw)

    def on_split(self, name: str, reason: str) -> None:
        self.names.add(name)
        self.splits.append(reason)


async def test_full_batch_runs_without_waiting_for_the_delay() -> None:
    handler = Recorder()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=4, max_delay_s=30)
    b.start()
    results = await asyncio.wait_for(asyncio.gather(*(b.submit(i) for i in range(4))), 5)
    assert results == [0, 10, 20, 30]
    assert handler.batches == [[0, 1, 2, 3]]
    await b.close()


async def test_partial_batch_runs_after_the_delay() -> None:
    handler = Recorder()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=100, max_delay_s=0.05)
    b.start()
    results = await asyncio.wait_for(asyncio.gather(b.submit(1), b.submit(2)), 5)
    assert results == [10, 20]
    assert handler.batches == [[1, 2]]
    await b.close()


async def test_a_partial_batch_runs_at_its_delay_not_later() -> None:
    delay = 0.2
    handler = Recorder()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=100, max_delay_s=delay)
    b.start()
    started = time.monotonic()
    assert await asyncio.wait_for(b.submit(1), 20 * delay) == 10
    waited = time.monotonic() - started
    # ratios of the configured delay only: it waited for company, then not much longer
    assert waited >= delay
    assert waited < 3 * delay, f"a partial batch waited {waited / delay:.1f}x max_delay"
    await b.close()


async def test_the_delay_counts_from_the_first_item_not_the_last() -> None:
    delay = 0.3
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=100, max_delay_s=delay)
    b.start()
    blocker = asyncio.ensure_future(b.submit(0))
    await asyncio.wait_for(handler.entered.wait(), 20 * delay)
    started = time.monotonic()
    first = asyncio.ensure_future(b.submit(1))  # both queue behind the running batch
    await asyncio.sleep(0.9 * delay)
    second = asyncio.ensure_future(b.submit(2))
    await asyncio.sleep(0)
    handler.release.set()
    assert await asyncio.wait_for(first, 20 * delay) == 10
    waited = time.monotonic() - started
    assert await asyncio.wait_for(asyncio.gather(blocker, second), 20 * delay) == [0, 20]
    assert handler.batches == [[0], [1, 2]]
    # a deadline taken from the second item would end near 1.9x the delay
    assert waited < 1.5 * delay, f"the batch ran {waited / delay:.2f}x max_delay after the first"
    await b.close()


async def test_requests_wait_while_a_batch_runs_and_then_batch_together() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=8, max_delay_s=0)
    b.start()
    first = asyncio.ensure_future(b.submit(0))
    await asyncio.wait_for(handler.entered.wait(), 5)
    rest = [asyncio.ensure_future(b.submit(i)) for i in range(1, 6)]
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in rest)  # held: the handler has not returned
    assert b.queue_depth == 5
    handler.release.set()
    assert await asyncio.wait_for(asyncio.gather(first, *rest), 5) == [0, 10, 20, 30, 40, 50]
    assert handler.batches == [[0], [1, 2, 3, 4, 5]]
    await b.close()


async def test_size_and_cost_budgets_split_batches() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=5, max_batch_cost=100, max_delay_s=0
    )
    b.start()
    blocker = asyncio.ensure_future(b.submit(-1))
    await handler.entered.wait()
    futs = [
        asyncio.ensure_future(b.submit(1, size=3, cost=10)),
        asyncio.ensure_future(b.submit(2, size=2, cost=10)),  # 5 sequences: full
        asyncio.ensure_future(b.submit(3, size=1, cost=90)),
        asyncio.ensure_future(b.submit(4, size=1, cost=20)),  # over the cost budget
        asyncio.ensure_future(b.submit(5, size=9, cost=1)),  # alone: larger than a batch
    ]
    await asyncio.sleep(0.01)
    handler.release.set()
    await asyncio.wait_for(asyncio.gather(blocker, *futs), 5)
    assert handler.batches == [[-1], [1, 2], [3], [4], [5]]
    await b.close()


async def test_a_failing_batch_fails_only_its_callers() -> None:
    calls = 0

    async def handler(items: list[int]) -> list[int]:
        nonlocal calls
        calls += 1
        if 13 in items:
            raise RuntimeError("boom")
        return items

    observer = Observer()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=2, max_delay_s=0.01, observer=observer
    )
    b.start()
    # bounded waits: a caller stranded by the failure must fail this test fast, not hang it
    bad = await asyncio.wait_for(
        asyncio.gather(b.submit(13), b.submit(14), return_exceptions=True), 5
    )
    assert [str(r) for r in bad] == ["boom", "boom"]
    assert all(isinstance(r, RuntimeError) for r in bad)
    good = await asyncio.wait_for(asyncio.gather(b.submit(1), b.submit(2)), 5)
    assert good == [1, 2]
    assert calls == 2
    assert [o["ok"] for o in observer.batches] == [False, True]
    await b.close()


async def test_an_item_error_fails_only_its_own_caller() -> None:
    """A handler's ItemError is its item's failure: that caller gets the error, the batch mates
    their results, and the batch is neither split nor run again."""
    calls: list[list[int]] = []

    async def handler(items: list[int]) -> list[int | ItemError]:
        calls.append(list(items))
        return [ItemError(ValueError(f"bad {i}")) if i < 0 else i * 10 for i in items]

    observer = Observer()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=4, max_delay_s=0.05, observer=observer, max_split_depth=3
    )
    b.start()
    got = await asyncio.wait_for(
        asyncio.gather(*(b.submit(i) for i in (1, -2, 3, -4)), return_exceptions=True), 5
    )
    assert got[::2] == [10, 30]
    assert [type(g) for g in got[1::2]] == [ValueError, ValueError]
    assert [str(g) for g in got[1::2]] == ["bad -2", "bad -4"]
    assert calls == [[1, -2, 3, -4]]
    assert [o["ok"] for o in observer.batches] == [True]
    assert observer.splits == []
    await b.close()


async def test_wrong_number_of_results_fails_the_batch() -> None:
    async def handler(items: list[int]) -> Sequence[int]:
        return items[:-1]

    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=2, max_delay_s=0.01)
    b.start()
    out = await asyncio.wait_for(
        asyncio.gather(b.submit(1), b.submit(2), return_exceptions=True), 5
    )
    assert len(out) == 2
    assert all(isinstance(r, HandlerResultMismatch) for r in out)
    assert "1 results for 2 items" in str(out[0])
    await b.close()


async def test_a_cancelled_caller_is_skipped_and_others_are_served() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=8, max_delay_s=0)
    b.start()
    first = asyncio.ensure_future(b.submit(0))
    await handler.entered.wait()
    gone = asyncio.ensure_future(b.submit(1))
    stays = asyncio.ensure_future(b.submit(2))
    await asyncio.sleep(0.01)
    gone.cancel()
    handler.release.set()
    assert await asyncio.wait_for(asyncio.gather(first, stays), 5) == [0, 20]
    assert gone.cancelled()
    assert handler.batches == [[0], [2]]
    await b.close()


async def test_cancelling_a_caller_while_its_batch_runs_leaves_the_rest() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=2, max_delay_s=1)
    b.start()
    a = asyncio.ensure_future(b.submit(1))
    c = asyncio.ensure_future(b.submit(2))
    await handler.entered.wait()
    a.cancel()
    handler.release.set()
    assert await asyncio.wait_for(c, 5) == 20
    assert a.cancelled()
    await b.close()


async def test_queue_limit_rejects_with_queue_full() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=1, max_delay_s=0, max_queue_size=2
    )
    b.start()
    running = asyncio.ensure_future(b.submit(0))
    await handler.entered.wait()
    queued = [asyncio.ensure_future(b.submit(i)) for i in (1, 2)]
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await b.submit(3)
    handler.release.set()
    assert await asyncio.gather(running, *queued) == [0, 10, 20]
    await b.close()


async def test_close_drains_queued_work_then_refuses_new() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=1, max_delay_s=0)
    b.start()
    futs = [asyncio.ensure_future(b.submit(i)) for i in range(3)]
    await handler.entered.wait()
    closing = asyncio.ensure_future(b.close(drain_timeout_s=5))
    await asyncio.sleep(0.01)
    with pytest.raises(BatcherClosed):
        await b.submit(9)
    handler.release.set()
    await closing
    assert await asyncio.gather(*futs) == [0, 10, 20]


async def test_close_timeout_fails_what_is_left() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=1, max_delay_s=0)
    b.start()
    running = asyncio.ensure_future(b.submit(0))
    queued = asyncio.ensure_future(b.submit(1))
    await handler.entered.wait()
    await b.close(drain_timeout_s=0.05)
    assert running.cancelled()
    with pytest.raises(BatcherClosed):
        await queued


async def test_observer_sees_depth_sizes_and_waits() -> None:
    observer = Observer()
    handler = Recorder()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=3, max_delay_s=1, observer=observer, name="m"
    )
    b.start()
    await asyncio.gather(*(b.submit(i, size=1, cost=7) for i in range(3)))
    (batch,) = observer.batches
    assert batch["items"] == 3
    assert batch["size"] == 3
    assert batch["cost"] == 21
    waits = batch["queue_waits"]
    assert isinstance(waits, list)
    assert len(waits) == 3
    assert all(w >= 0 for w in waits)
    assert max(observer.depths) == 3
    assert observer.depths[-1] == 0
    await b.close()


def test_arguments_are_checked() -> None:
    async def h(items: list[int]) -> list[int]:
        return items

    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        DynamicBatcher(h, max_batch_size=0, max_delay_s=0)
    with pytest.raises(ValueError, match="max_delay_s must be >= 0, got -1"):
        DynamicBatcher(h, max_batch_size=1, max_delay_s=-1)
    with pytest.raises(ValueError, match="max_batch_cost must be >= 1 or None, got 0"):
        DynamicBatcher(h, max_batch_size=1, max_delay_s=0, max_batch_cost=0)
    with pytest.raises(ValueError, match="max_queue_size must be >= 1 or None, got 0"):
        DynamicBatcher(h, max_batch_size=1, max_delay_s=0, max_queue_size=0)
    # the smallest legal values are legal
    b = DynamicBatcher(h, max_batch_size=1, max_delay_s=0, max_batch_cost=1, max_queue_size=1)
    assert (b.max_batch_size, b.max_delay_s, b.max_batch_cost, b.max_queue_size) == (1, 0, 1, 1)
    assert b.name == "batcher"


async def test_submit_before_start_is_refused() -> None:
    async def h(items: list[int]) -> list[int]:
        return items

    with pytest.raises(BatcherClosed, match=r"^batcher is not accepting work$"):
        await DynamicBatcher(h, max_batch_size=1, max_delay_s=0).submit(1)


async def test_errors_and_the_task_carry_the_batcher_name() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=1, max_delay_s=0, max_queue_size=1, name="m"
    )
    b.start()
    assert "m-batcher" in {t.get_name() for t in asyncio.all_tasks()}
    running = asyncio.ensure_future(b.submit(0))
    await asyncio.wait_for(handler.entered.wait(), 5)
    queued = asyncio.ensure_future(b.submit(1))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match=r"^m queue is full \(1 waiting\)$"):
        await b.submit(2)
    await b.close(drain_timeout_s=0.01)
    assert running.cancelled()
    with pytest.raises(BatcherClosed, match=r"^m stopped$"):
        await queued
    with pytest.raises(BatcherClosed, match=r"^m is not accepting work$"):
        await b.submit(3)


async def test_a_batch_that_reaches_a_budget_exactly_runs_at_once() -> None:
    # neither budget reached: the items wait for the delay
    for kwargs in ({"max_batch_size": 4}, {"max_batch_size": 100, "max_batch_cost": 10}):
        handler = Recorder()
        b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_delay_s=30, **kwargs)
        b.start()
        first = [asyncio.ensure_future(b.submit(i, cost=3)) for i in range(3)]  # size 3, cost 9
        await asyncio.sleep(0.05)
        assert handler.batches == [], kwargs
        last = asyncio.ensure_future(b.submit(3, cost=1))  # size 4, cost 10: full either way
        assert await asyncio.wait_for(asyncio.gather(*first, last), 5) == [0, 10, 20, 30]
        assert handler.batches == [[0, 1, 2, 3]]
        await b.close()


async def test_default_size_and_cost_are_one() -> None:
    observer = Observer()
    handler = Recorder()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=100, max_batch_cost=2, max_delay_s=30, observer=observer
    )
    b.start()
    assert await asyncio.wait_for(asyncio.gather(b.submit(1), b.submit(2)), 5) == [10, 20]
    assert (observer.batches[0]["size"], observer.batches[0]["cost"]) == (2, 2)
    await b.close()


async def test_budgets_add_up_over_queued_items() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=5, max_batch_cost=10, max_delay_s=0
    )
    b.start()
    blocker = asyncio.ensure_future(b.submit(-1))
    await asyncio.wait_for(handler.entered.wait(), 5)
    futs = [
        asyncio.ensure_future(b.submit(1, size=2, cost=1)),
        asyncio.ensure_future(b.submit(2, size=2, cost=1)),
        asyncio.ensure_future(b.submit(3, size=2, cost=1)),  # sizes 2 + 2 + 2 > 5: [1, 2]
        asyncio.ensure_future(b.submit(4, size=1, cost=4)),
        asyncio.ensure_future(b.submit(5, size=1, cost=6)),  # costs 1 + 4 + 6 > 10: [3, 4]
        asyncio.ensure_future(b.submit(6, size=1, cost=4)),  # costs 6 + 4 = 10 fit: [5, 6]
        asyncio.ensure_future(b.submit(7, size=1, cost=6)),
    ]
    await asyncio.sleep(0.01)
    handler.release.set()
    await asyncio.wait_for(asyncio.gather(blocker, *futs), 5)
    assert handler.batches == [[-1], [1, 2], [3, 4], [5, 6], [7]]
    await b.close()


async def test_a_cancelled_caller_in_the_middle_does_not_split_the_batch() -> None:
    handler = Recorder()
    handler.release.clear()
    b: DynamicBatcher[int, int] = DynamicBatcher(handler, max_batch_size=8, max_delay_s=0)
    b.start()
    first = asyncio.ensure_future(b.submit(0))
    await asyncio.wait_for(handler.entered.wait(), 5)
    futs = [asyncio.ensure_future(b.submit(i)) for i in (1, 2, 3)]
    await asyncio.sleep(0.01)
    futs[1].cancel()
    handler.release.set()
    assert await asyncio.wait_for(asyncio.gather(first, futs[0], futs[2]), 5) == [0, 10, 30]
    assert handler.batches == [[0], [1, 3]]
    await b.close()


async def test_observer_times_waits_and_compute_within_the_call() -> None:
    observer = Observer()

    async def slow(items: list[int]) -> list[int]:
        await asyncio.sleep(0.05)
        return items

    delay = 0.05
    b: DynamicBatcher[int, int] = DynamicBatcher(
        slow, max_batch_size=100, max_delay_s=delay, observer=observer, name="m"
    )
    b.start()
    started = time.monotonic()
    await asyncio.wait_for(asyncio.gather(b.submit(1), b.submit(2)), 5)
    elapsed = time.monotonic() - started
    (batch,) = observer.batches
    waits = batch["queue_waits"]
    compute = batch["compute_seconds"]
    assert isinstance(waits, list)
    assert isinstance(compute, float)
    # consistent with the call around them: each waited the delay, computed the handler's sleep
    assert all(delay <= w <= elapsed for w in waits)
    assert 0.05 <= compute <= elapsed
    assert max(waits) + compute <= elapsed
    assert batch["ok"] is True
    assert observer.names == {"m"}
    await b.close()


def test_request_ids_name_each_request_and_a_dash_for_none() -> None:
    assert request_ids([RequestContext("a1"), None, RequestContext("b2")]) == "a1,-,b2"


async def test_a_failure_is_logged_once_and_marked_so() -> None:
    async def handler(items: list[int]) -> list[int]:
        raise RuntimeError("boom")

    observer = Observer()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=2, max_delay_s=0.01, observer=observer, name="m",
        max_split_depth=1,
    )  # fmt: skip
    b.start()
    contexts: list[RequestContext] = []

    async def submit(i: int) -> int:
        contexts.append(open_request(f"r{i}"))  # as the HTTP layer opens one per request
        return await b.submit(i)

    out = await asyncio.wait_for(asyncio.gather(submit(1), submit(2), return_exceptions=True), 5)
    assert all(isinstance(e, RuntimeError) for e in out)
    assert [c.failure_logged for c in contexts] == [True, True]
    assert observer.splits == ["error"]
    assert observer.names == {"m"}
    await b.close()


async def test_wait_seconds_is_the_time_around_the_models_own() -> None:
    observer = Observer()

    async def timed(items: list[int]) -> list[int]:
        await asyncio.sleep(0.05)
        return TimedResults(items, compute_seconds=0.04)

    async def plain(items: list[int]) -> list[int]:
        return items

    elapsed = 0.0
    for handler in (plain, timed):
        b: DynamicBatcher[int, int] = DynamicBatcher(
            handler, max_batch_size=1, max_delay_s=0, observer=observer
        )
        b.start()
        started = time.monotonic()
        assert await asyncio.wait_for(b.submit(7), 5) == 7
        elapsed = time.monotonic() - started
        await b.close()
    plain_batch, timed_batch = observer.batches
    assert plain_batch["wait_seconds"] == 0.0
    assert timed_batch["compute_seconds"] == 0.04
    wait = timed_batch["wait_seconds"]
    assert isinstance(wait, float)
    # the handler's time less the model's own: at least the rest of its sleep, and no more
    # than the whole call less the model's own
    assert 0.01 - 1e-3 <= wait <= elapsed - 0.04
