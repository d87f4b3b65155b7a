"""The load-benchmark tools: generator (``bench/load.py``), naive baseline, report, plots."""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import numpy as np
import orjson
import pytest
from aiohttp import web
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from bench import bench_load, bench_load_report
from bench.bench_models import write_section
from bench.load import closed_loop, open_loop, poisson_arrivals, probe_binary
from bench.load_client import _Client, loopback_url
from bench.load_cpu import process_cpu_seconds
from bench.load_results import BatchStats, LoadResult, percentile
from bench.load_workloads import WORKLOADS, Workload, make_bodies
from bench.naive_server import create_app, start_naive_server
from tests.e2e.server import Server, free_port, stop
from tests.helpers import markdown_tables as _tables
from tests.integration.conftest import running_app

SMOOTH = WORKLOADS["smooth"]
JSON = {"content-type": "application/json"}


# -- pure functions ------------------------------------------------------------------------------


def test_percentiles_on_known_data() -> None:
    data = [float(v) for v in range(100, 0, -1)]  # 1..100, unsorted
    assert percentile(data, 50) == pytest.approx(50.5)
    assert percentile(data, 90) == pytest.approx(90.1)
    assert percentile(data, 99) == pytest.approx(99.01)
    assert percentile(data, 0) == 1.0
    assert percentile(data, 100) == 100.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    rng = np.random.default_rng(1)
    xs = rng.exponential(size=333).tolist()
    for q in (1, 50, 90, 99, 99.9):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12)


def test_refuses_non_loopback_hosts() -> None:
    for ok in (
        "http://127.0.0.1:8000/",
        "http://localhost:1",
        "http://[::1]:80",
        "http://127.1.2.3",
    ):
        assert loopback_url(ok) == ok.rstrip("/")
    for bad in (
        "http://10.0.0.1:8000",
        "http://example.com",
        "https://127.0.0.1",
        "http://0.0.0.0",
    ):
        with pytest.raises(ValueError):  # noqa: PT011 - the message varies with the reason
            loopback_url(bad)
    from bench.load import main

    with pytest.raises(SystemExit):
        main(["--url", "http://192.168.1.1:8000", "--seconds", "0.1"])


def test_bodies_are_seeded_and_shaped() -> None:
    a = make_bodies(SMOOTH, 40, seed=3)
    assert [b.data for b in a] == [b.data for b in make_bodies(SMOOTH, 40, seed=3)]
    for body in a:
        seqs = orjson.loads(body.data)["sequences"]
        assert len(seqs) == 1
        assert len(seqs[0]) == body.steps
        assert 50 <= body.steps <= 500
        assert {len(row) for row in seqs[0]} == {16}
    assert len({b.steps for b in a}) > 10  # lengths vary per request
    long = make_bodies(WORKLOADS["smooth4000"], 2)
    assert {b.steps for b in long} == {4000}
    binary = make_bodies(WORKLOADS["rollout"], 3, seed=5, fmt="binary")
    for body, same in zip(binary, make_bodies(WORKLOADS["rollout"], 3, seed=5), strict=True):
        tensors = st_load(body.data)
        assert tensors["inputs"].shape == (body.steps, 6)
        assert tensors["inputs"].dtype == np.float32
        assert tensors["lengths"].tolist() == [body.steps]
        assert body.headers["Content-Type"] == "application/x-safetensors"
        np.testing.assert_array_equal(
            tensors["inputs"], np.array(orjson.loads(same.data)["inputs"][0], np.float32)
        )


def test_poisson_arrivals_are_bounded_and_seeded() -> None:
    times = poisson_arrivals(1000.0, 2.0, None, seed=0)
    assert times == poisson_arrivals(1000.0, 2.0, None, seed=0)
    assert 1800 < len(times) < 2200
    assert all(0 <= t < 2.0 for t in times)
    assert times == sorted(times)
    assert len(poisson_arrivals(1000.0, 2.0, 50, seed=0)) == 50


# -- the generator against a tiny in-process server ----------------------------------------------


class Tiny:
    """Answers /smooth after ``delay`` s, every 4th request with a 503; fake batch metrics."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.requests = 0
        self.batches = 0
        self.release = asyncio.Event()  # set at shutdown: /hang answers then
        self.peers: list[object] = []  # each request's connection (client address and port)
        self.received: list[bytes] = []  # each /smooth and /close body, as it came

    async def smooth(self, request: web.Request) -> web.Response:
        data = await request.read()
        self.peers.append(request.transport.get_extra_info("peername") if request.transport else 0)
        self.received.append(data)
        if request.content_type == "application/x-safetensors":  # answers binary like rnnserve
            rows = int(st_load(data)["lengths"].sum())
            body = st_save({"sequences": np.zeros((rows, 16), np.float32)})
            return web.Response(body=body, content_type="application/x-safetensors")
        self.requests += 1
        n = self.requests
        self.batches += n % 2  # one batch per two requests, three sequences per request
        await asyncio.sleep(self.delay)
        if n % 4 == 0:
            return web.json_response({"type": "queue_full"}, status=503)
        return web.json_response({"model": "smoother", "sequences": [[[0.0] * 16]]})

    async def close(self, request: web.Request) -> web.Response:
        """Answers and closes the connection (``Connection: close``)."""
        self.received.append(await request.read())
        self.requests += 1
        return web.json_response({"ok": True}, headers={"Connection": "close"})

    async def hang(self, request: web.Request) -> web.Response:
        await self.release.wait()
        return web.json_response({})

    async def metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP rnnserve_batch_requests x\n# TYPE rnnserve_batch_requests histogram\n"
            f'rnnserve_batch_requests_count{{model="smoother"}} {self.batches}\n'
            f'rnnserve_batch_requests_sum{{model="smoother"}} {self.requests}\n'
            "# HELP rnnserve_batch_sequences x\n# TYPE rnnserve_batch_sequences histogram\n"
            f'rnnserve_batch_sequences_count{{model="smoother"}} {self.batches}\n'
            f'rnnserve_batch_sequences_sum{{model="smoother"}} {3 * self.requests}\n'
        )
        return web.Response(text=text)


@asynccontextmanager
async def tiny_server(tiny: Tiny) -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/smooth", tiny.smooth)
    app.router.add_post("/hang", tiny.hang)
    app.router.add_post("/close", tiny.close)
    app.router.add_get("/metrics", tiny.metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        tiny.release.set()
        await runner.cleanup()


async def test_closed_loop_counts_requests_errors_and_batches() -> None:
    tiny = Tiny(delay=0.002)
    bodies = make_bodies(SMOOTH, 7)
    async with tiny_server(tiny) as url:
        t0 = time.perf_counter()
        r = await closed_loop(url, SMOOTH, bodies, clients=4, seconds=30, max_requests=40)
        assert time.perf_counter() - t0 < 10  # stopped at max_requests, not at 30 s
    assert tiny.requests == r.sent == 40
    assert r.ok == 30
    assert r.errors == Counter({"503": 10})
    assert len(r.latencies) == 30
    assert all(lat >= 0.002 for lat in r.latencies)
    ok_steps = sum(bodies[i % 7].steps for i in range(40) if (i + 1) % 4)  # served in order
    assert r.timesteps == ok_steps
    assert r.requests_per_s == pytest.approx(30 / r.seconds)
    assert r.batch == BatchStats(batches=20, requests=40, sequences=120)
    assert r.batch.requests_per_batch == 2.0
    assert r.batch.sequences_per_batch == 6.0
    summary = json.loads(json.dumps(r.summary()))
    assert summary["errors"] == {"503": 10}
    assert summary["p99_ms"] >= summary["p50_ms"]


async def test_closed_loop_stops_at_its_time_limit() -> None:
    tiny = Tiny(delay=0.01)
    async with tiny_server(tiny) as url:
        t0 = time.perf_counter()
        r = await closed_loop(url, SMOOTH, make_bodies(SMOOTH, 3), clients=3, seconds=0.3)
        elapsed = time.perf_counter() - t0
    assert elapsed < 2.0
    assert 3 <= r.sent == tiny.requests
    assert r.ok + sum(r.errors.values()) == r.sent


async def test_open_loop_drops_beyond_max_outstanding() -> None:
    tiny = Tiny(delay=0.05)
    async with tiny_server(tiny) as url:
        t0 = time.perf_counter()
        r = await open_loop(
            url, SMOOTH, make_bodies(SMOOTH, 5), rate=400, seconds=0.5, max_outstanding=2, seed=7
        )
        elapsed = time.perf_counter() - t0
    arrivals = len(poisson_arrivals(400, 0.5, None, seed=7))
    assert elapsed < 3.0
    assert r.sent == tiny.requests
    assert r.sent + r.dropped == arrivals
    assert r.dropped > r.sent > 0  # 2 in flight x 50 ms each: ~40 of ~200 can be sent
    assert r.ok + sum(r.errors.values()) == r.sent
    assert all(lat >= 0.05 for lat in r.latencies)
    assert r.batch is not None
    assert r.batch.requests == r.sent


async def test_timeouts_and_refused_connections_are_errors_not_hangs() -> None:
    hang = Workload("hang", "/hang", "sequences", "sequences", "smoother", 16, 16, 50, 60)
    tiny = Tiny()
    async with tiny_server(tiny) as url:
        t0 = time.perf_counter()
        r = await open_loop(
            url, hang, make_bodies(hang, 2), rate=50, seconds=0.2, max_requests=4, timeout_s=0.3
        )
        assert time.perf_counter() - t0 < 3.0
    assert r.ok == 0
    assert r.errors == Counter({"timeout": r.sent})
    assert r.sent > 0
    dead = f"http://127.0.0.1:{free_port()}"
    r = await closed_loop(
        dead, SMOOTH, make_bodies(SMOOTH, 1), clients=2, seconds=5, max_requests=6
    )
    assert r.errors == Counter({"connection": 6})
    assert r.batch is None
    assert math.isnan(r.p(99))


async def test_the_client_sends_each_body_whole_on_kept_alive_connections() -> None:
    tiny = Tiny()
    bodies = make_bodies(SMOOTH, 5) + make_bodies(SMOOTH, 2, seed=1, fmt="binary")
    async with tiny_server(tiny) as url:
        r = await closed_loop(url, SMOOTH, bodies, clients=3, seconds=30, max_requests=28)
    assert r.sent == len(tiny.received) == 28
    assert sorted(tiny.received) == sorted(bodies[i % 7].data for i in range(28))
    assert len(set(tiny.peers)) == 3  # one connection per client, kept alive


async def test_a_server_that_closes_each_connection_is_not_an_error() -> None:
    close = Workload("close", "/close", "sequences", "sequences", "smoother", 16, 16, 50, 60)
    tiny = Tiny()
    bodies = make_bodies(close, 3)
    async with tiny_server(tiny) as url:
        r = await closed_loop(url, close, bodies, clients=2, seconds=30, max_requests=10)
    assert (r.ok, r.sent, tiny.requests) == (10, 10, 10)
    assert r.errors == Counter()


async def test_a_connection_the_server_closed_while_idle_is_not_reused() -> None:
    tiny = Tiny()
    app = web.Application()
    app.router.add_post("/smooth", tiny.smooth)
    runner = web.AppRunner(app, keepalive_timeout=0.05)  # as uvicorn closes idle connections
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    client = _Client(f"http://127.0.0.1:{port}")
    body = make_bodies(SMOOTH, 1)[0]
    try:
        assert await client.post("/smooth", body, timeout_s=5) == "200"
        await asyncio.sleep(0.3)  # past the server's keep-alive time: it closes the connection
        assert await client.post("/smooth", body, timeout_s=5) == "200"
    finally:
        client.close()
        await runner.cleanup()
    assert tiny.requests == 2
    assert len(set(tiny.peers)) == 2  # the second request came on a new connection


async def test_an_answer_that_is_not_http_is_a_connection_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)
        writer.write(b"SPDY/9 what\r\n\r\n")
        await writer.drain()
        await reader.read()  # until the client hangs up
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        r = await closed_loop(
            f"http://127.0.0.1:{port}", SMOOTH, make_bodies(SMOOTH, 1), clients=2, seconds=10,
            max_requests=4, timeout_s=5,
        )  # fmt: skip
    finally:
        server.close()
    assert r.errors == Counter({"connection": 4})
    assert r.ok == 0


async def test_binary_probe_and_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.load import main

    async with tiny_server(Tiny()) as url:
        assert await probe_binary(url, SMOOTH)
        assert not await probe_binary(url, WORKLOADS["rollout"])  # no /rollout here: 404
        args = ["--url", url, "--clients", "2", "--seconds", "5", "--max-requests", "8"]
        assert await asyncio.to_thread(main, args) == 0
        assert "6/8 answered 200" in capsys.readouterr().out
        args = ["--url", url, "--rate", "100", "--seconds", "0.2", "--json", "--binary"]
        assert await asyncio.to_thread(main, args) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["mode"] == "open"
        assert summary["format"] == "binary"
        assert summary["ok"] == summary["sent"] > 0


# -- the naive baseline ----------------------------------------------------------------------


async def test_naive_server_answers_like_rnnserve() -> None:
    rng = np.random.default_rng(0)
    smooth = {"sequences": [rng.uniform(-2, 2, (n, 16)).astype(np.float32) for n in (60, 1, 7)]}
    roll = {"inputs": [rng.uniform(-1, 1, (n, 6)).astype(np.float32) for n in (40, 1, 9)]}
    requests = [("/smooth", smooth, "sequences"), ("/rollout", roll, "positions")]
    opt = orjson.OPT_SERIALIZE_NUMPY
    naive = httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app()), base_url="http://n")
    async with naive:
        assert (await naive.get("/readyz")).status_code == 200
        naive_out = [
            (await naive.post(path, content=orjson.dumps(body, option=opt), headers=JSON)).json()
            for path, body, _ in requests
        ]
        wrong = await naive.post("/smooth", json={"sequences": [[[0.0] * 16]], "model": "x"})
        assert wrong.status_code == 404
    async with running_app() as (_, ours):
        our_out = [
            (await ours.post(path, content=orjson.dumps(body, option=opt), headers=JSON)).json()
            for path, body, _ in requests
        ]
    for (_, body, field), a, b in zip(requests, naive_out, our_out, strict=True):
        assert a["model"] == b["model"]
        assert len(a[field]) == len(b[field]) == 3
        for sent, x, y in zip(next(iter(body.values())), a[field], b[field], strict=True):
            assert len(x) == len(y) == len(sent)
            np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def naive_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = start_naive_server(tmp_path_factory.mktemp("naive"))
    try:
        yield server
    finally:
        stop(server)


def test_bench_load_runs_against_real_servers(naive_process: Server, tmp_path: Path) -> None:
    """The whole pipeline, with the naive server standing in for both sides (no rnnserve start)."""
    url = naive_process.url
    assert not asyncio.run(probe_binary(url, SMOOTH))  # JSON only: binary rows are left out
    report = bench_load.run(
        quick=True, seconds=0.3, repeats=2, clients=2, workloads=["smooth"], warmup_s=0.1,
        urls={"rnnserve": url, "baseline": url},
    )  # fmt: skip
    assert not report.binary
    assert report.baseline_threads is not None
    assert [(c.server, c.fmt, len(c.runs)) for c in report.cells] == [
        ("baseline", "json", 2),
        ("rnnserve", "json", 2),
    ]
    for c in report.cells:
        assert c.rps > 0
        assert not c.errors
        assert all(r.batch is None for r in c.runs)  # the baseline has no /metrics
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\nkept\n", encoding="utf-8")
    for _ in range(2):
        write_section(
            out, bench_load_report.render(report), bench_load_report.BEGIN, bench_load_report.END
        )
    text = out.read_text(encoding="utf-8")
    assert "kept" in text
    assert text.count(bench_load_report.BEGIN) == text.count(bench_load_report.END) == 1
    assert "did not answer the binary format" in text
    assert "| `/smooth`, one sequence of 50–500 steps × 16 | default | json | **" in text
    assert "--workers" not in text  # none measured: no such rows, no such method text


def test_bench_load_measures_a_running_workers_server(naive_process: Server) -> None:
    """The "workers" rows' plumbing (the naive server stands in for rnnserve --workers 2 too)."""
    url = naive_process.url
    report = bench_load.run(
        quick=True, seconds=0.2, repeats=1, clients=2, workloads=["smooth"], warmup_s=0.1,
        urls={"rnnserve": url, "baseline": url, "workers": url}, workers=2,
    )  # fmt: skip
    assert report.workers == 2
    assert [(c.server, c.fmt, len(c.runs)) for c in report.cells] == [
        ("baseline", "json", 1),
        ("rnnserve", "json", 1),
        ("workers", "json", 1),
    ]
    assert all(c.rps > 0 and not c.errors for c in report.cells)
    assert all(math.isnan(c.server_cpu_s) for c in report.cells)  # not started here: no pid
    text = bench_load_report.render(report)
    assert "| rnnserve --workers 2, json | " in text
    assert "| `/smooth`, one sequence of 50–500 steps × 16 | `--workers 2` | json | **" in text
    with pytest.raises(ValueError, match="workers >= 2"):
        bench_load.run(
            quick=True, seconds=0.1, repeats=1, clients=1, workloads=["smooth"],
            urls={"rnnserve": url, "baseline": url, "workers": url}, workers=0,
        )  # fmt: skip


# -- the report --------------------------------------------------------------------------------


def _result(workload: str, rps: float, p99_ms: float, batch: BatchStats | None) -> LoadResult:
    r = LoadResult(workload, "closed", "json", clients=64, seconds=10.0)
    r.ok = r.sent = round(rps * 10)
    r.timesteps = r.ok * 100
    r.latencies = [p99_ms / 1e3] * r.ok
    r.batch = batch
    return r


def test_render_shows_figures_targets_and_plots() -> None:
    cells = []
    for w, base_rps, ours_rps in (("smooth", 10, 300), ("rollout", 5, 100), ("smooth4000", 2, 300)):
        base = bench_load_report.Cell(w, "baseline", "json", [_result(w, base_rps, 6000, None)])
        batch = BatchStats(batches=10, requests=320, sequences=640)
        ours = bench_load_report.Cell(w, "rnnserve", "json", [_result(w, ours_rps, 200, batch)] * 2)
        fast = bench_load_report.Cell(
            w, "rnnserve", "binary", [_result(w, ours_rps * 2, 100, batch)]
        )
        cells += [base, ours, fast]
    report = bench_load_report.Report(cells, 64, 10.0, 2, False, binary=True, baseline_threads=2)
    text = bench_load_report.render(report, {"smooth": "img/load_smooth.png"})
    assert text.startswith(bench_load_report.BEGIN)
    assert text.rstrip().endswith(bench_load_report.END)
    rows = [ln for ln in text.splitlines() if ln.startswith("| `/")]
    assert len(rows) == 9 + 6  # figures: 3 workloads x 3; targets: 3 workloads x 2 formats
    assert "| naive FastAPI (baseline) | 10.0 | 1,000 | 6,000.0 |" in text
    assert "| 32.0 | 64.0 |" in text  # requests and sequences per batch
    # /smooth: 30x >= 25x and p99 1/30 <= 1/15: met; /rollout: 20x < 30x: not met
    assert "| json | **30.0×** | ≥ 25× | **1/30.0** | ≤ 1/15 | yes |" in text
    assert "| json | **20.0×** | ≥ 30× | **1/30.0** | ≤ 1/15 | no |" in text
    assert "| binary | **300.0×** | ≥ 100× | **1/60.0** | ≤ 1/15 | yes |" in text
    assert "![`/smooth`, one sequence of 50–500 steps × 16](img/load_smooth.png)" in text
    assert "2 torch threads" in text
    assert "same cores as the server" in text
    for table in _tables(text):
        assert len({row.count("|") for row in table}) == 1, table
        assert table[1].startswith("|---")


def test_cpu_per_request_and_the_ceiling_it_sets_for_a_target_not_met() -> None:
    base = bench_load_report.Cell(
        "smooth4000", "baseline", "json", [_result("smooth4000", 4, 9000, None)]
    )
    ours = bench_load_report.Cell(
        "smooth4000", "rnnserve", "json", [_result("smooth4000", 160, 500, None)]
    )
    ours.server_cpu, ours.client_cpu = [0.005, 0.004, 0.0045], [0.002, math.nan]
    fast = bench_load_report.Cell(
        "smooth4000", "rnnserve", "binary", [_result("smooth4000", 800, 50, None)]
    )
    fast.server_cpu, fast.client_cpu = [0.001], [0.0005]
    report = bench_load_report.Report([base, ours, fast], 64, 10.0, 3, False, binary=True)
    text = bench_load_report.render(report)
    # medians, in ms: server 4.5, generator 2.0 (NaN runs left out); no figure for the baseline
    assert "| 500.0 | 0 | – | – | 4.50 | 2.00 |" in text
    assert "| 9,000.0 | 0 | – | – | – | – |" in text
    cores = os.cpu_count() or 1
    # 160/4 = 40x < 100x: not met, so the ceiling is given. Its 750 KiB JSON bodies are read
    # on codec threads: no one-core cap, only the machine's (server and generator: 6.5 ms)
    assert (
        "rnnserve's process used 4.50 ms of CPU per request and the load generator 2.00 ms" in text
    )
    assert "Its JSON bodies (about 750 KiB) are read and written on codec threads" in text
    assert "One process runs its event loop" not in text
    shared = cores / 0.0065
    assert (
        f"cap it at {shared:,.0f} requests/s = {shared / 4:,.0f}× the baseline on this "
        f"{cores}-core machine" in text
    )
    assert text.count("not met: rnnserve's process") == 1  # binary: 200x, met, no line
    for table in _tables(text):
        assert len({row.count("|") for row in table}) == 1, table


def test_process_cpu_seconds_counts_this_process() -> None:
    before = process_cpu_seconds(os.getpid())
    assert before is not None
    t0 = time.process_time()
    while time.process_time() - t0 < 0.2:  # busy: CPU, not wall time
        pass
    after = process_cpu_seconds(os.getpid())
    assert after is not None
    assert 0.1 <= after - before <= 1.0
    assert process_cpu_seconds(2**22 + 12345) is None  # no such process


def test_plots_are_drawn_from_sweep_data(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the `bench` extra)")
    from bench.plot_load import plot

    def point(rate: float, p50: float, dropped: int = 0) -> dict[str, float]:
        return {"offered_per_s": rate, "p50_ms": p50, "p99_ms": 3 * p50, "ok": 10,
                "dropped": dropped}  # fmt: skip

    data = {
        "machine": "test",
        "series": [
            {
                "workload": w,
                "title": WORKLOADS[w].describe(),
                "server": s,
                "format": f,
                "points": [point(1, 5), point(10, 8), point(100, 50, dropped=3)],
            }
            for w in ("smooth", "rollout")
            for s, f in (("baseline", "json"), ("rnnserve", "json"), ("rnnserve", "binary"))
        ],
    }
    paths = plot(data, tmp_path / "img")
    assert [p.name for p in paths] == ["load_smooth.png", "load_rollout.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    found = bench_load_report.existing_plots(tmp_path / "BENCHMARKS.md", tmp_path / "img")
    assert found == {"smooth": "img/load_smooth.png", "rollout": "img/load_rollout.png"}
