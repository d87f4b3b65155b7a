"""Logging set-up shared by ``rnnserve`` and its engine process."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from rnnserve.service.config import Settings

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# libraries whose debug output drowns rnnserve's own at --log-level debug (numba logs every
# compiler pass); held at warning unless log_third_party is set
THIRD_PARTY = ("numba", "torch", "triton", "httpx", "httpcore", "python_multipart", "multipart")


def configure_logging(settings: Settings) -> None:
    """The root logger at ``settings.log_level``; third-party loggers at warning unless
    ``settings.log_third_party``."""
    logging.basicConfig(level=settings.log_level.upper(), format=FORMAT)
    if settings.log_third_party:
        return
    for name in THIRD_PARTY:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.WARNING:
            logger.setLevel(logging.WARNING)


def settings_line(settings: Settings) -> str:
    """One log line of the effective settings, secrets hidden."""
    return "settings: " + json.dumps(settings.public(), separators=(",", ":"))


def model_line(name: str, info: Mapping[str, Any]) -> str:
    """``smoother: smoother on cpu, backend numba, 32 parameters``: one start-up line a model."""
    kind = str(info.get("kind", "?"))
    device = str(info.get("device", "?"))
    config = info.get("config") or {}
    backend = config.get("rollout_backend") if isinstance(config, Mapping) else None
    if backend is None and kind == "smoother":
        from rnnserve.models.kernels import numba_available, triton_available

        if device.startswith("cpu"):
            backend = "numba" if numba_available() else "torch"
        else:
            backend = "triton" if triton_available() else "torch"
    return (
        f"model {name}: {kind} on {device}, backend {backend or 'torch'}, "
        f"{info.get('parameters', '?')} parameters"
    )


def log_models(served: Mapping[str, Any], log: logging.Logger) -> None:
    """One info line per served model (``served``: name -> object with an ``info`` dict)."""
    for name in sorted(served):
        log.info("%s", model_line(name, served[name].info))
