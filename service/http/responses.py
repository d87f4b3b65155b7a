"""The answers the HTTP layer sends: JSON, several buffers, and the error body."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response
from pydantic import BaseModel, Field

from rnnserve.service.http import errors
from rnnserve.service.interface import RequestError


class ErrorBody(BaseModel):
    detail: str
    type: str = Field(
        description="machine-readable kind of error; docs/API.md lists each",
        json_schema_extra={"enum": list(errors.CATALOGUE)},
    )
    loc: list[str | int]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """JSON via orjson; numpy arrays are written straight from their buffers."""
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


class BuffersResponse(Response):
    """A body sent as several buffers one after another (no copy into one ``bytes``)."""

    def __init__(self, parts: list[Any], media_type: str) -> None:
        super().__init__(b"", media_type=media_type)
        self.parts = [memoryview(p).cast("B") for p in parts]
        self.headers["content-length"] = str(sum(p.nbytes for p in self.parts))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        for i, part in enumerate(self.parts):
            more = i < len(self.parts) - 1
            await send({"type": "http.response.body", "body": part, "more_body": more})


def error_response(exc: RequestError, headers: dict[str, str] | None = None) -> Response:
    """The JSON answer to ``exc``, with the status the catalogue gives its type; 401 asks for
    the token, 503 says when to try again."""
    code = errors.status(exc.type)
    headers = dict(headers or {})
    if code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    elif code == 503:
        headers["Retry-After"] = "1"
    return json_response(errors.body(exc), code, headers or None)
