"""Hostile bodies and paths: an error answer stays small and never echoes the client's text.

A name, key or value the client sent is quoted in an error by at most a short prefix
(:func:`rnnserve.service.interface.quote`), in ``detail`` and in ``loc`` alike; whatever the
client sends, the answer is under 1 KiB.
"""

from __future__ import annotations

import struct
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from rnnserve.service.codec import bodies
from rnnserve.service.interface import QUOTE_CHARS, quote

ST = "application/x-safetensors"
JSON_LONG = "z" * 1_000_000  # 1 MB of one character: any echo of it shows
ST_LONG = "z" * 60_000  # under the header limits (safetensors, HTTP): the name itself is read
SMALL = 1024


def safetensors(header: dict[str, Any], data: bytes) -> bytes:
    """A safetensors body with exactly ``header`` (names and metadata as the test wants)."""
    raw = orjson.dumps(header)
    return struct.pack("<Q", len(raw)) + raw + data


def steps(n_features: int) -> bytes:
    return np.zeros((1, n_features), np.float32).tobytes() + np.array([1], np.int64).tobytes()


def entries(field: str, n_features: int) -> dict[str, Any]:
    width = 4 * n_features
    return {
        field: {"dtype": "F32", "shape": [1, n_features], "data_offsets": [0, width]},
        "lengths": {"dtype": "I64", "shape": [1], "data_offsets": [width, width + 8]},
    }


ONE_STEP = [[[0.0] * 16]]
CASES: dict[str, tuple[str, dict[str, Any], int, str]] = {
    # name: (path, httpx request arguments, status, type)
    "json-unknown-key": ("/smooth", {"json": {"sequences": ONE_STEP, JSON_LONG: 1}}, 422,
                         "unknown_field"),
    "json-unknown-key-rollout": ("/rollout", {"json": {JSON_LONG: 1, "inputs": [[[0.0] * 6]]}},
                                 422, "unknown_field"),
    "json-model": ("/smooth", {"json": {"sequences": ONE_STEP, "model": JSON_LONG}}, 404,
                   "unknown_model"),
    # an escape takes the body off the compiled reader, to pydantic's
    "json-model-escaped": ("/smooth", {"json": {"sequences": ONE_STEP, "model": JSON_LONG + "\n"}},
                           404, "unknown_model"),
    "path-name": (f"/models/{ST_LONG}/infer", {"json": {"inputs": ONE_STEP}}, 404,
                  "unknown_model"),
    "path-and-body-names-differ": ("/models/smoother/infer",
                                   {"json": {"inputs": ONE_STEP, "model": JSON_LONG}}, 422,
                                   "invalid_request"),
    "safetensors-tensor-name": ("/smooth", {"content": safetensors(
        {**entries("sequences", 16), ST_LONG: {"dtype": "F32", "shape": [0], "data_offsets":
                                                [0, 0]}}, steps(16))}, 422, "unknown_field"),
    "safetensors-bad-tensor-name": ("/smooth", {"content": safetensors(
        {**entries("sequences", 16), ST_LONG: {"dtype": "nope"}}, steps(16))}, 400,
        "invalid_safetensors"),
    "safetensors-misplaced-tensor-name": ("/smooth", {"content": safetensors(
        {**entries("sequences", 16), ST_LONG: {"dtype": "F32", "shape": [9], "data_offsets":
                                                [0, 4]}}, steps(16))}, 400,
        "invalid_safetensors"),
    "safetensors-metadata-model": ("/smooth", {"content": safetensors(
        {"__metadata__": {"model": ST_LONG}, **entries("sequences", 16)}, steps(16))}, 404,
        "unknown_model"),
    "safetensors-long-shape": ("/smooth", {"content": safetensors(
        {"sequences": {"dtype": "F32", "shape": [1] * 15_000, "data_offsets": [0, 4]},
         "lengths": {"dtype": "I64", "shape": [1], "data_offsets": [4, 12]}},
        steps(1))}, 422, "wrong_shape"),
    # refused for its size, before it is parsed
    "safetensors-huge-header": ("/smooth", {"content": safetensors(
        {"__metadata__": {"model": JSON_LONG}, **entries("sequences", 16)}, steps(16))}, 400,
        "invalid_safetensors"),
}  # fmt: skip


@pytest.mark.parametrize("reader", ["fast", "precise"])
@pytest.mark.parametrize("case", list(CASES))
async def test_an_error_answer_is_small_and_quotes_only_a_prefix(
    app_client: Any, case: str, reader: str
) -> None:
    path, request, status, kind = CASES[case]
    if "content" in request:
        request = {**request, "headers": {"content-type": ST}}
    async with app_client(json_reader=reader) as (_, client):
        client: httpx.AsyncClient
        r = await client.post(path, **request)
    assert (r.status_code, r.json()["type"]) == (status, kind), r.text[:300]
    assert len(r.content) < SMALL, r.text[:300]
    assert "z" * (QUOTE_CHARS + 1) not in r.text
    assert "z" * (QUOTE_CHARS + 1) not in "".join(map(str, r.json()["loc"]))


def test_quote_keeps_short_text_and_cuts_long_text_to_a_marked_prefix() -> None:
    assert quote("smoother") == "smoother"
    assert quote("a" * QUOTE_CHARS) == "a" * QUOTE_CHARS
    cut = quote("b" * (QUOTE_CHARS + 1))
    assert cut == "b" * QUOTE_CHARS + "…"
    listed = quote(["x"] * 1000)  # not text: its str(), in short
    assert listed == str(["x"] * 1000)[:QUOTE_CHARS] + "…"
    assert quote("c" * 10, limit=4) == "cccc…"


def test_a_remote_runtime_quotes_an_unknown_name_in_short() -> None:
    from rnnserve.service.interface import UnknownModel
    from rnnserve.service.ipc.worker_side import RemoteRuntime

    with pytest.raises(UnknownModel) as caught:
        RemoteRuntime("/nonexistent.sock").get(JSON_LONG)
    assert len(str(caught.value)) < SMALL
    assert "z" * (QUOTE_CHARS + 1) not in str(caught.value)


def test_the_codec_quotes_a_long_tensor_name_in_short() -> None:
    body = safetensors(
        {
            **entries("sequences", 16),
            ST_LONG: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        },
        steps(16),
    )
    limits = bodies.Limits(max_sequences=8, max_sequence_length=8, max_timesteps=8)
    with pytest.raises(bodies.RequestError) as caught:
        bodies.decode(body, ST, "sequences", limits)
    assert caught.value.type == "unknown_field"
    assert len(str(caught.value)) + len(str(caught.value.loc)) < SMALL
