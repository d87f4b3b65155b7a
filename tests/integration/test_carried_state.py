"""Carried state over HTTP, in-process: a long stream sent in pieces, each piece from the state
the one before returned, is answered exactly as the whole stream sent at once; on every model
kind that carries state, in JSON and in safetensors, under continuous and whole-batch
scheduling, with other streams and stateless requests in the same batches."""

from __future__ import annotations

import asyncio
import shutil
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from safetensors.numpy import load, save

from rnnserve import models
from rnnserve.models.recurrent import RecurrentConfig, RecurrentModel
from rnnserve.service.http.precise import precise_cost
from tests.integration.conftest import AppClient

SAFETENSORS = "application/x-safetensors"
TOLERANCE = 1e-5

# model name -> (path, input field, output field, input width)
ENDPOINTS: dict[str, tuple[str, str, str, int]] = {
    "smoother": ("/smooth", "sequences", "sequences", 16),
    "traveller": ("/rollout", "inputs", "positions", 6),
    "lstm": ("/models/lstm/infer", "inputs", "outputs", 5),
    "gru": ("/models/gru/infer", "inputs", "outputs", 5),
}
PARTS = {"smoother": {"s"}, "traveller": {"h", "c", "p"}, "lstm": {"h", "c"}, "gru": {"h"}}


def write_models(where: Path) -> Path:
    """The shipped smoother and Traveller, and an LSTM and a GRU of random weights."""
    for name in ("smoother", "traveller"):
        shutil.copy(models.DEFAULT_MODEL_DIR / f"{name}.safetensors", where)
    torch.manual_seed(0)
    for cell in ("lstm", "gru"):
        cfg = RecurrentConfig(cell, input_size=5, hidden_size=8, num_layers=2, head_size=3)
        models.save(RecurrentModel(cfg).eval(), where / f"{cell}.safetensors")
    return where


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_models(tmp_path_factory.mktemp("carried"))


# -- one request, either format -------------------------------------------------------------------

Post = Callable[..., Awaitable[httpx.Response]]


def metadata(body: bytes) -> dict[str, str]:
    (size,) = struct.unpack_from("<Q", body)
    meta: dict[str, str] = orjson.loads(body[8 : 8 + size]).get("__metadata__", {})
    return meta


async def send(
    post: Post, model: str, xs: list[np.ndarray], state: Any, binary: bool
) -> tuple[list[np.ndarray], Any]:
    """Post ``xs`` from ``state`` (an earlier answer's, or None) with ``return_state``; the
    outputs and the final state, in the same format."""
    path, field, out_field, _ = ENDPOINTS[model]
    if binary:
        tensors = {field: np.concatenate(xs), "lengths": np.array([len(x) for x in xs])}
        meta = {"return_state": "true"}
        if state is not None:
            tensors.update(state[0])
            meta.update(state[1])
        body = save(tensors, metadata=meta)
        headers = {"content-type": SAFETENSORS, "accept": SAFETENSORS}
        r = await post(path, content=body, headers=headers)
        assert r.status_code == 200, r.text
        out = load(r.content)
        ys = np.split(out[out_field], np.cumsum(out["lengths"])[:-1])
        got = {k: v for k, v in out.items() if k.startswith("state.")}
        meta = {k: v for k, v in metadata(r.content).items() if k.startswith("state_")}
        return ys, (got, meta)
    doc: dict[str, Any] = {field: [x.tolist() for x in xs], "return_state": True}
    if state is not None:
        doc["state"] = state
    r = await post(path, json=doc)
    assert r.status_code == 200, r.text
    answer = r.json()
    return [np.asarray(y, np.float32) for y in answer[out_field]], answer["state"]


def cuts(rng: np.random.Generator, length: int, pieces: int) -> list[int]:
    """``pieces`` non-empty pieces of a sequence of ``length`` steps: where each ends."""
    inner = np.sort(rng.choice(np.arange(1, length), pieces - 1, replace=False))
    return [*inner.tolist(), length]


async def in_pieces(
    post: Post,
    model: str,
    xs: list[np.ndarray],
    pieces: int,
    rng: np.random.Generator,
    binary: bool,
) -> tuple[list[np.ndarray], Any]:
    """Every sequence of ``xs`` cut at random into ``pieces`` pieces, piece ``j`` of each
    sent in request ``j`` from the state request ``j - 1`` returned."""
    ends = [cuts(rng, len(x), pieces) for x in xs]
    outs: list[list[np.ndarray]] = [[] for _ in xs]
    state = None
    for j in range(pieces):
        part = [x[(e[j - 1] if j else 0) : e[j]] for x, e in zip(xs, ends, strict=True)]
        ys, state = await send(post, model, part, state, binary)
        for i, y in enumerate(ys):
            outs[i].append(y)
    return [np.concatenate(o) for o in outs], state


def state_arrays(state: Any, binary: bool) -> dict[str, np.ndarray]:
    if binary:
        return {k.removeprefix("state."): v for k, v in state[0].items()}
    names = state["sequences"][0].keys()
    return {n: np.asarray([s[n] for s in state["sequences"]], np.float32) for n in names}


def random_streams(rng: np.random.Generator, model: str, n: int) -> list[np.ndarray]:
    width = ENDPOINTS[model][3]
    return [
        rng.standard_normal((int(rng.integers(10, 40)), width)).astype(np.float32) for _ in range(n)
    ]


def assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float(np.abs(g - w).max()) <= TOLERANCE


# -- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "safetensors"])
@pytest.mark.parametrize("model", list(ENDPOINTS))
async def test_pieces_carried_equal_the_whole_stream(
    app_client: AppClient, model_dir: Path, model: str, binary: bool
) -> None:
    rng = np.random.default_rng(hash((model, binary)) % 2**32)
    async with app_client(model_dir=model_dir) as (_, client):
        for _ in range(3):
            xs = random_streams(rng, model, int(rng.integers(1, 4)))
            whole, whole_state = await send(client.post, model, xs, None, binary)
            pieces = int(rng.integers(1, 11))
            got, got_state = await in_pieces(client.post, model, xs, pieces, rng, binary)
            assert_close(got, whole)
            want, final = state_arrays(whole_state, binary), state_arrays(got_state, binary)
            assert set(final) == PARTS[model]
            for part in PARTS[model]:
                assert float(np.abs(final[part] - want[part]).max()) <= TOLERANCE


async def test_a_stateless_answer_is_unchanged(app_client: AppClient, model_dir: Path) -> None:
    """No state sent, none asked: today's answer, without a "state" key."""
    rng = np.random.default_rng(3)
    async with app_client(model_dir=model_dir) as (_, client):
        for model, (path, field, out_field, _) in ENDPOINTS.items():
            xs = random_streams(rng, model, 2)
            plain = (await client.post(path, json={field: [x.tolist() for x in xs]})).json()
            assert "state" not in plain
            ys, _ = await send(client.post, model, xs, None, False)
            assert_close([np.asarray(y, np.float32) for y in plain[out_field]], ys)


async def test_asking_for_the_state_leaves_the_smoothers_answer_bit_for_bit(
    app_client: AppClient, model_dir: Path
) -> None:
    """On the CPU the smoother runs a batch with states in the same pass as one without: a
    sequence's outputs are the same bits whether it asks for its state, carries one beside
    others, or neither; and a carried state continues it exactly as the whole stream."""
    rng = np.random.default_rng(11)
    xs = random_streams(rng, "smoother", 3)
    body = {"sequences": [x.tolist() for x in xs]}
    async with app_client(model_dir=model_dir) as (_, client):
        plain = (await client.post("/smooth", json=body)).json()["sequences"]
        asked = (await client.post("/smooth", json={**body, "return_state": True})).json()
        assert asked["sequences"] == plain
        head, state = await send(client.post, "smoother", [x[:4] for x in xs], None, False)
        rest, _ = await send(client.post, "smoother", [x[4:] for x in xs], state, False)
    for j, whole in enumerate(plain):
        np.testing.assert_array_equal(head[j], np.asarray(whole, np.float32)[:4])
        np.testing.assert_allclose(rest[j], np.asarray(whole, np.float32)[4:], atol=1e-6)


async def test_a_body_larger_than_the_precise_readers_room_carries_its_state(
    app_client: AppClient, model_dir: Path
) -> None:
    """The fast reader reads a body with a state and ``return_state`` itself, leaving only the
    state to the precise one: a body whose whole precise read (about 128 bytes a number) would
    be over ``max_inflight_bytes`` is served, and answered as in pieces under a larger budget."""
    rng = np.random.default_rng(7)
    xs = random_streams(rng, "smoother", 2)
    xs = [np.repeat(x, 50, axis=0) for x in xs]  # thousands of steps: ~100 KB a sequence
    body = orjson.dumps({"sequences": [x.tolist() for x in xs], "return_state": True})
    budget = 3 * len(body)
    assert precise_cost(body) > budget  # the whole body's precise read would not fit
    async with app_client(model_dir=model_dir) as (_, client):
        whole, whole_state = await send(client.post, "smoother", xs, None, False)
        head = [x[:5] for x in xs]
        _, state = await send(client.post, "smoother", head, None, False)
    async with app_client(model_dir=model_dir, max_inflight_bytes=budget) as (_, client):
        rest, final = await send(client.post, "smoother", [x[5:] for x in xs], state, False)
    assert_close(rest, [w[5:] for w in whole])
    want, got = state_arrays(whole_state, False), state_arrays(final, False)
    assert float(np.abs(got["s"] - want["s"]).max()) <= TOLERANCE


@pytest.mark.parametrize("scheduling", ["continuous", "batch"])
async def test_concurrent_streams_share_batches_and_stay_exact(
    app_client: AppClient, model_dir: Path, scheduling: str
) -> None:
    """Several streams of each model, each in its own pieces, sent at once beside stateless
    requests: batches mix items with states, without and asking for none; each stream still
    equals itself sent whole (and a rollout from a carried state joins the running batch)."""
    rng = np.random.default_rng(11)
    settings = {"model_dir": model_dir, "rollout_scheduling": scheduling, "max_delay_ms": 20}
    async with app_client(**settings) as (_, client):
        jobs: list[tuple[str, list[np.ndarray], int]] = []
        for model in ENDPOINTS:
            for _ in range(3):
                jobs.append((model, random_streams(rng, model, 2), int(rng.integers(1, 11))))
        wholes = [await send(client.post, m, xs, None, False) for m, xs, _ in jobs]
        binary = [bool(rng.integers(0, 2)) for _ in jobs]
        carried = [
            in_pieces(client.post, m, xs, k, np.random.default_rng(i), b)
            for i, ((m, xs, k), b) in enumerate(zip(jobs, binary, strict=True))
        ]
        stateless = [
            client.post(
                "/rollout",
                json={"inputs": [x.tolist() for x in random_streams(rng, "traveller", 2)]},
            )
            for _ in range(4)
        ]
        results = await asyncio.gather(*carried, *stateless)
        for (whole, _), (got, _) in zip(wholes, results[: len(jobs)], strict=True):
            assert_close(got, whole)
        assert all(r.status_code == 200 for r in results[len(jobs) :])


async def test_a_carried_state_starts_a_streamed_rollout(
    app_client: AppClient, model_dir: Path
) -> None:
    """NDJSON: the second piece streams from the first piece's state; asking a stream for the
    final state is a located 422."""
    rng = np.random.default_rng(5)
    x = random_streams(rng, "traveller", 1)[0]
    async with app_client(model_dir=model_dir) as (_, client):
        whole, _ = await send(client.post, "traveller", [x], None, False)
        _, state = await send(client.post, "traveller", [x[:7]], None, False)
        doc = {"inputs": [x[7:].tolist()], "state": state}
        r = await client.post("/rollout", json=doc, headers={"accept": "application/x-ndjson"})
        assert r.status_code == 200
        lines = [orjson.loads(line) for line in r.text.splitlines()]
        rest = np.full((len(x) - 7, 2), np.nan, np.float32)
        for line in lines:
            if "positions" in line:
                rest[line["start"] : line["start"] + len(line["positions"])] = line["positions"]
        assert_close([rest], [whole[0][7:]])
        doc["return_state"] = True
        r = await client.post("/rollout", json=doc, headers={"accept": "application/x-ndjson"})
        assert r.status_code == 422
        assert r.json()["loc"] == ["return_state"]


# -- refusals ------------------------------------------------------------------------------------


async def first_state(client: httpx.AsyncClient, model: str, n: int = 2) -> Any:
    xs = random_streams(np.random.default_rng(0), model, n)
    _, state = await send(client.post, model, xs, None, False)
    return state


async def test_a_state_of_another_version_or_model_is_a_state_mismatch(
    app_client: AppClient, model_dir: Path
) -> None:
    async with app_client(model_dir=model_dir) as (_, client):
        state = await first_state(client, "lstm")
        xs = [x.tolist() for x in random_streams(np.random.default_rng(1), "lstm", 2)]
        versions = {m["name"]: m["version"] for m in (await client.get("/models")).json()["models"]}
        assert state["version"] == versions["lstm"]
        cases = [
            ({**state, "version": "0" * 12}, ["state", "version"]),
            ({**state, "model": "gru", "version": versions["gru"]}, ["state", "model"]),
        ]
        for bad, loc in cases:
            r = await client.post("/models/lstm/infer", json={"inputs": xs, "state": bad})
            assert r.status_code == 409, r.text
            body = r.json()
            assert body["type"] == "state_mismatch"
            assert body["loc"] == loc
        # the same in safetensors: metadata state_version
        tensors = {"inputs": np.zeros((4, 5), np.float32), "lengths": np.array([2, 2])}
        h = np.zeros((2, 2, 8), np.float32)
        meta = {"state_model": "lstm", "state_version": "f" * 12}
        body = save({**tensors, "state.h": h, "state.c": h}, metadata=meta)
        r = await client.post(
            "/models/lstm/infer", content=body, headers={"content-type": SAFETENSORS}
        )
        assert r.status_code == 409
        assert r.json()["type"] == "state_mismatch"


def _json_cases(state: dict[str, Any]) -> list[tuple[dict[str, Any], str, list[Any]]]:
    """(state, error type, loc) for broken states of the LSTM (2 sequences, 2 layers of 8)."""
    seqs = state["sequences"]

    def with_seq(i: int, **part: Any) -> dict[str, Any]:
        changed = [dict(s) for s in seqs]
        changed[i].update(part)
        return {**state, "sequences": changed}

    short_layer = [seqs[1]["h"][0][:5], seqs[1]["h"][1]]
    nan_inside = [seqs[0]["c"][0], [*seqs[0]["c"][1][:3], 1e39, *seqs[0]["c"][1][4:]]]
    no_c = {k: v for k, v in seqs[1].items() if k != "c"}
    return [
        (with_seq(1, h=short_layer), "wrong_shape", ["state", "sequences", 1, "h", 0]),
        (with_seq(0, h=seqs[0]["h"][:1]), "wrong_shape", ["state", "sequences", 0, "h"]),
        (with_seq(0, c=nan_inside), "non_finite", ["state", "sequences", 0, "c", 1, 3]),
        ({**state, "sequences": [seqs[0], no_c]}, "missing", ["state", "sequences", 1, "c"]),
        ({**state, "sequences": seqs[:1]}, "wrong_shape", ["state", "sequences"]),
        (with_seq(0, p=[0.0, 1.0]), "unknown_field", ["state", "sequences", 0, "p"]),
        (with_seq(1, p=[0.0, 1.0]), "unknown_field", ["state", "sequences", 1, "p"]),
        (with_seq(1, h="x"), "wrong_shape", ["state", "sequences", 1, "h"]),
        (with_seq(0, h=[["a"] * 8, seqs[0]["h"][1]]), "not_a_number",
         ["state", "sequences", 0, "h", 0, 0]),
        ({k: v for k, v in state.items() if k != "version"}, "missing", ["state", "version"]),
        ({**state, "extra": 1}, "unknown_field", ["state", "extra"]),
    ]  # fmt: skip


@pytest.mark.parametrize("reader", ["fast", "precise"])
async def test_broken_json_states_get_located_errors(
    app_client: AppClient, model_dir: Path, reader: str
) -> None:
    async with app_client(model_dir=model_dir, json_reader=reader) as (_, client):
        state = await first_state(client, "lstm")
        xs = [x.tolist() for x in random_streams(np.random.default_rng(1), "lstm", 2)]
        for bad, kind, loc in _json_cases(state):
            r = await client.post("/models/lstm/infer", json={"inputs": xs, "state": bad})
            assert r.status_code == 422, (kind, r.text)
            body = r.json()
            assert (body["type"], body["loc"]) == (kind, loc), body
            assert "1e39" not in body["detail"]
        r = await client.post("/models/lstm/infer", json={"inputs": xs, "return_state": "yes"})
        assert r.status_code == 422
        assert r.json()["loc"] == ["return_state"]


async def test_broken_binary_states_get_located_errors(
    app_client: AppClient, model_dir: Path
) -> None:
    async with app_client(model_dir=model_dir) as (_, client):
        versions = {m["name"]: m["version"] for m in (await client.get("/models")).json()["models"]}
        meta = {"state_model": "traveller", "state_version": versions["traveller"]}
        h = np.zeros((2, 2, 128), np.float32)
        base = {"inputs": np.zeros((5, 6), np.float32), "lengths": np.array([3, 2])}
        ok = {"state.h": h, "state.c": h, "state.p": np.zeros((2, 2), np.float32)}
        nan_c = h.copy()
        nan_c[1, 0, 5] = np.nan
        cases: list[tuple[dict[str, np.ndarray], dict[str, str], str, list[Any]]] = [
            ({**ok, "state.p": np.zeros((2, 3), np.float32)}, meta, "wrong_shape", ["state.p"]),
            ({**ok, "state.h": h[:1]}, meta, "wrong_shape", ["state.h"]),
            ({"state.h": h, "state.p": ok["state.p"]}, meta, "missing", ["state.c"]),
            ({**ok, "state.c": nan_c}, meta, "non_finite", ["state.c", 1]),
            ({**ok, "state.s": h[:, 0]}, meta, "unknown_field", ["state.s"]),
            # the name is the client's: answered in short
            ({**ok, "state." + "q" * 500: h}, meta, "unknown_field", ["state." + "q" * 58 + "…"]),
            ({**ok, "state.h": h.astype(np.float64)}, meta, "wrong_dtype", ["state.h"]),
            (ok, {"state_model": "traveller"}, "missing", ["__metadata__", "state_version"]),
        ]
        for tensors, md, kind, loc in cases:
            body = save({**base, **tensors}, metadata=md)
            r = await client.post("/rollout", content=body, headers={"content-type": SAFETENSORS})
            assert r.status_code == 422, (kind, r.text)
            got = r.json()
            assert (got["type"], got["loc"]) == (kind, loc), got
            assert "q" * 65 not in got["detail"]
        body = save({**base, **ok}, metadata=meta)
        r = await client.post("/rollout", content=body, headers={"content-type": SAFETENSORS})
        assert r.status_code == 200


async def test_a_model_without_state_refuses_one(app_client: AppClient, tmp_path: Path) -> None:
    """The smoother's state sent to /rollout is another model's; return_state on a model kind
    that carries none (TorchScript) is a 422 cannot_carry_state."""
    from examples.gru_encoder import make_packed
    from rnnserve.models import export

    write_models(tmp_path)
    export.export_torchscript(make_packed(), 6, "gru_ts", tmp_path)
    async with app_client(model_dir=tmp_path, trust_torchscript=True) as (_, client):
        state = await first_state(client, "smoother", 1)
        inputs = [random_streams(np.random.default_rng(2), "traveller", 1)[0].tolist()]
        r = await client.post("/rollout", json={"inputs": inputs, "state": state})
        assert (r.status_code, r.json()["type"]) == (409, "state_mismatch")
        ts = {"inputs": [[[0.0] * 6] * 3], "return_state": True}
        r = await client.post("/models/gru_ts/infer", json=ts)
        assert (r.status_code, r.json()["type"], r.json()["loc"]) == (
            422, "cannot_carry_state", ["return_state"],
        )  # fmt: skip


async def test_the_openapi_document_describes_the_state(
    app_client: AppClient, model_dir: Path
) -> None:
    async with app_client(model_dir=model_dir) as (_, client):
        doc = (await client.get("/openapi.json")).json()
    for path in ("/smooth", "/rollout", "/models/lstm/infer"):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        props = body["schema"]["properties"]
        assert {"state", "return_state"} <= set(props), path
        assert "$defs" not in body["schema"]  # refs inside the document would point at its root
        [state] = [s for s in props["state"]["anyOf"] if s.get("type") == "object"]
        assert {"model", "version", "sequences"} <= set(state["properties"])
        assert {"h", "c", "p", "s"} <= set(state["properties"]["sequences"]["items"]["properties"])
        assert "state_mismatch" in str(doc["paths"][path]["post"]["responses"]["409"])
    schemas = doc["components"]["schemas"]
    assert "state" in schemas["SmoothResponse"]["properties"]


async def test_a_state_made_before_a_reload_changed_the_model_is_refused(
    app_client: AppClient, tmp_path: Path
) -> None:
    """The fingerprint follows the file: after a reload swaps in new GRU weights, a state of
    the old version is a 409 at ``["state", "version"]``, and the new version's own works."""
    write_models(tmp_path)
    token = {"authorization": "Bearer s3cret"}

    async def post(path: str, **kw: Any) -> httpx.Response:
        return await client.post(path, headers={**token, **kw.pop("headers", {})}, **kw)

    async with app_client(model_dir=tmp_path, api_token="s3cret") as (_, client):
        xs = random_streams(np.random.default_rng(4), "gru", 2)
        _, old = await send(post, "gru", xs, None, False)
        torch.manual_seed(99)
        cfg = RecurrentConfig("gru", input_size=5, hidden_size=8, num_layers=2, head_size=3)
        models.save(RecurrentModel(cfg).eval(), tmp_path / ".gru.partial")
        (tmp_path / ".gru.partial").replace(tmp_path / "gru.safetensors")
        reload = await post("/admin/reload")
        assert reload.json()["changed"] == ["gru"]
        doc = {"inputs": [x.tolist() for x in xs], "state": old}
        r = await post("/models/gru/infer", json=doc)
        assert (r.status_code, r.json()["type"], r.json()["loc"]) == (
            409, "state_mismatch", ["state", "version"],
        )  # fmt: skip
        _, new = await send(post, "gru", xs, None, False)
        assert new["version"] == reload.json()["models"]["gru"] != old["version"]
        ys, _ = await send(post, "gru", xs, new, False)
        assert len(ys) == 2


async def test_a_non_finite_input_beside_a_state_is_located(
    app_client: AppClient, model_dir: Path
) -> None:
    """The smoother's stateful batches skip its CPU kernel's own finite check: the engine
    checks each sequence instead, and the 422 says where; a bad request that shares such a
    batch (stateless, or asking only for its final state) fails alone, located too."""
    async with app_client(model_dir=model_dir, device="cpu", max_delay_ms=50) as (_, client):
        state = await first_state(client, "smoother", 2)
        meta = {"state_model": "smoother", "state_version": state["version"]}
        s = np.asarray([seq["s"] for seq in state["sequences"]], np.float32)
        rows = np.ones((5, 16), np.float32)
        bad = rows.copy()
        bad[3, 7] = np.inf
        lengths = np.array([2, 3])
        headers = {"content-type": SAFETENSORS}

        def body(x: np.ndarray, **extra: Any) -> bytes:
            tensors = {"sequences": x, "lengths": lengths}
            meta_ = {k: v for k, v in extra.items() if k != "state"}
            if extra.get("state"):
                tensors["state.s"] = s
            return save(tensors, metadata=meta_)

        answers = await asyncio.gather(
            client.post("/smooth", content=body(bad, state=True, **meta), headers=headers),
            client.post("/smooth", content=body(rows, state=True, **meta), headers=headers),
            client.post("/smooth", content=body(bad), headers=headers),
            client.post("/smooth", content=body(bad, return_state="true"), headers=headers),
        )
        assert [r.status_code for r in answers] == [422, 200, 422, 422]
        for r in (answers[0], answers[2], answers[3]):
            assert (r.json()["type"], r.json()["loc"]) == ("non_finite", ["sequences", 1, 1, 7])
