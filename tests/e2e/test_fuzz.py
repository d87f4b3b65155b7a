"""Random bodies never get a 5xx: bad input is always a 4xx with a message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e

numbers = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, width=64),
    st.integers(-(2**70), 2**70),
)
scalars = st.one_of(numbers, st.booleans(), st.none(), st.text(max_size=5))
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=30,
)


def steps(width: int) -> st.SearchStrategy[list[list[Any]]]:
    """Mostly well-formed steps (width +-1) or, with width < 0, steps of anything."""
    if width < 0:
        return st.lists(st.lists(scalars, max_size=3), max_size=5)
    return st.lists(st.lists(numbers, min_size=width - 1, max_size=width + 1), max_size=5)


def bodies(field: str, width: int) -> st.SearchStrategy[Any]:
    seqs = st.lists(steps(width) | steps(-1), min_size=0, max_size=4)
    model = st.sampled_from([None, "smoother", "traveller", "gru"])
    shaped = st.builds(
        lambda s, m: {field: s} if m is None else {field: s, "model": m}, seqs, model
    )
    return st.one_of(shaped, json_values, st.dictionaries(st.just(field), json_values))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    env = {"RNNSERVE_MAX_SEQUENCE_LENGTH": "4", "RNNSERVE_MAX_REQUEST_TIMESTEPS": "12"}
    server = start_server(tmp, "--max-delay-ms", "0", env=env)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            yield c
    finally:
        stop(server)


def check(client: httpx.Client, path: str, body: Any) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()  # big ints too
    r = client.post(path, content=raw)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        err = r.json()
        assert err["detail"]
        assert err["type"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies("sequences", 16))
def test_smooth_never_5xx(client: httpx.Client, body: Any) -> None:
    check(client, "/smooth", body)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies("inputs", 6))
def test_rollout_never_5xx(client: httpx.Client, body: Any) -> None:
    check(client, "/rollout", body)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=64))
def test_arbitrary_bytes_never_5xx(client: httpx.Client, raw: bytes) -> None:
    check(client, "/smooth", raw)
