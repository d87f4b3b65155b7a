"""Fault isolation in the batchers: a failing batch is bisected so only the poison fails."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from rnnserve.service.engine.batcher import DynamicBatcher, TimedResults, failure_reason
from rnnserve.service.engine.continuous import ChunkOutcome, ContinuousBatcher
from rnnserve.service.interface import is_out_of_memory, open_request

POISON = -1


class Recorder:
    def __init__(self) -> None:
        self.batches: list[dict[str, object]] = []
        self.splits: list[str] = []

    def on_queue_depth(self, name: str, depth: int) -> None:
        pass

    def on_batch(self, name: str, **kw: object) -> None:
        self.batches.append(kw)

    def on_split(self, name: str, reason: str) -> None:
        self.splits.append(reason)


def _poisoned(calls: list[list[int]], error: Exception) -> object:
    async def handler(items: list[int]) -> list[int]:
        calls.append(list(items))
        if POISON in items:
            raise error
        return [2 * i for i in items]

    return handler


async def _submit_all(batcher: DynamicBatcher[int, int], items: Sequence[int]) -> list[object]:
    async def one(i: int) -> object:
        open_request(f"req-{i}")
        return await batcher.submit(i)

    return list(await asyncio.gather(*(one(i) for i in items), return_exceptions=True))


async def test_only_the_poison_request_of_a_batch_fails() -> None:
    calls: list[list[int]] = []
    obs = Recorder()
    b: DynamicBatcher[int, int] = DynamicBatcher(
        _poisoned(calls, RuntimeError("bad input")),  # type: ignore[arg-type]
        max_batch_size=8, max_delay_s=0.05, max_split_depth=3, observer=obs,
    )  # fmt: skip
    b.start()
    items = [1, 2, 3, POISON, 5, 6, 7, 8]
    out = await _submit_all(b, items)
    assert isinstance(out[3], RuntimeError)
    assert [o for i, o in enumerate(out) if i != 3] == [2, 4, 6, 10, 12, 14, 16]
    # 1 batch of 8, then halves: 4+4, 2+2, 1+1: 7 calls, 3 of them failing above the poison
    assert len(calls) == 7
    assert sum(POISON in c for c in calls) == 4
    assert obs.splits == ["error"] * 3
    assert [bt["ok"] for bt in obs.batches].count(False) == 4
    # queue waits are counted once per request, not again in the retries
    assert sum(len(bt["queue_waits"]) for bt in obs.batches) == 8  # type: ignore[arg-type]
    await b.close()


async def test_split_depth_bounds_the_retries() -> None:
    calls: list[list[int]] = []
    b: DynamicBatcher[int, int] = DynamicBatcher(
        _poisoned(calls, RuntimeError("bad")),  # type: ignore[arg-type]
        max_batch_size=8, max_delay_s=0.05, max_split_depth=1,
    )  # fmt: skip
    b.start()
    out = await _submit_all(b, [1, 2, 3, POISON, 5, 6, 7, 8])
    # one halving: the half with the poison fails as a whole, the other half is served
    assert [isinstance(o, RuntimeError) for o in out] == [True] * 4 + [False] * 4
    assert len(calls) == 3
    await b.close()


async def test_without_splitting_the_whole_batch_fails() -> None:
    calls: list[list[int]] = []
    b: DynamicBatcher[int, int] = DynamicBatcher(
        _poisoned(calls, RuntimeError("bad")),  # type: ignore[arg-type]
        max_batch_size=4, max_delay_s=0.05,
    )  # fmt: skip
    b.start()
    out = await _submit_all(b, [1, POISON, 3, 4])
    assert all(isinstance(o, RuntimeError) for o in out)
    assert len(calls) == 1
    await b.close()


async def test_out_of_memory_splits_and_every_request_is_served() -> None:
    calls: list[list[int]] = []
    obs = Recorder()

    async def handler(items: list[int]) -> list[int]:
        calls.append(list(items))
        if len(items) > 2:  # the device fits two items at once
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return items

    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=8, max_delay_s=0.05, max_split_depth=8, observer=obs
    )
    b.start()
    assert await _submit_all(b, list(range(8))) == list(range(8))
    assert obs.splits == ["out_of_memory"] * 3  # 8 -> 4 + 4 -> 2 + 2 + 2 + 2
    await b.close()


async def test_a_failure_is_logged_with_the_request_ids(caplog: pytest.LogCaptureFixture) -> None:
    b: DynamicBatcher[int, int] = DynamicBatcher(
        _poisoned([], RuntimeError("bad")),  # type: ignore[arg-type]
        max_batch_size=2, max_delay_s=0.05, max_split_depth=2, name="m",
    )  # fmt: skip
    b.start()
    with caplog.at_level(logging.WARNING, logger="rnnserve.service.engine.batcher"):
        await _submit_all(b, [7, POISON])
    split, failed = (r.getMessage() for r in caplog.records)
    assert "retrying each half apart" in split
    assert "req-7" in split
    assert f"req-{POISON}" in split
    assert failed == f"m: batch of 1 requests failed; requests req-{POISON}"
    await b.close()


async def test_timed_results_report_the_models_own_time() -> None:
    obs = Recorder()

    async def handler(items: list[int]) -> list[int]:
        await asyncio.sleep(0.05)  # waiting for a thread, say
        return TimedResults(items, 0.01)

    b: DynamicBatcher[int, int] = DynamicBatcher(
        handler, max_batch_size=1, max_delay_s=0, observer=obs
    )
    b.start()
    assert await b.submit(3) == 3
    (batch,) = obs.batches
    assert batch["compute_seconds"] == 0.01
    assert 0.035 < batch["wait_seconds"] < 1  # type: ignore[operator]
    await b.close()


def test_out_of_memory_is_recognised() -> None:
    class OutOfMemoryError(RuntimeError):
        pass

    assert is_out_of_memory(OutOfMemoryError("x"))
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: not enough memory: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert failure_reason(MemoryError()) == "out_of_memory"
    assert failure_reason(ValueError()) == "error"


def test_split_depth_is_checked() -> None:
    async def h(items: list[int]) -> list[int]:
        return items

    with pytest.raises(ValueError, match="max_split_depth must be >= 0"):
        DynamicBatcher(h, max_batch_size=1, max_delay_s=0, max_split_depth=-1)


# -- the continuous scheduler --------------------------------------------------------------------


class FakeEngine:
    """Items are step counts; a poison item (negative) fails any chunk it runs in."""

    def __init__(self) -> None:
        self.left: dict[int, int] = {}
        self.chunks: list[list[int]] = []

    async def __call__(
        self, joins: list[tuple[int, int]], leaves: list[int], unchanged: object
    ) -> ChunkOutcome[int]:
        for key in leaves:
            self.left.pop(key, None)
        for key, steps in joins:
            self.left[key] = steps
        self.chunks.append(sorted(self.left))
        await asyncio.sleep(0.001)
        if any(v < 0 for v in self.left.values()):
            self.left.clear()  # a failed engine holds nothing
            raise RuntimeError("poisoned chunk")
        done = {}
        progress = {}
        for key in list(self.left):
            self.left[key] -= 1
            progress[key] = key
            if self.left[key] <= 0:
                done[key] = key
                del self.left[key]
        return ChunkOutcome(done, progress, len(progress), compute_seconds=0.001)


async def test_a_poison_rollout_fails_alone_and_the_others_finish() -> None:
    engine = FakeEngine()
    obs = Recorder()
    s: ContinuousBatcher[int, int] = ContinuousBatcher(
        engine, max_active=8, max_split_depth=4, observer=obs
    )
    s.start()
    items = [3, 2, -1, 4, 1, 2]
    out = await asyncio.wait_for(
        asyncio.gather(*(s.submit(i) for i in items), return_exceptions=True), 10
    )
    assert isinstance(out[2], RuntimeError)
    assert [o for i, o in enumerate(out) if i != 2] == [0, 1, 3, 4, 5]  # results are the keys
    assert obs.splits  # split at least once
    assert set(obs.splits) == {"error"}
    assert all(bt["compute_seconds"] == 0.001 for bt in obs.batches if bt["ok"])
    await s.close()


async def test_a_retry_group_runs_alone() -> None:
    engine = FakeEngine()
    s: ContinuousBatcher[int, int] = ContinuousBatcher(engine, max_active=8, max_split_depth=4)
    s.start()
    first = asyncio.gather(s.submit(2), s.submit(-1), return_exceptions=True)
    await asyncio.sleep(0)
    out = await asyncio.wait_for(first, 10)
    assert out[0] == 0
    assert isinstance(out[1], RuntimeError)
    # after the failed chunk [0, 1], each ran without the other
    assert engine.chunks[0] == [0, 1]
    assert all(len(c) == 1 for c in engine.chunks[1:])
    await s.close()


async def test_a_stream_that_already_got_progress_fails_rather_than_restarts() -> None:
    engine = FakeEngine()
    s: ContinuousBatcher[int, int] = ContinuousBatcher(engine, max_active=8, max_split_depth=4)
    s.start()
    stream = s.stream(1000)
    got = [await anext(stream)]  # one chunk of progress reached the caller
    poison = asyncio.ensure_future(s.submit(-1))

    async def drain() -> None:
        async for piece in stream:
            got.append(piece)

    with pytest.raises(RuntimeError, match="poisoned chunk"):
        await drain()
    with pytest.raises(RuntimeError):
        await poison
    assert got[0] == 0
    await s.close()
