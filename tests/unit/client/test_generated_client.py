"""The synchronous client is generated from the asynchronous one (scripts/unasync.py), and both
take their paths and field names from the endpoint registry."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import orjson

from rnnserve.client import AsyncClient, Client
from rnnserve.service.endpoints import INFER, ROLLOUT, SMOOTH

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "unasync.py"
SOURCE = ROOT / "rnnserve" / "_async_client.py"
GENERATED = ROOT / "rnnserve" / "_sync_client.py"


def unasync(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )


def test_the_sync_client_is_what_the_async_source_generates() -> None:
    done = unasync("--check")
    assert done.returncode == 0, f"{done.stderr}\nrun: .venv/bin/python scripts/unasync.py"


def test_the_check_fails_once_the_async_source_changes(tmp_path: Path) -> None:
    planted = tmp_path / "_async_client.py"
    source = SOURCE.read_text()
    assert "await response.aread()" in source
    planted.write_text(source.replace("await response.aread()", "await response.aread()  # x", 1))
    before = GENERATED.read_text()

    done = unasync("--check", "--source", planted, "--target", GENERATED)
    assert done.returncode == 1
    assert "is not what" in done.stderr
    assert GENERATED.read_text() == before  # --check writes nothing

    out = tmp_path / "_sync_client.py"
    assert unasync("--source", planted, "--target", out).returncode == 0
    assert "response.read()  # x" in out.read_text()
    assert unasync("--check", "--source", planted, "--target", out).returncode == 0


def test_the_generated_module_has_no_async_left() -> None:
    tree = ast.parse(GENERATED.read_text())
    asynchronous = (ast.AsyncFunctionDef, ast.Await, ast.AsyncFor, ast.AsyncWith)
    assert not [type(n).__name__ for n in ast.walk(tree) if isinstance(n, asynchronous)]
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert {"Client", "RolloutStream"} <= names
    assert not {n for n in names if n.startswith("Async") or n in ("anext", "sleep_async")}
    assert GENERATED.read_text().startswith("# Generated from rnnserve/_async_client.py")


def test_importing_the_client_imports_neither_torch_nor_fastapi() -> None:
    script = (
        "import sys\n"
        "import rnnserve.client\n"
        "print(sorted(m for m in ('torch', 'fastapi', 'starlette') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.strip() == "[]"


def recorder(seen: list[tuple[str, list[str]]], field: str, out_field: str) -> httpx.MockTransport:
    """Answers every call with one ``[T, 2]`` output per sequence, recording path and fields."""

    def answer(request: httpx.Request) -> httpx.Response:
        body = orjson.loads(request.read())
        seen.append((request.url.raw_path.decode(), sorted(body)))
        outputs = [[[0.0, 1.0]] * len(seq) for seq in body[field]]
        return httpx.Response(200, json={out_field: outputs})

    return httpx.MockTransport(answer)


def test_both_clients_call_the_registrys_paths_with_its_field_names() -> None:
    x = np.zeros((3, 6), dtype=np.float32)
    cases = [
        (SMOOTH, SMOOTH.path, lambda c: c.smooth(x)),
        (ROLLOUT, ROLLOUT.path, lambda c: c.rollout(x)),
        (INFER, "/models/my%2Fnet/infer", lambda c: c.infer("my/net", x)),
    ]
    for endpoint, path, call in cases:
        seen: list[tuple[str, list[str]]] = []
        transport = recorder(seen, endpoint.input_field, endpoint.output_field)
        with Client("http://rnnserve", binary="never", transport=transport) as client:
            out = call(client)
        assert out.shape == (3, 2)
        assert seen == [(path, [endpoint.input_field])]


async def test_the_async_client_calls_the_same_paths() -> None:
    x = np.zeros((2, 6), dtype=np.float32)
    seen: list[tuple[str, list[str]]] = []
    transport = recorder(seen, ROLLOUT.input_field, ROLLOUT.output_field)
    async with AsyncClient("http://rnnserve", binary="never", transport=transport) as client:
        out = await client.rollout(x, model="traveller")
    assert out.shape == (2, 2)
    assert seen == [(ROLLOUT.path, sorted([ROLLOUT.input_field, "model"]))]
