"""The GRU encoder rows of ``bench/bench_models.py`` (``examples/gru_encoder.py``, your own model):
``--only encoder`` measures them alone and puts them into an earlier run's section."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import bench_models as bm
from tests.bench.test_bench_smoke import assert_tables_well_formed, run_quick

# trains and benchmarks the GRU encoder in a process of its own
pytestmark = pytest.mark.slow

EARLIER = f"""# Benchmarks

Someone's intro.

{bm.BEGIN}
## Model kernels (`python -m bench.bench_models`)

### Traveller (num_inputs 6, hidden 128, 2 layers)

the earlier run's Traveller figures

### Compile, first-call and capture times

| what | time |
|---|---|
| x | 1 s |
{bm.END}

## Another bench

its figures
"""


def test_only_encoder_puts_its_rows_into_the_earlier_section(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    out.write_text(EARLIER, encoding="utf-8")
    run_quick("bench_models", out, "--only", "encoder", "--no-jax")
    text = out.read_text(encoding="utf-8")
    for kept in ("Someone's intro.", "the earlier run's Traveller figures", "| x | 1 s |",
                 "## Another bench\n\nits figures"):  # fmt: skip
        assert kept in text, kept
    assert text.count(bm.BEGIN) == text.count(bm.END) == 1
    section = text.split(bm.BEGIN)[1].split(bm.END)[0]
    # inside the section, before its compile table
    assert bm.BEGIN_ENCODER in section
    assert section.index(bm.END_ENCODER) < section.index("### Compile, first-call")
    block = section.split(bm.BEGIN_ENCODER)[1].split(bm.END_ENCODER)[0]
    assert "### GRU encoder: your own model (`examples/gru_encoder.py`)" in block
    assert "*Measured on its own (`python -m bench.bench_models --quick" in block
    assert "--only encoder" in block
    for name in bm.ENCODER_NAMES:
        assert f"| {name} |" in block, name
    assert "B=1, T=20" in block
    assert "B=4, T=10" in block
    assert "FAILED" not in block
    assert "torch.jit.script(PackedGRUEncoder)" in block
    assert "What we expected / what we got" in block
    assert_tables_well_formed(block)
    # a second run replaces the first one's rows
    run_quick("bench_models", out, "--only", "encoder", "--no-jax")
    again = out.read_text(encoding="utf-8")
    assert again.count(bm.BEGIN_ENCODER) == again.count(bm.END_ENCODER) == 1
    assert "the earlier run's Traveller figures" in again


def test_encoder_rows_without_a_section_to_go_into(tmp_path: Path) -> None:
    out = tmp_path / "new.md"
    block = "\n".join(bm.render_encoder(bm.Results(), bm.PLANS[("cpu", True)], "*alone*"))
    bm.write_encoder(out, block + "\n")
    text = out.read_text(encoding="utf-8")
    assert text.count(bm.BEGIN) == text.count(bm.END) == 1
    assert "Not measured in this run." in text
    assert "*alone*" in text
