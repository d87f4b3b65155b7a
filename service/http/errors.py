"""Every error ``type`` a client can receive, once: its HTTP status, a title and when it comes.

Lower layers raise :class:`~rnnserve.service.interface.RequestError` with a ``type`` only; this
table gives it its status. The routes' OpenAPI responses, the error body's ``type`` enum and the
descriptions in ``/openapi.json`` all come from it (docs/API.md lists it too; a test compares).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rnnserve.service.interface import RequestError, quote


@dataclass(frozen=True)
class ErrorKind:
    status: int
    title: str
    description: str


def _kinds(status: int, title: str, **descriptions: str) -> dict[str, ErrorKind]:
    return {name: ErrorKind(status, title, text) for name, text in descriptions.items()}


CATALOGUE: dict[str, ErrorKind] = {
    **_kinds(
        400, "the body or a header cannot be read",
        invalid_json="the body is not JSON",
        invalid_http="the request is not valid HTTP/1.1 (its line, a header or its framing)",
        invalid_safetensors="a binary body that is not a safetensors file",
        invalid_header="X-Request-Timeout is not a positive number of seconds, the body has a "
        "Content-Encoding, or a /v2 request's Inference-Header-Content-Length cannot be used",
    ),
    **_kinds(
        401, "a bearer token is required (when the server has one) and was missing or wrong",
        unauthorized="the request had no bearer token or a wrong one",
    ),
    **_kinds(404, "no such model", unknown_model="no served model has that name"),
    **_kinds(
        409, "a carried state made by another model or model version",
        state_mismatch="the state's model or version is not the model's that serves it now",
    ),
    **_kinds(
        409, "the model changed after the request was checked against it",
        model_changed="a reload changed the model's input width while the request was on "
        "its way; send it again",
    ),
    **_kinds(
        408, "the body (or the request head) did not arrive in time",
        body_timeout="the body did not arrive within body_timeout_s",
        header_timeout="the request line and headers did not arrive within header_timeout_s",
    ),
    **_kinds(
        413, "request over a configured limit",
        body_too_large="the body is over max_request_bytes",
        too_many_sequences="more sequences than max_sequences_per_request",
        sequence_too_long="a sequence longer than max_sequence_length",
        too_many_timesteps="more steps in all than max_request_timesteps",
    ),
    **_kinds(
        422, "input of the wrong shape or values",
        invalid_request="a malformed request of another kind",
        invalid_body="the body is JSON but not an object",
        empty="no sequences, a sequence without steps or a step without features",
        missing="a required field or tensor is missing",
        unknown_field="a field or tensor the endpoint does not take",
        wrong_shape="wrong nesting of the sequences",
        wrong_dtype="a binary tensor that is not float32 (sequences) or int64 (lengths)",
        string_type="'model' is not a string",
        wrong_lengths="binary lengths that are negative or do not add up to the rows",
        wrong_feature_count="a step with the wrong number of features",
        not_a_number="a string, boolean or null where a number belongs",
        non_finite="NaN, Infinity or a number beyond float32's range",
        wrong_model_kind="a model sent to another kind's endpoint",
        cannot_stream="a streamed rollout while rollouts are scheduled in whole batches",
        cannot_carry_state="a carried state for a model that carries none",
    ),
    **_kinds(
        431, "the request line and headers are over a configured limit",
        request_header_too_large="the request line and headers are over max_request_head_bytes",
    ),
    **_kinds(500, "internal error; see the server log", internal="the model failed"),
    **_kinds(
        503, "try again after Retry-After",
        not_ready="the server is starting or shutting down",
        queue_full="the model's queue is full",
        overloaded="the request bytes held at once are at max_inflight_bytes",
        shutting_down="the batcher is shutting down",
        engine_unavailable="several workers: the model process has gone",
        out_of_memory="the model ran out of memory on this request alone",
        concurrency_limit="limit_concurrency connections or requests are open",
    ),
    **_kinds(
        504, "the request's deadline passed before its answer was ready",
        deadline_exceeded="request_timeout_s or X-Request-Timeout passed",
    ),
    # also 405 (a method a path does not take): the status is Starlette's
    **_kinds(404, "no such path", http_error="a path or method that does not exist"),
}  # fmt: skip

ERROR_TYPES: frozenset[str] = frozenset(CATALOGUE)

# an inference endpoint can answer every status of the catalogue
INFERENCE_STATUSES: tuple[int, ...] = tuple(sorted({kind.status for kind in CATALOGUE.values()}))


def status(error_type: str) -> int:
    """The HTTP status of ``error_type`` (a pydantic kind of its own: 422)."""
    kind = CATALOGUE.get(error_type)
    return kind.status if kind is not None else 422


def public_type(error_type: str) -> str:
    """``error_type``, or ``invalid_request`` for a parser's own kind (the documented few)."""
    return error_type if error_type in CATALOGUE else "invalid_request"


def types_of(code: int) -> list[str]:
    return sorted(t for t, kind in CATALOGUE.items() if kind.status == code)


def describe_status(code: int) -> str:
    """What an error status means: its titles, then each ``type`` that comes with it and what
    it means (a Markdown list, as OpenAPI descriptions are)."""
    titles = dict.fromkeys(k.title for k in CATALOGUE.values() if k.status == code)
    kinds = [f"- `{t}`: {CATALOGUE[t].description}" for t in types_of(code)]
    return "; ".join(titles) + ". The body's `type` says which:\n\n" + "\n".join(kinds)


def openapi_responses(codes: tuple[int, ...], model: Any) -> dict[int | str, dict[str, Any]]:
    """The FastAPI ``responses`` of a route that can answer ``codes``."""
    return {code: {"model": model, "description": describe_status(code)} for code in codes}


# the longest ``detail`` sent: messages are a sentence; anything longer repeats a client's text
DETAIL_CHARS = 512


def body(exc: RequestError) -> dict[str, Any]:
    """The JSON error body, with the documented ``type``.

    Each layer quotes the client's text in short (:func:`~rnnserve.service.interface.quote`);
    here every ``loc`` name and the ``detail`` are bounded once more, so that no error body
    grows with what the client sent, whichever layer raised it."""
    err = exc.body()
    err["type"] = public_type(exc.type)
    err["detail"] = quote(err["detail"], DETAIL_CHARS)
    err["loc"] = [quote(p) if isinstance(p, str) else p for p in err["loc"]]
    return err
