"""A session cancelled while its chunk runs (the server's shutdown, a test client's exit)
cancels the chunk too: it is a task of its own, which would otherwise run on in the batcher."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from rnnserve.service.http.sessions import _Session


async def test_cancelling_a_session_cancels_its_running_chunk() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def chunk() -> None:
        started.set()
        try:
            await asyncio.Event().wait()  # would run for ever
        except asyncio.CancelledError:
            cancelled.set()
            raise

    session = cast(Any, _Session)  # _until_gone reads nothing of the session
    waiting = asyncio.ensure_future(session._until_gone(None, chunk(), asyncio.Event()))
    await asyncio.wait_for(started.wait(), 10)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(cancelled.wait(), 10)
