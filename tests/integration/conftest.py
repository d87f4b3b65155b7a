"""The real app in-process over ASGI, with its lifespan (models loaded and warmed)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from rnnserve.service.config import Settings
from rnnserve.service.http.app import create_app

AppClient = Callable[..., AbstractAsyncContextManager[tuple[FastAPI, httpx.AsyncClient]]]


@asynccontextmanager
async def running_app(**overrides: Any) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    settings = Settings(**{"max_delay_ms": 5.0, **overrides})
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rnnserve") as client:
            yield app, client


@pytest.fixture
def app_client() -> AppClient:
    return running_app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with running_app() as (_, c):
        yield c
