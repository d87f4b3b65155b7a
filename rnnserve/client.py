"""A Python client for rnnserve: arrays in, arrays out, with retries, deadlines and typed errors.

::

    import numpy as np
    from rnnserve.client import Client

    with Client("http://127.0.0.1:8000") as rnn:
        smoothed = rnn.smooth(np.random.rand(100, 16))  # [100, 16] float32
        positions = rnn.rollout([np.random.rand(50, 6), np.random.rand(7, 6)])  # [[50, 2], [7, 2]]
        for i, start, chunk in rnn.stream_rollout(np.random.rand(500, 6)):
            ...  # positions of steps start .. start + len(chunk) - 1 of sequence i

:class:`Client` is synchronous, :class:`AsyncClient` has the same methods as coroutines (and
``stream_rollout`` as an async iterator). Both are built on httpx and are context managers.
:class:`AsyncClient` is the one written by hand (``rnnserve/_async_client.py``);
``scripts/unasync.py`` generates :class:`Client` from it.

Inputs: one ``[T, F]`` sequence (numpy array, torch tensor or nested list), a list of them (any
lengths), or one ``[N, T, F]`` array/tensor (N sequences of the same length). Outputs mirror the
inputs: one array for one sequence, a list for a list, an ``[N, T, F_out]`` array for a 3-D
input; each output is a float32 numpy array, or a float32 torch tensor on the input's device
when that input was a torch tensor. Inputs are sent as float32.

See docs/CLIENT.md for retries, deadlines, the binary format and errors.
"""

from __future__ import annotations

from rnnserve._async_client import AsyncClient, AsyncRolloutStream, AsyncSession
from rnnserve._core import (
    USE_DEFAULT,
    BadRequest,
    Chunk,
    ConnectionFailed,
    DeadlineExceeded,
    ModelInfo,
    ModelNotFound,
    Overloaded,
    ProtocolError,
    RnnserveError,
    ServerError,
)
from rnnserve._sync_client import Client, RolloutStream, Session

__all__ = [
    "USE_DEFAULT",
    "AsyncClient",
    "AsyncRolloutStream",
    "AsyncSession",
    "BadRequest",
    "Chunk",
    "Client",
    "ConnectionFailed",
    "DeadlineExceeded",
    "ModelInfo",
    "ModelNotFound",
    "Overloaded",
    "ProtocolError",
    "RnnserveError",
    "RolloutStream",
    "ServerError",
    "Session",
]
