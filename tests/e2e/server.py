"""Start and stop real ``rnnserve`` processes on free loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log


def start_server(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, ready_timeout_s: float = 60.0
) -> Server:
    """``rnnserve --port <free port> *args`` in ``tmp_path``, once its ``/readyz`` answers 200.

    ``env`` adds to the caller's environment without its ``RNNSERVE_*`` variables. Raises if it
    exits first or is not ready within ``ready_timeout_s`` (then killed).
    """
    port = free_port()
    exe = Path(sys.executable).with_name("rnnserve")
    log = tmp_path / f"rnnserve-{port}.log"
    proc = subprocess.Popen(
        [str(exe), "--port", str(port), *args],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        # only the settings a test names: none leak in from the caller's RNNSERVE_* variables
        env={
            **{k: v for k, v in os.environ.items() if not k.startswith("RNNSERVE_")},
            **(env or {}),
        },
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rnnserve exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return Server(proc, url, log)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"rnnserve did not become ready:\n{log.read_text()}")


def stop(server: Server) -> None:
    """SIGTERM, then check the shutdown was graceful (uvicorn re-raises the signal at exit)."""
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(timeout=30)
    log = server.log.read_text()
    assert code in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log, log
