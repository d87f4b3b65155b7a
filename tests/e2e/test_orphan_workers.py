"""``kill -9`` of the ``rnnserve --workers 2`` supervisor: its workers and its engine stop too,
and the port is free for the next server."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.server import start_server

pytestmark = pytest.mark.e2e
WAIT_S = 60.0  # bounded; the children stop within a few seconds of the kill


def children(pid: int) -> set[int]:
    """The live processes whose parent is ``pid`` (from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pid and stat[0] != "Z":
                found.add(int(entry.name))
    return found


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of ``pid``; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, ppid = text.rsplit(")", 1)[1].split()[:2]
    return state, int(ppid)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's exit is reaped by whoever adopted it, maybe never)."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        s.listen()
        return True


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_killing_the_supervisor_stops_every_child_and_frees_the_port(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--workers", "2", "--drain-timeout-s", "5")
    port = int(server.url.rsplit(":", 1)[1])
    kids: set[int] = set()
    try:
        kids = children(server.proc.pid)
        # the engine, two workers (and multiprocessing's resource tracker)
        assert len(kids) >= 3, kids
        assert httpx.get(f"{server.url}/readyz", timeout=10).status_code == 200
        assert not port_is_free(port)
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        deadline = time.monotonic() + WAIT_S
        while {k for k in kids if running(k)} and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {k for k in kids if running(k)}
        assert not left, f"still running after the supervisor's kill: {left}"
        assert port_is_free(port)
    finally:
        for kid in children(server.proc.pid) | {k for k in kids if running(k)}:
            os.kill(kid, signal.SIGKILL)
