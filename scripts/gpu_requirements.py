"""Print, one per line, what a GPU host needs besides its own torch, triton and jax.

``scripts/gpu_wheels.sh`` downloads wheels for these and ``scripts/gpu_check.sh`` installs them:
rnnserve's runtime dependencies from pyproject.toml except torch, plus the test and benchmark
tools that ``tests/gpu``, ``tests/unit/models/test_rollout_backends.py`` and the end-to-end
benchmark import (pytest and hypothesis included, in case the host lacks them).

``--missing``: only those the running interpreter has no distribution of, so that a GPU host
installs (and a wheelhouse carries) only what it lacks; ``NAME...``: only those named.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOST_PROVIDES = {"torch"}  # the host's CUDA build; never replaced from a wheelhouse
TOOLS = {"pytest", "pytest-timeout", "pytest-asyncio", "hypothesis", "httpx", "aiohttp", "pandas"}


def _name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    return match.group(0).lower().replace("_", "-") if match else requirement


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    runtime = [r for r in project["dependencies"] if _name(r) not in HOST_PROVIDES]
    tools = [r for r in project["optional-dependencies"]["test"] if _name(r) in TOOLS]
    return [*runtime, *tools]


def installed(requirement: str) -> bool:
    """Whether this interpreter has a distribution of the requirement's project (any version:
    a GPU host's own builds are kept)."""
    try:
        importlib.metadata.version(_name(requirement))
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("names", nargs="*", help="only these projects")
    parser.add_argument("--missing", action="store_true", help="only what is not installed")
    args = parser.parse_args(argv)
    wanted = {n.lower().replace("_", "-") for n in args.names}
    chosen = [
        r
        for r in requirements()
        if (not wanted or _name(r) in wanted) and not (args.missing and installed(r))
    ]
    sys.stdout.write("".join(f"{r}\n" for r in chosen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
