"""The Open Inference Protocol (KServe v2) routes in-process: metadata, JSON and binary
inference equal to the native endpoints, and errors in the protocol's ``{"error"}`` form."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from tests.integration.conftest import AppClient
from tests.metrics import value

# model, its native endpoint, input and output tensor names, widths in and out
MODELS = [
    ("smoother", "/smooth", "sequences", "sequences", 16, 16),
    ("traveller", "/rollout", "inputs", "positions", 6, 2),
]
HEADER = "Inference-Header-Content-Length"


def _seqs(width: int, lengths: tuple[int, ...], seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, width)).astype(np.float32) for n in lengths]


async def _native(client: httpx.AsyncClient, path: str, field: str, out: str, seqs: Any) -> Any:
    answer = await client.post(path, json={field: [s.tolist() for s in seqs]})
    assert answer.status_code == 200, answer.text
    return [np.asarray(s, np.float32) for s in answer.json()[out]]


def _binary_body(doc: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, dict[str, str]]:
    header = orjson.dumps(doc)
    return header + b"".join(blobs), {HEADER: str(len(header))}


def _read_binary(answer: httpx.Response) -> dict[str, np.ndarray]:
    """The outputs of a binary answer, by name."""
    n = int(answer.headers[HEADER])
    doc = orjson.loads(answer.content[:n])
    out, offset = {}, n
    for o in doc["outputs"]:
        size = o["parameters"]["binary_data_size"]
        dtype = {"FP32": "<f4", "INT64": "<i8"}[o["datatype"]]
        blob = answer.content[offset : offset + size]
        out[o["name"]] = np.frombuffer(blob, dtype).reshape(o["shape"])
        offset += size
    assert offset == len(answer.content)
    return out


async def test_server_metadata_and_health(client: httpx.AsyncClient) -> None:
    meta = (await client.get("/v2")).json()
    assert meta["name"] == "rnnserve"
    assert "binary_tensor_data" in meta["extensions"]
    assert (await client.get("/v2/health/live")).json() == {"live": True}
    assert (await client.get("/v2/health/ready")).json() == {"ready": True}
    ready = await client.get("/v2/models/traveller/ready")
    assert (ready.status_code, ready.json()) == (200, {"name": "traveller", "ready": True})


@pytest.mark.parametrize(("model", "path", "in_name", "out_name", "width", "out_w"), MODELS)
async def test_model_metadata_names_the_tensors_of_its_kind(
    client: httpx.AsyncClient, model: str, path: str, in_name: str, out_name: str, width: int,
    out_w: int,
) -> None:  # fmt: skip
    meta = (await client.get(f"/v2/models/{model}")).json()
    served = {m["name"]: m for m in (await client.get("/models")).json()["models"]}[model]
    assert meta["name"] == model
    assert meta["versions"] == [served["version"]]
    assert meta["inputs"] == [
        {"name": in_name, "datatype": "FP32", "shape": [-1, -1, width]},
        {"name": "lengths", "datatype": "INT64", "shape": [-1]},
    ]
    assert meta["outputs"][0] == {"name": out_name, "datatype": "FP32", "shape": [-1, -1, out_w]}


@pytest.mark.parametrize(("model", "path", "in_name", "out_name", "width", "out_w"), MODELS)
async def test_json_inference_of_one_sequence_equals_the_native_endpoint(
    client: httpx.AsyncClient, model: str, path: str, in_name: str, out_name: str, width: int,
    out_w: int,
) -> None:  # fmt: skip
    (x,) = _seqs(width, (7,))
    want = await _native(client, path, in_name, out_name, [x])
    tensor = {"name": in_name, "datatype": "FP32", "shape": [1, 7, width], "data": x.tolist()}
    answer = await client.post(f"/v2/models/{model}/infer", json={"id": "a1", "inputs": [tensor]})
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    doc = answer.json()
    assert (doc["model_name"], doc["id"]) == (model, "a1")
    (out,) = doc["outputs"]
    assert (out["name"], out["datatype"], out["shape"]) == (out_name, "FP32", [1, 7, out_w])
    np.testing.assert_array_equal(np.asarray(out["data"], np.float32).reshape(7, out_w), want[0])


@pytest.mark.parametrize(("model", "path", "in_name", "out_name", "width", "out_w"), MODELS)
async def test_binary_flat_inference_with_lengths_equals_the_native_endpoint(
    client: httpx.AsyncClient, model: str, path: str, in_name: str, out_name: str, width: int,
    out_w: int,
) -> None:  # fmt: skip
    seqs = _seqs(width, (4, 1, 9))
    want = await _native(client, path, in_name, out_name, seqs)
    data, lengths = np.concatenate(seqs), np.array([4, 1, 9], np.int64)
    doc = {
        "inputs": [
            {"name": in_name, "datatype": "FP32", "shape": list(data.shape),
             "parameters": {"binary_data_size": data.nbytes}},
            {"name": "lengths", "datatype": "INT64", "shape": [3],
             "parameters": {"binary_data_size": lengths.nbytes}},
        ],
        "parameters": {"binary_data_output": True},
    }  # fmt: skip
    body, headers = _binary_body(doc, [data.tobytes(), lengths.tobytes()])
    answer = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/octet-stream"
    out = _read_binary(answer)
    np.testing.assert_array_equal(out["lengths"], lengths)
    np.testing.assert_array_equal(out[out_name], np.concatenate(want))


async def test_only_the_outputs_asked_for_come_each_as_asked(client: httpx.AsyncClient) -> None:
    seqs = _seqs(6, (2, 3))
    data = np.concatenate(seqs)
    doc = {
        "inputs": [
            {"name": "inputs", "datatype": "FP32", "shape": [5, 6], "data": data.tolist()},
            {"name": "lengths", "datatype": "INT64", "shape": [2], "data": [2, 3]},
        ],
        "outputs": [{"name": "lengths", "parameters": {"binary_data": False}}],
    }
    answer = await client.post("/v2/models/traveller/infer", json=doc)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"] == [
        {"name": "lengths", "datatype": "INT64", "shape": [2], "data": [2, 3]}
    ]


async def test_requests_share_the_native_batches_and_metrics(app_client: AppClient) -> None:
    async with app_client(max_delay_ms=200.0) as (_, client):
        (x,) = _seqs(16, (5,))
        tensor = {"name": "sequences", "datatype": "FP32", "shape": [1, 5, 16], "data": x.tolist()}
        answers = await asyncio.gather(
            client.post("/v2/models/smoother/infer", json={"inputs": [tensor]}),
            client.post("/smooth", json={"sequences": [x.tolist()]}),
        )
        assert [a.status_code for a in answers] == [200, 200]
        text = (await client.get("/metrics")).text
    # one batch served both requests: the native and the protocol's share the batcher
    assert value(text, "rnnserve_batch_requests_count", model="smoother") == 1
    assert value(text, "rnnserve_batch_requests_sum", model="smoother") == 2
    duration = "rnnserve_request_duration_seconds_count"
    assert value(text, duration, endpoint="v2_infer", model="smoother", code="200") == 1


def _error(answer: httpx.Response, status: int) -> str:
    assert answer.status_code == status, answer.text
    doc = answer.json()
    assert list(doc) == ["error"]
    assert isinstance(doc["error"], str)
    message: str = doc["error"]
    return message


def _tensor(name: str = "sequences", shape: Any = (1, 2, 16), datatype: str = "FP32") -> Any:
    n = int(np.prod(shape))
    return {"name": name, "datatype": datatype, "shape": list(shape), "data": [0.5] * n}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"inputs": [_tensor(datatype="FP64")]}, "datatype"),
        ({"inputs": [{**_tensor(datatype="INT64"), "data": [1] * 32}]}, "must be FP32"),
        ({"inputs": [_tensor(shape=(2, 16))]}, "[N, T, F]"),
        ({"inputs": [{**_tensor(), "shape": [1, 3, 16]}]}, "shape holds"),
        ({"inputs": [_tensor(shape=(1, 2, 5))]}, "features"),
        ({"inputs": [_tensor(), _tensor("extra")]}, "no input 'extra'"),
        ({"inputs": [{**_tensor(), "data": ["0.5"] * 32}]}, "numbers"),
        ({"inputs": [_tensor(shape=(1, 0, 16))]}, "no sequences"),
        (
            {
                "inputs": [
                    _tensor(shape=(3, 16)),
                    {**_tensor("lengths", (2,), "INT64"), "data": [1, 1]},
                ]
            },
            "add up",
        ),
        ({"inputs": []}, "inputs"),
    ],
)
async def test_bad_input_is_a_400_in_the_protocols_form(
    client: httpx.AsyncClient, doc: dict[str, Any], words: str
) -> None:
    answer = await client.post("/v2/models/smoother/infer", json=doc)
    assert words in _error(answer, 400)


async def test_unknown_model_is_a_404_that_does_not_echo_a_long_name(
    client: httpx.AsyncClient,
) -> None:
    name = "m" * 5000
    message = _error(await client.post(f"/v2/models/{name}/infer", json={}), 404)
    assert len(message) < 600
    _error(await client.get(f"/v2/models/{name}"), 404)
    _error(await client.get("/v2/models/nope/ready"), 404)


async def test_bad_binary_framing_is_a_400(client: httpx.AsyncClient) -> None:
    x = np.zeros((1, 2, 16), np.float32)
    doc = {"inputs": [{**_tensor(), "data": None, "parameters": {"binary_data_size": x.nbytes}}]}
    del doc["inputs"][0]["data"]
    body, headers = _binary_body(doc, [x.tobytes()])
    path = "/v2/models/smoother/infer"
    assert (await client.post(path, content=body, headers=headers)).status_code == 200
    cut = await client.post(path, content=body[:-4], headers=headers)
    assert "cut short" in _error(cut, 400)
    trailing = await client.post(path, content=body + b"\0" * 4, headers=headers)
    assert "binary data" in _error(trailing, 400)
    bad_length = await client.post(path, content=body, headers={HEADER: "lots"})
    assert HEADER in _error(bad_length, 400)
    gz = await client.post(path, content=body, headers={**headers, "Content-Encoding": "gzip"})
    _error(gz, 400)


async def test_a_non_finite_binary_value_is_a_400(client: httpx.AsyncClient) -> None:
    x = np.zeros((1, 2, 16), np.float32)
    x[0, 1, 3] = np.nan
    doc = {"inputs": [{"name": "sequences", "datatype": "FP32", "shape": [1, 2, 16],
                       "parameters": {"binary_data_size": x.nbytes}}]}  # fmt: skip
    body, headers = _binary_body(doc, [x.tobytes()])
    answer = await client.post("/v2/models/smoother/infer", content=body, headers=headers)
    assert "step 1, feature 3" in _error(answer, 400)


async def test_limits_are_the_native_ones(app_client: AppClient) -> None:
    async with app_client(max_sequence_length=4) as (_, client):
        answer = await client.post(
            "/v2/models/smoother/infer", json={"inputs": [_tensor(shape=(1, 5, 16))]}
        )
        assert "limit is 4" in _error(answer, 413)


async def test_the_token_guards_models_and_inference_not_health(app_client: AppClient) -> None:
    async with app_client(api_token="s3cret") as (_, client):
        assert (await client.get("/v2/health/ready")).status_code == 200
        assert (await client.get("/v2")).status_code == 200
        _error(await client.get("/v2/models/smoother"), 401)
        _error(await client.post("/v2/models/smoother/infer", json={"inputs": [_tensor()]}), 401)
        auth = {"Authorization": "Bearer s3cret"}
        ok = await client.post(
            "/v2/models/smoother/infer", json={"inputs": [_tensor()]}, headers=auth
        )
        assert ok.status_code == 200


async def test_the_routes_are_in_the_openapi_document(client: httpx.AsyncClient) -> None:
    paths = (await client.get("/openapi.json")).json()["paths"]
    for path in ("/v2", "/v2/health/live", "/v2/health/ready", "/v2/models/{name}",
                 "/v2/models/{name}/ready", "/v2/models/{name}/infer"):  # fmt: skip
        assert path in paths
    assert paths["/v2/models/{name}/infer"]["post"]["tags"] == ["inference"]
    assert set(paths["/v2/models/{name}/infer"]["post"]["responses"]) >= {"200", "400", "404"}


async def test_paths_with_the_served_version_answer_and_others_are_404(
    client: httpx.AsyncClient,
) -> None:
    version = (await client.get("/v2/models/smoother")).json()["versions"][0]
    at = f"/v2/models/smoother/versions/{version}"
    assert (await client.get(at)).json()["versions"] == [version]
    assert (await client.get(f"{at}/ready")).json() == {"name": "smoother", "ready": True}
    answer = await client.post(f"{at}/infer", json={"inputs": [_tensor()]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model_version"] == version
    other = "/v2/models/smoother/versions/0"
    assert version in _error(await client.get(other), 404)
    _error(await client.get(f"{other}/ready"), 404)
    _error(await client.post(f"{other}/infer", json={"inputs": [_tensor()]}), 404)
