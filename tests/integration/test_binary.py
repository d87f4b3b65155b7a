"""The safetensors binary format over HTTP: round trips, bad bodies, Accept negotiation."""

from __future__ import annotations

import asyncio
import struct

import httpx
import numpy as np
import orjson
import pytest
import torch
from safetensors.numpy import load, save
from torch.nn.utils.rnn import pack_sequence

from rnnserve import models
from tests.integration.conftest import AppClient
from tests.metrics import value

ST = "application/x-safetensors"


def _flat(seqs: list[np.ndarray]) -> dict[str, np.ndarray]:
    return {"lengths": np.array([len(s) for s in seqs], np.int64), "x": np.concatenate(seqs)}


@pytest.mark.parametrize(
    ("path", "field", "out_field", "width"),
    [("/smooth", "sequences", "sequences", 16), ("/rollout", "inputs", "positions", 6)],
)
async def test_binary_round_trip_equals_json(
    client: httpx.AsyncClient, path: str, field: str, out_field: str, width: int
) -> None:
    rng = np.random.default_rng(7)
    seqs = [rng.standard_normal((n, width)).astype(np.float32) for n in (4, 1, 9)]
    flat = _flat(seqs)
    body = save({field: flat["x"], "lengths": flat["lengths"]})
    as_json = await client.post(path, json={field: [s.tolist() for s in seqs]})
    assert as_json.status_code == 200
    want = as_json.json()[out_field]
    # binary in, binary out
    r = await client.post(path, content=body, headers={"content-type": ST, "accept": ST})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == ST
    out = load(r.content)
    assert out["lengths"].tolist() == [4, 1, 9]
    got = np.split(out[out_field], np.cumsum(out["lengths"])[:-1])
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, np.array(w, np.float32))
    # binary in, JSON out; JSON in, binary out
    r = await client.post(path, content=body, headers={"content-type": ST})
    assert r.headers["content-type"] == "application/json"
    assert r.json()[out_field] == want
    r = await client.post(path, json={field: [s.tolist() for s in seqs]}, headers={"accept": ST})
    assert np.array_equal(load(r.content)[out_field], out[out_field])


async def test_model_metadata(client: httpx.AsyncClient) -> None:
    body = save(
        {"sequences": np.ones((2, 16), np.float32), "lengths": np.array([2])},
        metadata={"model": "traveller"},
    )
    r = await client.post("/smooth", content=body, headers={"content-type": ST})
    assert r.status_code == 422
    assert r.json()["type"] == "wrong_model_kind"
    body = save(
        {"sequences": np.ones((2, 16), np.float32), "lengths": np.array([2])},
        metadata={"model": "smoother"},
    )
    r = await client.post("/smooth", content=body, headers={"content-type": ST, "accept": ST})
    out = load(r.content)
    assert out["sequences"].shape == (2, 16)


def _body(**tensors: np.ndarray) -> bytes:
    return save(tensors)


GOOD = np.zeros((3, 16), np.float32)
BAD: list[tuple[str, bytes, int, str, str]] = [
    ("not safetensors", b"hello world", 400, "invalid_safetensors", "not a safetensors file"),
    ("short", b"\x01", 400, "invalid_safetensors", "not a safetensors file"),
    ("huge header", struct.pack("<Q", 2**63) + b"{}", 400, "invalid_safetensors", "past the end"),
    ("header not json", struct.pack("<Q", 3) + b"{{{", 400, "invalid_safetensors", "not JSON"),
    ("header a list", struct.pack("<Q", 2) + b"[]", 400, "invalid_safetensors", "JSON object"),
    (
        "offsets past the end",
        struct.pack("<Q", 64)
        + orjson.dumps({"lengths": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}).ljust(
            64
        ),
        400,
        "invalid_safetensors",
        "does not fit",
    ),
    ("no lengths", _body(sequences=GOOD), 422, "missing", "tensor 'lengths' is required"),
    ("no data", _body(lengths=np.array([3])), 422, "missing", "tensor 'sequences' is required"),
    (
        "extra tensor",
        _body(sequences=GOOD, lengths=np.array([3]), extra=np.zeros(1)),
        422,
        "unknown_field",
        "unknown tensor 'extra'",
    ),
    (
        "float64",
        _body(sequences=GOOD.astype(np.float64), lengths=np.array([3])),
        422,
        "wrong_dtype",
        "'sequences' must be F32, not F64",
    ),
    (
        "int32 lengths",
        _body(sequences=GOOD, lengths=np.array([3], np.int32)),
        422,
        "wrong_dtype",
        "'lengths' must be I64",
    ),
    (
        "3-d",
        _body(sequences=GOOD[None], lengths=np.array([3])),
        422,
        "wrong_shape",
        "must be 2-D",
    ),
    (
        "no sequences",
        _body(sequences=np.zeros((0, 16), np.float32), lengths=np.zeros(0, np.int64)),
        422,
        "empty",
        "holds no sequences",
    ),
    (
        "zero length",
        _body(sequences=GOOD, lengths=np.array([3, 0])),
        422,
        "empty",
        "sequence 1 has no steps",
    ),
    (
        "negative length",
        _body(sequences=GOOD, lengths=np.array([4, -1])),
        422,
        "wrong_lengths",
        "sequence 1 has a negative length",
    ),
    (
        "lengths too short",
        _body(sequences=GOOD, lengths=np.array([1, 1])),
        422,
        "wrong_lengths",
        "lengths add up to 2 steps; tensor 'sequences' has 3 rows",
    ),
    (
        "wrong width",
        _body(sequences=np.zeros((3, 4), np.float32), lengths=np.array([3])),
        422,
        "wrong_feature_count",
        "has 4 features; model 'smoother' takes 16",
    ),
    (
        "NaN",
        _body(
            sequences=np.where(np.arange(48).reshape(3, 16) == 37, np.nan, GOOD).astype(np.float32),
            lengths=np.array([2, 1]),
        ),
        422,
        "non_finite",
        "sequence 1, step 0, feature 5: value is not a finite number",
    ),
    (
        "too many sequences",
        _body(sequences=np.zeros((300, 16), np.float32), lengths=np.ones(300, np.int64)),
        413,
        "too_many_sequences",
        "300 sequences; the limit is 256",
    ),
]


@pytest.mark.parametrize(("body", "status", "kind", "message"),
                         [c[1:] for c in BAD], ids=[c[0] for c in BAD])  # fmt: skip
async def test_bad_binary_bodies(
    client: httpx.AsyncClient, body: bytes, status: int, kind: str, message: str
) -> None:
    r = await client.post("/smooth", content=body, headers={"content-type": ST, "accept": ST})
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"  # errors are always JSON
    err = r.json()
    assert err["type"] == kind
    assert message in err["detail"]
    assert len(r.content) < 300


async def test_fuzzed_binary_bodies_never_500(client: httpx.AsyncClient) -> None:
    rng = np.random.default_rng(11)
    good = bytearray(_body(sequences=GOOD, lengths=np.array([2, 1])))
    for _ in range(60):
        body = bytearray(good)
        for i in rng.integers(0, len(body), 3):
            body[i] = int(rng.integers(0, 256))
        r = await client.post("/smooth", content=bytes(body), headers={"content-type": ST})
        assert r.status_code in (200, 400, 413, 422), r.text


async def test_a_non_finite_value_found_by_the_model_fails_only_its_own_request(
    app_client: AppClient,
) -> None:
    """The smoother on the CPU checks binary inputs in its own pass: a NaN or an infinity in one
    request of a batch gets that request a located 422, and its batch mates their outputs."""
    rng = np.random.default_rng(3)
    bodies: list[bytes] = []
    seqs_of: list[list[np.ndarray]] = []
    bad_at = {1: (2, 5, 3, np.inf), 3: (0, 0, 15, np.nan), 4: (1, 6, 0, -np.inf)}
    for k in range(6):
        seqs = [rng.standard_normal((n, 16)).astype(np.float32) for n in (4, 7, 6)]
        if k in bad_at:
            i, t, f, v = bad_at[k]
            seqs[i][t, f] = v
        seqs_of.append(seqs)
        flat = _flat(seqs)
        bodies.append(save({"sequences": flat["x"], "lengths": flat["lengths"]}))
    async with app_client(max_delay_ms=300.0, max_batch_size=16) as (_, client):
        before = await _batches(client)
        rs = await asyncio.gather(
            *(client.post("/smooth", content=b, headers={"content-type": ST, "accept": ST})
              for b in bodies)
        )  # fmt: skip
        # the bad requests ran with the good ones, each once (no split, no retry)
        after = await _batches(client)
        assert after[1] - before[1] == 6, (before, after)
    model = models.load("smoother")
    for k, r in enumerate(rs):
        if k in bad_at:
            i, t, f, _ = bad_at[k]
            assert r.status_code == 422, r.text
            assert r.json() == {
                "detail": f"sequence {i}, step {t}, feature {f}: value is not a finite number",
                "type": "non_finite",
                "loc": ["sequences", i, t, f],
            }
            continue
        assert r.status_code == 200, r.text
        out = load(r.content)
        want = [model(pack_sequence([torch.from_numpy(s)])).data.numpy() for s in seqs_of[k]]
        got = np.split(out["sequences"], np.cumsum(out["lengths"])[:-1])
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-6)


async def test_a_non_finite_value_for_a_model_that_does_not_check_is_refused_located(
    client: httpx.AsyncClient,
) -> None:
    """The Traveller does not check its inputs: the engine does, before the batch."""
    inputs = np.zeros((9, 6), np.float32)
    inputs[6, 4] = -np.inf  # sequence 1 (rows 4..8), step 2
    body = _body(inputs=inputs, lengths=np.array([4, 5]))
    r = await client.post("/rollout", content=body, headers={"content-type": ST})
    assert r.status_code == 422, r.text
    assert r.json() == {
        "detail": "sequence 1, step 2, feature 4: value is not a finite number",
        "type": "non_finite",
        "loc": ["inputs", 1, 2, 4],
    }
    inputs[6, 4] = 0.5
    r = await client.post("/rollout", content=_body(inputs=inputs, lengths=np.array([4, 5])),
                          headers={"content-type": ST, "accept": ST})  # fmt: skip
    assert r.status_code == 200
    assert load(r.content)["positions"].shape == (9, 2)


async def _batches(client: httpx.AsyncClient) -> tuple[float, float]:
    """The smoother's batches so far, and the requests they held."""
    text = (await client.get("/metrics")).text
    return (
        value(text, "rnnserve_batch_requests_count", model="smoother"),
        value(text, "rnnserve_batch_requests_sum", model="smoother"),
    )
