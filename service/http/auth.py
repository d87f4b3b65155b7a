"""Admission of a request: the bearer token, and the byte budget its body is read against."""

from __future__ import annotations

import asyncio
import hmac
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import Gauge
from starlette.requests import ClientDisconnect

from rnnserve.service import endpoints
from rnnserve.service.codec import bodies
from rnnserve.service.http.outcomes import ClientGone
from rnnserve.service.interface import RequestError
from rnnserve.service.metrics import Metrics

# -- authentication ------------------------------------------------------------------------------

bearer = HTTPBearer(
    auto_error=False,
    description="Needed when the server has a token (RNNSERVE_API_TOKEN or api_token_file).",
)


def server_token(request: Request) -> bytes | None:
    state = request.app.state
    try:
        token: bytes | None = state.api_token
    except AttributeError:  # read once per app
        text = state.settings.bearer_token()
        token = state.api_token = text.encode() if text is not None else None
    return token


async def authorize(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """Require ``Authorization: Bearer <token>`` when the server has a token."""
    route = request.scope.get("route")
    check_token(request, credentials, endpoints.label(getattr(route, "path", "")))


def check_token(
    request: Request, credentials: HTTPAuthorizationCredentials | None, endpoint: str
) -> None:
    """Raise 401 ``unauthorized`` unless the server has no token or ``credentials`` hold it."""
    token = server_token(request)
    if token is None:
        return
    given = credentials.credentials.encode() if credentials is not None else b""
    if hmac.compare_digest(given, token):  # constant time: no timing oracle on the token
        return
    metrics: Metrics = request.app.state.metrics
    metrics.rejected.labels(endpoint, "unauthorized").inc()
    why = "a wrong bearer token" if credentials is not None else "no bearer token"
    raise RequestError("unauthorized", f"this endpoint needs a bearer token; got {why}")


AUTH = [Depends(authorize)]


# -- memory budget -------------------------------------------------------------------------------


class ByteBudget:
    """Request bytes being read, parsed, queued and run at once (one event loop: no lock).

    ``gauge``, if given, is set to the bytes used on every change; without it the budget's
    ``used`` is read by whoever reports it (:meth:`~rnnserve.service.metrics.Metrics.live`)."""

    def __init__(self, limit: int, gauge: Gauge | None) -> None:
        self.limit = limit
        self.used = 0
        self.gauge = gauge

    def take(self, n: int) -> bool:
        if self.used + n > self.limit:
            return False
        self._change(n)
        return True

    def hold(self, n: int) -> None:
        """Count ``n`` bytes that exist already (an answer being sent): never refused, but
        what they take is refused to new requests until they are given back."""
        self._change(n)

    def room(self) -> int:
        return max(self.limit - self.used, 0)

    def give(self, n: int) -> None:
        self._change(-n)

    def _change(self, n: int) -> None:
        self.used += n
        if self.gauge is not None:
            self.gauge.set(self.used)


def budget_of(request: Request) -> ByteBudget:
    return byte_budget(request.app.state)


def byte_budget(state: Any) -> ByteBudget:
    """The app's one budget (``state``: its ``app.state``)."""
    try:
        budget: ByteBudget = state.byte_budget
    except AttributeError:  # one per app
        metrics: Metrics = state.metrics
        budget = state.byte_budget = ByteBudget(state.settings.max_inflight_bytes, None)
        budget.gauge = metrics.live(metrics.inflight_bytes, lambda: budget.used)
    return budget


def overloaded(budget: ByteBudget) -> RequestError:
    return RequestError(
        "overloaded",
        f"the server holds {budget.used} bytes of requests (its budget is {budget.limit}); "
        "try again later",
    )  # fmt: skip


def _too_big(limit: int) -> RequestError:
    return RequestError("body_too_large", f"request body is over {limit} bytes")


class Held:
    """The bytes one request holds of the budget."""

    n = 0


async def read_body(
    request: Request, limit: int, timeout_s: float, held: Held, safetensors: bool = False
) -> bytes:
    """The body, within ``limit`` bytes and ``timeout_s`` seconds, counted against the budget as
    it arrives. A declared length over ``limit``, or over the budget's room now, is refused
    before the client sends it; but only bytes that came are held, so clients that declare
    large bodies and send nothing deny nobody. A body the caller reads as ``safetensors`` whose
    first 8 bytes declare a header the decoder would refuse (past the body's end, or over its
    limit) is refused with the decoder's own error as soon as they come, not once the whole
    body is held. A body cut
    short (the connection closed before its end: a hang-up, or a chunked body that broke off,
    which uvicorn answers itself) raises :class:`ClientGone`."""
    budget = budget_of(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        if int(declared) > limit:
            raise _too_big(limit)
        if int(declared) > budget.room():
            raise overloaded(budget)
    # the most bytes a safetensors header can take: the declared length, else the limit
    header_bound = (int(declared) if declared.isdigit() else limit) if safetensors else None
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_big(limit)
                if header_bound is not None and size >= 8:
                    # before the bytes are held: a refused body takes none of the budget (the
                    # pieces before this one are under 8 bytes, so the join copies at most 8)
                    first = b"".join([*chunks, chunk[:8]])
                    bodies.safetensors_header_length(first, header_bound)
                    header_bound = None
                if chunk:  # starlette ends with b"": a body in one piece is then not copied
                    if not budget.take(len(chunk)):
                        raise overloaded(budget)
                    held.n = size
                    chunks.append(chunk)
    except TimeoutError:
        raise RequestError(
            "body_timeout",
            f"the request body did not arrive within {timeout_s:g} s ({size} bytes came)",
        ) from None  # fmt: skip
    except ClientDisconnect:  # the client's doing: a 499, not the server's failure
        raise ClientGone from None
    return b"".join(chunks)
