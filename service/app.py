"""The FastAPI application: factory, lifespan, error handlers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import wire
from service.config import Settings
from service.metrics import Metrics
from service.routes import json_response, router
from service.runtime import ModelRuntime
from service.validation import RequestError

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; models load and warm up in its lifespan, before it takes traffic."""
    settings = settings if settings is not None else Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime: ModelRuntime = app.state.runtime
        await runtime.start()
        # the JSON scanner compiles here, not in the first request
        await asyncio.get_running_loop().run_in_executor(None, wire.warm_up)
        app.state.ready = True
        try:
            yield
        finally:
            app.state.ready = False  # /readyz answers 503 while draining
            await runtime.stop()

    app = FastAPI(
        title="rnnserve",
        version="0.1.0",
        summary="Batched serving of recurrent sequence models",
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.metrics = Metrics()
    app.state.runtime = ModelRuntime(settings, app.state.metrics)
    app.state.ready = False
    app.include_router(router)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return json_response(exc.body(), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = [p for p in err["loc"] if p != "body"]
        where = ".".join(str(p) for p in loc) or "request"
        return json_response(
            {"detail": f"{where}: {err['msg']}", "type": "invalid_request", "loc": loc}, 422
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return json_response(
            {"detail": str(exc.detail), "type": "http_error", "loc": []},
            exc.status_code,
            headers=dict(exc.headers) if exc.headers else None,
        )

    return app
