"""``bench_wire`` runs end to end on a small request and writes its stage table.

It runs in a subprocess because it pins torch to one thread for the whole process. No timing is
checked: the table's rows and the summary's lines are.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = (
    "json: parse (fast path)",
    "json carrying a state: parse",
    "binary: join the received pieces",
    "binary: parse (finite check left to the model)",
    "binary: parse, then the engine's finite check",
    "plan (row indices)",
    "pack (scatter)",
    "model",
    "unpack (gather)",
    "json: serialise",
    "binary: serialise",
    "ref: orjson.loads",
    "ref: orjson.dumps (numpy)",
    "ref: pydantic + to_arrays (the precise path)",
)


def test_a_small_run_writes_every_stage_and_the_summary(tmp_path: Path) -> None:
    out = tmp_path / "wire.md"
    command = ["-m", "bench.bench_wire", "--repeats", "2", "--sequences", "3", "--steps", "20"]
    proc = subprocess.run(
        [sys.executable, *command, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    text = out.read_text()
    assert "One `/smooth` request: 3 × 20 × 16 float32" in text
    rows = dict(re.findall(r"^\| (.+?) \| ([0-9.]+) \|$", text, re.MULTILINE))
    for stage in STAGES:
        matching = [name for name in rows if name.startswith(stage)]
        assert matching, f"no row for {stage!r} in {sorted(rows)}"
        assert all(float(rows[name]) >= 0 for name in matching)
    summary = [line for line in text.splitlines() if line.startswith("- ")]
    assert [line.split(":")[0] for line in summary] == [
        "- binary, server path (join, parse, serialise)",
        "- JSON",
        "- JSON carrying a state (`state` for every sequence, `return_state`)",
        "- The whole server path, binary",
    ]
