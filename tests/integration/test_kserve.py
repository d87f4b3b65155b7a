"""The Open Inference Protocol (KServe v2) routes in-process: metadata, JSON and binary
inference equal to the native endpoints, and errors in the protocol's ``{"error"}`` form."""

from __future__ import annotations

import asyncio
from pathlib import Path
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
    optional = [
        {"name": "lengths", "datatype": "INT64", "shape": [-1], "optional": True},
        *(
            {"name": f"state.{part}", "datatype": "FP32", "shape": [-1, *dims], "optional": True}
            for part, dims in STATEFUL[model][3].items()
        ),
    ]
    assert meta["inputs"] == [
        {"name": in_name, "datatype": "FP32", "shape": [-1, -1, width]},
        *optional,
    ]
    assert meta["outputs"] == [
        {"name": out_name, "datatype": "FP32", "shape": [-1, -1, out_w]},
        *optional,
    ]


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


async def test_paths_and_methods_the_protocol_lacks_answer_in_its_form(
    client: httpx.AsyncClient,
) -> None:
    """Extensions not served (configuration, statistics, repository) and wrong methods: 404 and
    405 as ``{"error": ...}``, which the protocol's clients read; other paths keep rnnserve's
    own form."""
    for path in ("/v2/models/smoother/config", "/v2/models/smoother/stats", "/v2/repository/index"):
        assert "Not Found" in _error(await client.get(path), 404)
    assert "Method Not Allowed" in _error(await client.get("/v2/models/smoother/infer"), 405)
    native = await client.get("/nope")
    assert (native.status_code, native.json()["type"]) == (404, "http_error")


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


# -- carried state ------------------------------------------------------------------------------

# model -> (input, output, width in, the state's parts and their shapes)
STATEFUL = {
    "smoother": ("sequences", "sequences", 16, {"s": (16,)}),
    "traveller": ("inputs", "positions", 6, {"h": (2, 128), "c": (2, 128), "p": (2,)}),
}
TOLERANCE = 1e-5
Carried = tuple[dict[str, np.ndarray], dict[str, str]]  # the state's tensors, and its tie


def _flat_inputs(in_name: str, xs: list[np.ndarray]) -> list[tuple[str, str, np.ndarray]]:
    lengths = np.array([len(x) for x in xs], np.int64)
    return [(in_name, "FP32", np.concatenate(xs)), ("lengths", "INT64", lengths)]


def _state_request(
    model: str, xs: list[np.ndarray], state: Carried | None, binary: bool
) -> tuple[bytes, dict[str, str]]:
    """A flat request of ``xs`` from ``state``, asking for the final state: in binary, with
    the parameter ``return_state``; in JSON, by naming the state's outputs."""
    in_name, out_name, _, parts = STATEFUL[model]
    tensors = _flat_inputs(in_name, xs)
    params: dict[str, Any] = {}
    if state is not None:
        tensors += [(name, "FP32", array) for name, array in state[0].items()]
        params.update(state[1])
    doc: dict[str, Any] = {"inputs": []}
    blobs = []
    for name, datatype, array in tensors:
        entry: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            entry["parameters"] = {"binary_data_size": array.nbytes}
            blobs.append(array.tobytes())
        else:
            entry["data"] = array.tolist()
        doc["inputs"].append(entry)
    if binary:
        params.update(binary_data_output=True, return_state=True)
    else:
        names = [out_name, "lengths", *(f"state.{p}" for p in parts)]
        doc["outputs"] = [{"name": n} for n in names]
    if params:
        doc["parameters"] = params
    if not binary:
        return orjson.dumps(doc), {"content-type": "application/json"}
    return _binary_body(doc, blobs)


def _outputs(answer: httpx.Response) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """An answer's outputs by name, and its parameters."""
    if HEADER in answer.headers:
        n = int(answer.headers[HEADER])
        return _read_binary(answer), orjson.loads(answer.content[:n]).get("parameters", {})
    doc = answer.json()
    out = {}
    for o in doc["outputs"]:
        dtype = {"FP32": np.float32, "INT64": np.int64}[o["datatype"]]
        out[o["name"]] = np.asarray(o["data"], dtype).reshape(o["shape"])
    return out, doc.get("parameters", {})


async def _send_carried(
    client: httpx.AsyncClient, model: str, xs: list[np.ndarray], state: Carried | None,
    binary: bool,
) -> tuple[list[np.ndarray], Carried]:  # fmt: skip
    body, headers = _state_request(model, xs, state, binary)
    answer = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    out, params = _outputs(answer)
    _, out_name, _, parts = STATEFUL[model]
    ys = np.split(out[out_name], np.cumsum(out["lengths"])[:-1])
    final = {f"state.{p}": out[f"state.{p}"] for p in parts}
    for p, shape in parts.items():
        assert final[f"state.{p}"].shape == (len(xs), *shape)
    return ys, (final, params)


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert float(np.abs(g - w).max()) <= TOLERANCE


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("model", list(STATEFUL))
async def test_pieces_carried_through_state_tensors_equal_the_whole_sequence(
    client: httpx.AsyncClient, model: str, binary: bool
) -> None:
    rng = np.random.default_rng(len(model) + binary)
    width = STATEFUL[model][2]
    xs = [rng.standard_normal((n, width)).astype(np.float32) for n in (23, 9, 31)]
    whole, (whole_state, _) = await _send_carried(client, model, xs, None, binary)
    versions = {m["name"]: m["version"] for m in (await client.get("/models")).json()["models"]}
    cuts = [(0, 4, 6, 23), (0, 1, 5, 9), (0, 17, 18, 31)]  # three pieces of each sequence
    outs: list[list[np.ndarray]] = [[] for _ in xs]
    state: Carried | None = None
    for j in range(3):
        piece = [x[c[j] : c[j + 1]] for x, c in zip(xs, cuts, strict=True)]
        ys, state = await _send_carried(client, model, piece, state, binary)
        assert state[1] == {"state_model": model, "state_version": versions[model]}
        for i, y in enumerate(ys):
            outs[i].append(y)
    assert state is not None
    _assert_close([np.concatenate(o) for o in outs], whole)
    for name, want in whole_state.items():
        assert float(np.abs(state[0][name] - want).max()) <= TOLERANCE
    # the same piece started afresh differs: the carried state is what makes them equal
    second = [x[c[1] : c[2]] for x, c in zip(xs, cuts, strict=True)]
    fresh, _ = await _send_carried(client, model, second, None, binary)
    assert float(np.abs(fresh[0] - whole[0][cuts[0][1] : cuts[0][2]]).max()) > 1e-3


async def test_a_batched_request_carries_its_state_too(client: httpx.AsyncClient) -> None:
    """[N, T, F] in, the state's outputs beside [N, T, F_out], asked by the parameter."""
    x = np.random.default_rng(8).standard_normal((2, 12, 6)).astype(np.float32)

    def doc(part: np.ndarray, state: dict[str, Any] | None) -> dict[str, Any]:
        inputs = [{"name": "inputs", "datatype": "FP32", "shape": list(part.shape),
                   "data": part.tolist()}]  # fmt: skip
        params: dict[str, Any] = {"return_state": True}
        if state is not None:
            inputs += [{"name": n, "datatype": "FP32", "shape": list(v.shape), "data": v.tolist()}
                       for n, v in state["tensors"].items()]  # fmt: skip
            params.update(state["params"])
        return {"inputs": inputs, "parameters": params}

    path = "/v2/models/traveller/infer"
    whole, _ = _outputs(await client.post(path, json=doc(x, None)))
    first, params = _outputs(await client.post(path, json=doc(x[:, :5], None)))
    assert set(first) == {"positions", "state.h", "state.c", "state.p"}
    carried = {"tensors": {n: v for n, v in first.items() if n.startswith("state.")},
               "params": params}  # fmt: skip
    rest, _ = _outputs(await client.post(path, json=doc(x[:, 5:], carried)))
    got = np.concatenate([first["positions"], rest["positions"]], axis=1)
    assert float(np.abs(got - whole["positions"]).max()) <= TOLERANCE


async def test_without_return_state_the_answer_has_no_state(client: httpx.AsyncClient) -> None:
    x = np.zeros((1, 3, 6), np.float32)
    tensor = {"name": "inputs", "datatype": "FP32", "shape": [1, 3, 6], "data": x.tolist()}
    answer = await client.post("/v2/models/traveller/infer", json={"inputs": [tensor]})
    out, params = _outputs(answer)
    assert (set(out), params) == ({"positions"}, {})


async def _a_state(client: httpx.AsyncClient, model: str, n: int = 2) -> Carried:
    width = STATEFUL[model][2]
    xs = [np.full((3, width), 0.25, np.float32)] * n
    _, state = await _send_carried(client, model, xs, None, binary=True)
    return state


def _infer_from(
    model: str, tensors: dict[str, np.ndarray], params: dict[str, Any], n: int = 2
) -> dict[str, Any]:
    in_name, _, width, _ = STATEFUL[model]
    x = np.full((n, 2, width), 0.5, np.float32)
    inputs = [{"name": in_name, "datatype": "FP32", "shape": list(x.shape), "data": x.tolist()}]
    for name, array in tensors.items():
        inputs.append(
            {"name": name, "datatype": "FP32", "shape": list(array.shape), "data": array.tolist()}
        )
    return {"inputs": inputs, "parameters": params}


async def test_a_state_of_another_version_or_model_is_a_409(client: httpx.AsyncClient) -> None:
    tensors, params = await _a_state(client, "traveller")
    path = "/v2/models/traveller/infer"
    ok = await client.post(path, json=_infer_from("traveller", tensors, params))
    assert ok.status_code == 200, ok.text
    other_version = {**params, "state_version": "0" * 12}
    answer = await client.post(path, json=_infer_from("traveller", tensors, other_version))
    assert "version" in _error(answer, 409)
    _, smoother_tie = await _a_state(client, "smoother")
    other_model = _infer_from("traveller", tensors, {**params, **smoother_tie})
    assert "'smoother'" in _error(await client.post(path, json=other_model), 409)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda t, p: ({**t, "state.h": t["state.h"][:, :1]}, p), "must have shape [2, 2, 128]"),
        (lambda t, p: ({**t, "state.p": t["state.p"][:1]}, p), "one row per sequence"),
        (lambda t, p: ({k: v for k, v in t.items() if k != "state.c"}, p), "'state.c' is required"),
        (lambda t, p: ({**t, "state.q": t["state.p"]}, p), "no state part 'q'"),
        (lambda t, p: (t, {"state_model": p["state_model"]}), "'state_version' is required"),
        (lambda t, p: (t, {**p, "state_version": 7}), "must be a string"),
        (lambda t, p: (t, {**p, "return_state": "yes"}), "'return_state' must be true or false"),
    ],
    ids=["inner-dims", "rows", "missing-part", "unknown-part", "no-version", "version-type",
         "return-state-type"],
)  # fmt: skip
async def test_a_bad_state_is_a_400_in_the_protocols_form(
    client: httpx.AsyncClient, change: Any, words: str
) -> None:
    tensors, params = await _a_state(client, "traveller")
    bad_tensors, bad_params = change(tensors, params)
    doc = _infer_from("traveller", bad_tensors, bad_params)
    answer = await client.post("/v2/models/traveller/infer", json=doc)
    assert words in _error(answer, 400)


async def test_a_non_finite_or_int64_state_is_a_400(client: httpx.AsyncClient) -> None:
    tensors, params = await _a_state(client, "smoother", 1)
    s = tensors["state.s"].copy()
    s[0, 3] = np.inf
    doc = {"inputs": [{"name": "sequences", "datatype": "FP32", "shape": [1, 2, 16],
                       "parameters": {"binary_data_size": 128}},
                      {"name": "state.s", "datatype": "FP32", "shape": [1, 16],
                       "parameters": {"binary_data_size": 64}}],
           "parameters": params}  # fmt: skip
    body, headers = _binary_body(doc, [np.zeros((1, 2, 16), np.float32).tobytes(), s.tobytes()])
    answer = await client.post("/v2/models/smoother/infer", content=body, headers=headers)
    assert "not finite" in _error(answer, 400)
    as_int = {"name": "state.s", "datatype": "INT64", "shape": [1, 16], "data": [0] * 16}
    doc = {"inputs": [_tensor(), as_int], "parameters": params}
    answer = await client.post("/v2/models/smoother/infer", json=doc)
    assert "must be FP32" in _error(answer, 400)


async def test_a_model_without_state_lists_none_and_refuses_one(
    app_client: AppClient, tmp_path: Path
) -> None:
    """TorchScript carries no state: its metadata has no state.<part>, and asking for one is
    cannot_carry_state, a 400 here."""
    from examples.gru_encoder import make_packed
    from rnnserve.models import export

    export.export_torchscript(make_packed(), 6, "gru_ts", tmp_path)
    async with app_client(model_dir=tmp_path, trust_torchscript=True) as (_, client):
        meta = (await client.get("/v2/models/gru_ts")).json()
        names = [t["name"] for t in meta["inputs"] + meta["outputs"]]
        assert names == ["inputs", "lengths", "outputs", "lengths"]
        x = {"name": "inputs", "datatype": "FP32", "shape": [1, 3, 6], "data": [0.0] * 18}
        path = "/v2/models/gru_ts/infer"
        asked = await client.post(path, json={"inputs": [x], "parameters": {"return_state": True}})
        assert "carries no state" in _error(asked, 400)
        named = await client.post(path, json={"inputs": [x], "outputs": [{"name": "state.h"}]})
        assert "carries no state" in _error(named, 400)
        h = {"name": "state.h", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}
        tie = {"state_model": "gru_ts", "state_version": meta["versions"][0]}
        sent = await client.post(path, json={"inputs": [x, h], "parameters": tie})
        assert "carries no state" in _error(sent, 400)
