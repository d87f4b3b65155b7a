"""A real server drops the rollout of a client that hangs up, streamed or not."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.e2e.server import Server, start_server, stop
from tests.metrics import value

pytestmark = pytest.mark.e2e
STEPS = 100_000


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("disconnect"), "--rollout-chunk-steps", "32")
    yield srv
    stop(srv)


def metric(server: Server, name: str, **labels: str) -> float:
    return value(httpx.get(f"{server.url}/metrics").text, name, **labels)


def hang_up_during_rollout(server: Server, accept: str) -> None:
    """Send a 100,000-step rollout over a raw socket and close it once the rollout runs."""
    body = orjson.dumps({"inputs": [[[0.1] * 6] * STEPS]})
    host, port = server.url.removeprefix("http://").split(":")
    before = metric(server, "rnnserve_batch_timesteps_sum", model="traveller")
    with socket.create_connection((host, int(port))) as sock:
        head = (
            f"POST /rollout HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Accept: {accept}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        deadline = time.monotonic() + 60
        while metric(server, "rnnserve_batch_timesteps_sum", model="traveller") == before:
            assert time.monotonic() < deadline, "the rollout never started"
            time.sleep(0.01)
    # hung up: the rollout stops at its next chunk and the request is counted as cancelled
    deadline = time.monotonic() + 60
    while metric(server, "rnnserve_requests_in_flight", endpoint="rollout") > 0:
        assert time.monotonic() < deadline, "the rollout still runs after the client left"
        time.sleep(0.01)


@pytest.mark.parametrize("accept", ["application/json", "application/x-ndjson"])
def test_a_client_that_hangs_up_stops_its_rollout(server: Server, accept: str) -> None:
    cancelled = metric(server, "rnnserve_requests_cancelled_total", endpoint="rollout")
    ran = metric(server, "rnnserve_batch_timesteps_sum", model="traveller")
    hang_up_during_rollout(server, accept)
    ran = metric(server, "rnnserve_batch_timesteps_sum", model="traveller") - ran
    assert metric(server, "rnnserve_requests_cancelled_total", endpoint="rollout") == cancelled + 1
    assert 0 < ran < STEPS / 2  # stopped long before its end
    # and the server goes on serving
    r = httpx.post(f"{server.url}/rollout", json={"inputs": [[[0.1] * 6] * 5]}, timeout=30)
    assert r.status_code == 200
