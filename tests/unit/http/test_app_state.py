"""``app.state``: starlette's State whose values are the object's own attributes."""

from __future__ import annotations

import pytest

from rnnserve.service.config import Settings
from rnnserve.service.http.app import AppState, create_app


def test_values_set_are_plain_attributes_that_starlettes_methods_see() -> None:
    state = AppState()
    state.ready = True
    assert vars(state)["ready"] is True  # found without __getattr__
    assert state.ready is True
    assert state["ready"] is True  # starlette's item access reads the same dict
    state["budget"] = 7
    assert state.budget == 7
    del state.ready
    assert "ready" not in vars(state)


def test_a_missing_value_is_an_attribute_error_as_with_starlette() -> None:
    state = AppState()
    with pytest.raises(AttributeError, match="has no attribute 'runtime'"):
        _ = state.runtime
    assert getattr(state, "runtime", None) is None
    assert not hasattr(state, "runtime")


def test_the_app_keeps_its_parts_in_such_a_state() -> None:
    app = create_app(Settings())
    assert isinstance(app.state, AppState)
    for part in ("settings", "metrics", "runtime", "codec", "tracing", "ready"):
        assert part in vars(app.state)
    app.state.codec.close()
