"""What both process modes tell uvicorn: the settings' limits reach its own knobs."""

from __future__ import annotations

from rnnserve.service.cli import uvicorn_options
from rnnserve.service.config import Settings
from rnnserve.service.http.protocol import HeaderTimeoutProtocol


def test_the_limits_reach_uvicorn() -> None:
    settings = Settings(
        max_request_head_bytes=4096, limit_concurrency=7, drain_timeout_s=2.5,
    )  # fmt: skip
    options = uvicorn_options(settings)
    assert options["h11_max_incomplete_event_size"] == 4096
    assert options["limit_concurrency"] == 7
    assert options["timeout_graceful_shutdown"] == 3
    assert options["http"] is HeaderTimeoutProtocol
