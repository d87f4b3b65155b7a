"""Hostile clients against one rnnserve, and a normal client timing its requests meanwhile.

Each attack is a loop on its own thread until ``stop`` is set, repeating one kind of abuse that a
server must survive without shutting out anyone else:

- ``declared_bodies``: connections that declare 8 MiB bodies and send none of them;
- ``unread_answers``: requests for multi-MiB answers whose clients never read a byte;
- ``huge_heads``: a request head of many MiB;
- ``cut_short``: bodies broken off mid-way by a hang-up;
- ``slow_heads``: heads trickled a byte at a time;
- ``huge_safetensors_header``: a safetensors body whose header claims tens of MiB;
- ``escaped_bodies``: large JSON bodies that only the precise parser reads.

``python -m bench.hostile_clients`` starts a server, times the normal client alone and then under
every attack at once, and prints the latency ratio (the e2e test
``tests/e2e/test_hostile_clients.py`` runs the same mix and checks what every client got).
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import select
import socket
import statistics
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import save

from rnnserve.service.codec.bodies import SAFETENSORS
from tests.e2e import rawhttp

MiB = 1 << 20
PAUSE_S = 0.1  # between repeats of one attack: each attacker is one client, not a flood
FEATURES = 16
NORMAL_BODY = {"sequences": [[[0.25 * ((i + j) % 5) for j in range(FEATURES)] for i in range(20)]]}


@dataclass
class Outcomes:
    """What the attackers got, by attack and answer (a status code, or ``closed``)."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, attack: str, what: str) -> None:
        with self.lock:
            self.counts[(attack, what)] += 1

    def of(self, attack: str) -> dict[str, int]:
        return {what: n for (a, what), n in self.counts.items() if a == attack}


def _status_or_closed(sock: socket.socket) -> str:
    try:
        return str(rawhttp.read_response(sock)[0])
    except (ConnectionError, TimeoutError, OSError):
        return "closed"


def declared_bodies(url: str, stop: threading.Event, out: Outcomes, count: int = 8) -> None:
    """``count`` connections at a time declare 8 MiB bodies (together the whole 64 MiB budget
    of :func:`server_args`, if declarations were held) and send nothing."""
    while not stop.is_set():
        socks = [rawhttp.connect(url, timeout_s=60) for _ in range(count)]
        for sock in socks:
            sock.sendall(rawhttp.post_head("/smooth", 8 * MiB))
        for sock in socks:  # answered 408 body_timeout, or still open when told to stop
            sock.settimeout(0.5)
            while not stop.is_set():
                try:
                    out.note("declared_bodies", str(rawhttp.read_response(sock)[0]))
                    break
                except TimeoutError:
                    continue
                except (ConnectionError, OSError):
                    out.note("declared_bodies", "closed")
                    break
            sock.close()
        stop.wait(PAUSE_S)


def _safetensors_body(steps: int) -> bytes:
    rows = np.full((steps, FEATURES), 0.5, dtype=np.float32)
    return bytes(save({"sequences": rows, "lengths": np.array([steps], dtype=np.int64)}))


def unread_answers(url: str, stop: threading.Event, out: Outcomes, count: int = 4) -> None:
    """``count`` clients at a time ask for 4 MiB answers and never read them."""
    body = _safetensors_body(4 * MiB // (4 * FEATURES))
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /smooth HTTP/1.1\r\nhost: x\r\ncontent-type: {SAFETENSORS}\r\n"
        f"accept: {SAFETENSORS}\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode()
    while not stop.is_set():
        socks = []
        for _ in range(count):
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.sendall(head + body)
            socks.append(sock)
        for sock in socks:  # wait until the server gives up on it (write_timeout_s)
            while not stop.is_set():
                if _hung_up(sock, 0.5):
                    out.note("unread_answers", "closed")
                    break
            sock.close()


def _hung_up(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server has closed or reset ``sock``, without reading what it sent."""
    poller = select.poll()
    poller.register(sock, select.POLLRDHUP | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(int(wait_s * 1000)))


def huge_heads(url: str, stop: threading.Event, out: Outcomes) -> None:
    """A request whose head is 24 MiB of one header."""
    header = b"x-filler: " + b"a" * (24 * MiB) + b"\r\n"
    while not stop.is_set():
        sock = rawhttp.connect(url)
        with contextlib.suppress(OSError):  # answered and closed before it was all sent
            sock.sendall(b"GET /healthz HTTP/1.1\r\nhost: x\r\n" + header + b"\r\n")
        out.note("huge_heads", _status_or_closed(sock))
        sock.close()
        stop.wait(PAUSE_S)


def cut_short(url: str, stop: threading.Event, out: Outcomes) -> None:
    """Half of a 1 MiB body, then a hang-up."""
    while not stop.is_set():
        sock = rawhttp.connect(url)
        sock.sendall(rawhttp.post_head("/smooth", MiB) + b'{"sequences": [[[' + b"0.5," * 60000)
        time.sleep(0.05)
        sock.close()
        out.note("cut_short", "hung_up")
        stop.wait(PAUSE_S)


def slow_heads(url: str, stop: threading.Event, out: Outcomes, count: int = 8) -> None:
    """``count`` connections trickle a request head a byte every 0.2 s."""
    head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-slow: " + b"s" * 200 + b"\r\n\r\n"
    while not stop.is_set():
        socks = [rawhttp.connect(url) for _ in range(count)]
        at = 0
        while not stop.is_set() and socks:
            for sock in list(socks):
                try:
                    sock.sendall(head[at : at + 1])
                except OSError:
                    socks.remove(sock)
                    out.note("slow_heads", "closed")
            at = (at + 1) % len(head)
            time.sleep(0.2)
        for sock in socks:
            sock.close()


def huge_safetensors_header(url: str, stop: threading.Event, out: Outcomes) -> None:
    """A safetensors body whose header is 16 MiB of JSON, sent whole by httpx (which reads
    the answer only after sending): answered 400, or ``closed`` if the answer never reached
    it (a reset while it was still sending)."""
    header = b'{"__metadata__": {"x": "' + b"m" * (16 * MiB) + b'"}}'
    body = struct.pack("<Q", len(header)) + header
    while not stop.is_set():
        try:
            r = httpx.post(
                f"{url}/smooth",
                content=body,
                headers={"content-type": SAFETENSORS},
                timeout=60,
            )
        except httpx.TransportError:
            out.note("huge_safetensors_header", "closed")
        else:
            out.note("huge_safetensors_header", str(r.status_code))
        stop.wait(PAUSE_S)


def escaped_bodies(url: str, stop: threading.Event, out: Outcomes) -> None:
    """2 MiB JSON bodies with an escaped key, which only the precise (slow) parser reads."""
    steps = 2 * MiB // (FEATURES * 10)
    rows = b"[" + b",".join([b"[" + b",".join([b"0.123456"] * FEATURES) + b"]"] * steps) + b"]"
    body = b'{"s\\u0065quences": [' + rows + b"]}"
    while not stop.is_set():
        r = httpx.post(
            f"{url}/smooth", content=body, headers={"content-type": "application/json"}, timeout=60
        )
        out.note("escaped_bodies", str(r.status_code))
        stop.wait(PAUSE_S)


ATTACKS: dict[str, Callable[[str, threading.Event, Outcomes], None]] = {
    "declared_bodies": declared_bodies,
    "unread_answers": unread_answers,
    "huge_heads": huge_heads,
    "cut_short": cut_short,
    "slow_heads": slow_heads,
    "huge_safetensors_header": huge_safetensors_header,
    "escaped_bodies": escaped_bodies,
}


def normal_client(url: str, stop: threading.Event, expected: bytes | None) -> list[float]:
    """Small /smooth requests one after another until ``stop``: each one's seconds. Every
    answer must be 200 and, when ``expected`` is given, exactly it."""
    latencies = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            r = client.post(f"{url}/smooth", json=NORMAL_BODY)
            latencies.append(time.perf_counter() - started)
            assert r.status_code == 200, (r.status_code, r.text[:200])
            assert expected is None or r.content == expected
            time.sleep(0.01)
    return latencies


def attack(url: str, seconds: float, names: Sequence[str] = tuple(ATTACKS)) -> Outcomes:
    """The attacks ``names`` (all by default) at once for ``seconds``, on threads of this
    process."""
    stop = threading.Event()
    out = Outcomes()
    threads = [threading.Thread(target=ATTACKS[n], args=(url, stop, out)) for n in names]
    for t in threads:
        t.start()
    stop.wait(seconds)
    stop.set()
    for t in threads:
        t.join(90)
    return out


def _attack_in_child(url: str, seconds: float, names: Sequence[str], answer: Connection) -> None:
    answer.send(dict(attack(url, seconds, names).counts))


def under_attack(
    url: str, seconds: float, expected: bytes, names: Sequence[str] = tuple(ATTACKS)
) -> tuple[list[float], Outcomes]:
    """The normal client's latencies while the attacks ``names`` run for ``seconds`` in another
    process (so that the attackers' own work does not slow the client's process)."""
    receiving, sending = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_attack_in_child, args=(url, seconds + 2.0, names, sending)
    )
    child.start()
    time.sleep(1.0)  # the attacks under way
    latencies = alone(url, seconds, expected)
    out = Outcomes(Counter(receiving.recv()))
    child.join(90)
    return latencies, out


def alone(url: str, seconds: float, expected: bytes) -> list[float]:
    stop = threading.Event()
    threading.Timer(seconds, stop.set).start()
    return normal_client(url, stop, expected)


def server_args() -> list[str]:
    """The limits the attacks run against: short timeouts so that each attack repeats."""
    return [
        "--max-inflight-bytes", str(64 * MiB),
        "--body-timeout-s", "3",
        "--header-timeout-s", "3",
        "--write-timeout-s", "2",
    ]  # fmt: skip


def _percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    from tests.e2e.server import start_server, stop

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--attacks", default=",".join(ATTACKS), help=f"comma-separated, of {', '.join(ATTACKS)}"
    )
    args = parser.parse_args()
    names = args.attacks.split(",")
    if unknown := set(names) - set(ATTACKS):
        parser.error(f"--attacks: unknown {', '.join(sorted(unknown))}")
    with tempfile.TemporaryDirectory() as folder:
        server = start_server(Path(folder), *server_args())
        try:
            expected = httpx.post(f"{server.url}/smooth", json=NORMAL_BODY).content
            for round_ in range(args.rounds):
                idle = alone(server.url, args.seconds, expected)
                hostile, out = under_attack(server.url, args.seconds, expected, names)
                p50 = statistics.median(hostile) / statistics.median(idle)
                p99 = _percentile(hostile, 99) / _percentile(idle, 99)
                print(
                    f"round {round_ + 1}: alone p50 {1e3 * statistics.median(idle):.2f} ms "
                    f"p99 {1e3 * _percentile(idle, 99):.2f} ms ({len(idle)} requests); "
                    f"under attack p50 {1e3 * statistics.median(hostile):.2f} ms "
                    f"p99 {1e3 * _percentile(hostile, 99):.2f} ms ({len(hostile)}); "
                    f"ratio p50 {p50:.2f}x p99 {p99:.2f}x"
                )
                print("  attacks:", {a: out.of(a) for a in names})
        finally:
            stop(server)


if __name__ == "__main__":
    main()
