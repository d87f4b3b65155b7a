"""The inference endpoints, once: from this table come the routes, the fast ASGI path, the
default model of each kind, the OpenAPI description and the Python client's paths.

Light on purpose (no torch, no FastAPI): the client imports it as well as the server.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Endpoint:
    """One ``POST`` inference endpoint.

    ``label`` is its ``endpoint`` label in the metrics (never the client's path: a model name
    in it would make a label series per client string); ``kind`` the model kind it serves by
    default (``None``: the model is named in the path); ``input_field`` and ``output_field``
    the JSON (and safetensors) names of the sequences in and out.
    """

    path: str
    label: str
    kind: str | None
    input_field: str
    output_field: str
    summary: str

    @property
    def names_model_in_path(self) -> bool:
        return "{name}" in self.path


SMOOTH = Endpoint(
    path="/smooth",
    label="smooth",
    kind="smoother",
    input_field="sequences",
    output_field="sequences",
    summary="Smooth N sequences with the smoother",
)
ROLLOUT = Endpoint(
    path="/rollout",
    label="rollout",
    kind="traveller",
    input_field="inputs",
    output_field="positions",
    summary="Roll the Traveller out over N sequences of exogenous inputs",
)
INFER = Endpoint(
    path="/models/{name}/infer",
    label="infer",
    kind=None,
    input_field="inputs",
    output_field="outputs",
    summary="Run any served model, named in the path, on N sequences",
)

INFERENCE = (SMOOTH, ROLLOUT, INFER)

# The Open Inference Protocol (KServe v2, Triton's HTTP/REST; docs/KSERVE.md): its own routes
# and codec (service/http/kserve.py), through the same runtime. Not in INFERENCE, whose
# endpoints share the native body formats, schemas and fast path.
KSERVE_INFER = Endpoint(
    path="/v2/models/{name}/infer",
    label="v2_infer",
    kind=None,
    input_field=INFER.input_field,
    output_field=INFER.output_field,
    summary="Open Inference Protocol: run a served model, named in the path",
)
KSERVE_MODEL = "/v2/models/{name}"
KSERVE_PREFIX = "/v2"  # every path of the protocol, and its clients' errors' form, is under it
KSERVE_MODEL_READY = "/v2/models/{name}/ready"

# a streaming session (docs/SESSIONS.md): a WebSocket whose chunks go through the same runtime
# and the same body formats as ``INFER``'s. Not in INFERENCE: no POST, no fast path, no schema.
STREAM = Endpoint(
    path="/models/{name}/stream",
    label="stream",
    kind=None,
    input_field=INFER.input_field,
    output_field=INFER.output_field,
    summary="Streaming session (WebSocket): chunks of steps in, their outputs out, the state "
    "carried between them",
)

# the ``endpoint`` label of every other route that counts its refusals (the bearer token)
OTHER_LABELS = {
    "/models": "models",
    "/metrics": "metrics",
    "/admin/reload": "admin",
    KSERVE_MODEL: "v2_models",
    KSERVE_MODEL_READY: "v2_models",
    KSERVE_INFER.path: KSERVE_INFER.label,
    STREAM.path: STREAM.label,
}


def tensor_names(kind: str) -> tuple[str, str]:
    """The input and output tensor names of a model of ``kind`` in the Open Inference
    Protocol: the JSON fields of its native endpoint (``sequences`` in and out for the
    smoother, ``inputs`` and ``positions`` for the Traveller, else ``inputs`` and ``outputs``)."""
    endpoint = native(kind) or INFER
    return endpoint.input_field, endpoint.output_field


def native(kind: str) -> Endpoint | None:
    """The endpoint that serves models of ``kind`` without naming them (``/smooth`` for the
    smoother), or ``None``: such models answer only at ``/models/{name}/infer``."""
    for endpoint in INFERENCE:
        if endpoint.kind == kind:
            return endpoint
    return None


def by_path(path: str) -> tuple[Endpoint, str | None] | None:
    """The endpoint a request path asks for, and the model named in it (if any)."""
    for endpoint in INFERENCE:
        if not endpoint.names_model_in_path:
            if path == endpoint.path:
                return endpoint, None
            continue
        head, _, tail = endpoint.path.partition("{name}")
        if path.startswith(head) and path.endswith(tail) and len(path) > len(head) + len(tail):
            name = path[len(head) : len(path) - len(tail)]
            if "/" not in name:
                return endpoint, name
    return None


def label(route_path: str) -> str:
    """The ``endpoint`` metric label of a route's path template; ``none`` for the rest."""
    for endpoint in INFERENCE:
        if endpoint.path == route_path:
            return endpoint.label
    return OTHER_LABELS.get(route_path, "none")
