"""The metrics observer: known batches in, exact sums, counts and buckets out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rnnserve.service.config import Settings
from rnnserve.service.http.auth import byte_budget
from rnnserve.service.metrics import Metrics
from tests.metrics import value


def test_on_batch_records_each_histogram_by_value() -> None:
    m = Metrics()
    m.on_batch("m", items=2, size=5, cost=12, queue_waits=[0.001, 0.003],
               compute_seconds=0.002, ok=True)  # fmt: skip
    m.on_batch("m", items=1, size=1, cost=3, queue_waits=[0.004], compute_seconds=0.5, ok=False)
    m.on_batch("other", items=1, size=2, cost=2, queue_waits=[0.0], compute_seconds=0.0, ok=True)
    text = m.exposition().decode()

    def v(name: str, **labels: str) -> float:
        return value(text, name, model="m", **labels)

    assert v("rnnserve_batch_requests_count") == 2
    assert v("rnnserve_batch_requests_sum") == 3
    assert v("rnnserve_batch_sequences_count") == 2
    assert v("rnnserve_batch_sequences_sum") == 6
    assert v("rnnserve_batch_sequences_bucket", le="1.0") == 1
    assert v("rnnserve_batch_sequences_bucket", le="4.0") == 1
    assert v("rnnserve_batch_sequences_bucket", le="8.0") == 2
    assert v("rnnserve_batch_timesteps_count") == 2
    assert v("rnnserve_batch_timesteps_sum") == 15
    assert v("rnnserve_queue_wait_seconds_count") == 3  # one per request, not per batch
    assert v("rnnserve_queue_wait_seconds_sum") == pytest.approx(0.008)
    assert v("rnnserve_batch_compute_seconds_count") == 2
    assert v("rnnserve_batch_compute_seconds_sum") == pytest.approx(0.502)
    assert v("rnnserve_batch_compute_seconds_bucket", le="0.0025") == 1
    assert v("rnnserve_batch_failures_total") == 1
    # labels keep models apart
    assert value(text, "rnnserve_batch_sequences_sum", model="other") == 2
    assert value(text, "rnnserve_batch_failures_total", model="other") == 0


def test_on_queue_depth_sets_the_gauge() -> None:
    m = Metrics()
    m.on_queue_depth("m", 7)
    m.on_queue_depth("m", 3)
    m.on_queue_depth("x", 1)
    text = m.exposition().decode()
    assert value(text, "rnnserve_queue_depth", model="m") == 3
    assert value(text, "rnnserve_queue_depth", model="x") == 1


def test_latency_buckets_suit_milliseconds() -> None:
    text = Metrics().exposition().decode()
    assert "rnnserve_request_duration_seconds" in text
    m = Metrics()
    m.request_duration.labels("smooth", "smoother", "200").observe(0.0007)
    text = m.exposition().decode()
    name = "rnnserve_request_duration_seconds_bucket"
    assert value(text, name, le="0.0005") == 0
    assert value(text, name, le="0.001") == 1


def test_each_app_has_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.on_batch("m", items=1, size=1, cost=1, queue_waits=[0.0], compute_seconds=0.0, ok=False)
    assert value(b.exposition().decode(), "rnnserve_batch_failures_total", model="m") == 0


def test_a_live_value_is_read_when_scraped_in_one_process() -> None:
    m = Metrics()
    held = [0]
    assert m.live(m.inflight_bytes, lambda: held[0]) is None  # nothing to set as it changes
    held[0] = 1234
    assert value(m.exposition().decode(), "rnnserve_request_bytes_in_flight") == 1234
    held[0] = 5
    assert value(m.exposition().decode(), "rnnserve_request_bytes_in_flight") == 5


def test_a_live_value_is_set_on_each_change_with_several_processes() -> None:
    m = Metrics(multiprocess=True)  # each process's value is its own file, summed when scraped
    assert m.live(m.inflight_bytes, lambda: 0) is m.inflight_bytes


def test_the_app_byte_budget_is_reported_live() -> None:
    m = Metrics()
    state = SimpleNamespace(metrics=m, settings=Settings(max_inflight_bytes=1000))
    budget = byte_budget(state)
    assert budget.gauge is None
    assert budget.take(600)
    assert not budget.take(500)
    budget.hold(100)
    assert value(m.exposition().decode(), "rnnserve_request_bytes_in_flight") == 700
    budget.give(650)
    assert value(m.exposition().decode(), "rnnserve_request_bytes_in_flight") == 50
    assert byte_budget(state) is budget  # one per app
