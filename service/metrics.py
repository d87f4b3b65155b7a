"""Prometheus metrics on their own registry; the batcher reports to them as an observer.

With several HTTP workers (``rnnserve --workers N``) every process writes its values to
prometheus_client's multiprocess folder (``PROMETHEUS_MULTIPROC_DIR``, set before any of them
imports prometheus_client), and ``Metrics(multiprocess=True).exposition()`` adds up every
process's files: the workers' request metrics and the engine's batch metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

__all__ = ["CONTENT_TYPE", "Metrics"]

# Millisecond-level latencies: 0.25 ms .. 10 s.
LATENCY_BUCKETS = (
    0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_BUCKETS = (1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
FRACTION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class Metrics:
    """Every rnnserve_* metric. One instance per app, so tests can build many apps."""

    def __init__(
        self, registry: CollectorRegistry | None = None, *, multiprocess: bool = False
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess = multiprocess
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.request_duration = Histogram(
            "rnnserve_request_duration_seconds",
            "Time from request received to response ready, by endpoint, model and status code.",
            ["endpoint", "model", "code"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "rnnserve_queue_wait_seconds",
            "Time a request waited in the batcher's queue before its batch ran.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_compute = Histogram(
            "rnnserve_batch_compute_seconds",
            "The model's own time for one batch (or chunk of rollout steps): pack, run, unpack, "
            "measured on the model's worker thread.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_thread_wait = Histogram(
            "rnnserve_batch_thread_wait_seconds",
            "Time a batch spent not computing: waiting for its model's worker thread to take it "
            "and for the event loop to take its result back.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_requests = Histogram(
            "rnnserve_batch_requests",
            "HTTP requests served by one batch.",
            ["model"],
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.batch_sequences = Histogram(
            "rnnserve_batch_sequences",
            "Sequences packed into one batch.",
            ["model"],
            buckets=COUNT_BUCKETS,
            registry=r,
        )
        self.batch_timesteps = Histogram(
            "rnnserve_batch_timesteps",
            "Timesteps (sum of sequence lengths) in one batch.",
            ["model"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.batch_active_fraction = Histogram(
            "rnnserve_batch_active_fraction",
            "Share of the batch's [sequences x longest] grid holding real steps (1 = no padding).",
            ["model"],
            buckets=FRACTION_BUCKETS,
            registry=r,
        )
        self.batch_failures = Counter(
            "rnnserve_batch_failures_total",
            "Batches whose model run raised an error.",
            ["model"],
            registry=r,
        )
        self.batch_splits = Counter(
            "rnnserve_batch_splits_total",
            "Failed batches split in two to retry each half apart (fault isolation), by reason: "
            "error or out_of_memory.",
            ["model", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "rnnserve_queue_depth",
            "Requests waiting in the batcher's queue.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",  # only the engine sets it; gone with the engine
        )
        self.in_flight = Gauge(
            "rnnserve_requests_in_flight",
            "Requests being handled now, by endpoint.",
            ["endpoint"],
            registry=r,
            multiprocess_mode="livesum",  # the sum over the live workers
        )
        self.cancelled = Counter(
            "rnnserve_requests_cancelled_total",
            "Requests whose client went away before the answer; their work was dropped.",
            ["endpoint"],
            registry=r,
        )
        self.rejected = Counter(
            "rnnserve_requests_rejected_total",
            "Requests refused without running the model, by endpoint and reason.",
            ["endpoint", "reason"],
            registry=r,
        )
        self.expired = Counter(
            "rnnserve_requests_expired_total",
            "Requests whose deadline passed before their answer was ready (504): dropped from "
            "the queue, or from a running rollout at its next chunk.",
            ["endpoint"],
            registry=r,
        )
        self.model_reloads = Counter(
            "rnnserve_model_reloads",
            "Models a reload of the model directory changed, by result: loaded (a new name), "
            "changed (a new version swapped in), removed, failed (the new file was refused; "
            "the old version serves on).",
            ["result"],
            registry=r,
        )
        self.inflight_bytes = Gauge(
            "rnnserve_request_bytes_in_flight",
            "Request body bytes being read, parsed, queued or run now, and bytes of answers not "
            "yet sent (the memory budget's use).",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.write_timeouts = Counter(
            "rnnserve_write_timeouts_total",
            "Connections closed because the client did not read its answer within write_timeout_s.",
            registry=r,
        )

        self.sessions_open = Gauge(
            "rnnserve_sessions_open",
            "Streaming sessions (WebSocket) open now, by model.",
            ["model"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.session_chunks = Counter(
            "rnnserve_session_chunks",
            "Chunks of streaming sessions answered, by model and outcome: ok, or the error type.",
            ["model", "outcome"],
            registry=r,
        )
        self.session_chunk_duration = Histogram(
            "rnnserve_session_chunk_duration_seconds",
            "Time from a session's chunk received to its outputs sent, by model.",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, remembered: per request, prometheus_client's label
        checks and lock cost more than the observation itself. For label values from a small
        set only (endpoints, served models, status codes), never a client's text."""
        key = (id(metric), values)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*values)
        return found

    # -- batcher observer -------------------------------------------------------------------

    def on_queue_depth(self, name: str, depth: int) -> None:
        self.child(self.queue_depth, name).set(depth)

    def on_batch(
        self,
        name: str,
        *,
        items: int,
        size: int,
        cost: int,
        queue_waits: Sequence[float],
        compute_seconds: float,
        ok: bool,
        wait_seconds: float = 0.0,
    ) -> None:
        wait = self.queue_wait.labels(name)
        for w in queue_waits:
            wait.observe(w)
        self.batch_compute.labels(name).observe(compute_seconds)
        self.batch_thread_wait.labels(name).observe(wait_seconds)
        self.batch_requests.labels(name).observe(items)
        self.batch_sequences.labels(name).observe(size)
        self.batch_timesteps.labels(name).observe(cost)
        if not ok:
            self.batch_failures.labels(name).inc()

    def on_split(self, name: str, reason: str) -> None:
        self.batch_splits.labels(name, reason).inc()

    def live(self, gauge: Gauge, read: Callable[[], float]) -> Gauge | None:
        """Report a value this process holds on ``gauge``: read when scraped, so that nothing
        is set as it changes (``None``: nothing to set); or, with several processes, whose
        values are each process's file, the gauge to set on every change."""
        if self.multiprocess:
            return gauge
        gauge.set_function(read)
        return None

    def exposition(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        MultiProcessCollector(merged)  # every process's values, from the shared folder
        return generate_latest(merged)
