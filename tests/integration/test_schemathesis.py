"""Property-based API testing with schemathesis against ``/openapi.json`` of a real server.

Bounded for CI (a few examples per operation, no deadline): every generated request, valid or
not, gets an answer that is not a 5xx, with a status code and a body that the schema
documents.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from rnnserve.service.endpoints import STREAM  # noqa: E402
from tests.e2e.server import Server, start_server, stop  # noqa: E402

pytestmark = pytest.mark.e2e
EXAMPLES = 25  # per operation: bounded for CI
SEEN: list[int] = []  # the status codes the checks saw


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_server(tmp_path_factory.mktemp("schemathesis"))
    yield s
    stop(s)


def no_server_error(ctx: Any, response: Any, case: Any) -> bool:
    """No 5xx; except a 504 for a request that set its own deadline (``X-Request-Timeout:
    5e-324`` is a valid header that no server can meet)."""
    SEEN.append(response.status_code)
    headers = {k.lower() for k in (case.headers or {})}
    if response.status_code == 504 and "x-request-timeout" in headers:
        return True
    assert response.status_code < 500, f"{response.status_code}: {response.text[:300]}"
    return True


def test_the_api_never_answers_5xx_and_keeps_to_its_schema(server: Server) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    checks = [
        no_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    # the stream path is a WebSocket handshake, documented but not an HTTP operation to call
    operations = [
        op
        for op in (result.ok() for result in schema.get_all_operations())
        if op.path != STREAM.path
    ]
    assert {op.path for op in operations} >= {"/smooth", "/rollout", "/models", "/metrics"}
    for operation in operations:

        @given(operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def check(case: Any) -> None:
            case.call_and_validate(checks=checks, timeout=30)

        check()
    assert len(SEEN) >= 2 * len(operations)
    assert any(400 <= code < 500 for code in SEEN)  # invalid input was tried too
