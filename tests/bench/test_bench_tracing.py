"""bench/bench_tracing.py: each mode measures what it names, and the table shows them all."""

from __future__ import annotations

import pytest

from bench import bench_tracing


def test_the_table_gives_each_mode_its_median_and_the_difference_to_off() -> None:
    results = {
        "off": [{"wall_us": 300.0, "cpu_us": 200.0}, {"wall_us": 500.0, "cpu_us": 240.0},
                {"wall_us": 400.0, "cpu_us": 220.0}],
        "on": [{"wall_us": 700.0, "cpu_us": 520.0}],
        "not installed": [{"wall_us": 410.0, "cpu_us": 215.0}],
    }  # fmt: skip
    lines = bench_tracing.report(results).splitlines()
    assert lines[2] == "| off | 400 µs | 220 µs | +0 µs |"
    assert lines[3] == "| on | 700 µs | 520 µs | +300 µs |"
    assert lines[4] == "| not installed | 410 µs | 215 µs | -5 µs |"


@pytest.mark.slow
@pytest.mark.parametrize("mode", bench_tracing.MODES)
def test_each_mode_runs_in_its_own_process_and_reports_per_request_figures(mode: str) -> None:
    figures = bench_tracing.run_mode(mode, 20)  # the child checks it traces only when "on"
    assert set(figures) == {"wall_us", "cpu_us"}
    assert figures["wall_us"] > 0
    assert figures["cpu_us"] > 0
