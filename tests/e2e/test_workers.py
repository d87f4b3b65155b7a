"""``rnnserve --workers 2``: two HTTP worker processes feeding one engine process.

Which worker answered is in the ``X-Rnnserve-Worker`` header; an HTTP connection stays with the
worker that accepted it, so a client with one connection is pinned to one worker.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest

from rnnserve.service.config import Settings
from rnnserve.service.http.app import create_app
from tests.e2e import rawhttp
from tests.e2e.server import Server, start_server, stop
from tests.e2e.test_disconnect import STEPS, hang_up_during_rollout
from tests.metrics import value

pytestmark = pytest.mark.e2e
HEADER = "x-rnnserve-worker"
BINARY = "application/x-safetensors"
# the batch window is long enough that two requests sent together always share a batch; the
# rollout's GEMM routes fixed, as measured ones may differ between the two servers' processes
# in the last bits of every answer
SETTINGS = {"max_delay_ms": 100.0, "rollout_chunk_steps": 32, "rollout_gemm_routes": "fixed"}
FLAGS = (
    "--workers", "2", "--max-delay-ms", "100", "--rollout-chunk-steps", "32",
    "--rollout-gemm-routes", "fixed",
)  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("workers"), *FLAGS)
    yield srv
    stop(srv)


def metrics(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=30).text


@asynccontextmanager
async def clients_per_worker(
    url: str, per_worker: int = 1, workers: int = 2
) -> AsyncIterator[list[list[httpx.AsyncClient]]]:
    """``per_worker`` one-connection clients on each worker (found by asking for pids)."""
    async with AsyncExitStack() as stack:
        pinned: dict[str, list[httpx.AsyncClient]] = {}
        for _ in range(60 * per_worker):
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=1))
            )
            pid = (await client.get("/healthz")).headers[HEADER]
            if len(pinned.setdefault(pid, [])) < per_worker:
                pinned[pid].append(client)
            if len(pinned) == workers and all(len(c) == per_worker for c in pinned.values()):
                yield list(pinned.values())
                return
        pytest.fail(f"not enough connections reached every worker: {pinned}")


@asynccontextmanager
async def one_client_per_worker(url: str) -> AsyncIterator[list[httpx.AsyncClient]]:
    async with clients_per_worker(url) as pinned:
        yield [clients[0] for clients in pinned]


@asynccontextmanager
async def single_process_app() -> AsyncIterator[httpx.AsyncClient]:
    """Today's single-process server, in this process, with the same settings."""
    app = create_app(Settings(**SETTINGS))  # type: ignore[arg-type]
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://one") as client:
            yield client


def bodies(seed: int, width: int, field: str, count: int, longest: int = 300) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [
        orjson.dumps({field: [rng.standard_normal((int(n), width)).round(4).tolist()
                              for n in rng.integers(1, longest, 1 + k % 3)]})
        for k in range(count)
    ]  # fmt: skip


async def test_answers_equal_the_single_process_server(server: Server) -> None:
    requests: list[tuple[str, bytes, dict[str, str]]] = [
        ("/smooth", b, {}) for b in bodies(1, 16, "sequences", 4)
    ] + [
        ("/rollout", b, {}) for b in bodies(2, 6, "inputs", 4)
    ] + [
        ("/rollout", b, {"accept": "application/x-ndjson"}) for b in bodies(3, 6, "inputs", 3)
    ] + [
        ("/smooth", b, {"accept": BINARY}) for b in bodies(4, 16, "sequences", 2)
    ]  # fmt: skip
    async with single_process_app() as one, one_client_per_worker(server.url) as workers:
        for k, (path, body, headers) in enumerate(requests):
            expected = await one.post(path, content=body, headers=headers)
            got = await workers[k % 2].post(path, content=body, headers=headers)
            assert expected.status_code == got.status_code == 200, got.text
            assert got.headers["content-type"] == expected.headers["content-type"]
            assert got.content == expected.content, path  # byte for byte
        for path, body in (("/smooth", b'{"sequences": [[[1, 2]]]}'), ("/nope", b"{}")):
            expected = await one.post(path, content=body)
            got = await workers[0].post(path, content=body)
            assert (got.status_code, got.content) == (expected.status_code, expected.content)
        expected_models = (await one.get("/models")).json()
        got_models = (await workers[1].get("/models")).json()
        # the effective settings differ by design (port, workers), and each server loaded its
        # models at its own time; everything else is the same
        want_settings = {**expected_models.pop("settings"), "workers": 2}
        got_settings = got_models.pop("settings")
        for listing in (got_models, expected_models):
            for model in listing["models"]:
                assert model.pop("loaded_at")
        assert got_models == expected_models
        served = {model["name"]: model for model in got_models["models"]}
        assert served["traveller"]["config"]["rollout_backend"] == "numba"
        assert "rollout_routes" not in served["traveller"]["config"]  # fixed, as asked
        assert {k: v for k, v in got_settings.items() if k != "port"} == {
            k: v for k, v in want_settings.items() if k != "port"
        }


async def test_requests_from_both_workers_share_a_batch(server: Server) -> None:
    async with one_client_per_worker(server.url) as (a, b):
        before = metrics(server.url)
        x = {"sequences": [[[0.5] * 16] * 20]}
        ra, rb = await asyncio.gather(a.post("/smooth", json=x), b.post("/smooth", json=x))
        assert {ra.status_code, rb.status_code} == {200}
        assert ra.headers[HEADER] != rb.headers[HEADER]
        after = metrics(server.url)
        for name, delta in (
            ("rnnserve_batch_requests_count", 1),
            ("rnnserve_batch_requests_sum", 2),
        ):
            seen = value(after, name, model="smoother") - value(before, name, model="smoother")
            assert seen == delta, f"{name}: {seen}"  # one batch held both workers' requests

        # rollouts: batches (a chunk of steps, or chunks run back to back while nothing
        # changed) that ran requests of both workers at once
        def shared_batches(text: str) -> float:
            every = value(text, "rnnserve_batch_requests_count", model="traveller")
            alone = value(text, "rnnserve_batch_requests_bucket", model="traveller", le="1.0")
            return every - alone

        before = metrics(server.url)
        u = {"inputs": [[[0.1] * 6] * 2000]}
        ra, rb = await asyncio.gather(a.post("/rollout", json=u), b.post("/rollout", json=u))
        assert {ra.status_code, rb.status_code} == {200}
        # equal to float32 rounding: one request may run some chunks alone (the kernel's
        # one-row loop) where the other ran them batched (BLAS's GEMM)
        np.testing.assert_allclose(
            np.asarray(ra.json()["positions"]), np.asarray(rb.json()["positions"]), atol=1e-6
        )
        assert shared_batches(metrics(server.url)) - shared_batches(before) >= 1


async def test_metrics_add_up_across_workers(server: Server) -> None:
    count = 40
    async with one_client_per_worker(server.url) as (a, b):
        texts = [(await c.get("/metrics")).text for c in (a, b)]
        assert {value(t, "rnnserve_request_duration_seconds_count") for t in texts}.__len__() == 1
        before = texts[0]
        x = {"sequences": [[[0.25] * 16] * 10]}
        sends = [(a if k % 2 else b).post("/smooth", json=x) for k in range(count)]
        replies = await asyncio.gather(*sends)
        assert [r.status_code for r in replies] == [200] * count
        assert len({r.headers[HEADER] for r in replies}) == 2
        for client in (a, b):  # every worker shows the whole server
            after = (await client.get("/metrics")).text
            labels = {"endpoint": "smooth", "code": "200"}
            done = value(after, "rnnserve_request_duration_seconds_count", **labels)
            assert (
                done - value(before, "rnnserve_request_duration_seconds_count", **labels) == count
            )
            batched = value(after, "rnnserve_batch_requests_sum", model="smoother")
            assert batched - value(before, "rnnserve_batch_requests_sum", model="smoother") == count
            queued = value(after, "rnnserve_queue_wait_seconds_count", model="smoother")
            assert (
                queued - value(before, "rnnserve_queue_wait_seconds_count", model="smoother")
                == count
            )
            assert value(after, "rnnserve_requests_in_flight", endpoint="smooth") == 0
            assert value(after, "rnnserve_queue_depth", model="smoother") == 0


@pytest.mark.parametrize("accept", ["application/json", "application/x-ndjson"])
def test_a_client_that_hangs_up_is_cancelled_in_the_engine(server: Server, accept: str) -> None:
    def metric(name: str, **labels: str) -> float:
        return value(metrics(server.url), name, **labels)

    cancelled = metric("rnnserve_requests_cancelled_total", endpoint="rollout")
    ran = metric("rnnserve_batch_timesteps_sum", model="traveller")
    hang_up_during_rollout(server, accept)
    ran = metric("rnnserve_batch_timesteps_sum", model="traveller") - ran
    assert metric("rnnserve_requests_cancelled_total", endpoint="rollout") == cancelled + 1
    assert 0 < ran < STEPS / 2  # the engine stopped it long before its end
    r = httpx.post(f"{server.url}/rollout", json={"inputs": [[[0.1] * 6] * 5]}, timeout=30)
    assert r.status_code == 200


def _in_flight(url: str) -> float:
    try:
        return value(metrics(url), "rnnserve_requests_in_flight", endpoint="rollout")
    except httpx.TransportError:
        return -1


def test_sigterm_finishes_every_accepted_request(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--workers", "2", "--max-batch-size", "2")
    inputs = np.random.default_rng(3).standard_normal((2000, 6)).round(3).tolist()

    async def scenario() -> list[httpx.Response]:
        async with clients_per_worker(srv.url, per_worker=6) as pinned:
            tasks = [
                asyncio.ensure_future(client.post("/rollout", json={"inputs": [inputs]}))
                for clients in pinned
                for client in clients
            ]
            deadline = time.monotonic() + 30
            while _in_flight(srv.url) < 12:  # all 12 accepted (by both workers), most queued
                assert time.monotonic() < deadline, "requests never arrived"
                await asyncio.sleep(0.01)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 12
    assert len({r.headers[HEADER] for r in responses}) == 2
    first = np.asarray(responses[0].json()["positions"])
    for r in responses:  # the same input, batched with different company: float32 rounding
        np.testing.assert_allclose(np.asarray(r.json()["positions"]), first, atol=1e-6, rtol=0)
    assert srv.proc.wait(timeout=60) == 0
    log = srv.log.read_text()
    assert log.count("Application shutdown complete") == 2, log
    assert "engine draining: 0 worker connection(s) open" in log, log  # workers went first
    assert "engine stopped" in log, log


def test_the_engine_dying_gives_503_and_stops_the_server(tmp_path: Path) -> None:
    srv = start_server(tmp_path, "--workers", "2", "--rollout-chunk-steps", "32")
    found = re.search(r"engine process (\d+) ready", srv.log.read_text())
    assert found is not None
    engine = int(found.group(1))

    async def scenario() -> tuple[httpx.Response, list[int | str]]:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            running = asyncio.ensure_future(
                client.post("/rollout", json={"inputs": [[[0.1] * 6] * STEPS]})
            )
            deadline = time.monotonic() + 60
            while value(metrics(srv.url), "rnnserve_batch_timesteps_sum", model="traveller") == 0:
                assert time.monotonic() < deadline, "the rollout never started"
                await asyncio.sleep(0.01)
            os.kill(engine, signal.SIGKILL)
            reply = await running
            ready: list[int | str] = []
            for _ in range(3):
                try:
                    ready.append((await client.get("/readyz")).status_code)
                except httpx.TransportError as exc:  # the server is already shutting down
                    ready.append(type(exc).__name__)
            return reply, ready

    reply, ready = asyncio.run(scenario())
    assert reply.status_code == 503, reply.text
    assert reply.json()["type"] == "engine_unavailable"
    assert 200 not in ready, ready
    assert srv.proc.wait(timeout=60) == 1
    assert "the engine process died" in srv.log.read_text()


# The engine process of this server's smoother fails on any batch holding the value 666
# (sitecustomize is imported by every Python process started with this folder on PYTHONPATH,
# the spawned engine included; a real server process has no test hook of its own).
POISON_SITE = """
import numpy as np
from rnnserve.models.smoothing import LinearRecursion

_real = LinearRecursion.smooth_flat


def _flaky(self, data, *args, **kwargs):
    if (np.asarray(data) == 666.0).any():
        raise RuntimeError("simulated kernel fault")
    return _real(self, data, *args, **kwargs)


LinearRecursion.smooth_flat = _flaky
"""


def test_a_poison_request_is_logged_once_with_its_request_id(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(POISON_SITE)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    flags = ("--workers", "2", "--max-delay-ms", "300", "--max-batch-size", "8")
    srv = start_server(tmp_path, *flags, env={"PYTHONPATH": path})

    async def scenario() -> list[httpx.Response]:
        async with clients_per_worker(srv.url, per_worker=4) as pinned:
            clients = [c for pair in zip(*pinned, strict=True) for c in pair]  # a, b, a, b...
            sent = [
                client.post(
                    "/smooth",
                    json={"sequences": [[[666.0 if i == 5 else 0.5] * 16] * (i + 1)]},
                    headers={"X-Request-Id": f"poison-w-{i}"},
                )
                for i, client in enumerate(clients)
            ]
            return await asyncio.gather(*sent)

    try:
        responses = asyncio.run(scenario())
    finally:
        stop(srv)
    assert [r.status_code for r in responses] == [200] * 5 + [500] + [200] * 2
    assert "poison-w-5" in responses[5].json()["detail"]
    assert len({r.headers[HEADER] for r in responses}) == 2  # both workers sent some
    lines = srv.log.read_text().splitlines()
    failed = [line for line in lines if "failed" in line and "poison-w-" in line]
    # the final failure, in the engine's log, names the poison request; logged once
    final = [line for line in failed if "ERROR" in line]
    assert len(final) == 1, failed
    assert final[0].endswith("failed; requests poison-w-5"), final
    # every split along the way names the requests of the batch that failed
    splits = [line for line in failed if "retrying each half apart" in line]
    assert splits, failed
    assert all("poison-w-5" in line for line in splits), failed
    assert not any("requests -" in line or ",-" in line for line in failed), failed
    # one traceback (the engine's), none from the worker that answered 500
    assert sum(line.startswith("Traceback") for line in lines) == 1, lines
    assert not any("smooth failed" in line for line in lines), lines


def test_the_memory_budget_is_per_worker(tmp_path: Path) -> None:
    """``max_inflight_bytes`` bounds each HTTP worker's held bytes: with 2 workers, twice it in
    all (the engine holds the rows of queued and running requests on top)."""
    budget, size = 1_000_000, 700_000  # one held request fits a worker's budget, two do not
    srv = start_server(
        tmp_path,
        *("--workers", "2", "--max-inflight-bytes", str(budget)),
        *("--max-request-bytes", str(budget)),
    )
    body = b'{"sequences": [[[0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]]]}'  # noqa: E501
    body = body.ljust(size)  # JSON may end in spaces
    socks: dict[str, list[socket.socket]] = {}
    spare: list[socket.socket] = []  # kept open, as a busy worker leaves the next to the other
    try:
        deadline = time.monotonic() + 60  # the second worker may still be starting
        while time.monotonic() < deadline:  # two keep-alive connections on each worker
            time.sleep(0.02)
            sock = rawhttp.connect(srv.url)
            status, headers, _ = rawhttp.get(sock, "/healthz")
            assert status == 200
            mine = socks.setdefault(headers[HEADER], [])
            (mine if len(mine) < 2 else spare).append(sock)
            if len(socks) == 2 and all(len(s) == 2 for s in socks.values()):
                break
        assert [len(s) for s in socks.values()] == [2, 2], socks
        (a1, a2), (b1, b2) = socks.values()
        sent = size - 1000  # bytes are held as they arrive, not as they are declared
        for sock in (a1, b1):  # one request held on each worker, its body nearly all sent
            sock.sendall(rawhttp.post_head("/smooth", size) + body[:sent])
        deadline = time.monotonic() + 30
        while value(metrics(srv.url), "rnnserve_request_bytes_in_flight") < 2 * sent:
            assert time.monotonic() < deadline, "the held requests never took their bytes"
            time.sleep(0.02)
        assert 2 * sent > budget  # held in all: more than one budget
        for sock in (a2, b2):  # each worker's own budget is full
            sock.sendall(rawhttp.post_head("/smooth", size))
            status, headers, answer = rawhttp.read_response(sock)
            assert status == 503, answer
            assert orjson.loads(answer)["type"] == "overloaded"
            assert headers["retry-after"] == "1"
        for sock in (a1, b1):  # the held ones are served once their bodies arrive
            sock.sendall(body[sent:])
            status, _, answer = rawhttp.read_response(sock)
            assert status == 200, answer
        assert value(metrics(srv.url), "rnnserve_request_bytes_in_flight") == 0
    finally:
        for sock in [*spare, *(s for group in socks.values() for s in group)]:
            sock.close()
        stop(srv)


@pytest.mark.parametrize("steps", [20, 5_000])  # parsed in place; in the precise child
def test_a_body_only_the_precise_reader_reads_is_served_by_the_workers(
    server: Server, steps: int
) -> None:
    # the precise path's sequences cross to the engine like the fast path's
    rows = np.random.default_rng(5).uniform(-1, 1, (steps, 16)).round(5).tolist()
    plain = orjson.dumps({"sequences": [rows, rows[:3]]})
    escaped = plain.replace(b'"sequences"', b'"s\\u0065quences"', 1)
    headers = {"content-type": "application/json"}
    want = httpx.post(f"{server.url}/smooth", content=plain, headers=headers, timeout=60)
    got = httpx.post(f"{server.url}/smooth", content=escaped, headers=headers, timeout=60)
    assert (want.status_code, got.status_code) == (200, 200), got.text[:300]
    assert got.content == want.content
