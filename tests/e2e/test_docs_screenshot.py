"""The docs page renders in a real headless browser against a real rnnserve, with no network.

Needs Debian's ``chromium`` (``scripts/install.sh --test`` installs it).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from tests.e2e.server import start_server, stop

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None, "chromium is missing: run scripts/install.sh --test"
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--disable-gpu",
            "--no-sandbox",
            "--no-first-run",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,2000",
            "--virtual-time-budget=15000",  # lets the page fetch /openapi.json and render
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def png_pixels(path: Path) -> tuple[int, int, bytes]:
    """Width, height and the decompressed scanlines of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    idat, pos = b"", 8
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        if kind == b"IDAT":
            idat += data[pos + 8 : pos + 8 + n]
        pos += 12 + n
    return width, height, zlib.decompress(idat)


@pytest.mark.timeout(120)
def test_swagger_ui_renders_both_endpoints_offline_and_start_up_logs(tmp_path: Path) -> None:
    # one server for this and the start-up log checks below (each start costs seconds)
    server = start_server(
        tmp_path,
        "--device", "cpu", "--log-level", "debug", "--api-token", "tok-do-not-log",
        env={"RNNSERVE_MAX_BATCH_SIZ": "3"},
    )  # fmt: skip
    try:
        log = server.log.read_text()
        assert "RNNSERVE_MAX_BATCH_SIZ is not an rnnserve setting" in log
        assert "did you mean RNNSERVE_MAX_BATCH_SIZE?" in log
        assert "model smoother: smoother on cpu, backend numba, 32 parameters" in log
        assert "model traveller: traveller on cpu, backend " in log
        assert '"max_batch_size":64' in log  # the effective settings line
        assert "tok-do-not-log" not in log
        assert " numba." not in log  # numba's debug loggers stay quiet
        url = f"{server.url}/docs"
        dom = chromium(tmp_path, "--dump-dom", url)
        assert dom.returncode == 0, dom.stderr[-2000:]
        html = dom.stdout
        assert 'class="swagger-ui' in html, html[:2000]
        assert 'data-path="/smooth"' in html, html[-3000:]
        assert 'data-path="/rollout"' in html
        shot = tmp_path / "docs.png"
        run = chromium(tmp_path, f"--screenshot={shot}", url)
        assert run.returncode == 0, run.stderr[-2000:]
        width, height, pixels = png_pixels(shot)
        assert (width, height) == (1280, 2000)
        assert shot.stat().st_size > 20_000  # text and colour, not a blank page
        assert len(set(pixels[: 1280 * 4 * 600])) > 20
    finally:
        stop(server)
