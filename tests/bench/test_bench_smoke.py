"""Smoke tests of the benchmarks: ``--quick`` runs and writes its tables (no timings checked).

Also: the JAX baselines against our models (skipped without JAX), the CUDA report rendered from
made-up rows (no GPU here), and the GPU-host scripts' syntax.

The benchmarks run in a subprocess because they pin torch to one thread (and the process to one
core) for the whole process.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bench import bench_gpu_e2e, bench_models
from rnnserve.models.packing import pack, unpack
from rnnserve.models.smoothing import LinearRecursion
from rnnserve.models.traveller import Traveller

# each runs a benchmark in a process of its own: tens of seconds
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HAVE_JAX = importlib.util.find_spec("jax") is not None


def run_quick(module: str, out: Path, *extra: str) -> str:
    """``python -m bench.<module> --quick --out <out>`` in a subprocess; it must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", "--quick", "--out", str(out), *extra],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


def assert_tables_well_formed(text: str) -> None:
    """Every table row has as many cells as its header, and a separator row follows it."""
    table: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            widths = {row.count(" | ") for row in table if not row.startswith("|---")}
            assert len(widths) == 1, table
            assert table[1].startswith("|---")
            assert table[1].count("|---") == widths.pop() + 1, table
            table = []


def test_quick_benchmark_writes_its_tables(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "BENCH.md"
    out.parent.mkdir()
    out.write_text("# Benchmarks\n\nA section someone else wrote.\n", encoding="utf-8")

    run_quick("bench_models", out)
    text = out.read_text(encoding="utf-8")
    for heading in (
        "### Smoother",
        "### Traveller",
        "### Compile, first-call and capture times",
        "### What we expected / what we got",
    ):
        assert heading in text
    for name in (
        "torch.tanh (floor)",
        "ema_packed_numba",
        "ema_packed_torch",
        'LinearRecursion, kernel "auto"',
        'LinearRecursion, kernel "torch"',
        "per-step loop (over sequences and steps)",
        "nn.LSTM teacher-forced + output layer (bound)",
        'Traveller.rollout, "torchscript"',
        'Traveller.rollout, "eager"',
        "per-step loop (nn.LSTM per step, per sequence)",
    ):
        assert f"| {name}" in text, name
    if HAVE_JAX:
        for name in ("JAX lax.scan (padded)", "JAX lax.associative_scan", "JAX lax.scan rollout"):
            assert f"| {name}" in text, name
        assert "JAX jit compile" in text
    assert "torch threads: 1" in text
    assert "process pinned to CPU" in text
    assert "FAILED" not in text
    assert "max abs err vs float64" in text
    assert_tables_well_formed(text)

    # A second run replaces the first run's section; without JAX its rows go, with the reason.
    log = run_quick("bench_models", out, "--no-jax")
    assert "skipping the JAX rows" not in log  # --no-jax does not even try
    text = out.read_text(encoding="utf-8")
    assert "A section someone else wrote." in text
    assert text.count("<!-- bench_models:begin -->") == 1
    assert text.count("<!-- bench_models:end -->") == 1
    assert "| JAX" not in text
    assert "**JAX.** Not measured in this run: not tried (--no-jax)" in text
    assert_tables_well_formed(text)


@pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (the optional `bench` extra)")
def test_jax_rows_measured_in_a_process_of_their_own(tmp_path: Path) -> None:
    """``--jax process`` (CUDA's default, tried here on the CPU): every JAX row checked and timed
    by ``python -m bench.jax_baselines``, its compile reported apart."""
    out = tmp_path / "BENCH.md"
    run_quick("bench_models", out, "--jax", "process")
    text = out.read_text(encoding="utf-8")
    for name in ("JAX lax.scan (padded)", "JAX lax.associative_scan", "JAX lax.scan rollout"):
        rows = [line for line in text.splitlines() if line.startswith("| B=") and name in line]
        assert len(rows) == 2, name  # one per quick shape, each timed (3 rounds) and checked
        for row in rows:
            cells = [c.strip() for c in row.strip("|").split("|")]
            assert float(cells[-2]) < 1e-5  # max abs err vs float64
            assert cells[-1].startswith("3 × ")
    assert text.count("; in its own process)") == 6  # the compile of each, apart
    assert "JAX rows: each measured in a process of its own" in text
    assert "(in a process of its own)" in text  # the version line says so
    assert "FAILED" not in text
    assert_tables_well_formed(text)


def test_no_jax_means_no_jax_process_either() -> None:
    """``--no-jax`` in process mode (CUDA's default, and gpu_check.sh's fallback) runs none."""
    suite = bench_models.Suite(bench_models.PLANS[("cpu", True)], use_jax=False, jax_process=True)
    with pytest.raises(bench_models.Unavailable, match=r"^not tried \(--no-jax\)$"):
        suite.jax_elsewhere("smoother_scan", {"x": np.zeros(1)}, "B=1, T=1")
    assert suite.res.compile == []


@pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (the optional `bench` extra)")
def test_a_failing_jax_process_costs_its_row_only() -> None:
    suite = bench_models.Suite(bench_models.PLANS[("cpu", True)], use_jax=True, jax_process=True)
    with pytest.raises(bench_models.Unavailable, match=r"its process failed \(exit 2\): .*"):
        suite.jax_elsewhere("no_such_function", {"x": np.zeros(1)}, "B=1, T=1")
    assert suite.res.compile == []


def _fake_row(name: str, batch: int, steps: int, ms: float, floor_ms: float) -> bench_models.Row:
    timing = bench_models.Timing(number=1, samples=[ms / 1e3] * 3)
    label = bench_models.shape_label(batch, steps)
    n = sum(bench_models.half_spread_lengths(batch, steps))
    return bench_models.Row(label, name, timing, ms / floor_ms, batch, steps, n, 1e-7)


def test_cuda_report_renders_from_rows(tmp_path: Path) -> None:
    """The CUDA section (no GPU here): its own markers, tables, leads and skipped rows."""
    bm = bench_models
    res = bm.Results()
    for b, t, floor in ((64, 1000, 0.02), (256, 4000, 0.05), (1, 100_000, 0.04)):
        res.smoother += [
            _fake_row(bm.SMOOTHER_FLOOR_CUDA, b, t, floor, floor),
            _fake_row('LinearRecursion, kernel "torch"', b, t, 30.0, floor),
            _fake_row(bm.JAX_ASSOC, b, t, 0.2, floor),
        ]
    for b, t, bound in ((1, 1000, 3.8), (64, 500, 2.8), (1024, 200, 7.5)):
        res.traveller += [
            _fake_row(bm.TRAVELLER_BOUND, b, t, bound, bound),
            _fake_row('Traveller.rollout, "torchscript"', b, t, 100.0, bound),
            _fake_row(f'Traveller.rollout, "eager"{bm.GRAPH_SUFFIX}', b, t, 20.0, bound),
        ]
    res.compile.append(("CUDA graph capture, eager rollout (B=1, T=1000)", "40 ms"))
    res.skipped.append(('Traveller.rollout, "triton"', "B=1, T=1000", "not in this checkout"))
    res.skipped.append(('Traveller.rollout, "triton"', "B=64, T=500", "not in this checkout"))
    plan = bm.PLANS[("cuda", False)]
    started = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    text = bm.render(res, plan, started, 100.0, "0.1", "NVIDIA H200 (140 GiB); host x")
    assert text.startswith(bm.BEGIN_CUDA)
    assert text.rstrip().endswith(bm.END_CUDA)
    assert "device-to-device copy" in text
    assert "cuDNN" in text
    assert "B=1, T=100000" in text
    assert "the reference figure for a torch loop over steps: 28.3 ms" in text
    assert "the fastest implementation per shape" in text
    assert '- Traveller.rollout, "triton" (B=1, T=1000; B=64, T=500): not in this checkout' in text
    assert_tables_well_formed(text)

    out = tmp_path / "B.md"
    bm.write_section(out, "<!-- bench_models:begin -->\ncpu\n<!-- bench_models:end -->\n")
    bm.write_section(out, text, bm.BEGIN_CUDA, bm.END_CUDA)
    both = out.read_text(encoding="utf-8")
    assert "cpu" in both
    assert both.count(bm.BEGIN_CUDA) == 1


@pytest.mark.skipif(not HAVE_JAX, reason="JAX is not installed (the optional `bench` extra)")
def test_jax_baselines_match_our_models() -> None:
    from bench import jax_baselines as jb

    lengths = [9, 1, 17, 4, 17]
    gen = torch.Generator().manual_seed(0)

    smoother = LinearRecursion(16).eval().requires_grad_(False)
    with torch.no_grad():
        smoother.alpha_smooth.copy_(0.05 + 0.9 * torch.rand(16, generator=gen))
        smoother.wx.copy_(0.5 + 1.5 * torch.rand(16, generator=gen))
    xs = [3 * torch.randn(n, 16, generator=gen) for n in lengths]
    want = [y.numpy() for y in unpack(smoother(pack(xs)))]
    x, mask = jb.padded_time_major([s.numpy() for s in xs])
    params = (smoother.alpha_smooth.numpy(), smoother.wx.numpy())
    for fn in (jb.smoother_scan, jb.smoother_associative_scan):
        compiled, _ = jb.compile_for(fn, x, mask, *params)
        y = np.asarray(compiled(x, mask, *params))
        assert not y[~mask].any(), "padded steps must be zero"
        for got, ref in zip(jb.unpad_time_major(y, lengths), want, strict=True):
            np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)

    torch.manual_seed(2)
    model = Traveller(6, 16, 2).eval().requires_grad_(False)
    with torch.no_grad():  # make positions reach well into tanh's curve, as the backend tests do
        model.output_layer.weight.mul_(12.0)
        model.output_layer.bias.mul_(4.0)
        model.lstm_layers.weight_ih_l0.mul_(3.0)
    us = [2 * torch.randn(n, 6, generator=gen) for n in lengths]
    want = [p.numpy() for p in unpack(model.rollout(pack(us)))]
    assert max(float(np.abs(p).max()) for p in want) > 0.6
    lstm = model.lstm_layers

    def per_layer(kind: str) -> list[np.ndarray]:
        return [getattr(lstm, f"{kind}_l{k}").numpy() for k in range(2)]

    weights = jb.traveller_weights(
        per_layer("weight_ih"),
        per_layer("weight_hh"),
        per_layer("bias_ih"),
        per_layer("bias_hh"),
        model.output_layer.weight.numpy(),
        model.output_layer.bias.numpy(),
    )
    u, mask = jb.padded_time_major([s.numpy() for s in us])
    compiled, _ = jb.compile_for(jb.traveller_rollout_scan, u, mask, weights)
    p = np.asarray(compiled(u, mask, weights))
    assert not p[~mask].any()
    for got, ref in zip(jb.unpad_time_major(p, lengths), want, strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5, rtol=0)


def test_float64_references_are_what_they_claim() -> None:
    """The benchmark's references: pandas-free EMA and the batched per-step loop, per sequence."""
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randn(n, 16, generator=gen) for n in (5, 2, 7)]
    alpha, wx = torch.full((16,), 0.3), torch.full((16,), 1.5)
    s, y = bench_models.smoother_reference(seqs, alpha, wx)
    x0 = seqs[0].double().numpy()
    s0 = [x0[0]]
    a = float(alpha[0])  # 0.3 in float32
    for t in range(1, 5):
        s0.append(a * s0[-1] + (1 - a) * x0[t])
    np.testing.assert_allclose(s[0, :5], np.stack(s0), atol=1e-12)
    np.testing.assert_allclose(y[0, :5], np.tanh(1.5 * np.stack(s0)), atol=1e-12)
    assert not s[1, 2:].any()
    assert not y[1, 2:].any()

    torch.manual_seed(0)
    model = Traveller(6, 8, 2).eval().double()
    us = [torch.randn(n, 6, generator=gen) for n in (6, 3)]
    ref = bench_models.rollout_reference(model, us)
    alone = bench_models.rollout_reference(model, us[1:])  # B=1: plainly the per-step loop
    np.testing.assert_allclose(ref[1, :3], alone[0], atol=1e-12)
    assert not ref[1, 3:].any()
    assert bench_models.half_spread_lengths(64, 1000)[::63] == [1000, 500]
    assert bench_models.half_spread_lengths(1, 1000) == [1000]


def test_e2e_report_and_answer_comparison() -> None:
    e2e = bench_gpu_e2e
    w = e2e.WORKLOADS[0]
    cuda = e2e.Result(w, "cuda", 300.0, 0.1, 0.2, 20.0, 1.5, [[[0.5, 0.25]]])
    cpu = e2e.Result(w, "cpu", 400.0, 0.1, 0.2, 30.0, 2.5, [[[0.5, 0.25 + 3e-7]]])
    assert e2e.max_difference(cuda, cpu) == pytest.approx(3e-7)
    text = e2e.render([cuda, cpu], ["cuda", "cpu"], quick=False, extra=[])
    assert "| `/smooth, 50–500 steps` | cuda | 300 | 0.75× |" in text
    assert "differ by at most 3.0e-07" in text
    assert_tables_well_formed(text)
    bodies = e2e.bodies_for(w, 3, seed=0)
    assert all(50 <= len(json.loads(b)["sequences"][0]) <= 500 for b in bodies)


def test_gpu_scripts() -> None:
    """bash syntax, shellcheck where installed, and what the wheelhouse holds."""
    scripts = [ROOT / "scripts" / "gpu_check.sh", ROOT / "scripts" / "gpu_wheels.sh"]
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        proc = subprocess.run(
            ["shellcheck", *map(str, scripts)], capture_output=True, text=True, check=False
        )
        assert proc.returncode == 0, proc.stdout
    names = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_requirements.py")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for needed in ("fastapi", "uvicorn", "pydantic-settings", "orjson", "aiohttp", "pytest"):
        assert needed in names
    assert "torch" not in names  # the host's CUDA build is used, never replaced


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


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="the Triton smoother needs triton"
)
def test_triton_forward_variants_are_benchmarked_on_cuda_and_checked() -> None:
    """The CUDA run times the chained single-pass scan and the Triton forward scanned in pieces
    (sub=8, 1; chunk=256) beside the default, each checked against the float64 reference first.
    Here (no GPU) the suite poses as a CUDA one and the kernels run in Triton's interpreter
    (tests/conftest.py sets it)."""
    bm = bench_models
    suite = bm.Suite(bm.PLANS[("cpu", True)], use_jax=False)
    seqs = bm.random_sequences(bm.half_spread_lengths(3, 12), 16, seed=1)
    x = pack(seqs)
    on_cpu = dict(suite.smoother_builders(seqs, x, "B=3, T=12"))
    variants = (bm.TRITON_CHAINED, bm.TRITON_PIECES_8, bm.TRITON_LOOP, bm.TRITON_LOOP_LONG)
    assert not set(variants) & set(on_cpu)
    suite.cuda = True
    builders = dict(suite.smoother_builders(seqs, x, "B=3, T=12"))
    for name in variants:
        case = builders[name]()
        assert case.name == name
        assert case.err < 1e-5
        y = case.fn()
        assert isinstance(y, torch.Tensor)
        assert y.shape == x.data.shape
    assert [what for what, _ in suite.res.compile] == [
        f"Triton smoother, {n} (B=3, T=12)" for n in variants
    ]


def test_tile_sweep_quick_run_measures_the_default_first(tmp_path: Path) -> None:
    out = tmp_path / "BENCH.md"
    out.write_text("# Benchmarks\n\nOther text.\n", encoding="utf-8")
    run_quick("bench_tiles", out, "--device", "cpu")  # Triton's interpreter (tests/conftest.py)
    text = out.read_text(encoding="utf-8")
    assert "Other text." in text
    assert text.count("<!-- bench_tiles:begin -->") == 1
    # the default and the quick candidates, each timed: the smoother's three (one chained),
    # each rollout shape's two
    for shape, n in (("B=3, T=20", 4), ("B=1, T=6", 3), ("B=20, T=4", 3)):
        rows = [line for line in text.splitlines() if line.startswith(f"| {shape} |")]
        assert rows[0].startswith(f"| {shape} | default |")
        assert " 1.00× | — |" in rows[0]
        assert len(rows) == n
        for row in rows[1:]:
            assert float(row.rstrip(" |").rsplit("|", 1)[1]) <= 1e-5  # checked against it
    assert "| B=3, T=20 | scan=chained, chunk=4, block=16 |" in text
    assert "4 candidates tried, 4 timed." in text
    assert "6 candidates tried, 6 timed." in text
    assert_tables_well_formed(text)


def test_tile_sweep_of_the_lookback_scan_alone(tmp_path: Path) -> None:
    """The smoother only, the look-back scan beside the default (its own run: its programs wait
    on one another)."""
    out = tmp_path / "BENCH.md"
    run_quick("bench_tiles", out, "--device", "cpu", "--kernels", "smoother", "--scans", "lookback")
    text = out.read_text(encoding="utf-8")
    assert "`python -m bench.bench_tiles --quick --device cpu --scans lookback" in text
    rows = [line for line in text.splitlines() if line.startswith("| B=3, T=20 |")]
    tiles = [r.split("|")[2].strip() for r in rows]
    assert tiles == ["default", "scan=lookback, chunk=4, block=16"]
    assert float(rows[1].rstrip(" |").rsplit("|", 1)[1]) <= 1e-5
    assert "### Rollout" not in text
    assert "2 candidates tried, 2 timed." in text
    assert_tables_well_formed(text)
    bad = subprocess.run(
        [sys.executable, "-m", "bench.bench_tiles", "--scans", "fast", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "--scans: choose from chunked, chained, lookback" in bad.stderr


def test_tile_sweep_candidates_and_report() -> None:
    from bench import bench_tiles as bt

    smoother = list(bt.smoother_candidates(1, 100_000, 16, quick=False))
    assert smoother[0] == {}  # the default first
    assert smoother[1] == {"scan": "chained"}  # then the chained scan with its own plan
    chained = [c for c in smoother if c.get("scan") == "chained"]
    assert smoother[1 : len(chained) + 1] == chained  # all before the chunked scan's tiles
    assert {(c["chunk"], c["block"]) for c in chained[1:]} == {
        (256, 16),
        (128, 16),
        (64, 16),
        (256, 32),
        (128, 32),
        (64, 32),
        (128, 64),
        (64, 64),
    }
    chunked = smoother[len(chained) + 1 :]
    assert all(c["block"] <= 32 for c in chunked)  # one sequence: 16 columns
    assert all(c["chunk"] * c["block"] <= 8192 for c in chunked if c["sub"] == c["chunk"])
    assert {c["sub"] for c in chunked} == {1, 8, 32, 64, 128, 256}
    wide = list(bt.smoother_candidates(256, 4000, 16, quick=False))
    assert max(c["block"] for c in wide if "sub" in c) == 256
    assert not [c for c in wide if c.get("scan") == "lookback"]  # swept only when asked
    lookback = list(bt.smoother_candidates(256, 4000, 16, False, scans=("lookback",)))
    assert lookback[:2] == [{}, {"scan": "lookback"}]
    assert all(c["scan"] == "lookback" for c in lookback[1:])
    assert all(c["chunk"] * c["block"] <= 8192 for c in lookback[2:])
    assert len(lookback) == 2 + 9
    rollout = list(bt.rollout_candidates(1024, quick=False))
    assert rollout[:3] == [{}, {"pdl": True}, {"precision": "tf32x3"}]
    assert all(c["config"].use_dot for c in rollout[3:])
    small = list(bt.rollout_candidates(1, quick=False))
    assert all(not c["config"].use_dot and c["pdl"] for c in small[3:])

    sweep = bt.Sweep(bt.PLANS[True], torch.device("cpu"), 10.0)
    shape = (3, 20)
    sweep.results = [
        bt.Result("smoother", shape, "default", 2e-3, None),
        bt.Result("smoother", shape, "chunk=8, block=32, sub=2", 1e-3, 1e-7),
        bt.Result("smoother", shape, "chunk=4, block=16, sub=1", None, 3e-2, "off"),
        bt.Result("rollout", (1, 6), "default", 6e-3, None),
        bt.Result("rollout", (1, 6), "PDL", None, None, "failed: RuntimeError: no"),
    ]
    sweep.left = {"rollout": 4}
    text = bt.render(sweep, dt.datetime(2026, 1, 1, tzinfo=dt.UTC), 12.0, "a machine")
    assert "| B=3, T=20 | default | 2 | 100 | 1.00× | — |" in text
    assert "| B=3, T=20 | chunk=8, block=32, sub=2 | 1 | 50 | 0.50× | 1.0e-07 |" in text
    assert "- B=3, T=20, chunk=4, block=16, sub=1: off by 3.0e-02" in text
    assert "3 candidates tried, 2 timed." in text
    assert "2 candidates tried, 1 timed, 4 left for lack of time." in text
    assert "- B=1, T=6, PDL: failed: RuntimeError: no" in text
    assert_tables_well_formed(text)


def test_gpu_time_needs_cuda_and_renders_its_table(tmp_path: Path) -> None:
    from bench import bench_tiles as bt

    refused = subprocess.run(
        [sys.executable, "-m", "bench.bench_tiles", "--device", "cpu", "--gpu-time",
         "--out", str(tmp_path / "t.md")],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert "--gpu-time" in refused.stderr
    lines = bt.render_gpu_time([
        bt.GraphResult((256, 4000), "chunked", 25e-6, 4, 0.0),
        bt.GraphResult((64, 1000), "chained", None, 4, 0.5, note="off"),
    ])  # fmt: skip
    table = [line for line in lines if line.startswith("| B=")]
    assert table[0] == "| B=256, T=4000 | chunked | 25 | 6.25 | 4 | 0.0e+00 |"
    assert table[1].startswith("| B=64, T=1000 | chained | off by 5.0e-01 |")
    assert bt.render_gpu_time([]) == []
