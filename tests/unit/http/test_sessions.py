"""The session's close codes and reasons, and how it tells its control message from a chunk."""

from __future__ import annotations

import json

import pytest

from rnnserve.service.http.sessions import _asks_state, close_code, close_reason


@pytest.mark.parametrize(
    ("error_type", "code"),
    [
        ("unauthorized", 1008),
        ("body_too_large", 1009),
        ("too_many_sessions", 1013),
        ("not_ready", 1013),
        ("idle_timeout", 4408),
        ("unknown_model", 4404),
        ("state_mismatch", 4409),
        ("cannot_carry_state", 4422),
    ],
)
def test_each_way_a_session_ends_has_its_close_code(error_type: str, code: int) -> None:
    assert close_code(error_type) == code


def test_a_close_reason_is_json_that_fits_a_close_frame() -> None:
    reason = close_reason("unknown_model", "model 'é" + "x" * 500 + "' is not served")
    assert len(reason.encode()) <= 123
    doc = json.loads(reason)
    assert doc["type"] == "unknown_model"
    assert doc["detail"].startswith("model 'éxxx")
    short = close_reason("idle_timeout", "nothing came within 1 s")
    assert json.loads(short) == {"type": "idle_timeout", "detail": "nothing came within 1 s"}


@pytest.mark.parametrize("char", ["x", "é", "€", "😀"])  # 1 to 4 bytes in UTF-8
def test_a_close_reason_keeps_as_much_of_its_detail_as_fits(char: str) -> None:
    reason = close_reason("unknown_model", "no model named '" + char * 100 + "'")
    assert len(reason.encode()) <= 123
    detail = json.loads(reason)["detail"]
    assert detail.startswith("no model named '" + char)
    assert detail.endswith("…")
    one_more = reason.replace("…", char + "…")
    assert len(one_more.encode()) > 123  # no room was left for another character


@pytest.mark.parametrize(
    ("frame", "asks"),
    [
        (b'{"get_state": true}', True),
        (b' { "get_state" : true } ', True),
        (b'{"get_state": false}', False),
        (b'{"get_state": 1}', False),  # equal to True in Python, not JSON's true
        (b'{"get_state": 1.0}', False),
        (b'{"get_state": true, "inputs": [[[1]]]}', False),
        (b'{"inputs": [[[1]]]}', False),
        (b'{"get_state": tru', False),
        (b"[1, 2]", False),
    ],
)
def test_only_the_get_state_message_is_taken_as_the_control_message(
    frame: bytes, asks: bool
) -> None:
    assert _asks_state(frame) is asks
