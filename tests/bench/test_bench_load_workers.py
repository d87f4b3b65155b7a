"""bench_load's ``rnnserve --workers N`` rows: the process-tree CPU, the rows, targets, ceilings."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import bench_load, bench_load_report, bench_load_servers
from bench.load_cpu import process_cpu_seconds, process_tree_cpu_seconds
from bench.load_results import BatchStats, LoadResult
from bench.load_workloads import Format
from tests.helpers import markdown_tables as _tables

TICK = 1 / os.sysconf("SC_CLK_TCK")  # /proc's unit of CPU time

_BURN = """
import time
def burn(s):
    t = time.process_time()
    while time.process_time() - t < s:  # busy: CPU time, not wall time
        pass
"""
# Burns 0.2 s of CPU, says so, and waits for its stdin to close.
GRANDCHILD = (
    _BURN
    + """
import sys
burn(0.2)
print("burned", flush=True)
sys.stdin.read()
"""
)
# Starts the grandchild, burns 0.2 s itself, prints the grandchild's pid; on a line from its
# parent, ends the grandchild and waits for it (reaps it), says so, and waits for the next line.
CHILD = (
    _BURN
    + f"""
import subprocess, sys
g = subprocess.Popen([sys.executable, "-c", {GRANDCHILD!r}], stdin=subprocess.PIPE,
                     stdout=subprocess.PIPE, text=True)
assert g.stdout.readline() == "burned\\n"
burn(0.2)
print(g.pid, flush=True)
sys.stdin.readline()
g.stdin.close()
g.wait()
print("reaped", flush=True)
sys.stdin.readline()
"""
)


def test_process_tree_cpu_seconds_sums_every_descendant() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdin is not None
        grandchild = int(child.stdout.readline())
        me = os.getpid()
        own = {pid: process_cpu_seconds(pid) for pid in (grandchild, child.pid, me)}
        tree_child = process_tree_cpu_seconds(child.pid)
        tree_me = process_tree_cpu_seconds(me)
        assert None not in own.values()
        assert tree_child is not None
        assert tree_me is not None
        own_s = {pid: s or 0.0 for pid, s in own.items()}
        assert own_s[grandchild] >= 0.2 - 2 * TICK
        assert own_s[child.pid] >= 0.2 - 2 * TICK
        # the tree holds the processes under it, and not the one above it
        assert process_tree_cpu_seconds(grandchild) == pytest.approx(own_s[grandchild], abs=TICK)
        # sums of tick counts divided by the tick rate: 0.21 + 0.2 > 0.41 in floats, so compare
        # with half a tick of room (a bug loses at least one whole tick)
        half = TICK / 2
        assert tree_child >= own_s[child.pid] + own_s[grandchild] - half
        assert tree_me >= own_s[me] + own_s[child.pid] + own_s[grandchild] - half
        assert tree_me >= tree_child + own_s[me] - half

        # a descendant that exits and is reaped: its CPU time stays in the tree (its parent's
        # children's time), so a before/after difference does not go negative
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline() == "reaped\n"
        after = process_tree_cpu_seconds(child.pid)
        assert after is not None
        assert after >= tree_child - 2 * TICK
        assert after >= own_s[child.pid] + own_s[grandchild] - 2 * TICK
    finally:
        child.kill()
        child.wait()
    assert process_tree_cpu_seconds(2**22 + 12345) is None  # no such process


def _result(workload: str, rps: float, p99_ms: float) -> LoadResult:
    r = LoadResult(workload, "closed", "json", clients=64, seconds=10.0)
    r.ok = r.sent = round(rps * 10)
    r.timesteps = r.ok * 100
    r.latencies = [p99_ms / 1e3] * r.ok
    r.batch = BatchStats(batches=10, requests=320, sequences=640)
    return r


def _cell(
    w: str, server: bench_load_servers.ServerName, fmt: Format, rps: float, p99_ms: float
) -> bench_load_report.Cell:
    return bench_load_report.Cell(w, server, fmt, [_result(w, rps, p99_ms)])


def _report() -> bench_load_report.Report:
    """Baseline 10/s (p99 6 s); rnnserve 200/s; --workers 2: 300/s json, 600/s binary."""
    cells = []
    for w in bench_load_report.ORDER:
        cells += [
            _cell(w, "baseline", "json", 10, 6000),
            _cell(w, "rnnserve", "json", 200, 200),
            _cell(w, "rnnserve", "binary", 400, 100),
            _cell(w, "workers", "json", 300, 200),
            _cell(w, "workers", "binary", 600, 100),
        ]
    for c in cells:
        c.server_cpu, c.client_cpu = [0.003], [0.001]
    return bench_load_report.Report(cells, 64, 10.0, 1, False, binary=True, workers=2)


def test_configs_put_the_workers_rows_after_the_single_process() -> None:
    assert bench_load_servers._configs(True, True) == [
        ("baseline", "json"),
        ("rnnserve", "json"),
        ("rnnserve", "binary"),
        ("workers", "json"),
        ("workers", "binary"),
    ]
    assert bench_load_servers._configs(False, True) == [
        ("baseline", "json"),
        ("rnnserve", "json"),
        ("workers", "json"),
    ]
    assert bench_load_servers._configs(False) == [("baseline", "json"), ("rnnserve", "json")]


def test_render_has_figures_and_targets_for_the_workers_rows() -> None:
    text = bench_load_report.render(_report())
    figures, targets = _tables(text)
    assert len(figures) == 2 + 3 * 5  # header, separator; 3 workloads x 5 (server, format)
    assert len(targets) == 2 + 3 * 4  # 3 workloads x 2 rnnserve configurations x 2 formats
    for table in (figures, targets):
        assert len({row.count("|") for row in table}) == 1, table
        assert table[1].startswith("|---")
    smooth = "| `/smooth`, one sequence of 50–500 steps × 16 |"
    assert f"{smooth} rnnserve --workers 2, json | 300.0 | 30,000 |" in text
    assert f"{smooth} rnnserve --workers 2, binary | 600.0 | 60,000 |" in text
    assert f"{smooth} rnnserve, json | 200.0 |" in text
    # the workers server's CPU (the whole tree) per request, in ms, like the other rows
    assert "| 32.0 | 64.0 | 3.00 | 1.00 |" in text
    # targets: /smooth >= 25x; /rollout >= 30x; /smooth 4,000 steps >= 100x; p99 1/30 or 1/60
    assert f"{smooth} default | json | **20.0×** | ≥ 25× | **1/30.0** | ≤ 1/15 | no |" in text
    assert f"{smooth} `--workers 2` | json | **30.0×** | ≥ 25× | **1/30.0** | ≤ 1/15 | yes |" in (
        text
    )
    assert f"{smooth} `--workers 2` | binary | **60.0×** | ≥ 25× | **1/60.0** | ≤ 1/15 | yes |" in (
        text
    )
    # the order: single process (json, binary), then --workers 2 (json, binary)
    hows = [row.split(" | ")[1:3] for row in targets[2:]]
    assert hows == [
        *[["default", "json"]] * 3,
        *[["default", "binary"]] * 3,
        *[["`--workers 2`", "json"]] * 3,
        *[["`--workers 2`", "binary"]] * 3,
    ]
    assert "a supervisor, one engine process that runs the models and 2 uvicorn HTTP worker" in (
        text
    )
    assert "(every process and thread; for `--workers 2`: the supervisor, the engine and the 2" in (
        text
    )
    assert bench_load_report._met(_report(), "smooth", "json", "workers") is True
    # default: the single process
    assert bench_load_report._met(_report(), "smooth", "json") is False


def test_the_ceiling_of_a_workers_row_is_the_machine_not_one_event_loop() -> None:
    report = _report()
    lines = bench_load_report._ceilings(report, "json", "workers")
    # --workers 2, json: /smooth 30x met (no line); /rollout 30x met; /smooth 4,000 30x < 100x
    assert len(lines) == 1
    (line,) = lines
    cores = os.cpu_count() or 1
    shared = cores / 0.004  # (3 ms server tree + 1 ms load generator) per request
    assert line.startswith("- `/smooth`, one sequence of 4,000 steps × 16, `--workers 2`, json")
    assert "rnnserve's processes (supervisor, engine and 2 HTTP workers together) used 3.00 ms" in (
        line
    )
    assert "the load generator 1.00 ms" in line
    assert "one loop's core does not cap it" in line
    assert f"cap it at {shared:,.0f} requests/s = {shared / 10:,.0f}× the baseline" in line
    assert f"on this {cores}-core machine, against the 100× target." in line
    assert "One process runs its event loop" not in line
    allows = "that CPU would allow the target, so it is not what held this row back."
    assert line.endswith(allows if shared / 10 >= 100 else "target.")
    # a machine whose cores would allow the target: the line says CPU is not what fell short
    cell = report.cell("smooth4000", "workers", "json")
    assert cell is not None
    cell.server_cpu, cell.client_cpu = [1e-5], [1e-5]
    (roomy,) = bench_load_report._ceilings(report, "json", "workers")
    assert roomy.endswith(allows)
    cell.server_cpu, cell.client_cpu = [0.003], [0.001]
    # the single process keeps its one-core cap where its event loop parses (bodies under
    # codec_offload_bytes, and binary ones); 4,000-step JSON is parsed on codec threads
    single = bench_load_report._ceilings(report, "json")
    assert len(single) == 3  # 20x: misses all three targets
    assert ["One process runs its event loop" in s for s in single] == [True, True, False]
    assert "caps it at 333 requests/s = 33× the baseline" in single[0]
    assert "are read and written on codec threads beside the event loop" in single[2]
    text = bench_load_report.render(report)
    assert text.count("HTTP workers together) used") == 2  # json and binary /smooth 4,000
    # json 20x misses all three; binary 40x meets /smooth's 25x and /rollout's 30x
    assert text.count("One process runs its event loop") == 2 + 1
    assert text.count("on codec threads beside the event loop") == 1
    # no CPU figure (a server started outside the benchmark): no ceiling line
    for c in report.cells:
        c.server_cpu = [math.nan]
    assert bench_load_report._ceilings(report, "json", "workers") == []


def test_no_workers_rows_when_not_measured() -> None:
    report = _report()
    report.cells = [c for c in report.cells if c.server != "workers"]
    report.workers = 0
    text = bench_load_report.render(report)
    assert "--workers" not in text
    assert "HTTP workers together" not in text


def test_command_line_refuses_one_worker_and_a_lone_workers_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "never.md"
    for argv in (
        ["--workers", "1"],
        ["--workers", "-2"],
        ["--rnnserve-workers-url", "http://127.0.0.1:1"],
        [
            "--workers", "0", "--rnnserve-url", "http://127.0.0.1:1",
            "--baseline-url", "http://127.0.0.1:2", "--rnnserve-workers-url", "http://127.0.0.1:3",
        ],
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            bench_load.main([*argv, "--out", str(out)])
        assert exc.value.code == 2
        assert "--workers" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(ValueError, match="at least 2"), bench_load_servers.servers(workers=1):
        pass
    want = 2 if (os.cpu_count() or 1) >= 2 else 0
    assert want == bench_load.DEFAULT_WORKERS
