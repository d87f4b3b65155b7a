"""The OpenAPI description of the models actually served, and the docs pages, offline.

:func:`install` replaces FastAPI's ``/docs`` and ``/redoc`` (which load Swagger UI and ReDoc from
a CDN) with pages whose scripts and styles come from the ``fastapi-offline`` package, served
under ``/docs/assets``, so the docs work on a host without internet access. ``/openapi.json`` is
built once the models are loaded (:func:`refresh`, from the app's lifespan): the request
schemas carry the served models' feature counts, names and the configured limits, with
examples that succeed as given; each served model also has its own path
``/models/<name>/infer`` with its input and output widths. The 200 examples are the models' real
answers to those requests, computed at start-up (:mod:`rnnserve.service.examples`).
"""

from __future__ import annotations

import copy
import importlib.resources
import re
import urllib.parse
from collections.abc import Mapping
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

from rnnserve.service import endpoints, examples
from rnnserve.service.codec import bodies
from rnnserve.service.config import Settings, package_version
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH, STREAM
from rnnserve.service.http import defaults, errors, sessions
from rnnserve.service.http.routes import listing
from rnnserve.service.interface import ServedInfo, state_shapes
from rnnserve.service.metrics import CONTENT_TYPE

ASSETS = "/docs/assets"
OAUTH2_REDIRECT = "/docs/oauth2-redirect"
NDJSON = "application/x-ndjson"

TAGS = [
    {"name": "inference", "description": "Run the served models over batches of sequences."},
    {"name": "models", "description": "What is served, the default models and the settings."},
    {"name": "health", "description": "Liveness and readiness probes (never need a token)."},
    {"name": "metrics", "description": "Prometheus text exposition of rnnserve_* metrics."},
    {"name": "admin", "description": "Reload the model directory while serving."},
]
_PATH_TAGS = {
    **{e.path: "inference" for e in endpoints.INFERENCE},
    **{path: label for path, label in endpoints.OTHER_LABELS.items()},
    "/healthz": "health",
    "/readyz": "health",
}

# The status each error ``type`` comes with: the catalogue's.
ERROR_STATUS: dict[str, int] = {t: kind.status for t, kind in errors.CATALOGUE.items()}


def assets_dir() -> str:
    """The Swagger UI and ReDoc files bundled in the ``fastapi-offline`` package."""
    return str(importlib.resources.files("fastapi_offline") / "static")


def install(app: FastAPI) -> None:
    """Offline ``/docs`` and ``/redoc``, and ``/openapi.json`` built from the served models.

    Create the app with ``docs_url=None, redoc_url=None``; these pages replace FastAPI's.
    """
    app.mount(ASSETS, StaticFiles(directory=assets_dir()), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{app.openapi_url}",
            title="rnnserve - Swagger UI",
            swagger_js_url=f"{root}{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{root}{ASSETS}/favicon.png",
            oauth2_redirect_url=f"{root}{OAUTH2_REDIRECT}",
            swagger_ui_parameters={"defaultModelsExpandDepth": 0, "tryItOutEnabled": True},
        )

    @app.get(OAUTH2_REDIRECT, include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        from fastapi.openapi.docs import get_swagger_ui_oauth2_redirect_html

        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(
            openapi_url=f"{root}{app.openapi_url}",
            title="rnnserve - ReDoc",
            redoc_js_url=f"{root}{ASSETS}/redoc.standalone.js",
            redoc_favicon_url=f"{root}{ASSETS}/favicon.png",
            with_google_fonts=False,
        )

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        served: Mapping[str, ServedInfo] = app.state.runtime.models
        schema = build(app, served, app.state.settings)
        if served:  # loaded: this is the final description
            app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
    app.state.runtime.on_models_changed(lambda: _models_changed(app))


def _models_changed(app: FastAPI) -> None:
    """A reload changed the served models: describe the new ones at the next request."""
    app.openapi_schema = None


def refresh(app: FastAPI) -> None:
    """Rebuild ``/openapi.json`` now that the models are loaded (called from the lifespan)."""
    app.openapi_schema = None
    app.openapi()


def build(app: FastAPI, served: Mapping[str, ServedInfo], settings: Settings) -> dict[str, Any]:
    """The OpenAPI document of ``app`` serving ``served`` under ``settings``."""
    schema = get_openapi(
        title="rnnserve",
        version=package_version(),
        summary="Batched serving of recurrent sequence models",
        description=_description(served, settings),
        routes=app.routes,
        tags=TAGS,
    )
    for path, ops in schema.get("paths", {}).items():
        for op in ops.values():
            tag = _PATH_TAGS.get(path, "inference" if path.startswith("/models/") else None)
            if tag is not None and not op.get("tags"):
                op["tags"] = [tag]
            _error_descriptions(op)
    paths = schema.get("paths", {})
    for endpoint in (SMOOTH, ROLLOUT):
        if endpoint.path in paths and endpoint.kind is not None:
            op = paths[endpoint.path]["post"]
            fields = (endpoint.input_field, endpoint.output_field)
            _inference(op, endpoint.kind, *fields, served, settings)
    if ROLLOUT.path in paths:
        _ndjson(paths[ROLLOUT.path]["post"], served, settings)
    if INFER.path in paths:
        _infer_paths(paths, served, settings)
    # FastAPI leaves WebSocket routes out of the document
    paths[STREAM.path] = {"get": _stream_operation(served, settings)}
    if settings.bearer_token() is None:
        _without_security(schema)
    if "/metrics" in paths:
        _metrics(paths["/metrics"]["get"])
    if "/readyz" in paths:
        paths["/readyz"]["get"]["responses"]["503"] = {
            "description": "starting (models loading or warming up) or draining",
            "content": {"application/json": {"example": {"status": "not ready"}}},
        }
    if "/models" in paths:
        _models(paths["/models"]["get"], served, settings)
    result: dict[str, Any] = _plain(schema)
    return result


# -- pieces ------------------------------------------------------------------------------------


def _description(served: Mapping[str, ServedInfo], settings: Settings) -> str:
    lines = [
        "Clients POST variable-length numeric sequences; concurrent requests are packed into "
        "one batch, run once, and every caller gets its own rows back.",
        "",
        "Bodies are JSON, or safetensors (`Content-Type: application/x-safetensors`: a float32 "
        "tensor of the sequences one after another and an int64 tensor `lengths`); ask for a "
        "binary answer with `Accept: application/x-safetensors`, for a streamed rollout with "
        "`Accept: application/x-ndjson`. Errors are always JSON: `detail`, `type`, `loc`.",
        "",
        "Served models:",
        "",
    ]
    for name in sorted(served):
        m = served[name]
        lines.append(f"- `{name}`: {m.kind}, {m.input_dim} input features")
    if not served:
        lines.append("- (none loaded yet)")
    lines += [
        "",
        f"Limits: at most {settings.max_sequences_per_request} sequences per request, "
        f"{settings.max_sequence_length} steps per sequence, "
        f"{settings.max_request_timesteps} steps per request and "
        f"{settings.max_request_bytes} bytes per body (413 above).",
    ]
    if settings.bearer_token() is not None:
        guarded = [e.path for e in endpoints.INFERENCE[:2]] + list(endpoints.OTHER_LABELS)
        lines += ["", "This server needs `Authorization: Bearer <token>` on "
                  f"{', '.join(guarded[:-1])} and {guarded[-1]}."]  # fmt: skip
    return "\n".join(lines)


def _without_security(schema: dict[str, Any]) -> None:
    """No token, no padlocks: ``/docs`` shows no Authorize button when nothing needs one."""
    schema.get("components", {}).pop("securitySchemes", None)
    for ops in schema.get("paths", {}).values():
        for op in ops.values():
            op.pop("security", None)


def _error_descriptions(op: dict[str, Any]) -> None:
    """Each error response, FastAPI's own too, says which ``type`` values come with its status
    and what each means."""
    for status, response in op.get("responses", {}).items():
        if status.isdigit() and int(status) >= 400 and errors.types_of(int(status)):
            response["description"] = errors.describe_status(int(status))


def _example(m: ServedInfo) -> dict[str, Any] | None:
    """The model's documented request and its real answer, if the runtime computed it."""
    example = m.info.get("example")
    return example if isinstance(example, dict) else None


def _answer_examples(
    out_field: str, requests: dict[str, tuple[str, str]], served: Mapping[str, ServedInfo]
) -> dict[str, Any]:
    """200 examples named like the request examples: each the model's real answer."""
    answers: dict[str, Any] = {}
    for key, (name, summary) in requests.items():
        example = _example(served[name])
        if example is not None:
            answers[key] = {
                "summary": summary,
                "value": {"model": name, out_field: example["outputs"]},
            }
    return answers


def _timeout_headers(op: dict[str, Any], settings: Settings) -> None:
    params = op.setdefault("parameters", [])
    params += [
        {
            "name": "X-Request-Timeout",
            "in": "header",
            "required": False,
            "description": "Seconds this request may take; can only shorten the server's "
            f"request_timeout_s ({settings.request_timeout_s:g} s). 504 after.",
            "schema": {"type": "number", "exclusiveMinimum": 0},
        },
        {
            "name": "X-Request-Id",
            "in": "header",
            "required": False,
            "description": "Your id for this request (printable ASCII, up to 128 characters); "
            "echoed back and written in the server's log. Generated when absent.",
            "schema": {"type": "string", "maxLength": 128},
        },
    ]


def _width_text(kind: str, of_kind: dict[str, int], default: str | None, width: int | None) -> str:
    """How many numbers a step of ``kind``'s endpoint holds, in words."""
    what = "features" if kind == "smoother" else "exogenous inputs"
    per_model = ", ".join(f"{name}: {dim}" for name, dim in of_kind.items())
    if len(set(of_kind.values())) > 1:
        shown = f" (the schema shows the default model {default}'s)" if default else ""
        return f"the model's number of {what} ({per_model}){shown}"
    if width is not None:
        return f"{width} {what}"
    return f"the model's number of {what}"


def _request_examples(
    field: str, of_kind: dict[str, int], default: str | None
) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """The request examples (one for the default model, one per model of the kind) and, per
    example, the model that answers it and its answer's summary."""
    requests: dict[str, Any] = {}
    answered: dict[str, tuple[str, str]] = {}  # example name -> (model, summary)
    steps_text = " and ".join(str(n) for n in examples.LENGTHS)
    if default is not None:
        summary = f"two sequences ({steps_text} steps) for the default model {default}"
        requests["default model"] = {
            "summary": summary,
            "value": {field: examples.example_inputs(of_kind[default])},
        }
        answered["default model"] = (default, f"{default}'s answer")
    for name, dim in of_kind.items():
        requests[f"model {name}"] = {
            "summary": f"two sequences ({steps_text} steps) for {name}",
            "value": {field: examples.example_inputs(dim), "model": name},
        }
        answered[f"model {name}"] = (name, f"{name}'s answer")
    return requests, answered


def _inference(
    op: dict[str, Any],
    kind: str,
    field: str,
    out_field: str,
    served: Mapping[str, ServedInfo],
    settings: Settings,
) -> None:
    """Feature counts, model names, limits and examples for ``POST /smooth`` or ``/rollout``."""
    of_kind = {name: m.input_dim for name, m in sorted(served.items()) if m.kind == kind}
    default = defaults.default_model(served, kind, settings)
    if default not in of_kind:
        default = None
    content = op["requestBody"]["content"]
    body = content["application/json"]["schema"]
    seqs = body["properties"][field]
    steps = seqs["items"]
    step = steps["items"]
    seqs["maxItems"] = settings.max_sequences_per_request
    steps["maxItems"] = settings.max_sequence_length
    widths = set(of_kind.values())
    width = of_kind[default] if default is not None else None
    if len(widths) == 1:
        width = next(iter(widths))
    if width is not None:
        step["minItems"] = step["maxItems"] = width
    width_text = _width_text(kind, of_kind, default, width)
    seqs["description"] = (
        f"N sequences (1 to {settings.max_sequences_per_request}), each a list of T_i steps "
        f"(1 to {settings.max_sequence_length}; at most {settings.max_request_timesteps} steps "
        f"in the whole request), each step a list of {width_text}."
    )
    if default is not None:
        choose = f"Optional: without it, {default} is used."
    elif of_kind:
        choose = (
            f"Required: several {kind} models are served and none is the default "
            f"(--default-{kind})."
        )
    else:
        choose = f"No {kind} model is served: every request gets 404 unknown_model."
    body["properties"]["model"] = {
        "type": "string",
        "enum": list(of_kind),
        "title": "Model",
        "description": f"Served {kind} model to run. {choose}",
    }
    body["description"] = (
        f"N sequences of T_i steps of {width_text} each, and optionally the model's name."
    )
    body["title"] = body.get("title", "Request")
    requests, answered = _request_examples(field, of_kind, default)
    if requests:
        content["application/json"]["examples"] = requests
    content[bodies.SAFETENSORS]["schema"]["description"] = (
        f"a safetensors file: float32 tensor '{field}' [sum T_i, {width or 'F'}] (the sequences "
        "one after another), int64 tensor 'lengths' [N], optional metadata 'model'"
    )
    op["description"] = (
        f"Runs a {kind} model over N sequences at once; concurrent requests share batches. "
        f"Send JSON or safetensors; the answer is JSON unless Accept asks for "
        f"application/x-safetensors"
        + (" or application/x-ndjson (streamed positions)." if kind == "traveller" else ".")
    )
    ok = op["responses"]["200"]
    answers = _answer_examples(out_field, answered, served)
    if answers:
        ok["content"]["application/json"]["examples"] = answers
    ok["description"] = (
        f"one output sequence per input sequence, in order ({out_field}); the examples are "
        "the served models' real answers to the request examples"
    )
    _binary_answer(op, out_field)
    _timeout_headers(op, settings)


def _infer_paths(
    paths: dict[str, Any], served: Mapping[str, ServedInfo], settings: Settings
) -> None:
    """``POST /models/{name}/infer`` with the limits, and one path per served model with its
    own input and output widths, an example request and its real answer."""
    in_field, out_field = INFER.input_field, INFER.output_field
    generic = paths[INFER.path]["post"]
    inputs = generic["requestBody"]["content"]["application/json"]["schema"]["properties"]
    inputs[in_field]["maxItems"] = settings.max_sequences_per_request
    inputs[in_field]["items"]["maxItems"] = settings.max_sequence_length
    names = sorted(served)
    generic["parameters"][0]["description"] = (
        f"a served model: {', '.join(names) or 'none yet'}; each also has its own path "
        "/models/<name>/infer below, with its widths and an example"
    )
    generic["description"] = (
        "Runs any served model (smoothers, Travellers, your own recurrent and TorchScript "
        "models) over N sequences at once; concurrent requests share batches. Send JSON or "
        f"safetensors (tensors '{in_field}' and 'lengths'); the answer is JSON unless Accept asks "
        "for application/x-safetensors."
    )
    _binary_answer(generic, out_field)
    _timeout_headers(generic, settings)
    taken = {op.get("operationId") for ops in paths.values() for op in ops.values()}
    for name in names:
        op = _model_path(generic, name, served[name], settings, taken)
        paths[f"/models/{urllib.parse.quote(name, safe='')}/infer"] = {"post": op}


def _answer_schema(name: str, out_field: str, out_width: Any) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "type": "object",
        "title": f"{name} answer",
        "properties": {
            "model": {"type": "string", "enum": [name]},
            out_field: {
                "type": "array",
                "description": f"N sequences, each [T_i][{out_width or 'outputs'}] numbers",
                "items": {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "number"}},
                },
            },
        },
        "required": ["model", out_field],
    }
    if isinstance(out_width, int):
        step = answer["properties"][out_field]["items"]["items"]
        step["minItems"] = step["maxItems"] = out_width
    return answer


def _model_path(
    generic: dict[str, Any], name: str, m: ServedInfo, settings: Settings, taken: set[Any]
) -> dict[str, Any]:
    """The ``POST /models/<name>/infer`` of one served model: its widths, example, answer."""
    in_field, out_field = INFER.input_field, INFER.output_field
    op = copy.deepcopy(generic)
    op["parameters"] = [p for p in op["parameters"] if p.get("in") != "path"]
    op_id = "infer_" + re.sub(r"\W", "_", name)
    while op_id in taken:
        op_id += "_"
    taken.add(op_id)
    op["operationId"] = op_id
    shapes = m.info.get("shapes", {})
    out_width = shapes.get("output", [None, None])[1] if isinstance(shapes, dict) else None
    out_text = f"{out_width} outputs" if isinstance(out_width, int) else "its outputs"
    op["summary"] = f"Run {name} ({m.kind}: {m.input_dim} features -> {out_text} per step)"
    op["description"] = (
        f"Runs the {m.kind} model {name} over N sequences of {m.input_dim} features per "
        f"step; the answer holds one sequence of {out_text} per step for each. "
        + generic["description"].split(" at once; ", 1)[1]
    )
    body = op["requestBody"]["content"]["application/json"]
    schema = body["schema"]
    schema["description"] = f"N sequences of T_i steps of {m.input_dim} features each."
    seqs = schema["properties"][in_field]
    seqs["items"]["items"]["minItems"] = seqs["items"]["items"]["maxItems"] = m.input_dim
    seqs["description"] = (
        f"N sequences (1 to {settings.max_sequences_per_request}), each a list of T_i steps "
        f"(1 to {settings.max_sequence_length}; at most {settings.max_request_timesteps} "
        f"steps in the whole request), each step a list of {m.input_dim} numbers."
    )
    schema["properties"]["model"] = {
        "type": "string",
        "enum": [name],
        "title": "Model",
        "description": "Optional; if given, it must be this path's model.",
    }
    steps_text = " and ".join(str(n) for n in examples.LENGTHS)
    summary = f"two sequences ({steps_text} steps) of {m.input_dim} features"
    body["examples"] = {
        "example": {
            "summary": summary,
            "value": {in_field: examples.example_inputs(m.input_dim)},
        }
    }
    binary = op["requestBody"]["content"][bodies.SAFETENSORS]["schema"]
    binary["description"] = (
        f"a safetensors file: float32 tensor '{in_field}' [sum T_i, {m.input_dim}] (the "
        "sequences one after another), int64 tensor 'lengths' [N]"
    )
    ok = op["responses"]["200"]
    answer = _answer_schema(name, out_field, out_width)
    ok["content"]["application/json"] = {"schema": answer}
    example = _example(m)
    if example is not None:
        ok["content"]["application/json"]["examples"] = {
            "example": {
                "summary": f"{name}'s answer to the request example",
                "value": {"model": name, out_field: example["outputs"]},
            }
        }
    ok["description"] = (
        "one output sequence per input sequence, in order; the example is the model's real "
        "answer to the request example"
    )
    return op


def _stream_operation(served: Mapping[str, ServedInfo], settings: Settings) -> dict[str, Any]:
    """``GET /models/{name}/stream``: the WebSocket handshake of a streaming session, its
    frames and its close codes (docs/SESSIONS.md)."""
    carrying = sorted(name for name, m in served.items() if state_shapes(m))
    name_schema: dict[str, Any] = {"type": "string"}
    if carrying:
        name_schema["enum"] = carrying
    return {
        "tags": ["inference"],
        "summary": STREAM.summary,
        "description": _stream_description(settings),
        "operationId": "stream_session",
        "parameters": [
            {
                "name": "name",
                "in": "path",
                "required": True,
                "schema": name_schema,
                "description": "A served model that carries state (a smoother, a Traveller, a "
                "recurrent model).",
            },
            _handshake_header("Upgrade", "websocket"),
            _handshake_header("Connection", "Upgrade"),
            _handshake_header("Sec-WebSocket-Version", "13"),
            {
                "name": "Sec-WebSocket-Key",
                "in": "header",
                "required": True,
                "schema": {"type": "string"},
                "description": "The client's random key, base64 (RFC 6455).",
            },
        ],
        "responses": {
            "101": {
                "description": "Switching Protocols: the session is open. A session refused "
                "after the handshake (token, readiness, model, max_sessions) is closed at once "
                "with its close code.",
                "headers": {
                    "Upgrade": {"schema": {"type": "string", "enum": ["websocket"]}},
                    "Sec-WebSocket-Accept": {"schema": {"type": "string"}},
                },
            }
        },
        "security": [{"HTTPBearer": []}],
    }


def _handshake_header(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "in": "header", "required": True, "schema": {"enum": [value]}}


def _stream_description(settings: Settings) -> str:
    closes = [
        (sessions.NORMAL, "the client closed the session"),
        (sessions.POLICY_VIOLATION, "`unauthorized`: no bearer token or a wrong one, when the "
         "server has one (`Authorization: Bearer <token>` at the handshake)"),
        (sessions.MESSAGE_TOO_BIG, f"`body_too_large`: a frame over {settings.max_chunk_bytes} "
         "bytes (max_chunk_bytes)"),
        (sessions.TRY_AGAIN_LATER, f"`too_many_sessions` ({settings.max_sessions} open: "
         "max_sessions) or `not_ready`: try again later"),
        (sessions.IDLE_TIMEOUT, f"`idle_timeout`: nothing came within "
         f"{settings.session_idle_timeout_s:g} s (session_idle_timeout_s)"),
    ]  # fmt: skip
    lines = [
        "A WebSocket (RFC 6455) to one served model: the client sends chunks of steps, the "
        "server answers each with its outputs and carries the recurrent state to the next "
        "chunk. Chunks share the batchers with HTTP requests.",
        "",
        "Frames, answered one by one in order:",
        "",
        f'- a text frame `{{"{STREAM.input_field}": [[[...step...], ...], ...]}}`: the next '
        f"piece of each of the session's N sequences, a body of `POST {INFER.path}`; answered "
        f'with a text frame `{{"model": ..., "{STREAM.output_field}": [...]}}`',
        f"- a binary frame: the same in safetensors (float32 `{STREAM.input_field}` "
        f"[sum T_i, F], int64 `lengths` [N]); answered in safetensors (`{STREAM.output_field}`, "
        "`lengths`)",
        "- the first chunk may add `state` (binary: `state.<part>` tensors and metadata "
        "`state_model`, `state_version`) to continue a stream begun elsewhere",
        '- a text frame `{"get_state": true}`: answered with `{"state": ...}`, the state '
        "after the last chunk (`null` before the first)",
        "",
        "A chunk with bad input, or one the server has no room for (`overloaded`), is answered "
        'with a text frame `{"error": {"detail": ..., "type": ..., "loc": [...]}, '
        '"status": ...}` '
        "and the session stays open, its state as before that chunk.",
        "",
        'Close codes, with a JSON reason `{"type": ..., "detail": ...}`:',
        "",
    ]
    lines += [f"- {code}: {text}" for code, text in closes]
    lines.append(
        "- 4000 + the HTTP status of the error type: 4404 `unknown_model`, 4409 "
        "`state_mismatch` (a reload replaced the model under the session), 4422 "
        "`cannot_carry_state`"
    )
    return "\n".join(lines)


def _binary_answer(op: dict[str, Any], out_field: str) -> None:
    ok = op["responses"]["200"]
    ok.setdefault("content", {})[bodies.SAFETENSORS] = {
        "schema": {
            "type": "string",
            "format": "binary",
            "description": f"with Accept: application/x-safetensors: tensors '{out_field}' "
            "[sum T_i, outputs] (float32) and 'lengths' [N] (int64)",
        }
    }
    ok["headers"] = {
        "X-Request-Id": {"description": "the request's id", "schema": {"type": "string"}}
    }


def _ndjson(op: dict[str, Any], served: Mapping[str, ServedInfo], settings: Settings) -> None:
    line = {
        "oneOf": [
            {
                "type": "object",
                "title": "Chunk",
                "properties": {
                    "sequence": {"type": "integer", "description": "index of the sequence"},
                    "start": {"type": "integer", "description": "step of the first position"},
                    "positions": {
                        "type": "array",
                        "items": {
                            "type": "array",
                            "items": {"type": "number"},
                            "minItems": 2,
                            "maxItems": 2,
                        },
                    },
                },
                "required": ["sequence", "start", "positions"],
            },
            {
                "type": "object",
                "title": "Done",
                "properties": {"model": {"type": "string"}, "done": {"const": True}},
                "required": ["model", "done"],
            },
            {
                "type": "object",
                "title": "Error",
                "properties": {"error": {"type": "object"}},
                "required": ["error"],
            },
        ],
        "description": "with Accept: application/x-ndjson, one JSON object per line: a chunk "
        "of positions per sequence per chunk of steps, then a done line (or an error line if "
        "the rollout failed or its deadline passed)",
    }
    media: dict[str, Any] = {"schema": line}
    default = defaults.default_model(served, "traveller", settings)
    example = _example(served[default]) if default is not None and default in served else None
    if example is not None:  # the real stream of the default model's answer
        k = settings.rollout_chunk_steps
        outputs = example["outputs"]
        lines = [
            orjson.dumps({"sequence": i, "start": start, "positions": y[start : start + k]})
            for start in range(0, max(map(len, outputs)), k)
            for i, y in enumerate(outputs)
            if start < len(y)
        ]
        lines.append(orjson.dumps({"model": default, "done": True}))
        media["example"] = b"".join(line + b"\n" for line in lines).decode()
    op["responses"]["200"]["content"][NDJSON] = media


def _metrics(op: dict[str, Any]) -> None:
    op["description"] = (
        f"Prometheus text exposition (Content-Type: {CONTENT_TYPE.strip()}); every metric is "
        "named rnnserve_*."
    )
    op["responses"]["200"] = {
        "description": "the metrics in Prometheus text format",
        "content": {
            "text/plain": {
                "schema": {"type": "string"},
                "example": "# HELP rnnserve_requests_in_flight Requests being handled now.\n"
                "# TYPE rnnserve_requests_in_flight gauge\n"
                'rnnserve_requests_in_flight{endpoint="smooth"} 0.0\n',
            }
        },
    }


def _models(op: dict[str, Any], served: Mapping[str, ServedInfo], settings: Settings) -> None:
    op["description"] = (
        "The served models (name, kind, config, shapes, parameter count, device), which model "
        "each endpoint uses when a request names none, and the effective settings (secrets "
        "shown as asterisks, never their value)."
    )
    example = {
        "models": [listing(served[name]) for name in sorted(served)],
        "defaults": {
            path: defaults.default_model(served, kind, settings)
            for kind, path in defaults.ENDPOINT.items()
        },
        "settings": settings.public(),
    }
    ok = op["responses"]["200"]
    ok["description"] = "what is served"
    ok.setdefault("content", {}).setdefault("application/json", {})["example"] = copy.deepcopy(
        example
    )


# -- plain text --------------------------------------------------------------------------------

_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain(text: str) -> str:
    """reStructuredText roles and literals as Markdown code: ``x`` -> `x`, :class:`~a.B` -> `B`."""
    return _LITERAL.sub(r"`\1`", _ROLE.sub(r"`\1`", text))


def _plain(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: plain(v) if k in ("description", "summary") and isinstance(v, str) else _plain(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_plain(v) for v in node]
    return node
