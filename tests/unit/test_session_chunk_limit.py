"""``max_chunk_bytes``, the largest frame of a streaming session: its default, held within
``max_request_bytes``, and refused when set above it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rnnserve.service.cli import uvicorn_options
from rnnserve.service.config import Settings

MIB = 1024 * 1024


def test_the_default_chunk_limit_is_4_mib_under_the_default_body_limit() -> None:
    settings = Settings()
    assert settings.max_chunk_bytes == 4 * MIB
    assert settings.max_chunk_bytes <= settings.max_request_bytes


def test_an_unset_chunk_limit_follows_a_smaller_body_limit() -> None:
    assert Settings(max_request_bytes=20_000).max_chunk_bytes == 20_000
    assert Settings(max_request_bytes=128 * MIB).max_chunk_bytes == 4 * MIB


def test_the_flag_and_the_environment_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings(_cli_parse_args=["--max-chunk-bytes", "3000"]).max_chunk_bytes == 3000
    monkeypatch.setenv("RNNSERVE_MAX_REQUEST_BYTES", "5000")
    assert Settings().max_chunk_bytes == 5000  # the body limit from the environment binds


def test_a_chunk_limit_over_the_body_limit_is_refused_naming_both() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(max_request_bytes=1000, max_chunk_bytes=1001)
    assert "max_chunk_bytes (1001) is over max_request_bytes (1000)" in str(refused.value)
    assert Settings(max_request_bytes=1000, max_chunk_bytes=1000).max_chunk_bytes == 1000


@pytest.mark.parametrize("limit", [0, -1])
def test_a_chunk_limit_below_one_byte_is_refused(limit: int) -> None:
    with pytest.raises(ValidationError):
        Settings(max_chunk_bytes=limit)


def test_the_chunk_limit_is_the_websocket_layers_frame_limit() -> None:
    options = uvicorn_options(Settings(max_request_bytes=32 * MIB, max_chunk_bytes=17 * MIB))
    assert options["ws_max_size"] == 17 * MIB
