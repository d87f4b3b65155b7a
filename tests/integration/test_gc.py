"""The objects alive once the models are warm are frozen out of the cyclic garbage collector
while the app serves (its full collections stalled every request: most of /smooth's p99), and
handed back at shutdown (no leak for processes that outlive an app, like this test run)."""

from __future__ import annotations

import gc

import pytest

from rnnserve.service.config import Settings
from rnnserve.service.engine.runtime import ModelRuntime
from rnnserve.service.http.app import create_app

pytestmark = pytest.mark.anyio


def _tracked(obj: object) -> bool:
    """Whether the collector walks ``obj`` (frozen objects are in none of its generations)."""
    return any(o is obj for o in gc.get_objects())


async def test_the_warm_app_is_frozen_while_serving_and_released_after() -> None:
    app = create_app(Settings(max_delay_ms=1.0))
    runtime = app.state.runtime
    assert isinstance(runtime, ModelRuntime)
    assert _tracked(app)
    assert _tracked(runtime)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 0
        assert not _tracked(app)
        assert not _tracked(runtime)
        made_after = {"a request's objects": []}  # made after start-up: collected as usual
        assert _tracked(made_after)
    assert gc.get_freeze_count() == 0
    assert _tracked(app)
    assert _tracked(runtime)
