"""Generate the synchronous client from the asynchronous one, with the ``unasync`` package.

    .venv/bin/python scripts/unasync.py          # rewrite rnnserve/_sync_client.py
    .venv/bin/python scripts/unasync.py --check  # exit 1 if it is not what the source gives

``unasync`` drops ``async``/``await`` and renames tokens (``__aenter__`` -> ``__enter__``,
``AsyncGenerator`` -> ``Generator``, and the names in :data:`RENAMES`); this script adds the
header and takes out the lint exemptions that only async functions need.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "rnnserve" / "_async_client.py"
TARGET = ROOT / "rnnserve" / "_sync_client.py"
COMMAND = "scripts/unasync.py"

#: Names of the async source -> their synchronous twins (beyond unasync's own).
RENAMES = {
    "AsyncClient": "Client",
    "AsyncRolloutStream": "RolloutStream",
    "AsyncSession": "Session",
    "AsyncBaseTransport": "BaseTransport",
    "aclose": "close",
    "aread": "read",
    "aiter_lines": "iter_lines",
    "aiter_raw": "iter_raw",
    "anext": "next",
    "sleep_async": "sleep",
}
#: ruff's ASYNC109 (an async function that takes a timeout) means nothing in sync code, and an
#: exemption nothing needs is itself a lint error.
ASYNC_ONLY_NOQA = "  # noqa: ASYNC109"


def load_unasync() -> ModuleType:
    """The ``unasync`` package, not this script of the same name (whose folder, run as a
    script, is first on ``sys.path``)."""
    here = Path(__file__).resolve().parent
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    try:
        return importlib.import_module("unasync")
    finally:
        sys.path[:] = saved


def header(source: Path) -> str:
    name = source.relative_to(ROOT) if source.is_relative_to(ROOT) else source.name
    return (
        f"# Generated from {name} by `python {COMMAND}`; edit that file and rerun.\n"
        f"# `python {COMMAND} --check` fails while this file is out of date.\n"
    )


def generate(source: Path = SOURCE) -> str:
    """The synchronous module's text for the async module at ``source``."""
    with tempfile.TemporaryDirectory() as tmp:
        async_dir, sync_dir = Path(tmp) / "async", Path(tmp) / "sync"
        async_dir.mkdir()
        shutil.copyfile(source, async_dir / "client.py")
        unasync = load_unasync()
        rule = unasync.Rule(f"{async_dir}/", f"{sync_dir}/", additional_replacements=RENAMES)
        unasync.unasync_files([str(async_dir / "client.py")], rules=[rule])
        text = (sync_dir / "client.py").read_text()
    return header(source) + text.replace(ASYNC_ONLY_NOQA, "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="fail if the file is not current")
    parser.add_argument("--source", type=Path, default=SOURCE, help=argparse.SUPPRESS)
    parser.add_argument("--target", type=Path, default=TARGET, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    text = generate(args.source)
    if not args.check:
        args.target.write_text(text)
        return 0
    if args.target.exists() and args.target.read_text() == text:
        return 0
    print(
        f"{args.target} is not what {args.source} generates: run `python {COMMAND}`",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
