"""The OpenAPI document's ``GET /models/{name}/stream``: FastAPI leaves WebSocket routes out,
so the document adds the session's handshake, its frames and its close codes."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from pydantic import SecretStr

from rnnserve.service.config import Settings
from rnnserve.service.http.app import create_app


def stream_operation(settings: Settings) -> dict[str, Any]:
    with TestClient(create_app(settings)) as client:
        paths = client.get("/openapi.json").json()["paths"]
    operation: dict[str, Any] = paths["/models/{name}/stream"]["get"]
    return operation


def test_the_openapi_document_describes_the_stream_handshake_frames_and_close_codes() -> None:
    op = stream_operation(Settings(max_chunk_bytes=123_456, max_sessions=7))
    params = {p["name"]: p for p in op["parameters"]}
    assert params["name"]["in"] == "path"
    assert params["name"]["schema"]["enum"] == ["smoother", "traveller"]  # both carry state
    assert params["Upgrade"] == {
        "name": "Upgrade", "in": "header", "required": True, "schema": {"enum": ["websocket"]}
    }  # fmt: skip
    assert set(params) == {"name", "Upgrade", "Connection", "Sec-WebSocket-Version",
                           "Sec-WebSocket-Key"}  # fmt: skip
    assert list(op["responses"]) == ["101"]
    text = op["description"]
    for said in ('{"get_state": true}', "safetensors", "`overloaded`",
                 "- 1008: `unauthorized`", "- 1009: `body_too_large`: a frame over 123456 bytes",
                 "- 1013: `too_many_sessions` (7 open", "- 4408: `idle_timeout`",
                 "- 4000 + the HTTP status", "4404 `unknown_model`"):  # fmt: skip
        assert said in text, said
    assert "security" not in op  # no token, no padlock


def test_the_stream_path_asks_for_the_token_when_the_server_has_one() -> None:
    op = stream_operation(Settings(api_token=SecretStr("stream-token-1234")))
    assert op["security"] == [{"HTTPBearer": []}]
