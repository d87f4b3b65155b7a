"""Imports point one way: HTTP -> batching/runtime -> models (STYLE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("service/batching.py", {"fastapi", "starlette", "torch", "models", "numpy"}),
        ("service/runtime.py", {"fastapi", "starlette"}),
        ("service/metrics.py", {"fastapi", "starlette", "torch", "models"}),
        ("service/scheduler.py", {"fastapi", "starlette", "torch", "models", "numpy"}),
        ("service/stepping.py", {"fastapi", "starlette"}),
        *(
            (str(p.relative_to(ROOT)), {"service", "fastapi", "starlette", "uvicorn"})
            for p in sorted((ROOT / "models").rglob("*.py"))
        ),
    ],
)
def test_layering(module: str, forbidden: set[str]) -> None:
    bad = imported_roots(ROOT / module) & forbidden
    assert not bad, f"{module} imports {sorted(bad)}"
