"""``bench/bench_ab.py``: the server CPU time, read from ``/proc`` as the kernel counts it, and
the commands it starts."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bench.bench_ab import Figures, Load, absolute, cpu_seconds, medians, table


def test_cpu_seconds_is_the_process_user_and_system_time() -> None:
    before, ours = cpu_seconds(os.getpid()), time.process_time()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn CPU, which the kernel books to this process
        pass
    spent = cpu_seconds(os.getpid()) - before
    # the same clock as time.process_time, in clock ticks (1/100 s on Linux)
    assert abs(spent - (time.process_time() - ours)) < 0.05
    assert spent > 0.25


def test_a_relative_program_is_made_absolute_without_following_its_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").symlink_to(sys.executable)  # as a venv's python is
    monkeypatch.chdir(tmp_path)
    assert absolute(["bin/python", "-m", "x"]) == [str(tmp_path / "bin" / "python"), "-m", "x"]
    assert absolute(["rnnserve", "--workers", "2"]) == ["rnnserve", "--workers", "2"]


def test_the_table_gives_each_sides_medians_and_b_over_a() -> None:
    a = [
        Figures(100.0, 2.0, 9.0, 4.0, 1.0),
        Figures(300.0, 4.0, 7.0, 2.0, 3.0),
        Figures(200.0, 3.0, 8.0, 3.0, 2.0),
    ]
    b = [Figures(400.0, 1.0, 5.0, 1.0, 3.0, 12.0)]
    assert medians(a) == Figures(200.0, 3.0, 8.0, 3.0, 2.0)
    header, _, row = table({"A": {"smooth": a}, "B": {"smooth": b}}, ["smooth"])
    cells = [c.strip() for c in row.strip("|").split("|")]
    names = [c.strip() for c in header.strip("|").split("|")]
    assert dict(zip(names, cells, strict=True)) == {
        "workload": "smooth", "A requests/s": "200.0", "B requests/s": "400.0", "B/A": "2.000",
        "A p50 ms": "3.0", "B p50 ms": "1.0", "A p99 ms": "8.0", "B p99 ms": "5.0",
        "A requests/batch": "3.0", "B requests/batch": "1.0", "A CPU ms/req": "2.000",
        "B CPU ms/req": "3.000", "B/A CPU": "1.500", "A dropped": "0", "B dropped": "12",
    }  # fmt: skip


def test_a_load_is_closed_unless_a_rate_is_given() -> None:
    assert str(Load(16)) == "16 clients"
    assert str(Load(16, 800.0)) == "open loop at 800/s"
