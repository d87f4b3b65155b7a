"""Smoke test of the kernel benchmark: ``--quick`` runs and writes its tables (no timings checked).

The benchmark runs in a subprocess because it pins torch to one thread for its whole process.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_quick(module: str, out: Path) -> None:
    """``python -m bench.<module> --quick --out <out>`` in a subprocess; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_quick_benchmark_writes_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "BENCH.md"
    out.parent.mkdir()
    out.write_text("# Benchmarks\n\nA section someone else wrote.\n", encoding="utf-8")

    for _ in range(2):  # the second run replaces the first run's section
        run_quick("bench_models", out)

    text = out.read_text(encoding="utf-8")
    assert "A section someone else wrote." in text
    assert text.count("<!-- bench_models:begin -->") == 1
    assert text.count("<!-- bench_models:end -->") == 1
    for heading in (
        "### Smoother",
        "### Traveller",
        "### Compile and first-call times",
        "### What we expected / what we got",
    ):
        assert heading in text
    for name in (
        "torch.tanh (floor)",
        "ema_packed_numba",
        "ema_packed_torch",
        'LinearRecursion, kernel "auto"',
        'LinearRecursion, kernel "torch"',
        "seed-style (loops over sequences and steps)",
        "nn.LSTM teacher-forced + output layer (bound)",
        'Traveller.rollout, "torchscript"',
        'Traveller.rollout, "eager"',
        "seed-style (nn.LSTM per step, per sequence)",
    ):
        assert f"| {name}" in text, name
    assert "torch threads: 1" in text
    assert "JAX" in text
    # Every table row has as many cells as its header.
    table: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            widths = {row.count(" | ") for row in table if not row.startswith("|---")}
            assert len(widths) == 1, table
            assert table[1].startswith("|---")
            table = []


def test_quick_thread_layout_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\nkept\n", encoding="utf-8")
    run_quick("bench_threads", out)
    text = out.read_text(encoding="utf-8")
    assert "kept" in text
    assert text.count("<!-- bench_threads:begin -->") == 1
    for label in ("smoother B=64 T=1000", "traveller B=1 T=500", "traveller B=64 T=200"):
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| {label} |"))
        assert row.count("×") == 4


def test_quick_http_benchmark(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    run_quick("bench_http", out)
    rows = [ln for ln in out.read_text(encoding="utf-8").splitlines() if ln.startswith("| `/")]
    assert len(rows) == 4
    batched = [r for r in rows if "dynamic batching" in r]
    assert len(batched) == 2
    assert all(r.count("|") == 8 for r in rows)
