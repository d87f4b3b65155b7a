"""What a load run measured: latencies, outcomes and, from ``/metrics``, batch sizes."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.load_workloads import Format


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between ranks (numpy's default).

    NaN for no values.
    """
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- batch sizes from /metrics -----------------------------------------------------------------

BATCH_COUNTERS = (
    "rnnserve_batch_requests_count",
    "rnnserve_batch_requests_sum",
    "rnnserve_batch_sequences_sum",
)


def batch_counters(metrics_text: str, model: str) -> dict[str, float] | None:
    """The batch histograms' count and sums for ``model`` (zeros before its first batch).

    None when the server does not expose ``rnnserve_batch_requests`` at all.
    """
    found = dict.fromkeys(BATCH_COUNTERS, 0.0)
    exposed = False
    for fam in text_string_to_metric_families(metrics_text):
        exposed = exposed or fam.name == "rnnserve_batch_requests"
        for s in fam.samples:
            if s.name in found and s.labels.get("model") == model:
                found[s.name] += s.value
    return found if exposed else None


@dataclass(frozen=True)
class BatchStats:
    """Batches run during a load, from the difference of two /metrics readings."""

    batches: float
    requests: float
    sequences: float

    @property
    def requests_per_batch(self) -> float:
        return self.requests / self.batches if self.batches else math.nan

    @property
    def sequences_per_batch(self) -> float:
        return self.sequences / self.batches if self.batches else math.nan

    @classmethod
    def between(
        cls, before: Mapping[str, float] | None, after: Mapping[str, float] | None
    ) -> BatchStats | None:
        if before is None or after is None:
            return None
        d = {k: after[k] - before[k] for k in BATCH_COUNTERS}
        return cls(
            d["rnnserve_batch_requests_count"],
            d["rnnserve_batch_requests_sum"],
            d["rnnserve_batch_sequences_sum"],
        )


async def read_batch_counters(
    session: aiohttp.ClientSession, model: str
) -> dict[str, float] | None:
    try:
        async with session.get("/metrics") as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    try:
        return batch_counters(text, model)
    except ValueError:  # not Prometheus text
        return None


# -- results -------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """What one load run did. Latencies are of the answered (200) requests only."""

    workload: str
    mode: Literal["closed", "open"]
    fmt: Format
    clients: int | None = None  # closed loop
    rate: float | None = None  # open loop: offered requests per second
    seconds: float = 0.0  # wall time, first request sent to last one answered
    sent: int = 0
    ok: int = 0
    timesteps: int = 0  # timesteps of the answered requests
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # "503", "timeout", "connection"…
    dropped: int = 0  # open loop: arrivals not sent, max_outstanding being in flight
    late: int = 0  # open loop: arrivals sent more than LATE_AFTER_S after their time
    batch: BatchStats | None = None

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else math.nan

    @property
    def timesteps_per_s(self) -> float:
        return self.timesteps / self.seconds if self.seconds > 0 else math.nan

    def p(self, q: float) -> float:
        """Latency percentile in seconds."""
        return percentile(self.latencies, q)

    def summary(self) -> dict[str, Any]:
        """A JSON-able digest (no raw latencies)."""
        return {
            "workload": self.workload,
            "mode": self.mode,
            "format": self.fmt,
            "clients": self.clients,
            "rate": self.rate,
            "seconds": self.seconds,
            "sent": self.sent,
            "ok": self.ok,
            "requests_per_s": self.requests_per_s,
            "timesteps_per_s": self.timesteps_per_s,
            "p50_ms": self.p(50) * 1e3,
            "p90_ms": self.p(90) * 1e3,
            "p99_ms": self.p(99) * 1e3,
            "errors": dict(self.errors),
            "dropped": self.dropped,
            "late": self.late,
            "requests_per_batch": self.batch.requests_per_batch if self.batch else None,
            "sequences_per_batch": self.batch.sequences_per_batch if self.batch else None,
        }


def format_result(r: LoadResult) -> str:
    """A few human-readable lines."""
    how = f"{r.clients} clients" if r.mode == "closed" else f"Poisson {r.rate:g}/s offered"
    lines = [
        f"{r.workload} ({r.fmt}, {r.mode} loop, {how}): {r.ok}/{r.sent} answered 200 "
        f"in {r.seconds:.2f} s",
        f"  {r.requests_per_s:,.1f} requests/s, {r.timesteps_per_s:,.0f} timesteps/s",
        f"  latency p50 {r.p(50) * 1e3:.1f} ms, p90 {r.p(90) * 1e3:.1f} ms, "
        f"p99 {r.p(99) * 1e3:.1f} ms",
        f"  errors: {dict(r.errors) or 'none'}",
    ]
    if r.mode == "open":
        lines.append(f"  dropped: {r.dropped}, late: {r.late}")
    if r.batch is not None:
        lines.append(
            f"  batches: {r.batch.batches:.0f}, {r.batch.requests_per_batch:.1f} requests and "
            f"{r.batch.sequences_per_batch:.1f} sequences per batch"
        )
    else:
        lines.append("  batches: no rnnserve_batch_* metrics on this server")
    return "\n".join(lines)
