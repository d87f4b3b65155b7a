"""With ``--workers 2``, the HTTP worker processes never load torch or the models; the engine does.

Each worker names its pid in the ``X-Rnnserve-Worker`` header; a process has torch loaded when
torch's shared library is mapped into it (``/proc/<pid>/maps``).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e


def maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def worker_pids(url: str) -> set[int]:
    pids: set[int] = set()
    for _ in range(400):
        # a fresh connection each time: the kernel hands connections to either worker
        r = httpx.get(f"{url}/healthz", headers={"connection": "close"}, timeout=10)
        pids.add(int(r.headers["x-rnnserve-worker"]))
        if len(pids) == 2:
            break
    return pids


def test_http_workers_load_no_torch_and_still_answer(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--workers", "2")
    try:
        x = np.linspace(-1, 1, 3 * 16, dtype=np.float32).reshape(3, 16)
        r = httpx.post(f"{server.url}/smooth", json={"sequences": [x.tolist()]}, timeout=60)
        assert r.status_code == 200
        assert np.asarray(r.json()["sequences"][0]).shape == (3, 16)
        workers = worker_pids(server.url)
        assert len(workers) == 2
        assert set(workers) <= set(children(server.proc.pid))
        assert not any(maps_torch(pid) for pid in workers)
        # the check can see torch where it is: the engine process, a child of the supervisor
        others = set(children(server.proc.pid)) - workers
        assert any(maps_torch(pid) for pid in others)
    finally:
        stop(server)
