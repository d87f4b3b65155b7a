"""Load generator for a running rnnserve (or any server with its API), on loopback only.

Usage::

    python -m bench.load --url http://127.0.0.1:8000 --workload smooth --clients 64 --seconds 20
    python -m bench.load --url http://127.0.0.1:8000 --workload rollout --rate 200 --seconds 20

Two ways to load a server, both bounded in requests and in time, both stopping by themselves:

- **closed loop** (``--clients N``): N clients, each sending its next request as soon as its last
  one is answered. New requests start until ``--seconds`` have passed (or ``--max-requests`` were
  sent); the ones in flight then finish (each within ``--timeout``).
- **open loop** (``--rate R``): requests arrive as a Poisson process of R per second (seeded),
  whether or not earlier ones were answered. At most ``--max-outstanding`` are in flight; an
  arrival beyond that is *dropped* (counted, never sent). An arrival that the generator could
  only send more than 10 ms after its scheduled time is counted *late*. Latency is measured from
  the scheduled arrival, so a slow server is not hidden by a generator that waits for it.

Workloads (request bodies are built, seeded, before the clock starts): ``smooth`` -- ``/smooth``
with one sequence of 50-500 steps x 16 features (lengths uniform per request); ``rollout`` --
``/rollout`` with one sequence of 50-500 steps x 6 inputs; ``smooth4000`` -- ``/smooth`` with one
sequence of 4,000 steps x 16. ``--binary`` sends rnnserve's safetensors format instead of JSON.

Reported: requests/s, timesteps/s, p50/p90/p99 latency of the answered requests, errors by status,
and -- where the server exposes ``rnnserve_batch_requests_*`` and ``rnnserve_batch_sequences_*``
on ``/metrics`` -- the mean requests and sequences per batch during the run.

The client is kept cheap, since it shares the machine with the server it measures: each
connection (HTTP/1.1, kept alive) writes a request built once (head and body) in one call
and reads the answer with httptools (llhttp, uvicorn's parser), which finds its end by its
length without keeping the body -- as ``wrk`` does. On the 4,000-step JSON workload it takes
0.28 ms of CPU per request where aiohttp's client took 0.61-0.65 (docs/BENCHMARKS.md); the
naive baseline's figures are the same with either. ``/metrics`` is read with aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
import httptools
import numpy as np
import orjson
from prometheus_client.parser import text_string_to_metric_families
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

JSON_TYPE = "application/json"
BINARY_TYPE = "application/x-safetensors"
LATE_AFTER_S = 0.010  # an open-loop arrival sent later than this after its time is "late"
Format = Literal["json", "binary"]


@dataclass(frozen=True)
class Workload:
    """One kind of request: endpoint, field names, shape of its single sequence."""

    name: str
    path: str
    field: str  # request field: "sequences" or "inputs"
    out_field: str  # response field: "sequences" or "positions"
    model: str  # the model's label in rnnserve's metrics
    features: int
    out_features: int
    min_steps: int
    max_steps: int

    def describe(self) -> str:
        steps = (
            f"{self.min_steps:,}"
            if self.min_steps == self.max_steps
            else f"{self.min_steps}–{self.max_steps}"
        )
        return f"`{self.path}`, one sequence of {steps} steps × {self.features}"


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("smooth", "/smooth", "sequences", "sequences", "smoother", 16, 16, 50, 500),
        Workload("rollout", "/rollout", "inputs", "positions", "traveller", 6, 2, 50, 500),
        Workload("smooth4000", "/smooth", "sequences", "sequences", "smoother", 16, 16, 4000, 4000),
    )
}


@dataclass(frozen=True)
class Body:
    """One pre-built request: the bytes, their headers, and the timesteps they hold."""

    data: bytes
    headers: Mapping[str, str]
    steps: int


def make_bodies(
    workload: Workload, count: int = 64, *, seed: int = 0, fmt: Format = "json"
) -> list[Body]:
    """``count`` request bodies of one sequence each, lengths uniform in the workload's range."""
    rng = np.random.default_rng(seed)
    bodies = []
    for _ in range(count):
        steps = int(rng.integers(workload.min_steps, workload.max_steps + 1))
        x = rng.uniform(-1.0, 1.0, (steps, workload.features)).astype(np.float32)
        bodies.append(encode(workload, [x], fmt))
    return bodies


def encode(workload: Workload, sequences: Sequence[np.ndarray], fmt: Format = "json") -> Body:
    """One request body holding ``sequences`` (each ``[T_i, features]`` float32)."""
    steps = sum(len(s) for s in sequences)
    if fmt == "json":
        data = orjson.dumps(
            {workload.field: [np.ascontiguousarray(s, np.float32) for s in sequences]},
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        return Body(data, {"Content-Type": JSON_TYPE}, steps)
    tensors: dict[str, np.ndarray] = {
        workload.field: np.ascontiguousarray(np.concatenate(sequences), np.float32),
        "lengths": np.array([len(s) for s in sequences], np.int64),
    }
    headers = {"Content-Type": BINARY_TYPE, "Accept": BINARY_TYPE}
    return Body(st_save(tensors), headers, steps)


def loopback_url(url: str) -> str:
    """``url`` without a trailing slash, if it is ``http://`` to a loopback host; else ValueError.

    The generator is for benchmarking one's own machine: it refuses to load anything else.
    """
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "http":
        raise ValueError(f"{url!r}: only http:// URLs are supported")
    if host != "localhost":
        try:
            loopback = ipaddress.ip_address(host).is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            raise ValueError(f"{url!r}: refusing to load a non-loopback host ({host!r})")
    return url.rstrip("/")


def process_cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user + system, all threads) used so far by process ``pid``; None if unknown.

    Read from ``/proc/<pid>/stat`` (Linux), so a benchmark can say what a request costs the
    server, not only how long it took.
    """
    fields = _stat_fields(pid)
    if fields is None:
        return None
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (proc(5)'s field 3 onwards)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces: count fields from its closing parenthesis
    return stat[stat.rindex(")") + 2 :].split()


def process_tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds used so far by process ``pid`` and every live descendant; None if unknown.

    For a server of several processes (``rnnserve --workers N``: the supervisor, the engine and
    the N workers). Each process counts its own user + system time (all threads) plus that of
    the children it has waited for (``cutime`` + ``cstime``), so a descendant that exits and is
    reaped between two readings is not lost from the second: its time moves to its parent's
    figure. Descendants are found by their parent ids in ``/proc/*/stat`` (Linux).
    """
    parents: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(entry.name)
        if fields is None:  # gone since the listing
            continue
        child = int(entry.name)
        parents.setdefault(int(fields[1]), []).append(child)  # field 4: the parent's id
        times[child] = sum(int(f) for f in fields[11:15])  # fields 14-17: utime .. cstime
    if pid not in times:
        return None
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        total += times.get(p, 0)
        todo += parents.get(p, [])
    return total / os.sysconf("SC_CLK_TCK")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between ranks (numpy's default).

    NaN for no values.
    """
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# -- batch sizes from /metrics -----------------------------------------------------------------

BATCH_COUNTERS = (
    "rnnserve_batch_requests_count",
    "rnnserve_batch_requests_sum",
    "rnnserve_batch_sequences_sum",
)


def batch_counters(metrics_text: str, model: str) -> dict[str, float] | None:
    """The batch histograms' count and sums for ``model`` (zeros before its first batch).

    None when the server does not expose ``rnnserve_batch_requests`` at all.
    """
    found = dict.fromkeys(BATCH_COUNTERS, 0.0)
    exposed = False
    for fam in text_string_to_metric_families(metrics_text):
        exposed = exposed or fam.name == "rnnserve_batch_requests"
        for s in fam.samples:
            if s.name in found and s.labels.get("model") == model:
                found[s.name] += s.value
    return found if exposed else None


@dataclass(frozen=True)
class BatchStats:
    """Batches run during a load, from the difference of two /metrics readings."""

    batches: float
    requests: float
    sequences: float

    @property
    def requests_per_batch(self) -> float:
        return self.requests / self.batches if self.batches else math.nan

    @property
    def sequences_per_batch(self) -> float:
        return self.sequences / self.batches if self.batches else math.nan

    @classmethod
    def between(
        cls, before: Mapping[str, float] | None, after: Mapping[str, float] | None
    ) -> BatchStats | None:
        if before is None or after is None:
            return None
        d = {k: after[k] - before[k] for k in BATCH_COUNTERS}
        return cls(
            d["rnnserve_batch_requests_count"],
            d["rnnserve_batch_requests_sum"],
            d["rnnserve_batch_sequences_sum"],
        )


async def read_batch_counters(
    session: aiohttp.ClientSession, model: str
) -> dict[str, float] | None:
    try:
        async with session.get("/metrics") as r:
            if r.status != 200:
                return None
            text = await r.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    try:
        return batch_counters(text, model)
    except ValueError:  # not Prometheus text
        return None


# -- results -------------------------------------------------------------------------------------


@dataclass
class LoadResult:
    """What one load run did. Latencies are of the answered (200) requests only."""

    workload: str
    mode: Literal["closed", "open"]
    fmt: Format
    clients: int | None = None  # closed loop
    rate: float | None = None  # open loop: offered requests per second
    seconds: float = 0.0  # wall time, first request sent to last one answered
    sent: int = 0
    ok: int = 0
    timesteps: int = 0  # timesteps of the answered requests
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)  # "503", "timeout", "connection"…
    dropped: int = 0  # open loop: arrivals not sent, max_outstanding being in flight
    late: int = 0  # open loop: arrivals sent more than LATE_AFTER_S after their time
    batch: BatchStats | None = None

    @property
    def requests_per_s(self) -> float:
        return self.ok / self.seconds if self.seconds > 0 else math.nan

    @property
    def timesteps_per_s(self) -> float:
        return self.timesteps / self.seconds if self.seconds > 0 else math.nan

    def p(self, q: float) -> float:
        """Latency percentile in seconds."""
        return percentile(self.latencies, q)

    def summary(self) -> dict[str, Any]:
        """A JSON-able digest (no raw latencies)."""
        return {
            "workload": self.workload,
            "mode": self.mode,
            "format": self.fmt,
            "clients": self.clients,
            "rate": self.rate,
            "seconds": self.seconds,
            "sent": self.sent,
            "ok": self.ok,
            "requests_per_s": self.requests_per_s,
            "timesteps_per_s": self.timesteps_per_s,
            "p50_ms": self.p(50) * 1e3,
            "p90_ms": self.p(90) * 1e3,
            "p99_ms": self.p(99) * 1e3,
            "errors": dict(self.errors),
            "dropped": self.dropped,
            "late": self.late,
            "requests_per_batch": self.batch.requests_per_batch if self.batch else None,
            "sequences_per_batch": self.batch.sequences_per_batch if self.batch else None,
        }


def format_result(r: LoadResult) -> str:
    """A few human-readable lines."""
    how = f"{r.clients} clients" if r.mode == "closed" else f"Poisson {r.rate:g}/s offered"
    lines = [
        f"{r.workload} ({r.fmt}, {r.mode} loop, {how}): {r.ok}/{r.sent} answered 200 "
        f"in {r.seconds:.2f} s",
        f"  {r.requests_per_s:,.1f} requests/s, {r.timesteps_per_s:,.0f} timesteps/s",
        f"  latency p50 {r.p(50) * 1e3:.1f} ms, p90 {r.p(90) * 1e3:.1f} ms, "
        f"p99 {r.p(99) * 1e3:.1f} ms",
        f"  errors: {dict(r.errors) or 'none'}",
    ]
    if r.mode == "open":
        lines.append(f"  dropped: {r.dropped}, late: {r.late}")
    if r.batch is not None:
        lines.append(
            f"  batches: {r.batch.batches:.0f}, {r.batch.requests_per_batch:.1f} requests and "
            f"{r.batch.sequences_per_batch:.1f} sequences per batch"
        )
    else:
        lines.append("  batches: no rnnserve_batch_* metrics on this server")
    return "\n".join(lines)


# -- the two loops -------------------------------------------------------------------------------


async def _send(
    client: _Client, path: str, body: Body, started: float, result: LoadResult, timeout_s: float
) -> float:
    """POST one body; record its outcome in ``result``; return when it ended."""
    result.sent += 1
    outcome: str
    try:
        outcome = await client.post(path, body, timeout_s)
    except Exception as exc:  # a load generator counts failures; it does not stop
        outcome = type(exc).__name__
    ended = time.perf_counter()
    if outcome == "200":
        result.ok += 1
        result.timesteps += body.steps
        result.latencies.append(ended - started)
    else:
        result.errors[outcome] += 1
    return ended


class _Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection: sends a request and reads its answer (llhttp parses
    it; its status is kept, its body's bytes are read and dropped)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[int] | None = None
        self.reusable = True

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"not an HTTP answer: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._fail(ConnectionError("the server closed the connection"))

    # httptools' callback (no on_body: llhttp then skips the body's bytes, by its length)
    def on_message_complete(self) -> None:
        self.reusable = self.reusable and self.parser.should_keep_alive()
        if self.answer is not None and not self.answer.done():
            self.answer.set_result(self.parser.get_status_code())
        self.answer = None

    def _fail(self, exc: Exception) -> None:
        self.reusable = False
        if self.answer is not None and not self.answer.done():
            self.answer.set_exception(exc)
        self.answer = None
        if self.transport is not None:
            self.transport.close()

    def send(self, request: bytes) -> asyncio.Future[int]:
        """Write one request; the future is its answer's status."""
        assert self.transport is not None
        assert self.answer is None
        self.answer = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        return self.answer

    def close(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.close()


class _Client:
    """The connections of one load run: an idle one is reused, else a new one opened (the loops
    bound how many requests are in flight, so how many connections there are)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(loopback_url(url))
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self._host_header = f"{self.host}:{self.port}"
        self._idle: list[_Connection] = []
        self._requests: dict[tuple[str, int], tuple[Body, bytes]] = {}

    def request(self, path: str, body: Body) -> bytes:
        """The whole request, head and body, built once per path and body (one write, nothing
        joined per request)."""
        key = (path, id(body))
        built = self._requests.get(key)
        if built is None or built[0] is not body:
            lines = [f"POST {path} HTTP/1.1", f"Host: {self._host_header}"]
            lines += [f"{k}: {v}" for k, v in body.headers.items()]
            lines.append(f"Content-Length: {len(body.data)}")
            head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
            built = self._requests[key] = (body, head + body.data)
        return built[1]

    async def post(self, path: str, body: Body, timeout_s: float) -> str:
        """POST ``body``; the answer's status ("200", "503"...), "timeout" or "connection"."""
        conn: _Connection | None = None
        try:
            async with asyncio.timeout(timeout_s):
                if self._idle:
                    conn = self._idle.pop()
                else:
                    _, conn = await asyncio.get_running_loop().create_connection(
                        _Connection, self.host, self.port
                    )
                status = await conn.send(self.request(path, body))
        except TimeoutError:
            if conn is not None:
                conn.close()  # its answer may still come: the connection cannot be reused
            return "timeout"
        except (OSError, ConnectionError):
            return "connection"
        if conn.reusable:
            self._idle.append(conn)
        else:
            conn.close()
        return str(status)

    def close(self) -> None:
        for conn in self._idle:
            conn.close()
        self._idle.clear()


def _session(url: str, timeout_s: float) -> aiohttp.ClientSession:
    """aiohttp for /metrics and the binary probe (the load itself goes through _Client)."""
    connector = aiohttp.TCPConnector(limit=1)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    return aiohttp.ClientSession(loopback_url(url), connector=connector, timeout=timeout)


async def closed_loop(
    url: str,
    workload: Workload,
    bodies: Sequence[Body],
    *,
    clients: int,
    seconds: float,
    max_requests: int | None = None,
    timeout_s: float = 120.0,
    fmt: Format = "json",
) -> LoadResult:
    """``clients`` clients back to back until ``seconds`` pass or ``max_requests`` were sent."""
    if clients < 1 or not bodies:
        raise ValueError("need at least one client and one body")
    result = LoadResult(workload.name, "closed", fmt, clients=clients)
    client = _Client(url)
    async with _session(url, timeout_s) as session:  # /metrics only
        before = await read_batch_counters(session, workload.model)
        start = time.perf_counter()
        stop_at = start + seconds
        issued = 0
        last_end = start

        async def one() -> None:
            nonlocal issued, last_end
            while time.perf_counter() < stop_at and (max_requests is None or issued < max_requests):
                body = bodies[issued % len(bodies)]
                issued += 1
                ended = await _send(
                    client, workload.path, body, time.perf_counter(), result, timeout_s
                )
                last_end = max(last_end, ended)

        try:
            await asyncio.gather(*(one() for _ in range(clients)))
        finally:
            client.close()
        result.seconds = last_end - start
        result.batch = BatchStats.between(
            before, await read_batch_counters(session, workload.model)
        )
    return result


def poisson_arrivals(rate: float, seconds: float, limit: int | None, seed: int) -> list[float]:
    """Arrival times in [0, seconds) of a Poisson process of ``rate`` per second (seeded)."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = np.random.default_rng(seed)
    times: list[float] = []
    t = 0.0
    while limit is None or len(times) < limit:
        t += float(rng.exponential(1.0 / rate))
        if t >= seconds:
            break
        times.append(t)
    return times


async def open_loop(
    url: str,
    workload: Workload,
    bodies: Sequence[Body],
    *,
    rate: float,
    seconds: float,
    max_requests: int | None = None,
    max_outstanding: int = 256,
    timeout_s: float = 120.0,
    seed: int = 0,
    fmt: Format = "json",
) -> LoadResult:
    """Poisson arrivals at ``rate`` per second for ``seconds`` (at most ``max_requests``).

    Arrivals beyond ``max_outstanding`` in flight are dropped. After the last arrival, requests
    still in flight get ``timeout_s`` to finish.
    """
    if max_outstanding < 1 or not bodies:
        raise ValueError("need max_outstanding >= 1 and at least one body")
    arrivals = poisson_arrivals(rate, seconds, max_requests, seed)
    result = LoadResult(workload.name, "open", fmt, rate=rate)
    client = _Client(url)
    async with _session(url, timeout_s) as session:  # /metrics only
        before = await read_batch_counters(session, workload.model)
        tasks: set[asyncio.Task[float]] = set()
        ends: list[float] = []

        def done(task: asyncio.Task[float]) -> None:
            tasks.discard(task)
            if not task.cancelled():
                ends.append(task.result())

        start = time.perf_counter()
        for i, at in enumerate(arrivals):
            due = start + at
            delay = due - time.perf_counter()
            await asyncio.sleep(max(delay, 0.0))  # sleep(0) still lets replies be read
            if time.perf_counter() - due > LATE_AFTER_S:
                result.late += 1
            if len(tasks) >= max_outstanding:
                result.dropped += 1
                continue
            task = asyncio.create_task(
                _send(client, workload.path, bodies[i % len(bodies)], due, result, timeout_s)
            )
            tasks.add(task)
            task.add_done_callback(done)
        if tasks:
            await asyncio.wait(set(tasks))  # each ends within timeout_s
        client.close()
        result.seconds = (max(ends) if ends else time.perf_counter()) - start
        result.batch = BatchStats.between(
            before, await read_batch_counters(session, workload.model)
        )
    return result


async def probe_binary(url: str, workload: Workload) -> bool:
    """Whether the server answers the safetensors format: one request, checked in full."""
    x = np.linspace(-1, 1, 3 * workload.features, dtype=np.float32).reshape(3, -1)
    body = encode(workload, [x, x[:2]], "binary")
    async with _session(url, 30.0) as session:
        try:
            async with session.post(workload.path, data=body.data, headers=body.headers) as r:
                data = await r.read()
                if r.status != 200 or not r.content_type.startswith(BINARY_TYPE):
                    return False
        except (aiohttp.ClientError, TimeoutError):
            return False
    try:
        tensors = st_load(data)
    except Exception:  # anything unreadable means "not supported"
        return False
    # the output rows, whatever the server names them: [3 + 2 steps, out_features]
    return any(t.shape == (5, workload.out_features) for t in tensors.values())


# -- command line --------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="loopback server URL")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="smooth")
    loop = parser.add_mutually_exclusive_group()
    loop.add_argument("--clients", type=int, default=64, help="closed loop: concurrent clients")
    loop.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to send requests")
    parser.add_argument("--max-requests", type=int, default=100_000, help="most requests sent")
    parser.add_argument("--max-outstanding", type=int, default=256, help="open loop: in flight")
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    parser.add_argument("--binary", action="store_true", help="send safetensors, not JSON")
    parser.add_argument("--bodies", type=int, default=64, help="distinct pre-built bodies")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = parser.parse_args(argv)
    try:
        url = loopback_url(args.url)
    except ValueError as exc:
        parser.error(str(exc))
    workload = WORKLOADS[args.workload]
    fmt: Format = "binary" if args.binary else "json"
    bodies = make_bodies(workload, args.bodies, seed=args.seed, fmt=fmt)
    if args.rate is not None:
        result = asyncio.run(
            open_loop(
                url, workload, bodies, rate=args.rate, seconds=args.seconds,
                max_requests=args.max_requests, max_outstanding=args.max_outstanding,
                timeout_s=args.timeout, seed=args.seed, fmt=fmt,
            )
        )  # fmt: skip
    else:
        result = asyncio.run(
            closed_loop(
                url, workload, bodies, clients=args.clients, seconds=args.seconds,
                max_requests=args.max_requests, timeout_s=args.timeout, fmt=fmt,
            )
        )  # fmt: skip
    print(json.dumps(result.summary()) if args.json else format_result(result))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
