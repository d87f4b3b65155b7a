"""Reliability against real ``rnnserve`` processes: deadlines, the bearer token, slow bodies,
and a storm of large bodies and slow-loris clients under a memory budget."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save

from tests.e2e import rawhttp
from tests.e2e.server import Server, start_server, stop

pytestmark = pytest.mark.e2e

ROW6 = [0.1] * 6
MiB = 1024 * 1024
SAFETENSORS = "application/x-safetensors"


def _status(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` size in bytes (VmRSS: now; VmHWM: the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def test_deadlines_end_requests_and_the_server_goes_on(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--request-timeout-s", "0.5", "--rollout-chunk-steps", "16")
    try:
        long = {"inputs": [[ROW6] * 100_000]}  # seconds of rollout on this machine
        started = time.monotonic()
        r = httpx.post(f"{server.url}/rollout", json=long, timeout=30)
        assert r.status_code == 504, r.text
        assert r.json()["type"] == "deadline_exceeded"
        assert time.monotonic() - started < 5
        r = httpx.post(
            f"{server.url}/rollout", json=long, headers={"X-Request-Timeout": "0.2"}, timeout=30
        )
        assert r.status_code == 504
        # the rollouts left the running batch: a short one is answered at once
        started = time.monotonic()
        r = httpx.post(f"{server.url}/rollout", json={"inputs": [[ROW6] * 5]}, timeout=30)
        assert r.status_code == 200
        assert time.monotonic() - started < 0.5
        text = httpx.get(f"{server.url}/metrics").text
        assert 'rnnserve_requests_expired_total{endpoint="rollout"} 2.0' in text
    finally:
        stop(server)


def test_the_bearer_token_guards_inference_and_metrics(tmp_path: Path) -> None:
    server = start_server(tmp_path, env={"RNNSERVE_API_TOKEN": "t0ken"})
    try:
        body = {"sequences": [[[0.5] * 16]]}
        r = httpx.post(f"{server.url}/smooth", json=body)
        assert r.status_code == 401
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        auth = {"Authorization": "Bearer t0ken"}
        assert httpx.post(f"{server.url}/smooth", json=body, headers=auth).status_code == 200
        assert httpx.get(f"{server.url}/metrics", headers=auth).status_code == 200
        assert httpx.get(f"{server.url}/healthz").status_code == 200
        assert httpx.get(f"{server.url}/readyz").status_code == 200
    finally:
        stop(server)


def test_an_unreadable_token_file_stops_the_start(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("rnnserve")
    missing = tmp_path / "no-such-token"
    proc = subprocess.run(
        [str(exe), "--api-token-file", str(missing)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--api-token-file" in lines[0]
    assert "cannot read the token file" in lines[0]


def _slow_client(url: str, declared: int, stop_at: float, results: list[int]) -> None:
    """Declares ``declared`` bytes, then trickles a byte every 0.2 s."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(
            b"POST /smooth HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % declared
        )
        reply = b""
        s.settimeout(0.2)
        while time.monotonic() < stop_at:
            try:
                s.sendall(b" ")
            except OSError:
                break
            try:
                reply += s.recv(65536)
                if reply:
                    break
            except TimeoutError:
                pass
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1") else 0
        results.append(status)


def _big_body(mib: int, seed: int) -> bytes:
    rows = mib * MiB // (16 * 4)
    rng = np.random.default_rng(seed)
    data = rng.standard_normal((rows, 16), dtype=np.float32)
    lengths = np.full(10, rows // 10, dtype=np.int64)
    lengths[-1] += rows - lengths.sum()
    return save({"sequences": data, "lengths": lengths})


def test_a_storm_of_large_and_slow_bodies_stays_within_memory(tmp_path: Path) -> None:
    budget = 256 * MiB
    server: Server = start_server(
        tmp_path,
        "--max-inflight-bytes", str(budget),
        "--body-timeout-s", "8",
        "--max-request-timesteps", "2000000",
    )  # fmt: skip
    pid = server.proc.pid
    try:
        baseline = _status(pid, "VmRSS")
        bodies = [_big_body(20 + (i * 40) // 15, i) for i in range(16)]  # 20..60 MiB
        statuses: list[int] = []
        slow: list[int] = []
        normal: list[float] = []
        stop_at = time.monotonic() + 30
        peak = [baseline]

        def watch() -> None:
            while time.monotonic() < stop_at and server.proc.poll() is None:
                peak[0] = max(peak[0], _status(pid, "VmRSS"))
                time.sleep(0.05)

        def big(body: bytes) -> None:
            headers = {"content-type": SAFETENSORS, "accept": SAFETENSORS}
            r = httpx.post(f"{server.url}/smooth", content=body, headers=headers, timeout=60)
            statuses.append(r.status_code)

        def normal_client() -> None:
            # a small request every 0.2 s, retried on 503 like rnnserve.client does
            while time.monotonic() < stop_at - 12:
                started = time.monotonic()
                while True:
                    r = httpx.post(
                        f"{server.url}/smooth", json={"sequences": [[[0.5] * 16] * 10]}, timeout=30
                    )
                    if r.status_code != 503:
                        break
                    time.sleep(0.05)
                assert r.status_code == 200
                normal.append(time.monotonic() - started)
                time.sleep(0.2)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(16 + 20 + 1) as pool:
            futures = [pool.submit(_slow_client, server.url, MiB, stop_at, slow) for _ in range(20)]
            futures.append(pool.submit(normal_client))
            futures += [pool.submit(big, b) for b in bodies]
            for f in futures:
                f.result()
        watcher.join()
        assert server.proc.poll() is None, "the server died"
        hwm = _status(pid, "VmHWM")
        assert set(statuses) <= {200, 503}, statuses
        assert statuses.count(200) >= 4
        assert slow == [408] * 20, slow
        assert normal, "the normal client was never served"
        grew = hwm - baseline
        print(
            f"\nstorm: {len(bodies)} bodies of 20-60 MiB ({sum(map(len, bodies)) / MiB:.0f} MiB), "
            f"20 slow clients; statuses {sorted(statuses)}; RSS baseline {baseline / MiB:.0f} "
            f"MiB, peak {hwm / MiB:.0f} MiB (+{grew / MiB:.0f} MiB, budget {budget / MiB:.0f} "
            f"MiB); normal client: {len(normal)} requests, slowest {max(normal) * 1000:.0f} ms"
        )
        # documented bound (docs/RELIABILITY.md): growth under 3 x the budget
        assert grew < 3 * budget, f"RSS grew by {grew / MiB:.0f} MiB"
        assert httpx.get(f"{server.url}/readyz").status_code == 200
    finally:
        stop(server)


HEAD = b"POST /smooth HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"


def _trickle_head(url: str, first: int | None, gap_s: float, out: dict[str, object]) -> None:
    """Send the first ``first`` bytes of a request head at once, then one byte every ``gap_s``
    (a head that never ends; ``None``: send nothing at all); record how long after connecting
    the server closed the connection, and what it answered."""
    sock = rawhttp.connect(url, timeout_s=60)
    sock.settimeout(gap_s)
    started = time.monotonic()
    answer = b""
    try:
        head = HEAD + b"x-trickle: " + b"a" * 10_000
        sock.sendall(head[: first or 0])
        filler = iter(head[first or 0 :])
        while True:
            try:
                got = sock.recv(65536)
            except TimeoutError:
                if first is not None:
                    sock.sendall(bytes([next(filler)]))
                continue
            if not got:
                break
            answer += got
    except (ConnectionResetError, BrokenPipeError):
        pass
    finally:
        out["elapsed"] = time.monotonic() - started
        out["answer"] = answer
        sock.close()


def test_a_client_trickling_its_headers_is_cut_off_and_others_are_served(tmp_path: Path) -> None:
    timeout = 1.0
    server = start_server(tmp_path, "--header-timeout-s", str(timeout))
    try:
        results: list[dict[str, object]] = [{} for _ in range(6)]
        firsts = [10, len(HEAD), 1, None, len(HEAD), 20]  # None: connects, sends nothing
        threads = [
            threading.Thread(target=_trickle_head, args=(server.url, first, 0.1, out))
            for first, out in zip(firsts, results, strict=True)
        ]
        # a kept-alive connection: one whole request, then the next one's head trickles
        kept = rawhttp.connect(server.url)
        assert rawhttp.get(kept, "/healthz")[0] == 200
        for t in threads:
            t.start()
        kept_started = time.monotonic()
        kept.sendall(b"GET /healthz HTTP/1.1\r\n")
        # meanwhile: a normal client, and one that sends its head slowly but within the limit
        served = 0
        with httpx.Client(base_url=server.url, timeout=30) as client:
            while any(t.is_alive() for t in threads):
                r = client.post("/smooth", json={"sequences": [[[0.5] * 16] * 4]})
                assert r.status_code == 200, r.text
                served += 1
        slow_but_in_time = rawhttp.connect(server.url)
        for piece in (b"GET /healthz HTTP/1.1\r\n", b"host: test\r\n", b"\r\n"):
            slow_but_in_time.sendall(piece)
            time.sleep(timeout / 8)  # the whole head in 3/8 of the limit
        assert rawhttp.read_response(slow_but_in_time)[0] == 200
        slow_but_in_time.close()
        kept.settimeout(10 * timeout)
        assert rawhttp.closed_by_peer(kept)
        kept_elapsed = time.monotonic() - kept_started
        kept.close()
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        stop(server)
    for out in results:
        ratio = float(out["elapsed"]) / timeout  # type: ignore[arg-type]
        assert 0.9 <= ratio <= 4, out  # cut off after the limit, within a few multiples of it
        answer = bytes(out["answer"])  # type: ignore[arg-type]
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b'"type":"header_timeout"' in answer
    assert 0.9 <= kept_elapsed / timeout <= 4
    assert served >= 1
    rejected = 'rnnserve_requests_rejected_total{endpoint="none",reason="header_timeout"}'
    assert f"{rejected} 7.0" in text, text


def test_beyond_limit_concurrency_requests_get_503(tmp_path: Path) -> None:
    limit = 4
    server = start_server(tmp_path, "--limit-concurrency", str(limit))
    try:
        idle = [rawhttp.connect(server.url) for _ in range(limit - 1)]  # open, nothing sent
        body = {"sequences": [[[0.5] * 16]]}
        deadline = time.monotonic() + 30
        while (r := httpx.post(f"{server.url}/smooth", json=body)).status_code != 503:
            assert time.monotonic() < deadline, "the idle connections never counted"
            time.sleep(0.05)  # until the server has accepted them
        assert r.json()["type"] == "concurrency_limit"
        assert str(limit) in r.json()["detail"]
        assert r.headers["retry-after"] == "1"
        for sock in idle:
            sock.close()
        deadline = time.monotonic() + 30
        while (r := httpx.post(f"{server.url}/smooth", json=body)).status_code != 200:
            assert r.status_code == 503
            assert time.monotonic() < deadline, "the closed connections were never let go"
            time.sleep(0.05)
        text = httpx.get(f"{server.url}/metrics").text
    finally:
        stop(server)
    assert 'rnnserve_requests_rejected_total{endpoint="none",reason="concurrency_limit"}' in text
