"""Imports point one way: http -> codec -> interface; engine -> models; ipc between them.

Checked on the source, at every module's top level: the HTTP layer builds the single-process
server's runtime with an import inside its factory (:func:`rnnserve.service.http.app.create_app`),
so that an HTTP worker of ``--workers N`` never loads torch; a subprocess checks that too.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIGHT = {"torch", "numba.np", "rnnserve.models", "triton"}  # what an HTTP worker never imports
SERVER = {"fastapi", "starlette", "uvicorn"}
OPENTELEMETRY = {"opentelemetry"}  # imported inside functions, once tracing is on


def top_level_imports(path: Path) -> set[str]:
    """Every module imported at the top level of ``path`` (not inside a function)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


def violations(path: Path, forbidden: set[str]) -> list[str]:
    return sorted(
        name
        for name in top_level_imports(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )


def sources(folder: str) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / folder).rglob("*.py"))]


RULES = [
    *(
        (
            m,
            {
                *SERVER,
                "rnnserve.service.http",
                "rnnserve.service.engine",
                "rnnserve.service.ipc",
                "rnnserve.service.codec",
                "rnnserve.client",
            },
        )
        for m in sources("models")
    ),
    ("service/interface.py", {*LIGHT, *SERVER, "numba", "rnnserve"}),
    *(
        (m, {*LIGHT, "rnnserve.service.engine", "rnnserve.service.ipc.engine_side"})
        for m in sources("service/http")
    ),
    *(
        (
            m,
            {
                *LIGHT,
                *SERVER,
                "rnnserve.service.http",
                "rnnserve.service.engine",
                "rnnserve.service.ipc",
            },
        )
        for m in sources("service/codec")
    ),
    *(
        (
            m,
            {
                *LIGHT,
                *SERVER,
                "rnnserve.service.http",
                "rnnserve.service.codec",
                "rnnserve.service.engine",
                *OPENTELEMETRY,
            },
        )
        for m in sources("service/ipc")
    ),
    *(
        (m, {*SERVER, "rnnserve.service.http", "rnnserve.service.codec"})
        for m in sources("service/engine")
    ),
    ("service/engine/batcher.py", {"torch", "numpy", "rnnserve.models"}),
    ("service/engine/continuous.py", {"torch", "numpy", "rnnserve.models"}),
    ("service/metrics.py", {*LIGHT, *SERVER}),
    # tracing: beside both sides and light, and OpenTelemetry only imported once it is on
    (
        "service/tracing.py",
        {
            *LIGHT,
            *SERVER,
            *OPENTELEMETRY,
            "rnnserve.service.http",
            "rnnserve.service.engine",
            "rnnserve.service.ipc",
            "rnnserve.service.codec",
        },
    ),
    ("service/http/tracing.py", OPENTELEMETRY),
    ("service/engine/tracing.py", {"torch", "numpy", "rnnserve.models", *OPENTELEMETRY}),
    ("service/config.py", {*LIGHT, *SERVER}),
    # the rollout settings' values, shared by the configuration and the models: typing only
    ("rnnserve/options.py", {*LIGHT, *SERVER, "numba", "numpy", "pydantic", "rnnserve"}),
    # the client: only the endpoint registry of the server's modules
    *(
        (
            m,
            {
                *LIGHT,
                *SERVER,
                "rnnserve.service.http",
                "rnnserve.service.engine",
                "rnnserve.service.ipc",
                "rnnserve.service.codec",
                "rnnserve.service.interface",
            },
        )
        for m in sources("rnnserve")
    ),
]


@pytest.mark.parametrize(("module", "forbidden"), RULES, ids=[r[0] for r in RULES])
def test_layering(module: str, forbidden: set[str]) -> None:
    assert not violations(ROOT / module, forbidden)


def test_a_rule_catches_a_forbidden_import(tmp_path: Path) -> None:
    planted = tmp_path / "bad.py"
    planted.write_text("import os\nfrom rnnserve.models.packing import pack\n")
    assert violations(planted, {"rnnserve.models"}) == [
        "rnnserve.models.packing",
        "rnnserve.models.packing.pack",
    ]
    assert violations(planted, {"rnnserve.service"}) == []


def test_an_http_worker_loads_neither_torch_nor_the_models() -> None:
    # the worker's app as uvicorn builds it in each worker process (the engine is not reached
    # until the app starts, so the socket need not exist)
    script = (
        "import sys\n"
        "from rnnserve.service.http.app import create_worker_app\n"
        "app = create_worker_app()\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')"
        " or m.startswith('rnnserve.models') or m.startswith('rnnserve.service.engine.')"
        " or m == 'triton')\n"
        "print(type(app.state.runtime).__name__, heavy)\n"
    )
    env = {**os.environ, "_RNNSERVE_ENGINE_SOCKET": "/nonexistent/engine.sock"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
        cwd=ROOT / "tests",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["RemoteRuntime", "[]"]
