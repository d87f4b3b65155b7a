"""The OpenAPI description built from the served models, default models, settings and the CLI."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import SecretStr

import rnnserve.service.cli
from rnnserve.service.config import Settings, package_version, unknown_environment
from rnnserve.service.engine.runtime import StartupError
from rnnserve.service.http import defaults, openapi
from rnnserve.service.http.app import create_app
from rnnserve.service.http.errors import CATALOGUE, ERROR_TYPES
from rnnserve.service.http.errors import status as status_of
from rnnserve.service.interface import RequestError
from rnnserve.service.logs import THIRD_PARTY, configure_logging, model_line


@dataclass
class Fake:
    name: str
    kind: str
    input_dim: int
    info: dict[str, Any] = field(default_factory=dict)
    version: str = "0123456789ab"
    loaded_at: float = 1.0e9


def served(*models: Fake) -> dict[str, Fake]:
    return {m.name: m for m in models}


BUNDLED = served(Fake("smoother", "smoother", 16), Fake("traveller", "traveller", 6))


def build(models: dict[str, Fake], **settings: Any) -> dict[str, Any]:
    s = Settings(**settings)
    return openapi.build(create_app(s), models, s)


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield k, v
            yield from walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk(v)


def body(schema: dict[str, Any], path: str) -> dict[str, Any]:
    content: dict[str, Any] = schema["paths"][path]["post"]["requestBody"]["content"]
    return content


def test_feature_counts_limits_and_model_names_of_the_served_set() -> None:
    schema = build(BUNDLED, max_sequences_per_request=7, max_sequence_length=99)
    for path, field_name, width in (("/smooth", "sequences", 16), ("/rollout", "inputs", 6)):
        js = body(schema, path)["application/json"]["schema"]
        seqs = js["properties"][field_name]
        assert seqs["maxItems"] == 7
        assert seqs["items"]["maxItems"] == 99
        assert seqs["items"]["items"]["minItems"] == seqs["items"]["items"]["maxItems"] == width
        assert f"{width} " in seqs["description"]
        assert js["properties"]["model"]["enum"] == [path.strip("/").replace("smooth", "smoother")
                                                     .replace("rollout", "traveller")]  # fmt: skip


def test_several_smoothers_of_different_widths_are_named_in_the_description() -> None:
    models = served(Fake("a", "smoother", 4), Fake("b", "smoother", 8))
    schema = build(models, default_smoother="b")
    js = body(schema, "/smooth")["application/json"]["schema"]
    seqs = js["properties"]["sequences"]
    assert seqs["items"]["items"]["maxItems"] == 8  # the default's
    assert "a: 4" in seqs["description"]
    assert "b: 8" in seqs["description"]
    examples = body(schema, "/smooth")["application/json"]["examples"]
    assert len(examples["default model"]["value"]["sequences"][0][0]) == 8
    assert len(examples["model a"]["value"]["sequences"][0][0]) == 4
    # no default: the description says so, and there is no example without "model"
    schema = build(models)
    js = body(schema, "/smooth")["application/json"]["schema"]
    assert "maxItems" not in js["properties"]["sequences"]["items"]["items"]
    assert "Required" in js["properties"]["model"]["description"]
    assert "default model" not in body(schema, "/smooth")["application/json"]["examples"]


def test_media_types_tags_and_every_error_type() -> None:
    schema = build(BUNDLED)
    paths = schema["paths"]
    metrics = paths["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    for path in ("/smooth", "/rollout"):
        op = paths[path]["post"]
        assert "application/x-safetensors" in op["requestBody"]["content"]
        assert "application/x-safetensors" in op["responses"]["200"]["content"]
        assert op["tags"] == ["inference"]
    assert "application/x-ndjson" in paths["/rollout"]["post"]["responses"]["200"]["content"]
    assert "application/x-ndjson" not in paths["/smooth"]["post"]["responses"]["200"]["content"]
    assert paths["/models"]["get"]["tags"] == ["models"]
    assert paths["/healthz"]["get"]["tags"] == paths["/readyz"]["get"]["tags"] == ["health"]
    assert paths["/metrics"]["get"]["tags"] == ["metrics"]
    assert paths["/admin/reload"]["post"]["tags"] == ["admin"]
    assert {t["name"] for t in schema["tags"]} == {
        "inference", "models", "health", "metrics", "admin",
    }  # fmt: skip
    enum = schema["components"]["schemas"]["ErrorBody"]["properties"]["type"]["enum"]
    assert set(enum) == ERROR_TYPES
    assert set(openapi.ERROR_STATUS) == ERROR_TYPES
    # each type is named in the description of its status's response (test_errors.py checks
    # docs/API.md's table against the same catalogue)
    responses = paths["/smooth"]["post"]["responses"]
    for kind, status in openapi.ERROR_STATUS.items():
        entry = f"- `{kind}`: {CATALOGUE[kind].description}"
        assert entry in responses[str(status)]["description"].splitlines(), kind


def test_descriptions_are_plain_text() -> None:
    schema = build(BUNDLED)
    texts = [v for k, v in walk(schema) if k in ("description", "summary") and isinstance(v, str)]
    assert len(texts) > 20
    for text in texts:
        assert "``" not in text, text
        assert not re.search(r":(class|meth|func|mod|attr):`", text), text
    assert openapi.plain("``a`` and :class:`~service.x.Thing`") == "`a` and `Thing`"


def test_the_schema_is_built_after_the_models_load() -> None:
    app = create_app(Settings())
    before = app.openapi()  # no models yet: not cached
    assert "maxItems" not in before["paths"]["/smooth"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]["sequences"]["items"]["items"]  # fmt: skip
    assert app.openapi_schema is None


# -- default models -------------------------------------------------------------------------


def test_default_model_rules() -> None:
    s = Settings()
    assert defaults.default_model(BUNDLED, "smoother", s) == "smoother"
    mine = served(Fake("mine", "smoother", 3))
    assert defaults.default_model(mine, "smoother", s) == "mine"
    assert defaults.default_model(mine, "traveller", s) is None
    two = served(Fake("a", "smoother", 3), Fake("b", "smoother", 3))
    assert defaults.default_model(two, "smoother", s) is None
    assert defaults.default_model(two, "smoother", Settings(default_smoother="b")) == "b"
    with_named = served(*two.values(), Fake("smoother", "smoother", 3))
    assert defaults.default_model(with_named, "smoother", s) == "smoother"
    with pytest.raises(RequestError) as err:
        defaults.resolve(two, "smoother", s)
    assert (status_of(err.value.type), err.value.type, err.value.loc) == (
        422,
        "missing",
        ("model",),
    )
    assert "a, b" in err.value.message
    assert "--default-smoother" in err.value.message
    with pytest.raises(RequestError) as err:
        defaults.resolve(mine, "traveller", s)
    assert (status_of(err.value.type), err.value.type) == (404, "unknown_model")


def test_a_configured_default_must_be_served_and_of_its_kind() -> None:
    names = ["smoother", "traveller"]
    rnnserve.service.cli.check_defaults(Settings(default_smoother="smoother"), names)
    with pytest.raises(StartupError, match="--default-smoother nope: no such"):
        rnnserve.service.cli.check_defaults(Settings(default_smoother="nope"), names)
    with pytest.raises(StartupError, match="is a traveller model, not a smooth"):
        rnnserve.service.cli.check_defaults(Settings(default_smoother="traveller"), names)


# -- settings, CLI, logging -------------------------------------------------------------------


def test_public_settings_hide_the_token() -> None:
    s = Settings(api_token=SecretStr("hunter2-secret"))
    public = s.public()
    assert "hunter2-secret" not in repr(public)
    assert public["api_token"] == "**********"
    assert set(public) == set(Settings.model_fields)


def test_unknown_environment_variables_name_the_closest_setting() -> None:
    warnings = unknown_environment(
        {"RNNSERVE_MAX_BATCH_SIZ": "3", "RNNSERVE_PORT": "1", "HOME": "/", "RNNSERVE_ZZZ": "1"}
    )
    assert len(warnings) == 2
    assert "RNNSERVE_MAX_BATCH_SIZ" in warnings[0]
    assert "RNNSERVE_MAX_BATCH_SIZE" in warnings[0]
    assert "RNNSERVE_ZZZ" in warnings[1]
    assert "did you mean" not in warnings[1]


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as code:
        rnnserve.service.cli.parse_settings(["--version"])
    assert code.value.code == 0
    assert capsys.readouterr().out.strip() == f"rnnserve {package_version()}"
    with pytest.raises(SystemExit):
        rnnserve.service.cli.parse_settings(["--help"])
    text = capsys.readouterr().out
    assert "--model-dir Path" in text
    assert "--default-smoother" in text
    assert "{Path,null}" not in text
    assert "{SecretStr,null}" not in text
    assert "(default: null)" not in text
    assert "``" not in text
    # one default per option
    for block in re.split(r"\n  (?=--)", text):
        assert block.count("(default:") <= 1, block
    assert rnnserve.service.cli.parse_settings(["--port", "9"]).port == 9


def test_third_party_debug_logs_stay_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in THIRD_PARTY:
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    configure_logging(Settings(log_level="debug"))
    assert logging.getLogger("numba.core.ssa").getEffectiveLevel() == logging.WARNING
    monkeypatch.setattr(logging.getLogger("numba"), "level", logging.NOTSET)
    configure_logging(Settings(log_level="debug", log_third_party=True))
    assert logging.getLogger("numba").level == logging.NOTSET


def test_one_start_up_line_per_model() -> None:
    line = model_line(
        "traveller",
        {"kind": "traveller", "device": "cpu", "parameters": 203010,
         "config": {"rollout_backend": "numba"}},
    )  # fmt: skip
    assert line == "model traveller: traveller on cpu, backend numba, 203010 parameters"
    assert "backend" in model_line("smoother", {"kind": "smoother", "device": "cpu"})
    routes = "layer 0: loop 1, openblas 2-12, mkl 13-"
    line = model_line(
        "traveller",
        {"kind": "traveller", "device": "cpu", "parameters": 9,
         "config": {"rollout_backend": "numba", "rollout_routes": routes}},
    )  # fmt: skip
    assert line == (
        f"model traveller: traveller on cpu, backend numba, 9 parameters (GEMM routes: {routes})"
    )


# -- one path per served model, real answers ---------------------------------------------------


def test_a_path_per_model_with_its_widths_and_no_made_up_answers() -> None:
    mine = Fake("my enc", "recurrent", 6, {"shapes": {"input": ["T", 6], "output": ["T", 4]}})
    schema = build(served(*BUNDLED.values(), mine))
    paths = schema["paths"]
    op = paths["/models/my%20enc/infer"]["post"]
    step = body(schema, "/models/my%20enc/infer")["application/json"]["schema"]["properties"][
        "inputs"]["items"]["items"]  # fmt: skip
    assert step["minItems"] == step["maxItems"] == 6
    answer = op["responses"]["200"]["content"]["application/json"]["schema"]
    out_step = answer["properties"]["outputs"]["items"]["items"]
    assert out_step["minItems"] == out_step["maxItems"] == 4
    assert op["operationId"] == "infer_my_enc"
    assert "recurrent: 6 features -> 4 outputs per step" in op["summary"]
    example = body(schema, "/models/my%20enc/infer")["application/json"]["examples"]["example"]
    assert [len(seq) for seq in example["value"]["inputs"]] == [3, 2]
    assert {len(step) for seq in example["value"]["inputs"] for step in seq} == {6}
    # the fakes computed no answers: no 200 examples at all, rather than invented numbers
    for path in ("/models/my%20enc/infer", "/smooth", "/rollout"):
        ok = paths[path]["post"]["responses"]["200"]["content"]
        assert "examples" not in ok["application/json"], path
        assert "example" not in ok["application/json"], path
    assert "example" not in paths["/rollout"]["post"]["responses"]["200"]["content"][
        "application/x-ndjson"]  # fmt: skip


def test_the_answers_are_the_runtimes_and_the_stream_is_cut_in_chunks() -> None:
    outputs = [[[0.5, -0.25], [0.125, 1.0], [0.0, 0.75]], [[1.5, 2.5], [3.5, 4.5]]]
    traveller = Fake("traveller", "traveller", 6, {"example": {"inputs": [], "outputs": outputs}})
    schema = build(served(traveller), rollout_chunk_steps=2)
    op = schema["paths"]["/rollout"]["post"]
    answers = op["responses"]["200"]["content"]["application/json"]["examples"]
    assert answers["default model"]["value"] == {"model": "traveller", "positions": outputs}
    assert answers["model traveller"]["value"]["positions"] == outputs
    stream = op["responses"]["200"]["content"]["application/x-ndjson"]["example"]
    assert stream.splitlines() == [
        '{"sequence":0,"start":0,"positions":[[0.5,-0.25],[0.125,1.0]]}',
        '{"sequence":1,"start":0,"positions":[[1.5,2.5],[3.5,4.5]]}',
        '{"sequence":0,"start":2,"positions":[[0.0,0.75]]}',
        '{"model":"traveller","done":true}',
    ]


def test_no_token_no_padlocks() -> None:
    """Without a token nothing asks for one: no security scheme, no per-operation security
    (Swagger UI then shows no Authorize button); with one, every guarded route has it."""
    bare = build(BUNDLED)
    assert "securitySchemes" not in bare.get("components", {})
    assert not [op for ops in bare["paths"].values() for op in ops.values() if "security" in op]
    guarded = build(BUNDLED, api_token=SecretStr("hunter2-secret"))
    assert "HTTPBearer" in guarded["components"]["securitySchemes"]
    for path in ("/smooth", "/rollout", "/models/{name}/infer"):
        assert guarded["paths"][path]["post"]["security"] == [{"HTTPBearer": []}]
    assert guarded["paths"]["/models"]["get"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in guarded["paths"]["/healthz"]["get"]
