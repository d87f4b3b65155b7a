"""The JAX rollout variants and bench/rollout_vs_jax.py: every variant computes the model's
rollout, the FLOP count is the weight shapes', and the report ranks what it timed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import rollout_vs_jax as rvj
from rnnserve.models.packing import pack, unpack
from rnnserve.models.traveller import Traveller

ROOT = Path(__file__).resolve().parents[2]
HAVE_JAX = importlib.util.find_spec("jax") is not None
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (the `bench` extra)")


def test_rollout_flops_count_every_product_of_a_step() -> None:
    # hidden 3, 2 layers, 5 inputs: layer 0 [2 + 3 + 5] x [12], layer 1 [6] x [12], out [3] x [2]
    per_row = 2 * (10 * 12 + 6 * 12 + 3 * 2)
    assert rvj.rollout_flops([4, 2, 1], num_inputs=5, hidden=3, num_layers=2) == per_row * 7
    # the default Traveller at 64 active rows: the ~25.7 MFLOP a step the floor is built on
    assert rvj.rollout_flops([64], 6, 128, 2) == pytest.approx(25.7e6, rel=2e-3)


def _shape(cases: dict[str, float]) -> dict[str, object]:
    return {
        "batch": 2,
        "steps": 10,
        "flops_packed": 1e9,
        "flops_padded": 2e9,
        "flops_step_full": 1e8,
        "cases": {
            name: {
                "cpu": [ms / 1e3, ms / 1e3 + 0.001, ms / 1e3 - 0.001],
                "samples": [2 * ms / 1e3] * 3,  # the wall clock of a loaded machine
                "err": 1e-7,
            }
            for name, ms in cases.items()
        },
    }


def test_report_ratios_are_against_the_fastest_jax_variant() -> None:
    shape = _shape({rvj.NUMBA: 90.0, "JAX split-tuple-highest-u1": 100.0, "JAX a": 120.0})
    assert rvj.best_jax(shape["cases"]) == "JAX split-tuple-highest-u1"  # type: ignore[arg-type]
    lines = rvj.shape_table(shape, peak_gflops=100.0)
    numba = next(line for line in lines if line.startswith(f"| {rvj.NUMBA} |"))
    cells = [c.strip() for c in numba.strip("|").split("|")]
    # CPU time: 90 ms over the fastest JAX's 100 ms; 1 GFLOP in 90 ms; floor 1 GFLOP at
    # 100 GFLOP/s = 10 ms; the wall clock beside it
    assert cells[1:7] == ["90", "89–91", "180", "0.90×", "11.1", "9.00×"]
    fastest = next(line for line in lines if "(fastest)" in line)
    assert fastest.startswith("| JAX split-tuple-highest-u1 (fastest) | 100 |")
    assert "| 1.00× | 20.0 | 5.00× |" in fastest  # JAX counts the padded FLOPs
    # ranked by the wall clock (the unpinned layout), the same ratios here
    assert "| 0.90× |" in rvj.shape_table(shape, 100.0, clock="samples")[2]


def test_later_runs_keep_the_fastest_variants_and_the_first_baseline() -> None:
    pytest.importorskip("jax")
    run = {
        "layout": "one",
        "shapes": [
            _shape({rvj.NUMBA: 1.0, "JAX a-b-c-u1": 3.0, "JAX d-e-f-u2": 2.0, "JAX g-h-i-u4": 9.0}),
            _shape({rvj.NUMBA: 1.0, "JAX a-b-c-u1": 2.0, "JAX d-e-f-u2": 3.0, "JAX g-h-i-u4": 9.0}),
        ],
    }
    keys = rvj.fastest_keys(run, keep=1).split(",")
    assert keys == ["d-e-f-u2", "a-b-c-u1", "concat-stacked-highest-u1"]


@needs_jax
def test_every_variant_is_the_models_rollout() -> None:
    from bench import jax_baselines as jb

    lengths = [9, 1, 17, 4]
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(2)
    model = Traveller(6, 16, 3).eval().requires_grad_(False)
    with torch.no_grad():  # positions well into tanh's curve, as the backend tests make them
        model.output_layer.weight.mul_(12.0)
        model.output_layer.bias.mul_(4.0)
        model.lstm_layers.weight_ih_l0.mul_(3.0)
    us = [2 * torch.randn(n, 6, generator=gen) for n in lengths]
    want = [p.numpy() for p in unpack(model.rollout(pack(us)))]
    assert max(float(np.abs(p).max()) for p in want) > 0.6
    lstm = model.lstm_layers
    weights = jb.traveller_weights(
        *(
            [getattr(lstm, f"{kind}_l{k}").numpy() for k in range(3)]
            for kind in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
        ),
        model.output_layer.weight.numpy(),
        model.output_layer.bias.numpy(),
    )
    u, mask = jb.padded_time_major([s.numpy() for s in us])
    assert len(jb.ROLLOUT_VARIANTS) == 24
    assert set(jb.CPU_CANDIDATES) <= set(jb.ROLLOUT_VARIANTS)
    for variant in jb.ROLLOUT_VARIANTS:
        assert jb.RolloutVariant.parse(variant.key) == variant
        compiled, _ = jb.compile_for(jb.rollout_variant_fn(variant), u, mask, weights)
        p = np.asarray(compiled(u, mask, weights))
        assert not p[~mask].any(), variant
        for got, ref in zip(jb.unpad_time_major(p, lengths), want, strict=True):
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0, err_msg=variant.key)
    with pytest.raises(ValueError, match="no rollout variant"):
        jb.RolloutVariant.parse("split-tuple-highest-u3")


@needs_jax
@pytest.mark.slow
def test_quick_run_writes_its_section(tmp_path: Path) -> None:
    out = tmp_path / "B.md"
    out.write_text("# Benchmarks\n\nkept\n", encoding="utf-8")
    variants = "split-tuple-highest-u1,concat-stacked-highest-u1"
    command = [sys.executable, "-m", "bench.rollout_vs_jax", "--quick", "--runs", "1"]
    proc = subprocess.run(
        [*command, "--rounds", "2", "--variants", variants, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text(encoding="utf-8")
    assert "kept" in text
    assert text.count(rvj.BEGIN) == 1
    assert "threads `one`" in text
    assert "threads `jax-default`" in text
    rows = [line for line in text.splitlines() if line.startswith(f"| {rvj.NUMBA} |")]
    assert len(rows) == 4  # two shapes, two thread layouts
    for row in rows:
        assert float(row.strip("|").split("|")[-1]) < 1e-5  # checked against float64
    assert "GFLOP/s**, the theoretical peak of one core" in text


def test_rounds_shuffle_the_cases_and_warm_each_one_call_sample() -> None:
    """No case always follows the same other one (a rotation keeps the cyclic order, and the
    case after a cache-thrashing one pays for it), and a sample of one call comes right after
    an untimed call of the same case."""
    calls: list[str] = []

    def slow(name: str) -> rvj.Case:
        def fn() -> None:
            calls.append(name)
            end = time.process_time() + 0.004  # one call per 1 ms sample
            while time.process_time() < end:
                pass

        return rvj.Case(name, fn)

    cases = [slow(n) for n in "abcd"]
    rounds = 12
    out = rvj.measure_both(cases, rounds, sample_s=0.001)
    assert all(len(out[n]["cpu"]) == rounds for n in "abcd")
    timed = calls[3 * len(cases) :]  # after the 3 calibration calls of each case
    assert len(timed) == 2 * rounds * len(cases)
    pairs = [timed[i : i + 2] for i in range(0, len(timed), 2)]
    assert all(first == second for first, second in pairs)  # the untimed call, then the timed
    order = [first for first, _ in pairs]
    before_a = {order[i - 1] for i in range(1, len(order)) if order[i] == "a"}
    assert len(before_a) > 1
