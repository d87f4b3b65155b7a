"""The OpenAPI description of the Open Inference Protocol's routes
(:mod:`rnnserve.service.http.kserve`): its bodies as pydantic models, for the schema only (the
routes read their bodies by hand, as the protocol's codec)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from rnnserve.service.http import errors


class ProtocolError(BaseModel):
    """The protocol's error body."""

    error: str


class Tensor(BaseModel):
    name: str
    datatype: str = Field(
        description="FP32 (the sequences, the carried state's state.<part>) or INT64 (lengths)"
    )
    shape: list[int]
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data_size: the tensor's bytes after the JSON header"
    )
    data: list[Any] | None = Field(None, description="row-major values (nested or flat)")


class RequestedOutput(BaseModel):
    name: str
    parameters: dict[str, Any] | None = Field(
        None, description="binary_data: true sends this output as binary data"
    )


class InferRequest(BaseModel):
    id: str | None = None
    parameters: dict[str, Any] | None = Field(
        None,
        description="binary_data_output: true sends every output as binary data; "
        "return_state: true answers the final state's outputs state.<part>; state_model and "
        "state_version: the model and version that made the state inputs state.<part> "
        "(required with them)",
    )
    inputs: list[Tensor]
    outputs: list[RequestedOutput] | None = None


class InferResponse(BaseModel):
    model_name: str
    model_version: str | None = None
    id: str | None = None
    parameters: dict[str, str] | None = Field(
        None,
        description="with a final state: state_model and state_version, for the next request "
        "to send back with it",
    )
    outputs: list[Tensor]


class Live(BaseModel):
    live: bool


class Ready(BaseModel):
    ready: bool


class ServerMetadata(BaseModel):
    name: str
    version: str
    extensions: list[str]


class TensorMetadata(BaseModel):
    name: str
    datatype: str
    shape: list[int]
    optional: bool | None = Field(
        None,
        description="true: an input a request may leave out, an output that comes only in "
        "the flat layout (lengths) or when asked for (the carried state's state.<part>)",
    )


class ModelMetadata(BaseModel):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class ModelReady(BaseModel):
    name: str
    ready: bool


def _inline(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` put in place (an OpenAPI operation's own
    schema has nowhere to keep them)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref", "")
            if ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    result: dict[str, Any] = resolve(schema)
    return result


def error_responses(codes: tuple[int, ...]) -> dict[int | str, dict[str, Any]]:
    """The error answers of a route, in the protocol's form; 422 of the catalogue is a 400."""
    protocol = sorted({400 if code == 422 else code for code in codes})
    return {
        code: {"model": ProtocolError, "description": errors.describe_status(code)}
        for code in protocol
    }


HEALTH: dict[int | str, dict[str, Any]] = {
    200: {"model": Live | Ready},
    503: {"model": Ready, "description": "starting (models loading or warming up) or draining"},
}
METADATA: dict[int | str, dict[str, Any]] = {200: {"model": ServerMetadata}}
MODEL_METADATA: dict[int | str, dict[str, Any]] = {
    200: {"model": ModelMetadata},
    **error_responses((401, 404)),
}

INFER_SPEC: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "JSON; or, with the Inference-Header-Content-Length header, that many "
        "bytes of JSON then each input's binary data (docs/KSERVE.md)",
        "content": {"application/json": {"schema": _inline(InferRequest)}},
    },
    "responses": {
        "200": {
            "description": "the outputs; application/octet-stream (JSON header, then binary "
            "data) when any output was asked for as binary data",
            "content": {
                "application/json": {"schema": _inline(InferResponse)},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            },
        }
    },
}
