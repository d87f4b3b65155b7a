"""A real ``rnnserve --workers 2``: the OpenAPI examples, computed by the engine process at
start-up and carried to the HTTP workers, are the answers the server gives to them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e


def test_every_example_answers_as_documented_across_processes(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--workers", "2", "--rollout-chunk-steps", "2")
    try:
        schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
        posted = []
        for path, ops in schema["paths"].items():
            for method, op in ops.items():
                content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
                for name, example in content.get("examples", {}).items():
                    r = httpx.request(
                        method, f"{server.url}{path}", json=example["value"], timeout=30
                    )
                    assert r.status_code == 200, (path, name, r.text)
                    answers = op["responses"]["200"]["content"]["application/json"]["examples"]
                    assert r.json() == answers[name]["value"], (path, name)
                    posted.append(path)
        assert sorted(set(posted)) == [
            "/models/smoother/infer", "/models/traveller/infer", "/rollout", "/smooth"
        ]  # fmt: skip
        op = schema["paths"]["/rollout"]["post"]
        request = op["requestBody"]["content"]["application/json"]["examples"]["default model"]
        r = httpx.post(
            f"{server.url}/rollout",
            json=request["value"],
            headers={"accept": "application/x-ndjson"},
            timeout=30,
        )
        assert r.text == op["responses"]["200"]["content"]["application/x-ndjson"]["example"]
        # GET /models shows the same example and answer per model
        listed = httpx.get(f"{server.url}/models", timeout=10).json()["models"]
        smoother = next(m for m in listed if m["name"] == "smoother")
        direct = httpx.post(
            f"{server.url}/models/smoother/infer",
            json={"inputs": smoother["example"]["inputs"]},
            timeout=30,
        )
        assert direct.json()["outputs"] == smoother["example"]["outputs"]
    finally:
        stop(server)
