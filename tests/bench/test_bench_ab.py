"""``bench/bench_ab.py``'s server CPU time: read from ``/proc`` as the kernel counts it."""

from __future__ import annotations

import os
import time

from bench.bench_ab import cpu_seconds


def test_cpu_seconds_is_the_process_user_and_system_time() -> None:
    before, ours = cpu_seconds(os.getpid()), time.process_time()
    end = time.process_time() + 0.3
    while time.process_time() < end:  # burn CPU, which the kernel books to this process
        pass
    spent = cpu_seconds(os.getpid()) - before
    # the same clock as time.process_time, in clock ticks (1/100 s on Linux)
    assert abs(spent - (time.process_time() - ours)) < 0.05
    assert spent > 0.25
