"""Which model serves a request that names none.

Per endpoint kind (``smoother`` for ``POST /smooth``, ``traveller`` for ``POST /rollout``):

1. the model named by ``default_smoother`` / ``default_traveller``, when set (``rnnserve``
   refuses to start if it is not served or is of the other kind);
2. else the only served model of that kind;
3. else the served model named after the kind (the bundled ``smoother`` and ``traveller``);
4. else none: such requests get 422 ``missing`` at ``model``, naming the choices.
"""

from __future__ import annotations

from collections.abc import Mapping

from rnnserve.service.config import Settings
from rnnserve.service.endpoints import INFERENCE, native
from rnnserve.service.interface import RequestError, ServedInfo

# the endpoint that serves each kind without naming the model (from the endpoint registry)
ENDPOINT = {e.kind: e.path for e in INFERENCE if e.kind is not None and native(e.kind) is e}


def configured(settings: Settings, kind: str) -> str | None:
    value = getattr(settings, f"default_{kind}", None)
    return value if isinstance(value, str) else None


def default_model(served: Mapping[str, ServedInfo], kind: str, settings: Settings) -> str | None:
    """The model of ``kind`` a request without ``model`` gets; None when it is ambiguous or
    no model of that kind is served."""
    chosen = configured(settings, kind)
    if chosen is not None:
        return chosen
    of_kind = sorted(name for name, m in served.items() if m.kind == kind)
    if len(of_kind) == 1:
        return of_kind[0]
    if kind in of_kind:
        return kind
    return None


def resolve(served: Mapping[str, ServedInfo], kind: str, settings: Settings) -> str:
    """:func:`default_model`, or the client error that says what to send instead."""
    name = default_model(served, kind, settings)
    if name is not None:
        return name
    of_kind = sorted(name for name, m in served.items() if m.kind == kind)
    if not of_kind:
        known = ", ".join(sorted(served)) or "none"
        raise RequestError(
            "unknown_model", f"no {kind} model is served (served: {known})", ("model",)
        )
    raise RequestError(
        "missing",
        f"'model' is required: several {kind} models are served ({', '.join(of_kind)}) and "
        f"none is the default (set --default-{kind})",
        ("model",),
    )  # fmt: skip
