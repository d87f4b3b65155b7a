"""Triton's own Python client (``tritonclient.http``, blocking and asyncio) against a real
rnnserve process, one HTTP worker and ``--workers 2``: health, metadata, inference equal to the
native endpoints, a carried state, batching and the protocol's errors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from tests.e2e.server import Server, start_server, stop
from tests.metrics import value

httpclient = pytest.importorskip("tritonclient.http")
aioclient = pytest.importorskip("tritonclient.http.aio")
from tritonclient.utils import InferenceServerException  # noqa: E402

pytestmark = pytest.mark.e2e
# model, its native endpoint, input and output tensor names (the native JSON fields), width
MODELS = [
    ("smoother", "/smooth", "sequences", "sequences", 16),
    ("traveller", "/rollout", "inputs", "positions", 6),
]
# each model's carried state: its parts and their shapes for one sequence
STATES = {"smoother": {"s": (16,)}, "traveller": {"h": (2, 128), "c": (2, 128), "p": (2,)}}
# a batch window long enough that requests sent together share a batch
FLAGS = ("--max-delay-ms", "200")
READY_TIMEOUT_S = 300  # two processes compiling and warming the models on a busy two-core host


@pytest.fixture(scope="module", params=[(), ("--workers", "2")], ids=["one", "workers2"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("tritonclient")
    srv = start_server(where, *FLAGS, *request.param, ready_timeout_s=READY_TIMEOUT_S)
    yield srv
    stop(srv)


def _host(server: Server) -> str:
    return server.url.removeprefix("http://")


def _native(server: Server, path: str, field: str, out: str, seqs: list[np.ndarray]) -> Any:
    answer = httpx.post(f"{server.url}{path}", json={field: [s.tolist() for s in seqs]}, timeout=60)
    assert answer.status_code == 200, answer.text
    return [np.asarray(s, np.float32) for s in answer.json()[out]]


def _seqs(width: int, lengths: tuple[int, ...], seed: int = 11) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]


def test_health_and_metadata(server: Server) -> None:
    client = httpclient.InferenceServerClient(_host(server))
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.get_server_metadata()["name"] == "rnnserve"
    for model, _, in_name, out_name, width in MODELS:
        assert client.is_model_ready(model)
        meta = client.get_model_metadata(model)
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
            (in_name, "FP32", [-1, -1, width]),
            ("lengths", "INT64", [-1]),
            *((f"state.{part}", "FP32", [-1, *dims]) for part, dims in STATES[model].items()),
        ]
        assert [t.get("optional", False) for t in meta["inputs"]] == [False] + [True] * (
            1 + len(STATES[model])
        )
        assert meta["outputs"][0]["name"] == out_name
        assert [t["name"] for t in meta["outputs"][1:]] == [t["name"] for t in meta["inputs"][1:]]
    assert not client.is_model_ready("no-such-model")
    version = client.get_model_metadata("smoother")["versions"][0]
    assert client.is_model_ready("smoother", model_version=version)
    assert not client.is_model_ready("smoother", model_version="0")
    client.close()


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize(("model", "path", "in_name", "out_name", "width"), MODELS)
def test_one_sequence_equals_the_native_endpoint(
    server: Server, model: str, path: str, in_name: str, out_name: str, width: int, binary: bool
) -> None:
    (x,) = _seqs(width, (9,))
    want = _native(server, path, in_name, out_name, [x])[0]
    client = httpclient.InferenceServerClient(_host(server))
    tensor = httpclient.InferInput(in_name, [1, 9, width], "FP32")
    tensor.set_data_from_numpy(x[None], binary_data=binary)
    asked = [httpclient.InferRequestedOutput(out_name, binary_data=binary)]
    version = client.get_model_metadata(model)["versions"][0]
    result = client.infer(model, [tensor], model_version=version, outputs=asked)
    got = result.as_numpy(out_name)
    assert got.shape[:2] == (1, 9)
    np.testing.assert_array_equal(got[0], want)
    client.close()


@pytest.mark.parametrize(("model", "path", "in_name", "out_name", "width"), MODELS)
def test_flat_sequences_with_lengths_equal_the_native_endpoint(
    server: Server, model: str, path: str, in_name: str, out_name: str, width: int
) -> None:
    seqs = _seqs(width, (3, 8, 1))
    want = _native(server, path, in_name, out_name, seqs)
    client = httpclient.InferenceServerClient(_host(server))
    data = httpclient.InferInput(in_name, [12, width], "FP32")
    data.set_data_from_numpy(np.concatenate(seqs))
    lengths = httpclient.InferInput("lengths", [3], "INT64")
    lengths.set_data_from_numpy(np.array([3, 8, 1], np.int64))
    result = client.infer(model, [data, lengths])  # no outputs named: all, as binary data
    np.testing.assert_array_equal(result.as_numpy("lengths"), [3, 8, 1])
    np.testing.assert_array_equal(result.as_numpy(out_name), np.concatenate(want))
    client.close()


def _piece(
    client: Any, model: str, x: np.ndarray, state: tuple[dict[str, np.ndarray], Any], binary: bool
) -> tuple[np.ndarray, tuple[dict[str, np.ndarray], Any]]:
    """``x`` ``[N, T, F]`` from ``state`` (its tensors and the answer's parameters that tie them
    to the model version), asking for the final state by naming its outputs; the outputs and
    the final state."""
    _, _, in_name, out_name, _ = next(m for m in MODELS if m[0] == model)
    tensors, tie = state
    inputs = []
    for name, array in {in_name: x, **tensors}.items():
        tensor = httpclient.InferInput(name, list(array.shape), "FP32")
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    names = [out_name, *(f"state.{part}" for part in STATES[model])]
    asked = [httpclient.InferRequestedOutput(name, binary_data=binary) for name in names]
    result = client.infer(model, inputs, outputs=asked, parameters=tie)
    final = {name: result.as_numpy(name) for name in names[1:]}
    return result.as_numpy(out_name), (final, result.get_response()["parameters"])


@pytest.mark.parametrize("binary", [True, False], ids=["binary", "json"])
@pytest.mark.parametrize("model", list(STATES))
def test_two_pieces_carried_through_the_state_tensors_equal_one_request(
    server: Server, model: str, binary: bool
) -> None:
    width = next(m[4] for m in MODELS if m[0] == model)
    x = np.random.default_rng(5).standard_normal((2, 30, width)).astype(np.float32)
    client = httpclient.InferenceServerClient(_host(server))
    whole, (whole_state, _) = _piece(client, model, x, ({}, None), binary)
    first, state = _piece(client, model, x[:, :12], ({}, None), binary)
    version = client.get_model_metadata(model)["versions"][0]
    assert state[1] == {"state_model": model, "state_version": version}
    for part, dims in STATES[model].items():
        assert state[0][f"state.{part}"].shape == (2, *dims)
    rest, final = _piece(client, model, x[:, 12:], state, binary)
    got = np.concatenate([first, rest], axis=1)
    assert float(np.abs(got - whole).max()) <= 1e-5
    for name, want in whole_state.items():
        assert float(np.abs(final[0][name] - want).max()) <= 1e-5
    stale = {**state[1], "state_version": "0" * 12}
    with pytest.raises(InferenceServerException) as mismatch:
        _piece(client, model, x[:, 12:], (state[0], stale), binary)
    assert mismatch.value.status() == "409"
    client.close()


def test_errors_come_in_the_protocols_form(server: Server) -> None:
    client = httpclient.InferenceServerClient(_host(server))
    x = httpclient.InferInput("sequences", [1, 4, 16], "FP32")
    x.set_data_from_numpy(np.zeros((1, 4, 16), np.float32))
    with pytest.raises(InferenceServerException) as unknown:
        client.infer("no-such-model", [x])
    assert unknown.value.status() == "404"
    assert "no-such-model" in unknown.value.message()
    narrow = httpclient.InferInput("sequences", [1, 4, 3], "FP32")
    narrow.set_data_from_numpy(np.zeros((1, 4, 3), np.float32))
    with pytest.raises(InferenceServerException) as width:
        client.infer("smoother", [narrow])
    assert width.value.status() == "400"
    assert "takes 16" in width.value.message()
    doubles = httpclient.InferInput("sequences", [1, 4, 16], "FP64")
    doubles.set_data_from_numpy(np.zeros((1, 4, 16), np.float64))
    with pytest.raises(InferenceServerException) as dtype:
        client.infer("smoother", [doubles])
    assert dtype.value.status() == "400"
    assert "FP32" in dtype.value.message()
    with pytest.raises(InferenceServerException) as config:  # an extension not served
        client.get_model_config("smoother")
    assert config.value.status() == "404"
    assert "not a path or method" in config.value.message()
    client.close()


def _batch_counts(server: Server) -> tuple[float, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    name = "rnnserve_batch_requests"
    return value(text, f"{name}_count", model="smoother"), value(
        text, f"{name}_sum", model="smoother"
    )


def test_the_asyncio_client_s_concurrent_requests_are_batched_together(server: Server) -> None:
    seqs = _seqs(16, (5, 7, 2, 6, 3, 4, 8, 1))
    want = _native(server, "/smooth", "sequences", "sequences", seqs)
    batches_before, requests_before = _batch_counts(server)

    async def one(client: Any, x: np.ndarray) -> np.ndarray:
        tensor = aioclient.InferInput("sequences", [1, *x.shape], "FP32")
        tensor.set_data_from_numpy(x[None])
        result = await client.infer("smoother", [tensor])
        return np.asarray(result.as_numpy("sequences"))[0]

    async def all_at_once() -> list[np.ndarray]:
        client = aioclient.InferenceServerClient(_host(server))
        try:
            assert await client.is_server_ready()
            return await asyncio.gather(*(one(client, x) for x in seqs))
        finally:
            await client.close()

    got = asyncio.run(all_at_once())
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    batches_after, requests_after = _batch_counts(server)
    assert requests_after - requests_before == len(seqs)
    # fewer batches than requests: some batch served several of them
    assert batches_after - batches_before < len(seqs)
