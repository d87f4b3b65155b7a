"""Hostile clients against a real ``rnnserve`` (bench/hostile_clients.py's attacks, all at once)
while a normal client goes on: every one of its requests is answered 200 with exactly the answer
it gets alone, each attack gets the answer its limit gives, and once they stop the server holds
nothing and has answered no 5xx but the budget's own 503s. The normal client's latency under
attack against alone is the benchmark's (docs/BENCHMARKS.md), not asserted here."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from bench import hostile_clients as hostile
from tests.e2e.server import start_server, stop
from tests.metrics import samples, value

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SECONDS = 12.0


@pytest.mark.parametrize("workers", ["1", "2"])
def test_hostile_clients_shut_no_normal_client_out(tmp_path: Path, workers: str) -> None:
    server = start_server(tmp_path, *hostile.server_args(), "--workers", workers)
    try:
        expected = httpx.post(f"{server.url}/smooth", json=hostile.NORMAL_BODY).content
        outcomes: list[hostile.Outcomes] = []
        attackers = threading.Thread(
            target=lambda: outcomes.append(hostile.attack(server.url, SECONDS + 1.0))
        )
        attackers.start()
        latencies = hostile.alone(server.url, SECONDS, expected)  # asserts 200 and the answer
        attackers.join(120)
        assert not attackers.is_alive()
        out = outcomes[0]
        assert len(latencies) >= 10

        # taken (then 408 after body_timeout_s) or refused up front (503: no room for what they
        # declare); had declarations held the budget, the normal client would have got 503s
        assert set(out.of("declared_bodies")) <= {"408", "503"}, out.counts
        assert sum(out.of("declared_bodies").values()) >= 8
        assert set(out.of("huge_heads")) <= {"431", "closed"}, out.counts
        assert out.of("huge_heads").get("431", 0) >= 1
        assert set(out.of("huge_safetensors_header")) <= {"400", "503"}, out.counts
        assert out.of("huge_safetensors_header").get("400", 0) >= 1
        assert out.of("unread_answers").get("closed", 0) >= 4  # write_timeout_s closed them
        assert out.of("slow_heads").get("closed", 0) >= 8  # header_timeout_s closed them
        assert set(out.of("escaped_bodies")) <= {"200", "503"}, out.counts
        assert out.of("escaped_bodies").get("200", 0) >= 1  # read, in the precise child

        text = httpx.get(f"{server.url}/metrics").text
        assert value(text, "rnnserve_request_bytes_in_flight") == 0
        assert value(text, "rnnserve_write_timeouts_total") >= 4
        codes = {
            s.labels["code"]
            for s in samples(text, "rnnserve_request_duration_seconds_count")
            if s.value > 0
        }
        assert codes <= {"200", "400", "408", "499", "503"}, codes
        assert httpx.get(f"{server.url}/healthz").status_code == 200
    finally:
        stop(server)
    log = server.log.read_text()
    assert "Traceback" not in log, log[-3000:]
