"""rnnserve: ``from rnnserve.client import Client`` for the Python client.

The server installs beside it as :mod:`rnnserve.service` (HTTP, engine, IPC, codec) and
:mod:`rnnserve.models` (PyTorch models, kernels, weights). The client's names are imported on
first use, so that importing the server does not import the client (httpx) too.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AsyncClient",
    "AsyncRolloutStream",
    "BadRequest",
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
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rnnserve import client

        return getattr(client, name)
    raise AttributeError(f"module 'rnnserve' has no attribute {name!r}")
