"""The Open Inference Protocol (KServe v2, Triton's HTTP/REST) with its binary tensor data
extension: health, metadata and inference, so that clients of that protocol (Triton's
``tritonclient.http`` among them) work against rnnserve. docs/KSERVE.md describes it.

An inference request takes the steps of a native one
(:mod:`rnnserve.service.http.inference`: admission, the byte budget, the deadline, the same
runtime and batchers, the same metrics, the same check of a carried state); only its body's
codec (:mod:`rnnserve.service.codec.kserve_binary`) and its error form, ``{"error": "..."}``,
are the protocol's own.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials

from rnnserve.service import endpoints
from rnnserve.service.codec import kserve_binary
from rnnserve.service.codec.bodies import STATE_PREFIX
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.config import package_version
from rnnserve.service.endpoints import KSERVE_INFER, KSERVE_MODEL, KSERVE_MODEL_READY
from rnnserve.service.http import errors, inference
from rnnserve.service.http.auth import bearer, check_token
from rnnserve.service.http.kserve_openapi import (
    HEALTH,
    INFER_SPEC,
    METADATA,
    MODEL_METADATA,
    error_responses,
)
from rnnserve.service.http.outcomes import ClientGone, DeadlineExceeded
from rnnserve.service.http.responses import BuffersResponse, json_response
from rnnserve.service.interface import (
    RequestError,
    Runtime,
    ServedInfo,
    UnknownModel,
    quote,
    state_shapes,
)

router = APIRouter()
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]
BINARY = "application/octet-stream"
EXTENSIONS = ["binary_tensor_data"]
# the protocol's paths that name a version too: the one served, else 404 (not in /openapi.json:
# the same operations as those without it)
VERSION = "/versions/{version}"


def protocol_status(error_type: str) -> int:
    """The catalogue's status for ``error_type``; the protocol answers bad input with 400,
    where the native endpoints say 422."""
    code = errors.status(error_type)
    return 400 if code == 422 else code


def protocol_error(exc: RequestError, headers: dict[str, str] | None = None) -> Response:
    """``exc`` in the protocol's form: ``{"error": message}``, bounded like every error body."""
    code = protocol_status(exc.type)
    extra = dict(headers or {})
    if code == 401:
        extra["WWW-Authenticate"] = "Bearer"
    elif code == 503:
        extra["Retry-After"] = "1"
    message = quote(exc.message, errors.DETAIL_CHARS)
    return json_response({"error": message}, code, extra)


def _as_protocol_error(native: Response) -> Response:
    """A native error answer (``{"detail", "type", "loc"}``) in the protocol's form."""
    if not native.body:  # a 499: nobody reads it
        return native
    doc = orjson.loads(native.body)
    headers = {
        k: v for k, v in native.headers.items() if k not in ("content-length", "content-type")
    }
    exc = RequestError(doc["type"], doc["detail"])
    return protocol_error(exc, headers)


def _authorize(request: Request, credentials: Credentials, route: str) -> None:
    check_token(request, credentials, endpoints.label(route))


def _served(request: Request, name: str) -> ServedInfo:
    runtime: Runtime = request.app.state.runtime
    try:
        return runtime.get(name)
    except UnknownModel as exc:  # the runtime's message, as the inference routes say it
        raise RequestError("unknown_model", str(exc)) from None


def _of_version(served: ServedInfo, version: str | None) -> ServedInfo:
    """``served``, when ``version`` (the path's, if it names one) is the one it serves."""
    if version is not None and version != served.version:
        raise RequestError(
            "unknown_model",
            f"model '{served.name}' serves version '{served.version}', not '{quote(version)}'",
        )  # fmt: skip
    return served


def _is_ready(request: Request) -> bool:
    return bool(request.app.state.ready and request.app.state.runtime.available)


# -- health and metadata ------------------------------------------------------------------------


@router.get(
    "/v2/health/live",
    summary="Open Inference Protocol liveness: 200 while the process runs",
    responses=HEALTH,
    tags=["health"],
)
async def live() -> Response:
    return json_response({"live": True})


@router.get(
    "/v2/health/ready",
    summary="Open Inference Protocol readiness: 200 once models are warm, 503 before and while "
    "draining",
    responses=HEALTH,
    tags=["health"],
)
async def ready(request: Request) -> Response:
    if _is_ready(request):
        return json_response({"ready": True})
    return json_response({"ready": False}, 503)


@router.get(
    "/v2",
    summary="Open Inference Protocol server metadata: name, version, extensions",
    responses=METADATA,
    tags=["models"],
)
async def server_metadata() -> Response:
    return json_response(
        {"name": "rnnserve", "version": package_version(), "extensions": EXTENSIONS}
    )


@router.get(
    KSERVE_MODEL,
    summary="Open Inference Protocol model metadata: its tensors' names, datatypes and shapes",
    responses=MODEL_METADATA,
    tags=["models"],
)
async def model_metadata(request: Request, name: str, credentials: Credentials) -> Response:
    return _model_metadata(request, name, None, credentials)


@router.get(KSERVE_MODEL + VERSION, include_in_schema=False)
async def version_metadata(
    request: Request, name: str, version: str, credentials: Credentials
) -> Response:
    return _model_metadata(request, name, version, credentials)


def _model_metadata(
    request: Request, name: str, version: str | None, credentials: Credentials
) -> Response:
    try:
        _authorize(request, credentials, KSERVE_MODEL)
        return json_response(metadata(_of_version(_served(request, name), version)))
    except RequestError as exc:
        return protocol_error(exc)


@router.get(
    KSERVE_MODEL_READY,
    summary="Open Inference Protocol model readiness: 200 when it is served and warm",
    responses=error_responses((401, 404, 503)),
    tags=["models"],  # it needs the token, as the model list does
)
async def model_ready(request: Request, name: str, credentials: Credentials) -> Response:
    return _model_ready(request, name, None, credentials)


@router.get(KSERVE_MODEL + VERSION + "/ready", include_in_schema=False)
async def version_ready(
    request: Request, name: str, version: str, credentials: Credentials
) -> Response:
    return _model_ready(request, name, version, credentials)


def _model_ready(
    request: Request, name: str, version: str | None, credentials: Credentials
) -> Response:
    try:
        _authorize(request, credentials, KSERVE_MODEL_READY)
        served = _of_version(_served(request, name), version)
    except RequestError as exc:
        return protocol_error(exc)
    ready = _is_ready(request)
    return json_response({"name": served.name, "ready": ready}, 200 if ready else 503)


def metadata(m: ServedInfo) -> dict[str, Any]:
    """A model's metadata: the batched form of its tensors (``-1``: any size), then, marked
    ``"optional": true``, ``lengths`` and the carried state's parts ``state.<part>``, each an
    input a request may leave out and an output that comes only in the flat layout or when
    asked for; the flat form (``[sum T, F]`` with ``lengths``) is described in docs/KSERVE.md."""
    in_name, out_name = endpoints.tensor_names(m.kind)
    shapes = m.info.get("shapes", {})
    out_width = shapes.get("output", [None, None])[1] if isinstance(shapes, dict) else None
    optional = [_optional(kserve_binary.LENGTHS, kserve_binary.INT64, [-1])]
    for part, dims in (state_shapes(m) or {}).items():
        optional.append(_optional(STATE_PREFIX + part, kserve_binary.FP32, [-1, *dims]))
    return {
        "name": m.name,
        "versions": [m.version],
        "platform": f"rnnserve_{m.kind}",
        "inputs": [
            {"name": in_name, "datatype": "FP32", "shape": [-1, -1, m.input_dim]},
            *optional,
        ],
        "outputs": [
            {"name": out_name, "datatype": "FP32", "shape": [-1, -1, _size(out_width)]},
            *optional,
        ],
    }


def _optional(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
    return {"name": name, "datatype": datatype, "shape": shape, "optional": True}


def _size(width: Any) -> int:
    return width if isinstance(width, int) else -1


# -- inference ----------------------------------------------------------------------------------


@router.post(
    KSERVE_INFER.path,
    summary=KSERVE_INFER.summary,
    openapi_extra=INFER_SPEC,
    responses=error_responses(errors.INFERENCE_STATUSES),
    tags=["inference"],
)
async def infer(request: Request, name: str, credentials: Credentials) -> Response:
    try:
        _authorize(request, credentials, KSERVE_INFER.path)
    except RequestError as exc:
        return protocol_error(exc)
    return await serve(request, name)


@router.post(KSERVE_MODEL + VERSION + "/infer", include_in_schema=False)
async def version_infer(
    request: Request, name: str, version: str, credentials: Credentials
) -> Response:
    try:
        _authorize(request, credentials, KSERVE_INFER.path)
    except RequestError as exc:
        return protocol_error(exc)
    return await serve(request, name, version)


async def serve(request: Request, name: str, version: str | None = None) -> Response:
    """One inference request, through the native steps with the protocol's codec."""
    call = inference.begin_call(request, KSERVE_INFER, name)
    try:
        inference.admit(call)
        model, served = inference.choose_model(call, None)  # named in the path: 404 first
        _of_version(served, version)
        with call.trace.step("read body"):
            body = await inference.read_request_body(call)
        with call.trace.step("decode"):
            parsed = await _decode(call, body)
            in_name, out_name = endpoints.tensor_names(served.kind)
            limits = inference.limits_of(call.state.settings)
            seqs, layout = kserve_binary.sequences(parsed, in_name, served.input_dim, limits, model)
            call.sequences = seqs
            asked = kserve_binary.state_asked(parsed)
            call.sequences = inference.carry_state(seqs, asked, model, served)
        outputs = await _run(call, model)
        with call.trace.step("encode"):
            tensors = kserve_binary.answer_tensors(outputs, layout, out_name)
            chosen = kserve_binary.chosen_outputs(parsed, tensors)
            params = kserve_binary.state_parameters(outputs.state)
            return await _respond(call, served, parsed.id, chosen, params)
    except (ClientGone, DeadlineExceeded, RequestError) as exc:
        return _as_protocol_error(inference.refuse(call, exc))
    except Exception as exc:
        mapped = inference.as_request_error(exc, call)
        native = (
            inference.refuse(call, mapped)
            if mapped is not None
            else inference.internal_error(call, exc)
        )
        return _as_protocol_error(native)
    finally:
        inference.account(call)
        call.trace.end(call.code, call.error)


async def _decode(call: inference.Call, body: bytes) -> kserve_binary.Request:
    request = call.request
    inference.refuse_compressed(call)
    codec: CodecPool = call.state.codec
    header_length = request.headers.get(kserve_binary.HEADER_LENGTH)
    return await codec.run(len(body), kserve_binary.decode_request, body, header_length)


async def _run(call: inference.Call, model: str) -> Any:
    if time.perf_counter() >= call.deadline:  # reading and parsing took it all: never queued
        raise DeadlineExceeded
    runtime: Runtime = call.state.runtime
    call.running = True
    work = runtime.infer(model, call.sequences)
    with call.trace.engine_call():
        outputs = await inference.unless_disconnected(call.request, work, call.deadline)
    return outputs


async def _respond(
    call: inference.Call,
    served: ServedInfo,
    rid: str | None,
    chosen: list[tuple[kserve_binary.Tensor, bool]],
    parameters: dict[str, str] | None,
) -> Response:
    codec: CodecPool = call.state.codec
    size = sum(t.array.nbytes * (1 if binary else 3) for t, binary in chosen)
    parts, header_length = await codec.run(
        size, kserve_binary.encode_answer, served.name, served.version, rid, chosen, parameters
    )
    call.code = 200
    if header_length is None:
        return Response(parts[0], media_type="application/json", headers=call.headers)
    response = BuffersResponse(parts, media_type=BINARY)
    response.headers.update(call.headers)
    response.headers[kserve_binary.HEADER_LENGTH] = str(header_length)
    return response
