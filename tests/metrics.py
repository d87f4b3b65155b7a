"""Read rnnserve's Prometheus exposition back (tests and bench share this)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def samples(text: str, name: str) -> list[Sample]:
    """Every sample called exactly ``name`` (e.g. ``rnnserve_batch_requests_sum``)."""
    return [
        s for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name
    ]


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(
        s.value for s in samples(text, name) if all(s.labels.get(k) == v for k, v in labels.items())
    )
