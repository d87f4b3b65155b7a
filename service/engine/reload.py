"""What a reload of the model directory looks at: each model's file, its version, and the
directory's state for the optional poll (``reload_poll_s``).

:meth:`rnnserve.service.engine.runtime.ModelRuntime.reload` does the reload itself: it checks
and loads each new or changed file beside the version being served, then swaps it in.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from rnnserve import models
from rnnserve.models import torchscript

log = logging.getLogger(__name__)

VERSION_DIGITS = 12  # of the sha256: enough to tell versions apart, short enough to read


def model_dir(where: Path | None) -> Path:
    return where if where is not None else models.DEFAULT_MODEL_DIR


def model_file(name: str, where: Path | None) -> Path:
    """The file model ``name`` is loaded from (one file per name: the loader refuses two)."""
    root = model_dir(where)
    archive = root / f"{name}{torchscript.SUFFIX}"
    return archive if archive.is_file() else root / f"{name}.safetensors"


def file_version(path: Path) -> str:
    """The first hex digits of the sha256 of the file's bytes: its tensors and its metadata
    (kind and config) both, so any change to what would be served changes the version.

    Only a regular file (or a link to one) is read: a FIFO would block the read for ever and a
    device (a link to ``/dev/zero``) never end it."""
    if not path.is_file():
        raise models.ModelLoadError(f"{path}: not a regular file")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:VERSION_DIGITS]


def directory_state(where: Path | None) -> tuple[tuple[str, int, int, int], ...]:
    """Each file's name, size, modification time and inode: cheap to read, and any write or
    ``os.replace`` in the folder changes it."""
    try:
        entries = list(os.scandir(model_dir(where)))
    except OSError:
        return ()
    state = []
    for entry in entries:
        try:
            st = entry.stat()
        except OSError:  # removed meanwhile
            continue
        state.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ino))
    return tuple(sorted(state))


async def poll_directory(
    where: Path | None,
    period_s: float,
    reload: Callable[[], Awaitable[object]],
    seen: tuple[tuple[str, int, int, int], ...],
) -> None:
    """Call ``reload`` whenever the folder's files change from ``seen`` (their state when the
    served versions were read), looking every ``period_s`` seconds.

    A file caught half-written fails its reload (the old version stays); the write's end
    changes the folder again, and the next look reloads it."""
    while True:
        await asyncio.sleep(period_s)
        now = await asyncio.to_thread(directory_state, where)
        if now != seen:
            seen = now
            try:
                await reload()
            except Exception:  # the poll goes on: the next change may load
                log.exception("reloading the model directory failed")
