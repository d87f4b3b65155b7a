"""Threads that read and write large JSON bodies beside the event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any, TypeVar

A = TypeVar("A")


class CodecPool:
    """Threads that read large JSON bodies and write large JSON answers off the event loop.

    The JSON scanner and writer are numba functions that release the GIL, so on a thread they
    run beside the event loop (which goes on reading, routing and answering other requests) and
    beside each other, so a busy loop keeps serving (docs/BENCHMARKS.md has the gain). Below
    ``min_bytes`` the work stays on the loop: the hand-off (a future, a wake-up, the GIL
    changing hands) costs more than a small parse.
    """

    def __init__(self, threads: int, min_bytes: int) -> None:
        self.min_bytes = min_bytes
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="rnnserve-codec")
            if threads > 0
            else None
        )

    async def run(self, size: int, fn: Callable[..., A], *args: Any) -> A:
        """``fn(*args)``: on a codec thread when ``size`` bytes are at least ``min_bytes``."""
        if self._pool is None or size < self.min_bytes:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
