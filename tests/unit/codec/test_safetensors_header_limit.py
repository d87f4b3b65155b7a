"""A safetensors header (a JSON object of a few hundred bytes in a real body) is read only up to
``MAX_SAFETENSORS_HEADER`` bytes: a larger one is refused with the limit, before it is parsed."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest

from rnnserve.service.codec import bodies
from rnnserve.service.http.errors import status as status_of
from rnnserve.service.interface import Limits, RequestError

LIMITS = Limits(256, 100_000, 1_000_000)


def padded(header_bytes: int) -> bytes:
    """A valid body (one 1-step sequence of 3 features) whose header is ``header_bytes`` long,
    padded with spaces as safetensors writers pad it."""
    header = {
        "sequences": {"dtype": "F32", "shape": [1, 3], "data_offsets": [0, 12]},
        "lengths": {"dtype": "I64", "shape": [1], "data_offsets": [12, 20]},
    }
    text = orjson.dumps(header)
    text += b" " * (header_bytes - len(text))
    data = np.zeros(3, np.float32).tobytes() + np.array([1], np.int64).tobytes()
    return struct.pack("<Q", len(text)) + text + data


def test_a_header_at_the_limit_is_read() -> None:
    decoded = bodies.decode(padded(bodies.MAX_SAFETENSORS_HEADER), bodies.SAFETENSORS,
                            "sequences", LIMITS)  # fmt: skip
    assert decoded is not None
    assert decoded.sequences(3, "m").lengths.tolist() == [1]


@pytest.mark.parametrize("over", [1, 20_000_000])
def test_a_header_over_the_limit_is_refused_unparsed(
    over: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[Any] = []
    monkeypatch.setattr(bodies.orjson, "loads", lambda text: parsed.append(text))
    body = padded(bodies.MAX_SAFETENSORS_HEADER + over)
    with pytest.raises(RequestError) as caught:
        bodies.decode(body, bodies.SAFETENSORS, "sequences", LIMITS)
    error = caught.value
    assert (status_of(error.type), error.type) == (400, "invalid_safetensors")
    assert str(bodies.MAX_SAFETENSORS_HEADER) in error.message
    assert str(bodies.MAX_SAFETENSORS_HEADER + over) in error.message
    assert parsed == []


def test_a_header_length_past_the_body_is_still_past_the_end() -> None:
    body = struct.pack("<Q", 100) + b"{}"
    with pytest.raises(RequestError, match="past the end"):
        bodies.decode(body, bodies.SAFETENSORS, "sequences", LIMITS)
