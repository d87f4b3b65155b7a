"""The continuous batcher with a fake engine: no HTTP, no models."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from rnnserve.service.engine import continuous
from rnnserve.service.engine.continuous import ChunkOutcome, ContinuousBatcher
from rnnserve.service.interface import BatcherClosed, QueueFull, open_request


class FakeEngine:
    """Items are step counts; each chunk runs every active item ``chunk`` steps further.

    Records what joined and left at each chunk and can be held on an event.
    """

    def __init__(self, chunk: int = 1) -> None:
        self.chunk = chunk
        self.left: dict[int, int] = {}  # key -> steps left
        self.items: dict[int, int] = {}
        self.calls: list[tuple[list[int], list[int], list[int]]] = []  # joins, leaves, active
        self.release = asyncio.Event()
        self.release.set()
        self.entered = asyncio.Event()
        self.fail_when: int | None = None  # raise when this item is active
        self.compute: float | None = None  # reported as the engine's own time
        self.fail_once: BaseException | None = None  # raised by the next chunk only
        self.delay = 0.0  # seconds each chunk takes
        self.unchanged_at_end: list[bool] = []  # unchanged() as each chunk ends

    async def __call__(
        self, joins: list[tuple[int, int]], leaves: list[int], unchanged: Callable[[], bool]
    ) -> ChunkOutcome[str]:
        self.unchanged = unchanged
        for key in leaves:
            self.left.pop(key)
        for key, steps in joins:
            self.left[key] = steps
            self.items[key] = steps
        self.calls.append(([i for _, i in joins], [self.items[k] for k in leaves], []))
        self.calls[-1][2].extend(sorted(self.items[k] for k in self.left))
        self.entered.set()
        await asyncio.sleep(self.delay)  # like the real engine's hop to its worker thread
        await self.release.wait()
        self.unchanged_at_end.append(unchanged())
        if self.fail_once is not None:
            exc, self.fail_once = self.fail_once, None
            self.left.clear()
            raise exc
        if self.fail_when is not None and self.fail_when in (self.items[k] for k in self.left):
            self.left.clear()
            raise RuntimeError("boom")
        ran = 0
        done = {}
        progress = {}
        for key in list(self.left):
            n = min(self.chunk, self.left[key])
            progress[key] = (self.items[key] - self.left[key], n)  # (first step, steps run)
            self.left[key] -= n
            ran += n
            if not self.left[key]:
                del self.left[key]
                done[key] = f"done {self.items[key]}"
        return ChunkOutcome(done, progress, ran, self.compute)


async def test_a_short_item_joins_a_running_long_one_and_finishes_first() -> None:
    engine = FakeEngine()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8)
    b.start()
    long = asyncio.ensure_future(b.submit(50))
    await asyncio.wait_for(engine.entered.wait(), 5)
    short = asyncio.ensure_future(b.submit(3))
    assert await asyncio.wait_for(short, 5) == "done 3"
    assert not long.done()  # the long one is still running after the short one ended
    assert await asyncio.wait_for(long, 5) == "done 50"
    # the short item joined at a chunk boundary while the long one ran, not after it
    join_chunk = next(i for i, (joins, _, _) in enumerate(engine.calls) if 3 in joins)
    assert 0 < join_chunk < 50
    assert engine.calls[join_chunk][2] == [3, 50]
    assert sum(1 for _, _, active in engine.calls if 50 in active) == 50
    await b.close()


async def test_results_go_to_their_own_callers() -> None:
    engine = FakeEngine(chunk=2)
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=4)
    b.start()
    steps = [7, 1, 4, 9, 2, 2, 5]
    results = await asyncio.wait_for(asyncio.gather(*(b.submit(n) for n in steps)), 5)
    assert results == [f"done {n}" for n in steps]
    await b.close()


async def test_active_sequences_never_exceed_the_limit() -> None:
    engine = FakeEngine()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=3)
    b.start()
    sizes = {10: 2, 11: 1, 12: 2, 13: 1, 14: 3}
    await asyncio.wait_for(asyncio.gather(*(b.submit(n, size=s) for n, s in sizes.items())), 5)
    for _, _, active in engine.calls:
        assert sum(sizes[n] for n in active) <= 3
    # an item larger than the limit still runs, alone
    assert await asyncio.wait_for(b.submit(15, size=5), 5) == "done 15"
    assert engine.calls[-1][2] == [15]
    await b.close()


async def test_a_cancelled_caller_leaves_at_the_next_chunk() -> None:
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8)
    b.start()
    gone = asyncio.ensure_future(b.submit(1000))
    stays = asyncio.ensure_future(b.submit(5))
    await asyncio.wait_for(engine.entered.wait(), 5)
    gone.cancel()
    engine.release.set()
    assert await asyncio.wait_for(stays, 5) == "done 5"
    leaves = [left for _, lefts, _ in engine.calls for left in lefts]
    assert leaves == [1000]
    assert sum(1 for _, _, active in engine.calls if 1000 in active) == 1  # dropped after one
    await b.close()


async def test_a_cancelled_caller_that_never_ran_is_skipped() -> None:
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=1)
    b.start()
    first = asyncio.ensure_future(b.submit(2))
    await asyncio.wait_for(engine.entered.wait(), 5)
    gone = asyncio.ensure_future(b.submit(77))
    await asyncio.sleep(0)
    gone.cancel()
    engine.release.set()
    assert await asyncio.wait_for(first, 5) == "done 2"
    assert all(77 not in joins for joins, _, _ in engine.calls)
    await b.close()


async def test_a_failing_chunk_fails_the_items_running_in_it_only() -> None:
    engine = FakeEngine()
    engine.fail_when = 13
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=2)
    b.start()
    bad = await asyncio.wait_for(
        asyncio.gather(b.submit(13), b.submit(4), b.submit(6), return_exceptions=True), 5
    )
    # 13 and 4 ran together and failed together; 6 waited for a slot and ran after
    assert [type(r) for r in bad[:2]] == [RuntimeError, RuntimeError]
    assert bad[2] == "done 6"
    assert await asyncio.wait_for(b.submit(3), 5) == "done 3"
    await b.close()


async def test_queue_limit_and_closing() -> None:
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=1, max_queue_size=1)
    b.start()
    running = asyncio.ensure_future(b.submit(2))
    await asyncio.wait_for(engine.entered.wait(), 5)
    queued = asyncio.ensure_future(b.submit(3))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull):
        await b.submit(4)
    closing = asyncio.ensure_future(b.close(drain_timeout_s=5))
    await asyncio.sleep(0.01)
    with pytest.raises(BatcherClosed):
        await b.submit(5)
    engine.release.set()
    await asyncio.wait_for(closing, 5)
    assert await running == "done 2"
    assert await queued == "done 3"  # drained, not dropped


async def test_observer_counts_chunks_steps_and_waits() -> None:
    class Observer:
        def __init__(self) -> None:
            self.batches: list[dict[str, object]] = []

        def on_queue_depth(self, name: str, depth: int) -> None:
            pass

        def on_batch(self, name: str, **kw: object) -> None:
            self.batches.append(kw)

    observer = Observer()
    engine = FakeEngine(chunk=4)
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8, observer=observer)
    b.start()
    await asyncio.wait_for(asyncio.gather(b.submit(10), b.submit(3)), 5)
    assert sum(o["cost"] for o in observer.batches) == 13  # type: ignore[misc]
    waits = [w for o in observer.batches for w in o["queue_waits"]]  # type: ignore[attr-defined]
    assert len(waits) == 2  # one wait per request, when it joined
    assert all(o["ok"] for o in observer.batches)
    await b.close()


def test_arguments_are_checked() -> None:
    async def engine(joins: object, leaves: object, unchanged: object) -> ChunkOutcome[str]:
        return ChunkOutcome({}, {}, 0)

    with pytest.raises(ValueError, match="max_active"):
        ContinuousBatcher(engine, max_active=0)
    with pytest.raises(ValueError, match="max_queue_size"):
        ContinuousBatcher(engine, max_active=1, max_queue_size=0)


async def test_a_stream_yields_each_chunks_progress_then_ends() -> None:
    engine = FakeEngine(chunk=3)
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=4)
    b.start()
    other = asyncio.ensure_future(b.submit(20))
    pieces = [p async for p in b.stream(8)]
    assert pieces == [(0, 3), (3, 3), (6, 2)]
    assert await asyncio.wait_for(other, 5) == "done 20"
    await b.close()


async def test_closing_a_stream_early_takes_it_out_of_the_running_set() -> None:
    engine = FakeEngine(chunk=1)
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=4)
    b.start()
    stream = b.stream(1000)
    seen = [await anext(stream) for _ in range(3)]
    assert seen == [(0, 1), (1, 1), (2, 1)]
    await stream.aclose()  # the client went away
    chunks_before = len(engine.calls)
    assert await asyncio.wait_for(b.submit(2), 5) == "done 2"
    assert [left for _, lefts, _ in engine.calls for left in lefts] == [1000]
    after = [active for _, _, active in engine.calls[chunks_before:]]
    assert sum(1 for active in after if 1000 in active) <= 1  # at most the chunk under way
    await b.close()


async def test_a_failing_chunk_raises_from_the_stream() -> None:
    engine = FakeEngine(chunk=1)
    engine.fail_when = 13
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=4)
    b.start()
    before = {t for t in asyncio.all_tasks() if not t.done()}
    with pytest.raises(RuntimeError, match="boom"):
        async for _ in b.stream(13):
            pass
    await asyncio.sleep(0)
    assert {t for t in asyncio.all_tasks() if not t.done()} <= before  # no getter left waiting
    await b.close()


class Recorder:
    """An observer that keeps every call, as it was made."""

    def __init__(self) -> None:
        self.batches: list[tuple[str, dict[str, Any]]] = []
        self.depths: list[tuple[str, int]] = []
        self.splits: list[tuple[str, str]] = []

    def on_queue_depth(self, name: str, depth: int) -> None:
        self.depths.append((name, depth))

    def on_batch(self, name: str, **kw: Any) -> None:
        self.batches.append((name, kw))

    def on_split(self, name: str, reason: str) -> None:
        self.splits.append((name, reason))


async def test_the_observer_gets_each_chunks_own_figures() -> None:
    engine = FakeEngine(chunk=4)
    engine.compute = 0.001
    rec = Recorder()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(
        engine, max_active=8, observer=rec, name="rollouts"
    )
    b.start()
    await asyncio.wait_for(asyncio.gather(b.submit(10, size=2), b.submit(3)), 5)
    assert {name for name, _ in rec.batches} == {"rollouts"}
    assert [kw["items"] for _, kw in rec.batches] == [2, 1, 1]  # 3 steps, then 10 = 4 + 4 + 2
    assert [kw["size"] for _, kw in rec.batches] == [3, 2, 2]
    assert [kw["cost"] for _, kw in rec.batches] == [7, 4, 2]
    waits = [w for _, kw in rec.batches for w in kw["queue_waits"]]
    assert len(waits) == 2
    assert all(0 <= w < 5 for w in waits)
    for _, kw in rec.batches:
        assert kw["ok"] is True
        assert kw["compute_seconds"] == 0.001  # the engine's own figure
        assert 0.0 <= kw["wait_seconds"] < 5  # the rest of the chunk's wall time
    assert rec.depths[0] == ("rollouts", 1)
    assert all(name == "rollouts" for name, _ in rec.depths)
    assert rec.depths[-1] == ("rollouts", 0)
    engine.compute = None  # an engine that does not measure: the wall time, no wait
    engine.fail_when = 99
    rec.batches.clear()
    failed = await asyncio.wait_for(asyncio.gather(b.submit(99), return_exceptions=True), 5)
    assert isinstance(failed[0], RuntimeError)
    ((_, kw),) = rec.batches
    assert kw["ok"] is False
    assert kw["cost"] == 0
    assert 0.0 <= kw["compute_seconds"] < 5
    assert kw["wait_seconds"] == 0.0
    await b.close()


async def test_errors_and_the_task_carry_the_schedulers_name() -> None:
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=1, max_queue_size=1)
    with pytest.raises(BatcherClosed, match=r"^scheduler is not accepting work$"):
        await b.submit(1)
    b.start()
    assert any(t.get_name() == "scheduler-scheduler" for t in asyncio.all_tasks())
    running = asyncio.ensure_future(b.submit(5))
    await asyncio.wait_for(engine.entered.wait(), 5)
    queued = asyncio.ensure_future(b.submit(6))
    await asyncio.sleep(0)
    with pytest.raises(QueueFull, match=r"^scheduler queue is full \(1 waiting\)$"):
        await b.submit(7)
    await asyncio.wait_for(b.close(drain_timeout_s=0.05), 5)  # the engine never finishes
    assert running.done()
    assert queued.done()  # nothing is left hanging once close returns
    assert running.cancelled()
    with pytest.raises(BatcherClosed, match=r"^scheduler stopped$"):
        await queued
    with pytest.raises(ValueError, match="max_split_depth must be >= 0, got -1"):
        ContinuousBatcher(engine, max_active=1, max_split_depth=-1)
    await ContinuousBatcher(engine, max_active=1).close()  # never started: nothing to stop


@pytest.mark.parametrize(("depth", "survivors"), [(1, {5, 6}), (2, {4, 5, 6})])
async def test_a_failing_chunk_is_retried_in_halves_alone(depth: int, survivors: set[int]) -> None:
    engine = FakeEngine()
    engine.fail_when = 13
    rec = Recorder()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(
        engine, max_active=8, observer=rec, max_split_depth=depth
    )
    b.start()
    items = [13, 4, 5, 6]
    out = await asyncio.wait_for(
        asyncio.gather(*(b.submit(i) for i in items), return_exceptions=True), 5
    )
    ok = {i for i, r in zip(items, out, strict=True) if r == f"done {i}"}
    assert ok == survivors
    assert all(isinstance(r, RuntimeError) for i, r in zip(items, out, strict=True) if i not in ok)
    actives = [active for _, _, active in engine.calls]
    assert actives[0] == [4, 5, 6, 13]
    assert actives[1] == [4, 13]  # the first half, alone
    if depth == 2:
        assert actives[2] == [13]  # split again: 13 alone, then 4 alone
        assert actives[3] == [4]
    assert [5, 6] in actives  # the second half, alone as well
    assert rec.splits[0] == ("scheduler", "error")
    assert len(rec.splits) == depth
    await b.close()


async def test_an_item_behind_a_cancelled_one_joins_at_the_next_chunk() -> None:
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8)
    b.start()
    first = asyncio.ensure_future(b.submit(2))
    await asyncio.wait_for(engine.entered.wait(), 5)
    gone = asyncio.ensure_future(b.submit(77))
    after = asyncio.ensure_future(b.submit(3))
    await asyncio.sleep(0)
    gone.cancel()
    engine.release.set()
    assert await asyncio.wait_for(asyncio.gather(first, after), 5) == ["done 2", "done 3"]
    assert engine.calls[1][0] == [3]  # joined right after the chunk it waited for
    # only cancelled callers waiting and nothing running: the scheduler goes on
    engine.release.clear()
    engine.entered.clear()
    held = asyncio.ensure_future(b.submit(1))
    await asyncio.wait_for(engine.entered.wait(), 5)
    lost = asyncio.ensure_future(b.submit(8))
    await asyncio.sleep(0)
    lost.cancel()
    held.cancel()  # finishes in the chunk under way: its result has nobody to go to
    engine.release.set()
    assert await asyncio.wait_for(b.submit(4), 5) == "done 4"
    await b.close()


async def test_streams_of_default_size_share_a_chunk_and_leave_no_tasks() -> None:
    engine = FakeEngine(chunk=2)
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=2)
    b.start()
    before = {t for t in asyncio.all_tasks() if not t.done()}

    async def drain(n: int) -> list[Any]:
        return [p async for p in b.stream(n)]

    got = await asyncio.wait_for(asyncio.gather(drain(4), drain(4)), 5)
    assert got == [[(0, 2), (2, 2)], [(0, 2), (2, 2)]]
    assert engine.calls[0][2] == [4, 4]  # one sequence each: both fit in max_active=2
    await asyncio.sleep(0)
    assert {t for t in asyncio.all_tasks() if not t.done()} <= before  # no getter left waiting
    await b.close()


async def test_a_retry_group_runs_alone_until_it_is_done() -> None:
    """After a chunk fails, each half starts over alone: nothing joins it until it ends."""
    engine = FakeEngine()
    engine.fail_once = RuntimeError("CUDA out of memory")  # a one-off failure of the chunk
    rec = Recorder()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(
        engine, max_active=8, observer=rec, max_split_depth=1
    )
    b.start()
    out = await asyncio.wait_for(asyncio.gather(b.submit(3), b.submit(4)), 5)
    assert out == ["done 3", "done 4"]
    actives = [active for _, _, active in engine.calls]
    assert actives == [[3, 4]] + [[3]] * 3 + [[4]] * 4  # each half alone, to its end
    assert rec.splits == [("scheduler", "out_of_memory")]
    late = asyncio.ensure_future(b.submit(2))  # and afterwards work is admitted as usual
    both = asyncio.ensure_future(b.submit(2))
    assert await asyncio.wait_for(asyncio.gather(late, both), 5) == ["done 2", "done 2"]
    assert engine.calls[-1][2] == [2, 2]
    await b.close()


async def test_wait_seconds_are_the_chunks_time_beyond_the_engines_own() -> None:
    engine = FakeEngine()
    engine.delay = 0.5  # each chunk takes half a second, of which the engine reports 0.45
    engine.compute = 0.45
    rec = Recorder()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8, observer=rec)
    b.start()
    await asyncio.wait_for(b.submit(1), 5)
    ((_, kw),) = rec.batches
    assert kw["compute_seconds"] == 0.45
    assert 0.03 < kw["wait_seconds"] < 0.45  # wall - compute: about 0.05 s
    await b.close()


async def test_new_work_waits_while_the_last_retry_group_runs() -> None:
    engine = FakeEngine()
    engine.fail_once = RuntimeError("boom")
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8, max_split_depth=1)
    b.start()
    first = asyncio.gather(b.submit(3), b.submit(6))
    for _ in range(1000):  # until the last half ([6]) runs alone
        if [6] in [active for _, _, active in engine.calls]:
            break
        await asyncio.sleep(0)
    newcomer = b.submit(2)
    assert await asyncio.wait_for(asyncio.gather(first, newcomer), 5) == [
        ["done 3", "done 6"],
        "done 2",
    ]
    actives = [active for _, _, active in engine.calls]
    assert not any(2 in a and 6 in a for a in actives)  # it joined after the group, not beside
    assert actives[-1] == [2]
    await b.close()


async def test_a_failed_chunk_is_logged_once_with_the_ids_of_its_requests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine()
    engine.fail_when = 13
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=2, name="sched")
    b.start()

    async def submit(steps: int, rid: str) -> str:
        open_request(rid)  # as the HTTP layer opens one per request
        return await b.submit(steps)

    with caplog.at_level(logging.ERROR, logger="rnnserve"):
        out = await asyncio.wait_for(
            asyncio.gather(submit(13, "r13"), submit(4, "r4"), return_exceptions=True), 5
        )
    assert [type(r) for r in out] == [RuntimeError, RuntimeError]
    failed = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(failed) == 1
    assert "sched" in failed[0]
    assert failed[0].endswith("requests r13,r4")
    await b.close()


async def _held_first_chunk(
    steps: int, max_active: int = 8
) -> tuple[FakeEngine, ContinuousBatcher[int, str], Any]:
    """A started batcher whose engine holds its first chunk: one item of ``steps``."""
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=max_active)
    b.start()
    task = asyncio.ensure_future(b.submit(steps))
    await asyncio.wait_for(engine.entered.wait(), 5)
    return engine, b, task


@pytest.fixture(autouse=True)
def run_on_for_half_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long enough that no test here reaches it by accident on a slow machine."""
    monkeypatch.setattr(continuous, "RUN_ON_S", 0.5)


async def test_the_engine_may_go_on_until_an_item_is_queued() -> None:
    engine, b, running = await _held_first_chunk(3, max_active=1)
    unchanged = engine.unchanged
    assert unchanged() is True
    assert unchanged() is True  # asking changes nothing
    queued = asyncio.ensure_future(b.submit(2))  # cannot join (max_active 1), still news
    await asyncio.sleep(0)
    assert unchanged() is False
    engine.release.set()
    assert await asyncio.wait_for(asyncio.gather(running, queued), 5) == ["done 3", "done 2"]
    await b.close()


async def test_the_engine_may_go_on_until_a_caller_goes_away() -> None:
    engine, b, gone = await _held_first_chunk(1000)
    unchanged = engine.unchanged
    assert unchanged() is True
    gone.cancel()
    await asyncio.sleep(0)  # the future's callbacks run on the next turn of the loop
    await asyncio.sleep(0)
    assert unchanged() is False
    engine.release.set()
    await b.close()


async def test_the_engine_may_go_on_until_the_batcher_closes() -> None:
    engine, b, running = await _held_first_chunk(2)
    unchanged = engine.unchanged
    closing = asyncio.ensure_future(b.close())
    await asyncio.sleep(0)
    assert unchanged() is False
    engine.release.set()
    await asyncio.wait_for(closing, 5)
    assert await running == "done 2"  # drained


async def test_an_item_that_finishes_by_itself_is_no_news() -> None:
    """Only a caller that went away is news, not one answered: every call of a run with no
    arrivals after its start may go on."""
    engine = FakeEngine(chunk=2)
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8)
    b.start()
    answers = await asyncio.wait_for(asyncio.gather(b.submit(2), b.submit(9)), 5)
    assert answers == ["done 2", "done 9"]
    assert len(engine.unchanged_at_end) == 5
    assert all(engine.unchanged_at_end)
    await b.close()


async def test_the_engine_may_go_on_for_run_on_s_at_most() -> None:
    """So that the metrics and traces see a lone long rollout now and then."""
    engine, b, running = await _held_first_chunk(2)
    unchanged = engine.unchanged
    assert unchanged() is True
    await asyncio.sleep(continuous.RUN_ON_S * 1.2)
    assert unchanged() is False
    engine.release.set()
    assert await asyncio.wait_for(running, 5) == "done 2"
    await b.close()


async def test_a_running_stream_never_lets_the_engine_go_on() -> None:
    """A streaming caller gets its progress chunk by chunk, so every chunk comes back."""
    engine = FakeEngine()
    engine.release.clear()
    b: ContinuousBatcher[int, str] = ContinuousBatcher(engine, max_active=8)
    b.start()
    stream = b.stream(3)
    first = asyncio.ensure_future(anext(stream))
    await asyncio.wait_for(engine.entered.wait(), 5)
    assert engine.unchanged() is False
    engine.release.set()
    assert await first == (0, 1)
    await stream.aclose()
    await b.close()
