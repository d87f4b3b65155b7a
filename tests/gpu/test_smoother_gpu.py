"""The Triton smoother on CUDA against the CPU path, on realistic shapes (skipped without CUDA).

Lengths are spread over T/2..T as in the benchmarks. Forward and final state are compared with
the numba kernel, gradients with autograd through the torch step loop (float64 on the CPU).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

from rnnserve.models.kernels import ema_packed_numba, ema_packed_torch, last_step_rows
from rnnserve.models.packing import pack
from rnnserve.models.smoothing import LinearRecursion

triton_mod = pytest.importorskip("rnnserve.models.kernels.smoother_triton")
smooth_packed_triton = triton_mod.smooth_packed_triton
plan_tiles = triton_mod.plan_tiles

CUDA = torch.device("cuda")
SHAPES = [(64, 1000, 16), (256, 4000, 16), (1, 100_000, 16), (1000, 50, 16), (3, 777, 5)]


def batch(n_seqs: int, n_steps: int, feat: int, seed: int, dtype: torch.dtype) -> PackedSequence:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(1, n_steps // 2), n_steps + 1, (n_seqs,), generator=gen)
    lengths[0] = n_steps
    return pack([torch.randn(int(n), feat, generator=gen, dtype=dtype) for n in lengths])


def params(feat: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(feat)
    alpha = 0.05 + 0.9 * torch.rand(feat, generator=gen, dtype=dtype)
    return alpha, 0.2 + 1.5 * torch.rand(feat, generator=gen, dtype=dtype)


def cpu_forward(
    packed: PackedSequence, alpha: Tensor, wx: Tensor, init: Tensor | None
) -> tuple[Tensor, Tensor]:
    s = ema_packed_numba(packed.data, packed.batch_sizes, alpha, init)
    return torch.tanh(wx * s), s[last_step_rows(packed.batch_sizes)]


@pytest.mark.parametrize(("n_seqs", "n_steps", "feat"), SHAPES)
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_forward_and_state_equal_the_cpu_path(
    n_seqs: int, n_steps: int, feat: int, with_state: bool
) -> None:
    packed = batch(n_seqs, n_steps, feat, seed=n_steps, dtype=torch.float32)
    alpha, wx = params(feat, torch.float32)
    init = torch.randn(n_seqs, feat) if with_state else None
    y, final = smooth_packed_triton(
        packed.data.to(CUDA),
        packed.batch_sizes,
        alpha.to(CUDA),
        wx.to(CUDA),
        None if init is None else init.to(CUDA),
    )
    want_y, want_final = cpu_forward(packed, alpha, wx, init)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-5, rtol=0)
    torch.testing.assert_close(final.cpu(), want_final, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("n_seqs", "n_steps", "feat"), SHAPES)
@pytest.mark.parametrize("tiles", [{"sub": 8}, {"sub": 1}, {"chunk": 256, "sub": 1}], ids=str)
def test_forward_in_pieces_equals_the_cpu_path(
    n_seqs: int, n_steps: int, feat: int, tiles: dict[str, int]
) -> None:
    """The forward variants the benchmark measures (each chunk scanned in pieces)."""
    packed = batch(n_seqs, n_steps, feat, seed=n_steps + 1, dtype=torch.float32)
    alpha, wx = params(feat, torch.float32)
    with torch.inference_mode():
        y, final = smooth_packed_triton(
            packed.data.to(CUDA), packed.batch_sizes, alpha.to(CUDA), wx.to(CUDA), None, **tiles
        )
    want_y, want_final = cpu_forward(packed, alpha, wx, None)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-5, rtol=0)
    torch.testing.assert_close(final.cpu(), want_final, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("n_seqs", "n_steps", "feat"), SHAPES)
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
@pytest.mark.parametrize(
    "tiles", [{}, {"chunk": 64, "block": 32}, {"chunk": 128, "block": 64}], ids=str
)
def test_chained_scan_equals_the_cpu_path(
    n_seqs: int, n_steps: int, feat: int, with_state: bool, tiles: dict[str, int]
) -> None:
    """The single-pass chained forward (its own plan, and tiles of the sweep), served as the
    server runs it and with its states kept for a backward pass."""
    packed = batch(n_seqs, n_steps, feat, seed=n_steps + 2, dtype=torch.float32)
    alpha, wx = params(feat, torch.float32)
    init = torch.randn(n_seqs, feat) if with_state else None
    want_y, want_final = cpu_forward(packed, alpha, wx, init)
    for mode in (torch.inference_mode, torch.enable_grad):
        with mode():
            y, final = smooth_packed_triton(
                packed.data.to(CUDA),
                packed.batch_sizes,
                alpha.to(CUDA).requires_grad_(mode is torch.enable_grad),
                wx.to(CUDA),
                None if init is None else init.to(CUDA),
                scan="chained",
                **tiles,
            )
        torch.testing.assert_close(y.detach().cpu(), want_y, atol=1e-5, rtol=0)
        torch.testing.assert_close(final.detach().cpu(), want_final, atol=1e-5, rtol=0)


# The look-back scan's programs spin on flags other programs set: a fault in its ordering is a
# hang, not a wrong number. It runs in a child process under a timeout, so a hang fails this test
# instead of stopping the run; repeated calls give races their chance.
LOOKBACK_CHILD = r"""
import sys, torch
sys.path[:0] = [sys.argv[1]]
from tests.gpu.test_smoother_gpu import SHAPES, batch, cpu_forward, params
from rnnserve.models.kernels.smoother_triton import smooth_packed_triton
worst = 0.0
for n_seqs, n_steps, feat in SHAPES:
    packed = batch(n_seqs, n_steps, feat, seed=n_steps + 3, dtype=torch.float32)
    alpha, wx = params(feat, torch.float32)
    for with_state in (False, True):
        init = torch.randn(n_seqs, feat) if with_state else None
        want_y, want_final = cpu_forward(packed, alpha, wx, init)
        for tiles in ({}, {"chunk": 16, "block": 32}, {"chunk": 64, "block": 64}):
            for _ in range(int(sys.argv[2])):
                with torch.inference_mode():
                    y, final = smooth_packed_triton(
                        packed.data.cuda(), packed.batch_sizes, alpha.cuda(), wx.cuda(),
                        None if init is None else init.cuda(), scan="lookback", **tiles,
                    )
                err = max(float((y.cpu() - want_y).abs().max()),
                          float((final.cpu() - want_final).abs().max()))
                worst = max(worst, err)
                if err > 1e-5:
                    print(f"OFF {n_seqs} {n_steps} {feat} {with_state} {tiles} {err:.3e}")
print(f"WORST {worst:.3e}")
"""


def test_lookback_scan_equals_the_cpu_path_and_never_hangs() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run(
            [sys.executable, "-c", LOOKBACK_CHILD, str(root), "3"],
            capture_output=True,
            text=True,
            timeout=90,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the look-back scan hung (or ran over 90 s)")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "OFF" not in done.stdout, done.stdout
    assert "WORST" in done.stdout


@pytest.mark.parametrize(("n_seqs", "n_steps", "feat"), [(64, 1000, 16), (1, 100_000, 16)])
def test_float64_on_cuda_is_tight(n_seqs: int, n_steps: int, feat: int) -> None:
    packed = batch(n_seqs, n_steps, feat, seed=1, dtype=torch.float64)
    alpha, wx = params(feat, torch.float64)
    y, final = smooth_packed_triton(
        packed.data.to(CUDA), packed.batch_sizes, alpha.to(CUDA), wx.to(CUDA)
    )
    want_y, want_final = cpu_forward(packed, alpha, wx, None)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-12, rtol=0)
    torch.testing.assert_close(final.cpu(), want_final, atol=1e-12, rtol=0)


def test_lengths_on_and_beside_the_default_chunk_edges() -> None:
    feat = 16
    chunk = plan_tiles(8 * 64, 24, feat).chunk
    lengths = [k * chunk + d for k in (1, 2, 7) for d in (-1, 0, 1)] + [1, 2, 8 * 64]
    gen = torch.Generator().manual_seed(3)
    packed = pack([torch.randn(n, feat, generator=gen) for n in lengths])
    alpha, wx = params(feat, torch.float32)
    y, final = smooth_packed_triton(
        packed.data.to(CUDA), packed.batch_sizes, alpha.to(CUDA), wx.to(CUDA)
    )
    want_y, want_final = cpu_forward(packed, alpha, wx, None)
    torch.testing.assert_close(y.cpu(), want_y, atol=1e-5, rtol=0)
    torch.testing.assert_close(final.cpu(), want_final, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n_seqs", "n_steps"), [(32, 500), (1, 3000)])
def test_backward_equals_autograd_through_the_cpu_loop(
    dtype: torch.dtype, n_seqs: int, n_steps: int
) -> None:
    feat = 16
    packed = batch(n_seqs, n_steps, feat, seed=5, dtype=torch.float64)
    alpha, wx = params(feat, torch.float64)
    init = torch.randn(n_seqs, feat, dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    g_y = torch.randn(packed.data.shape, generator=gen, dtype=torch.float64)
    g_fin = torch.randn(n_seqs, feat, generator=gen, dtype=torch.float64)

    def grads(device: torch.device, dt: torch.dtype, triton: bool) -> list[Tensor]:
        leaves = [t.to(device, dt).requires_grad_() for t in (packed.data, alpha, wx, init)]
        x, a, w, s0 = leaves
        if triton:
            y, final = smooth_packed_triton(x, packed.batch_sizes, a, w, s0)
        else:
            s = ema_packed_torch(x, packed.batch_sizes, a, s0)
            y, final = torch.tanh(w * s), s[last_step_rows(packed.batch_sizes)]
        loss = (y * g_y.to(device, dt)).sum() + (final * g_fin.to(device, dt)).sum()
        return [g.double().cpu() for g in torch.autograd.grad(loss, leaves)]

    want = grads(torch.device("cpu"), torch.float64, triton=False)
    got = grads(CUDA, dtype, triton=True)
    tol = 1e-9 if dtype == torch.float64 else 1e-4
    for name, g, w in zip(("x", "alpha", "wx", "init"), got, want, strict=True):
        scale = w.abs().max().clamp_min(1.0)
        assert (g - w).abs().max() <= tol * scale, name


def test_model_on_cuda_picks_triton_and_keeps_state_order() -> None:
    model = LinearRecursion(16)
    alpha, wx = params(16, torch.float32)
    with torch.no_grad():
        model.alpha_smooth.copy_(alpha)
        model.wx.copy_(wx)
    packed = batch(40, 300, 16, seed=8, dtype=torch.float32)
    state = torch.randn(40, 16)
    cpu_model = LinearRecursion(16)
    cpu_model.load_state_dict(model.state_dict())
    gpu_model = model.to(CUDA)
    assert gpu_model._pick_kernel(packed.data.to(CUDA), None) == "triton"
    with torch.inference_mode():
        out, final = gpu_model.forward_with_state(packed.to(CUDA), state.to(CUDA))  # type: ignore[arg-type]
        want, want_final = cpu_model.forward_with_state(packed, state)
    torch.testing.assert_close(out.data.cpu(), want.data, atol=1e-5, rtol=0)
    torch.testing.assert_close(final.cpu(), want_final, atol=1e-5, rtol=0)


def _compiled(kernel: object) -> int:
    """How many binaries of ``kernel`` Triton holds (its per-device kernel caches)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton version keeps its compiled kernels elsewhere")
    return sum(len(entry[0]) for entry in caches.values())


def test_after_warm_up_no_served_batch_compiles_a_kernel() -> None:
    """The server's start-up compiles every tile plan; batches of any size then compile none
    (a compile met while serving stalled /smooth batches for up to ~0.6 s on the H200)."""
    model = LinearRecursion(16).to(CUDA)
    names = ("_fwd_chunk_summary", "_carry_scan", "_fwd_replay")
    gen = torch.Generator().manual_seed(11)
    with torch.inference_mode():
        assert model.warm_up(4000) == len(triton_mod.tile_plans(16, 4000))
        before = {name: _compiled(getattr(triton_mod, name)) for name in names}
        for k in range(40):
            n_seqs = int(torch.randint(1, 65, (1,), generator=gen))
            n_steps = int(torch.randint(1, 4001, (1,), generator=gen))
            packed = batch(n_seqs, n_steps, 16, seed=k, dtype=torch.float32)
            y = model(packed.to(CUDA))
            assert y.data.shape == packed.data.shape
        torch.cuda.synchronize()
        after = {name: _compiled(getattr(triton_mod, name)) for name in names}
    assert after == before


@pytest.mark.parametrize("scan", ["chunked", "chained"])  # the look-back runs in a child above
def test_inner_entry_replayed_as_a_cuda_graph_over_rotating_inputs(scan: str) -> None:
    """What ``bench_tiles --gpu-time`` times: ``launch_forward`` on three buffer sets, captured
    in one graph, replayed after the rows change in place: each set's output is the public
    call's on its rows."""
    packed = batch(64, 1000, 16, seed=5, dtype=torch.float32)
    alpha, wx = (p.to(CUDA) for p in params(16, torch.float32))
    rows = [packed.data.to(CUDA) * (1 + k) for k in range(3)]
    sets = [triton_mod.prepare_forward(x, packed.batch_sizes, alpha, wx, scan=scan) for x in rows]
    for buf in sets:
        triton_mod.launch_forward(buf)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for buf in sets:
            triton_mod.launch_forward(buf)
    for k, buf in enumerate(sets):
        buf.x.copy_(rows[(k + 1) % 3])  # rotate the rows under the captured pointers
        buf.y.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for k, buf in enumerate(sets):
        want_y, want_final = smooth_packed_triton(
            rows[(k + 1) % 3], packed.batch_sizes, alpha, wx, scan=scan
        )
        torch.testing.assert_close(buf.y, want_y, atol=0, rtol=0)
        torch.testing.assert_close(buf.final, want_final, atol=0, rtol=0)
