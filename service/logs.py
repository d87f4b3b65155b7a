"""Logging set-up shared by ``rnnserve`` and its engine process."""

from __future__ import annotations

import copy
import json
import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter
from uvicorn.config import LOGGING_CONFIG

from rnnserve.service import tracing
from rnnserve.service.config import Settings
from rnnserve.service.interface import current_request

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# libraries whose debug output drowns rnnserve's own at --log-level debug (numba logs every
# compiler pass); held at warning unless log_third_party is set
THIRD_PARTY = ("numba", "torch", "triton", "httpx", "httpcore", "python_multipart", "multipart")


class JsonLineFormatter(JsonFormatter):
    """One JSON object a record: ``time`` (ISO 8601, UTC), ``level``, ``logger``, ``process``,
    ``message``, ``request_id`` while a request is served, ``trace_id`` and ``span_id`` while a
    span is current (tracing on), ``traceback`` with an exception."""

    def __init__(self) -> None:
        super().__init__(
            "%(levelname)s %(name)s %(process)d %(message)s",
            rename_fields={
                "levelname": "level",
                "name": "logger",
                "exc_info": "traceback",
                "stack_info": "stack",
            },
            timestamp="time",
            # uvicorn's copy of its message with terminal colours; Python 3.12's asyncio task
            reserved_attrs=[*RESERVED_ATTRS, "color_message", "taskName"],
        )

    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_data, record, message_dict)
        # formatted in the thread and task that logged, so this is the request being served
        context = current_request()
        if context is not None and context.request_id != "-":
            log_data["request_id"] = context.request_id
        ids = tracing.current_ids()
        if ids is not None:
            log_data["trace_id"], log_data["span_id"] = ids

    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        # the time first, as a reader scanning the lines expects it
        return {"time": log_data.pop("time"), **log_data}


def json_handler(stream: TextIO | None = None) -> logging.Handler:
    """A handler writing JSON lines to ``stream`` (stderr). It also sends ``warnings.warn``
    through logging, so that in every process that logs through it none is plain text."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonLineFormatter())
    logging.captureWarnings(True)
    return handler


def configure_logging(settings: Settings) -> None:
    """The root logger at ``settings.log_level``, in ``settings.log_format``; third-party loggers
    at warning unless ``settings.log_third_party``."""
    level = settings.log_level.upper()
    if settings.log_format == "json":
        logging.basicConfig(level=level, handlers=[json_handler()])
    else:
        logging.basicConfig(level=level, format=FORMAT)
    if settings.log_third_party:
        return
    for name in THIRD_PARTY:
        logger = logging.getLogger(name)
        if logger.getEffectiveLevel() < logging.WARNING:
            logger.setLevel(logging.WARNING)


def uvicorn_log_config(settings: Settings) -> dict[str, Any]:
    """uvicorn's ``log_config``: what every process it runs applies (the supervisor and each
    HTTP worker of ``--workers N``, before the worker's app is built).

    ``text``: uvicorn's own. ``json``: uvicorn's loggers and the root logger write JSON lines,
    uvicorn's to stderr and its access log to stdout, as uvicorn does."""
    if settings.log_format != "json":
        return copy.deepcopy(LOGGING_CONFIG)
    handler = "rnnserve.service.logs.json_handler"
    held = {} if settings.log_third_party else {name: {"level": "WARNING"} for name in THIRD_PARTY}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "handlers": {
            "default": {"()": handler, "stream": "ext://sys.stderr"},
            "access": {"()": handler, "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
            **held,
        },
        "root": {"handlers": ["default"], "level": settings.log_level.upper()},
    }


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
    routes = config.get("rollout_routes") if isinstance(config, Mapping) else None
    return (
        f"model {name}: {kind} on {device}, backend {backend or 'torch'}, "
        f"{info.get('parameters', '?')} parameters"
        + (f" (GEMM routes: {routes})" if routes else "")
    )


def log_models(served: Mapping[str, Any], log: logging.Logger) -> None:
    """One info line per served model (``served``: name -> object with an ``info`` dict)."""
    for name in sorted(served):
        log.info("%s", model_line(name, served[name].info))
