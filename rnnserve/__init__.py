"""rnnserve's Python client: ``from rnnserve.client import Client``.

The server itself lives in the ``service`` and ``models`` packages; this package only holds the
client, which needs numpy, httpx and orjson (torch only when you pass it torch tensors).
"""

from rnnserve.client import (
    AsyncClient,
    AsyncRolloutStream,
    BadRequest,
    Client,
    ConnectionFailed,
    DeadlineExceeded,
    ModelInfo,
    ModelNotFound,
    Overloaded,
    ProtocolError,
    RnnserveError,
    RolloutStream,
    ServerError,
)

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
