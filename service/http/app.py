"""The FastAPI application: factory, lifespan, error handlers.

:func:`create_app` builds the single-process server: the models live in this process. With
``rnnserve --workers N`` each HTTP worker is built by :func:`create_worker_app` instead: the same
routes over a :class:`~rnnserve.service.ipc.worker_side.RemoteRuntime` that reaches the engine
process.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Receive, Scope, Send

from rnnserve.service import tracing
from rnnserve.service.codec import bodies
from rnnserve.service.codec.threads import CodecPool
from rnnserve.service.config import Settings, package_version
from rnnserve.service.endpoints import KSERVE_PREFIX
from rnnserve.service.http import openapi, precise
from rnnserve.service.http.responses import error_response, json_response
from rnnserve.service.http.routes import (
    router,
    serve_inference,
)
from rnnserve.service.http.tracing import Tracing
from rnnserve.service.interface import RequestError, Runtime
from rnnserve.service.logs import log_models
from rnnserve.service.memory import settle_garbage_collector
from rnnserve.service.metrics import Metrics

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

log = logging.getLogger(__name__)

# set by ``rnnserve --workers N`` for its HTTP workers: where the engine listens
ENGINE_SOCKET_ENV = "_RNNSERVE_ENGINE_SOCKET"
WORKER_HEADER = "X-Rnnserve-Worker"


def create_worker_app() -> App:
    """One HTTP worker of ``rnnserve --workers N`` (uvicorn's app factory in each worker).

    Settings come from the ``RNNSERVE_*`` environment the parent set; the models from the
    engine process at ``$_RNNSERVE_ENGINE_SOCKET``. Responses name the worker's pid in an
    ``X-Rnnserve-Worker`` header.
    """
    try:
        socket_path = os.environ[ENGINE_SOCKET_ENV]
    except KeyError:
        raise RuntimeError(f"{ENGINE_SOCKET_ENV} is not set: start workers with rnnserve") from None
    app = create_app(Settings(), engine_socket=socket_path)
    app.extra_header = (WORKER_HEADER.lower().encode(), str(os.getpid()).encode())
    return app


class App(FastAPI):
    """FastAPI, with the inference endpoints served before its middleware and routing
    (:func:`rnnserve.service.http.routes.serve_inference`); everything else goes through FastAPI."""

    extra_header: tuple[bytes, bytes] | None = None  # on every response (worker's pid)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.extra_header is not None:
                send = _with_header(send, self.extra_header)
            scope["app"] = self  # as Starlette sets it: request.app
            if await serve_inference(scope, receive, send):
                return
        await super().__call__(scope, receive, send)


class AppState(State):
    """``app.state``: starlette's State, with its values kept as the object's own attributes.

    starlette's State keeps them in a dict that ``__getattr__`` reads, and Python calls
    ``__getattr__`` only after the ordinary lookup has failed and formatted an AttributeError:
    several thousand instructions a read, and a request reads the state about a dozen times.
    Here that dict is the object's ``__dict__``, so a read is a plain attribute lookup; setting,
    deleting and missing attributes behave as starlette's."""

    def __init__(self) -> None:
        super().__init__(self.__dict__)


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    async def send_with_header(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", []), header]
        await send(message)

    return send_with_header


def create_app(
    settings: Settings | None = None,
    *,
    engine_socket: str | None = None,
    tracer_provider: TracerProvider | None = None,
) -> App:
    """Build the app; models load and warm up in its lifespan, before it takes traffic.

    With ``engine_socket`` the models are the engine process's, reached over that socket, and
    ``/metrics`` reads every process's values from the Prometheus multiprocess folder.

    Traced with ``tracer_provider`` if given, else as the ``OTEL_*`` variables say
    (:mod:`rnnserve.service.tracing`; off unless they ask for it).
    """
    settings = settings if settings is not None else Settings()
    traced, own_provider = _tracing(tracer_provider, remote_engine=engine_socket is not None)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime: Runtime = app.state.runtime
        await runtime.start()
        if engine_socket is None:  # with workers, the engine process logs its models
            log_models(runtime.models, log)
        openapi.refresh(app)  # the description of the models now served
        # the JSON scanner compiles here, not in the first request
        await asyncio.get_running_loop().run_in_executor(None, bodies.warm_up)
        settle_garbage_collector()
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False  # /readyz answers 503 while draining
            await runtime.stop()
            app.state.codec.close()
            precise.READER.close()  # its child, if a large body started one
            gc.unfreeze()
            if own_provider is not None:  # sends the spans still buffered
                await asyncio.get_running_loop().run_in_executor(None, own_provider.shutdown)

    app = App(
        title="rnnserve",
        version=package_version(),
        summary="Batched serving of recurrent sequence models",
        lifespan=lifespan,
        docs_url=None,  # openapi.install serves /docs and /redoc from bundled assets
        redoc_url=None,
    )
    app.state = AppState()
    app.state.settings = settings
    app.state.tracing = traced
    # imported here, not at the top: an HTTP worker of --workers N never loads torch and the
    # models, which only the single-process server's runtime needs
    if engine_socket is None:
        from rnnserve.service.engine.runtime import ModelRuntime

        app.state.metrics = Metrics()
        app.state.runtime = ModelRuntime(settings, app.state.metrics)
    else:
        from rnnserve.service.ipc.worker_side import RemoteRuntime

        app.state.metrics = Metrics(multiprocess=True)
        app.state.runtime = RemoteRuntime(engine_socket)
    app.state.codec = CodecPool(settings.codec_threads, settings.codec_offload_bytes)
    app.state.ready = False
    app.include_router(router)
    openapi.install(app)
    _handle_errors(app)
    return app


def _handle_errors(app: App) -> None:
    """Errors raised outside the inference endpoints' own steps, as rnnserve's JSON errors."""

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return error_response(exc)  # raised by a dependency (the bearer token check)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [p for p in err["loc"] if p != "body"]
        where = ".".join(str(p) for p in loc) or "request"
        return error_response(RequestError("invalid_request", f"{where}: {err['msg']}", tuple(loc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        headers = dict(exc.headers) if exc.headers else None
        if _is_protocol_path(request.url.path):
            # the protocol's form, which its clients read (tritonclient fails on another)
            detail = f"{exc.detail}: not a path or method of this server's Open Inference Protocol"
            return json_response({"error": detail}, exc.status_code, headers=headers)
        return json_response(
            {"detail": str(exc.detail), "type": "http_error", "loc": []},
            exc.status_code,
            headers=headers,
        )


def _is_protocol_path(path: str) -> bool:
    return path == KSERVE_PREFIX or path.startswith(KSERVE_PREFIX + "/")


def _tracing(
    given: TracerProvider | None, *, remote_engine: bool
) -> tuple[Tracing | None, TracerProvider | None]:
    """The app's tracing (also this process's: the batchers' spans, the log lines' ids), and
    the provider it made from the ``OTEL_*`` variables, which it shuts down when it stops."""
    own = None if given is not None else tracing.provider_from_environment(package_version())
    provider = given if given is not None else own
    if provider is None:
        tracing.use(None)
        return None, None
    tracer = provider.get_tracer(tracing.INSTRUMENTATION, package_version())
    tracing.use(tracer)
    return Tracing(tracer, remote_engine), own
