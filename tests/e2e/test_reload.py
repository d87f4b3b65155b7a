"""Replacing a model's weights under load, with real server processes, in both process modes.

A few clients send requests without pause while the smoother's file is replaced three times
(written aside, then ``os.replace``), reloaded by ``SIGHUP`` to the server's process or by
``POST /admin/reload``. Every request must be answered 200 with exactly one version's answer
(each request holds several sequences, so a batch run on two versions would show as a mix),
no client may see an older version after a newer one, and a request sent after a swap was seen
must get the new version or a later one. The order of events is a shared counter, not the clock.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from rnnserve import models
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.service.engine.reload import file_version
from tests.e2e.server import Server, start_server, stop
from tests.e2e.test_workers import one_client_per_worker
from tests.metrics import value

pytestmark = pytest.mark.e2e

TOKEN = "a-token-for-the-reload-test"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WIDTH = 16
ALPHAS = (0.5, 0.8, 0.2, 0.65)  # the served version, then the three replacements
CLIENTS = 3
WAIT_S = 120.0  # the longest wait for anything the server does; a failure, never a measure


def write(folder: Path, alpha: float, width: int = WIDTH) -> None:
    module = models.build("smoother", {"feat_dim": width, "alpha_smooth": alpha})
    aside = folder / ".smoother.partial"
    models.save(module, aside)
    os.replace(aside, folder / "smoother.safetensors")


def request_of(client: int) -> list[np.ndarray]:
    rng = np.random.default_rng(client)
    return [rng.standard_normal((n, WIDTH)).astype(np.float32) for n in (7, 2, 12)]


def local_answer(alpha: float, sequences: list[np.ndarray], width: int = WIDTH) -> list[np.ndarray]:
    module = models.build("smoother", {"feat_dim": width, "alpha_smooth": alpha}).eval()
    assert isinstance(module, LinearRecursion)
    data = np.concatenate(sequences)
    lengths = np.array([len(s) for s in sequences], np.int64)
    out = module.smooth_flat(data, lengths)
    return np.split(out, np.cumsum(lengths)[:-1])


@dataclass
class Record:
    client: int
    sent: int  # ticks of the shared counter
    received: int
    status: int
    body: bytes


@dataclass
class Load:
    """``CLIENTS`` threads, each sending its own request again and again until stopped."""

    url: str
    bodies: list[dict[str, Any]]
    records: list[Record] = field(default_factory=list)
    stopping: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    ticks: itertools.count[int] = field(default_factory=itertools.count)
    threads: list[threading.Thread] = field(default_factory=list)

    def tick(self) -> int:
        with self.lock:
            return next(self.ticks)

    def start(self) -> None:
        for client in range(CLIENTS):
            thread = threading.Thread(target=self._client, args=(client,), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _client(self, client: int) -> None:
        with httpx.Client(base_url=self.url, headers=AUTH, timeout=WAIT_S) as http:
            while not self.stopping.is_set():
                sent = self.tick()
                r = http.post("/smooth", json=self.bodies[client])
                record = Record(client, sent, self.tick(), r.status_code, r.content)
                with self.lock:
                    self.records.append(record)

    def answered_since(self, tick: int) -> int:
        """The fewest requests any client sent after ``tick`` and got answered."""
        with self.lock:
            return min(
                sum(1 for r in self.records if r.client == c and r.sent > tick)
                for c in range(CLIENTS)
            )

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(WAIT_S)


def until(check: Callable[[], bool], what: str) -> None:
    done = threading.Event()
    deadline = threading.Timer(WAIT_S, done.set)
    deadline.start()
    try:
        while not check():
            assert not done.wait(0.05), f"gave up waiting for {what}"
    finally:
        deadline.cancel()


def served_version(http: httpx.Client) -> str:
    [model] = http.get("/models").json()["models"]
    assert model["name"] == "smoother"
    assert model["loaded_at"].endswith("+00:00")
    version: str = model["version"]
    return version


@pytest.mark.parametrize("workers", [1, 2])
def test_replacing_the_weights_under_load_answers_each_request_from_one_version(
    tmp_path: Path, workers: int
) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    write(folder, ALPHAS[0])
    server = start_server(
        # requests wait up to 50 ms for batch-mates: at each swap some are queued on the old one
        tmp_path, "--model-dir", str(folder), "--device", "cpu", "--workers", str(workers),
        "--max-delay-ms", "50",
        env={"RNNSERVE_API_TOKEN": TOKEN}, ready_timeout_s=300,
    )  # fmt: skip
    try:
        _replace_three_times_under_load(server, folder)
    finally:
        stop(server)


def _replace_three_times_under_load(server: Server, folder: Path) -> None:
    requests = [request_of(c) for c in range(CLIENTS)]
    bodies = [{"sequences": [s.tolist() for s in r]} for r in requests]
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=WAIT_S) as http:

        def answers_now() -> list[bytes]:
            return [http.post("/smooth", json=b).content for b in bodies]

        versions, answers = [served_version(http)], [answers_now()]
        load = Load(server.url, bodies)
        load.start()
        swaps: list[tuple[int, int]] = []  # (tick the file was replaced, tick the swap was seen)
        try:
            for k, alpha in enumerate(ALPHAS[1:], 1):
                since = swaps[-1][1] if swaps else -1
                until(lambda s=since: load.answered_since(s) >= 2, "the clients' requests")
                write(folder, alpha)
                replaced = load.tick()
                if k == 2:
                    without_token = httpx.post(f"{server.url}/admin/reload", timeout=WAIT_S)
                    assert without_token.status_code == 401
                    r = http.post("/admin/reload")
                    assert r.status_code == 200, r.text
                    assert r.json()["changed"] == ["smoother"]
                    assert r.json()["failed"] == []
                else:
                    server.proc.send_signal(signal.SIGHUP)
                    until(lambda: served_version(http) != versions[-1], "the new version")
                swaps.append((replaced, load.tick()))
                versions.append(served_version(http))
                answers.append(answers_now())
            until(lambda: load.answered_since(swaps[-1][1]) >= 2, "the clients' requests")
        finally:
            load.stop()
        _check_the_answers(load.records, answers, swaps, requests)
        assert len(set(versions)) == len(ALPHAS), versions
        text = http.get("/metrics").text
        assert value(text, "rnnserve_model_reloads_total", result="changed") == 3
        _a_bad_file_keeps_the_last_version(http, folder, answers[-1], bodies)


def _check_the_answers(
    records: list[Record],
    answers: list[list[bytes]],
    swaps: list[tuple[int, int]],
    requests: list[list[np.ndarray]],
) -> None:
    for k, alpha in enumerate(ALPHAS):  # the server's answers are each version's own
        for client, body in enumerate(answers[k]):
            got = httpx.Response(200, content=body).json()["sequences"]
            for g, want in zip(got, local_answer(alpha, requests[client]), strict=True):
                np.testing.assert_allclose(np.array(g, np.float32), want, atol=1e-5, rtol=0)
        if k:
            assert answers[k] != answers[k - 1]
    assert len(records) > 8 * CLIENTS
    last_seen = [0] * CLIENTS
    for record in sorted(records, key=lambda r: r.sent):
        assert record.status == 200, record.body
        of_client = [a[record.client] for a in answers]
        assert record.body in of_client, "an answer of no single version"
        version = of_client.index(record.body)
        assert version >= last_seen[record.client], "a client went back to an older version"
        last_seen[record.client] = version
        seen_swaps = sum(1 for _, seen in swaps if seen < record.sent)
        assert version >= seen_swaps, "sent after a swap was seen, answered by the old version"
        written = sum(1 for replaced, _ in swaps if replaced < record.received)
        assert version <= written, "answered by a version not yet written"
    assert sorted(set(last_seen)) == [len(ALPHAS) - 1]


def _a_bad_file_keeps_the_last_version(
    http: httpx.Client, folder: Path, last: list[bytes], bodies: list[dict[str, Any]]
) -> None:
    before = served_version(http)
    (folder / ".broken").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    os.replace(folder / ".broken", folder / "smoother.safetensors")
    r = http.post("/admin/reload")
    assert r.status_code == 200, r.text
    [failure] = r.json()["failed"]
    assert failure["model"] == "smoother"
    assert "not a valid safetensors file" in failure["error"]
    assert r.json()["models"] == {"smoother": before}
    assert [http.post("/smooth", json=b).content for b in bodies] == last
    text = http.get("/metrics").text
    assert value(text, "rnnserve_model_reloads_total", result="failed") == 1


def test_the_poll_reloads_a_replaced_file_in_the_engine_process(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    write(folder, ALPHAS[0])
    server = start_server(
        tmp_path, "--model-dir", str(folder), "--device", "cpu", "--workers", "2",
        "--reload-poll-s", "0.2", ready_timeout_s=300,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as http:
            before = served_version(http)
            body = {"sequences": [s.tolist() for s in request_of(0)]}
            write(folder, ALPHAS[1])
            until(lambda: served_version(http) != before, "the poll to reload the file")
            got = http.post("/smooth", json=body).json()["sequences"]
            for g, want in zip(got, local_answer(ALPHAS[1], request_of(0)), strict=True):
                np.testing.assert_allclose(np.array(g, np.float32), want, atol=1e-5, rtol=0)
    finally:
        stop(server)


# Each HTTP worker of this server holds back the MODELS frames the engine sends it while the file
# HOLD/hold exists (as a worker whose event loop has not read them yet), and notes each frame it
# holds (HOLD/held-<pid>) and each it then applies (HOLD/applied-<pid>). The engine, the
# sockets and the workers are otherwise the real ones (sitecustomize is imported by every
# Python process started with this folder on PYTHONPATH; a real server has no test hook).
HOLD_MODELS_SITE = """
import asyncio
import os
import pathlib

from rnnserve.service.ipc.worker_side import RemoteRuntime

_HOLD = pathlib.Path(os.environ["TEST_HOLD_DIR"])
_apply = RemoteRuntime._models_changed
_held = {}


def _models_changed(self, frame):
    if not (_HOLD / "hold").exists() and self not in _held:
        return _apply(self, frame)
    (_HOLD / f"held-{os.getpid()}").touch()
    if self not in _held:
        _held[self] = []
        asyncio.get_running_loop().create_task(_apply_once_released(self))
    _held[self].append(frame)


async def _apply_once_released(runtime):
    while (_HOLD / "hold").exists():
        await asyncio.sleep(0.01)
    for frame in _held.pop(runtime):
        _apply(runtime, frame)
    (_HOLD / f"applied-{os.getpid()}").touch()


RemoteRuntime._models_changed = _models_changed
"""


def smooth_body(width: int) -> dict[str, Any]:
    rng = np.random.default_rng(width)
    return {"sequences": [rng.standard_normal((n, width)).round(3).tolist() for n in (5, 2)]}


def pids_noted(folder: Path, what: str) -> set[str]:
    return {p.name.removeprefix(f"{what}-") for p in folder.glob(f"{what}-*")}


def test_a_request_checked_by_a_worker_before_it_learns_a_width_change_is_409(
    tmp_path: Path,
) -> None:
    """``--workers 2``: the engine swaps in a smoother of another width while both workers still
    check requests against the old one (their MODELS frames held back): each such request is
    answered 409 ``model_changed``, naming the new version and both widths; once the workers
    have the new list, the old width is a 422 and the new one the new version's answer."""
    folder, hold, site = tmp_path / "models", tmp_path / "hold", tmp_path / "site"
    for made in (folder, hold, site):
        made.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_MODELS_SITE)
    write(folder, ALPHAS[0])
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    server = start_server(
        tmp_path, "--model-dir", str(folder), "--device", "cpu", "--workers", "2",
        env={"PYTHONPATH": path, "TEST_HOLD_DIR": str(hold)}, ready_timeout_s=300,
    )  # fmt: skip
    try:
        asyncio.run(_widen_while_the_workers_hold_the_old_list(server, folder, hold))
    finally:
        stop(server)


async def _widen_while_the_workers_hold_the_old_list(
    server: Server, folder: Path, hold: Path
) -> None:
    async with one_client_per_worker(server.url) as clients:
        for client in clients:
            assert (await client.post("/smooth", json=smooth_body(WIDTH))).status_code == 200
        (hold / "hold").touch()
        write(folder, ALPHAS[1], width=6)
        new_version = file_version(folder / "smoother.safetensors")
        server.proc.send_signal(signal.SIGHUP)
        # the engine sends the list as it swaps: both workers hold it, the engine serves width 6
        until(lambda: len(pids_noted(hold, "held")) == 2, "both workers to hold the new list")
        for client in clients:
            r = await client.post("/smooth", json=smooth_body(WIDTH))
            assert r.status_code == 409, r.text
            assert r.json() == {
                "type": "model_changed",
                "detail": f"model 'smoother' changed while this request was on its way: "
                f"version '{new_version}' takes 6 input features per step, the request's "
                f"steps have {WIDTH}",
                "loc": ["model"],
            }
        (hold / "hold").unlink()
        until(lambda: len(pids_noted(hold, "applied")) == 2, "both workers to have the list")
        for client in clients:
            [model] = (await client.get("/models")).json()["models"]
            assert model["version"] == new_version
            r = await client.post("/smooth", json=smooth_body(WIDTH))  # checked again: refused
            assert r.status_code == 422, r.text
            assert r.json()["type"] == "wrong_feature_count"
            body = smooth_body(6)
            r = await client.post("/smooth", json=body)
            assert r.status_code == 200, r.text
            sequences = [np.array(s, np.float32) for s in body["sequences"]]
            want = local_answer(ALPHAS[1], sequences, width=6)
            for got, w in zip(r.json()["sequences"], want, strict=True):
                np.testing.assert_allclose(np.array(got, np.float32), w, atol=1e-5, rtol=0)


def test_after_a_reload_answers_every_worker_lists_the_new_model_and_not_the_removed_one(
    tmp_path: Path,
) -> None:
    """``--workers 2``: ``POST /admin/reload`` answers once every worker has the new list (the
    engine waits for each worker's acknowledgement), so a new model is listed and answered, and
    a removed one is 404, on both workers as soon as the answer arrives."""
    folder = tmp_path / "models"
    folder.mkdir()
    write(folder, ALPHAS[0])
    server = start_server(
        tmp_path, "--model-dir", str(folder), "--device", "cpu", "--workers", "2",
        ready_timeout_s=300,
    )  # fmt: skip
    try:
        asyncio.run(_add_one_and_remove_one(server, folder))
    finally:
        stop(server)


async def _add_one_and_remove_one(server: Server, folder: Path) -> None:
    module = models.build("smoother", {"feat_dim": WIDTH, "alpha_smooth": ALPHAS[1]})
    models.save(module, folder / ".added.partial")
    os.replace(folder / ".added.partial", folder / "added.safetensors")
    body = {"inputs": [s.tolist() for s in request_of(0)]}
    async with one_client_per_worker(server.url) as clients:
        r = await clients[0].post("/admin/reload")
        assert r.status_code == 200, r.text
        assert (r.json()["loaded"], r.json()["removed"]) == (["added"], [])
        for client in clients:
            listed = [m["name"] for m in (await client.get("/models")).json()["models"]]
            assert listed == ["added", "smoother"]
            r = await client.post("/models/added/infer", json=body)
            assert r.status_code == 200, r.text
            want = local_answer(ALPHAS[1], request_of(0))
            for got, w in zip(r.json()["outputs"], want, strict=True):
                np.testing.assert_allclose(np.array(got, np.float32), w, atol=1e-5, rtol=0)
        (folder / "smoother.safetensors").unlink()
        r = await clients[1].post("/admin/reload")
        assert r.status_code == 200, r.text
        assert (r.json()["loaded"], r.json()["removed"]) == ([], ["smoother"])
        for client in clients:
            listed = [m["name"] for m in (await client.get("/models")).json()["models"]]
            assert listed == ["added"]
            r = await client.post("/models/smoother/infer", json=body)
            assert r.status_code == 404, r.text
            assert r.json()["type"] == "unknown_model"
