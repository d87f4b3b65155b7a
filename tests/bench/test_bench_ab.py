"""``bench/bench_ab.py``: the server CPU time, read from ``/proc`` as the kernel counts it, and
the commands it starts."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from bench.bench_ab import absolute, cpu_seconds


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
