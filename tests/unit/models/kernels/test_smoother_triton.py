"""The Triton smoother (chunked scan) against an fp64 loop, under TRITON_INTERPRET=1 on the CPU.

Shapes are small and chunks short (4 steps) so that sequences cross chunk edges and the carry
scan loops several times, while the interpreter (which runs each program in Python) stays fast.
Also: initial and final state for every kernel, and the backward pass (gradcheck in float64).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.nn.utils.rnn import PackedSequence

import rnnserve.models.smoothing
from rnnserve.models.packing import pack, unpack
from rnnserve.models.smoothing import LinearRecursion

triton_mod = pytest.importorskip("rnnserve.models.kernels.smoother_triton")
single_pass = pytest.importorskip("rnnserve.models.kernels.smoother_triton_single_pass")
plan_tiles = triton_mod.plan_tiles
smooth_packed_triton = triton_mod.smooth_packed_triton

ON_CPU = not torch.cuda.is_available()
DEVICE = "cpu" if ON_CPU else "cuda"
KERNELS = ["numba", "torch", "triton"]
SMALL = {"chunk": 4, "block": 8, "carry": 2}  # many chunks, several carry-scan trips


@pytest.fixture
def small_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the model's triton path use SMALL tiles too (its own plan would be one chunk here)."""
    default = triton_mod.plan_tiles

    def small(n_steps: int, n_seqs: int, n_feat: int, **_: Any) -> Any:
        return default(n_steps, n_seqs, n_feat, **SMALL)

    monkeypatch.setattr(triton_mod, "plan_tiles", small)


def loop_reference(
    seqs: list[np.ndarray], alpha: np.ndarray, wx: np.ndarray, init: np.ndarray | None = None
) -> tuple[list[np.ndarray], np.ndarray]:
    """fp64 step loop: outputs ``tanh(wx * s)`` per sequence and the final states [B, F]."""
    a, w = alpha.astype(np.float64), wx.astype(np.float64)
    ys, finals = [], []
    for i, x in enumerate(seqs):
        x = x.astype(np.float64)
        s = x[0] if init is None else a * init[i] + (1 - a) * x[0]
        out = [s]
        for t in range(1, len(x)):
            s = a * s + (1 - a) * x[t]
            out.append(s)
        ys.append(np.tanh(w * np.stack(out)))
        finals.append(s)
    return ys, np.stack(finals)


def random_seqs(
    lengths: list[int], feat: int, seed: int, dtype: torch.dtype = torch.float32
) -> list[Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, feat, generator=gen, dtype=dtype) for n in lengths]


def random_params(
    feat: int, seed: int, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    alpha = 0.05 + 0.9 * torch.rand(feat, generator=gen, dtype=dtype)
    wx = 0.2 + 1.5 * torch.rand(feat, generator=gen, dtype=dtype)
    return alpha, wx


def run_triton(
    seqs: list[Tensor],
    alpha: Tensor,
    wx: Tensor,
    init: Tensor | None = None,
    **tiles: int,
) -> tuple[list[Tensor], Tensor]:
    """Pack, smooth with the triton kernel, unpack; ``init``/final state in original order."""
    packed = pack(seqs, DEVICE)
    init_sorted = None if init is None else init.to(DEVICE)[packed.sorted_indices]
    y, final = smooth_packed_triton(
        packed.data, packed.batch_sizes, alpha.to(DEVICE), wx.to(DEVICE), init_sorted, **tiles
    )
    out = PackedSequence(y, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices)
    return [o.cpu() for o in unpack(out)], final[packed.unsorted_indices].cpu()


def make_model(feat: int, kernel: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    model = LinearRecursion(feat).to(dtype)
    alpha, wx = random_params(feat, seed, dtype)
    with torch.no_grad():
        model.alpha_smooth.copy_(alpha)
        model.wx.copy_(wx)
    model.kernel = kernel
    return model.to(DEVICE) if kernel == "triton" else model


def assert_matches(
    got: list[Tensor], want: list[np.ndarray], atol: float, final: Tensor, want_final: np.ndarray
) -> None:
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.double().numpy(), w, atol=atol, rtol=0)
    np.testing.assert_allclose(final.double().numpy(), want_final, atol=atol, rtol=0)


def check_against_the_loop(
    seqs: list[Tensor], alpha: Tensor, wx: Tensor, init: Tensor | None, atol: float, **tiles: Any
) -> None:
    """The triton kernel with ``tiles`` against the fp64 loop: outputs and final states."""
    got, final = run_triton(seqs, alpha, wx, init, **tiles)
    want, want_final = loop_reference(
        [s.numpy() for s in seqs],
        alpha.numpy(),
        wx.numpy(),
        None if init is None else init.double().numpy(),
    )
    assert_matches(got, want, atol, final, want_final)


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_forward_matches_fp64_loop(dtype: torch.dtype, atol: float, with_state: bool) -> None:
    lengths = [9, 1, 13, 4, 8, 5, 2]
    seqs = random_seqs(lengths, 3, seed=1, dtype=dtype)
    alpha, wx = random_params(3, 1, dtype)
    init = torch.randn(len(lengths), 3, dtype=dtype) if with_state else None
    check_against_the_loop(seqs, alpha, wx, init, atol, **SMALL)


@pytest.mark.parametrize("length", [1, 3, 4, 5, 8, 9, 16, 17, 33])
def test_single_sequence_across_chunk_edges(length: int) -> None:
    # chunk = 4: lengths that end exactly on a chunk edge and one step either side of one
    seqs = random_seqs([length], 2, seed=length, dtype=torch.float64)
    alpha, wx = random_params(2, 2, torch.float64)
    got, final = run_triton(seqs, alpha, wx, **SMALL)
    want, want_final = loop_reference([seqs[0].numpy()], alpha.numpy(), wx.numpy())
    assert_matches(got, want, 1e-12, final, want_final)


def test_ragged_batch_ending_on_and_beside_chunk_edges() -> None:
    lengths = [3, 4, 5, 7, 8, 9, 12, 13, 16, 17]  # chunk = 4
    seqs = random_seqs(lengths, 2, seed=5)
    alpha, wx = random_params(2, 5)
    init = torch.randn(len(lengths), 2)
    got, final = run_triton(seqs, alpha, wx, init, chunk=4, block=4, carry=2)
    want, want_final = loop_reference(
        [s.numpy() for s in seqs], alpha.numpy(), wx.numpy(), init.numpy()
    )
    assert_matches(got, want, 1e-5, final, want_final)


@pytest.mark.parametrize("sub", [1, 2, 8])
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_chunks_scanned_in_pieces_match_the_loop(sub: int, with_state: bool) -> None:
    """``sub`` < ``chunk``: each chunk scanned ``sub`` steps at a time (``sub=1``: a loop over
    its steps), the state carried from piece to piece; sequences end inside pieces, on their
    edges and on the chunk edges, and the last chunk runs past the end of the batch."""
    lengths = [1, 2, 7, 8, 9, 15, 16, 23]  # chunk = 8
    seqs = random_seqs(lengths, 2, seed=21, dtype=torch.float64)
    alpha, wx = random_params(2, 21, torch.float64)
    init = torch.randn(len(lengths), 2, dtype=torch.float64) if with_state else None
    got, final = run_triton(seqs, alpha, wx, init, chunk=8, block=4, carry=2, sub=sub)
    want, want_final = loop_reference(
        [s.numpy() for s in seqs], alpha.numpy(), wx.numpy(), None if init is None else init.numpy()
    )
    assert_matches(got, want, 1e-12, final, want_final)


def test_long_single_sequence_with_the_default_plan() -> None:
    # B = 1: the default plan splits time into chunks (here 3 of 32 steps)
    seqs = random_seqs([70], 1, seed=9, dtype=torch.float64)
    alpha, wx = random_params(1, 9, torch.float64)
    assert plan_tiles(70, 1, 1).n_chunks == 3
    got, final = run_triton(seqs, alpha, wx)
    want, want_final = loop_reference([seqs[0].numpy()], alpha.numpy(), wx.numpy())
    assert_matches(got, want, 1e-12, final, want_final)


def test_each_output_independent_of_batch_mates() -> None:
    lengths = [6, 11, 3, 9]
    seqs = random_seqs(lengths, 3, seed=3)
    alpha, wx = random_params(3, 3)
    together, _ = run_triton(seqs, alpha, wx, **SMALL)
    for seq, y in zip(seqs, together, strict=True):
        alone, _ = run_triton([seq], alpha, wx, **SMALL)
        torch.testing.assert_close(y, alone[0], atol=1e-6, rtol=0)


@settings(max_examples=6, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    feat=st.integers(1, 3),
    chunk=st.sampled_from([2, 4, 8]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_batches_match_the_loop(
    lengths: list[int], feat: int, chunk: int, with_state: bool, seed: int
) -> None:
    seqs = random_seqs(lengths, feat, seed, torch.float64)
    alpha, wx = random_params(feat, seed, torch.float64)
    init = torch.randn(len(lengths), feat, dtype=torch.float64) if with_state else None
    got, final = run_triton(seqs, alpha, wx, init, chunk=chunk, block=8, carry=2)
    want, want_final = loop_reference(
        [s.numpy() for s in seqs],
        alpha.numpy(),
        wx.numpy(),
        None if init is None else init.numpy(),
    )
    assert_matches(got, want, 1e-12, final, want_final)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("kernel", KERNELS)
def test_final_state_for_every_kernel(kernel: str) -> None:
    lengths = [5, 12, 1, 8]
    seqs = random_seqs(lengths, 3, seed=4)
    model = make_model(3, kernel, seed=4)
    init = torch.randn(len(lengths), 3)
    alpha, wx = (p.detach().cpu().numpy() for p in (model.alpha_smooth, model.wx))
    with torch.inference_mode():
        for state in (None, init):
            out, final = model.forward_with_state(
                pack(seqs, DEVICE), None if state is None else state.to(DEVICE)
            )
            want, want_final = loop_reference(
                [s.numpy() for s in seqs], alpha, wx, None if state is None else state.numpy()
            )
            assert final.shape == (len(lengths), 3)
            assert_matches([y.cpu() for y in unpack(out)], want, 1e-5, final.cpu(), want_final)


@pytest.mark.usefixtures("small_tiles")
@pytest.mark.parametrize("kernel", KERNELS)
def test_resuming_from_the_state_equals_one_pass(kernel: str) -> None:
    lengths = [10, 7, 13]
    splits = [4, 1, 9]  # where each sequence is cut: head [:k], tail [k:]
    seqs = random_seqs(lengths, 2, seed=6)
    model = make_model(2, kernel, seed=6)
    with torch.inference_mode():
        whole, final = model.forward_with_state(pack(seqs, DEVICE))
        head, state = model.forward_with_state(
            pack([s[:k] for s, k in zip(seqs, splits, strict=True)], DEVICE)
        )
        tail, final2 = model.forward_with_state(
            pack([s[k:] for s, k in zip(seqs, splits, strict=True)], DEVICE), state
        )
    for w, h, t, k in zip(unpack(whole), unpack(head), unpack(tail), splits, strict=True):
        torch.testing.assert_close(torch.cat([h, t]), w, atol=1e-6, rtol=0)
        assert len(h) == k
    torch.testing.assert_close(final2, final, atol=1e-6, rtol=0)


def test_forward_with_state_rejects_a_wrong_state_shape() -> None:
    model = make_model(2, "numba")
    with pytest.raises(ValueError, match=r"\[2, 2\]"):
        model.forward_with_state(pack([torch.randn(3, 2), torch.randn(4, 2)]), torch.zeros(3, 2))


def test_model_forward_with_the_triton_kernel_keeps_its_contract() -> None:
    seqs = random_seqs([6, 2, 9], 4, seed=8)
    packed = pack(seqs, DEVICE)
    model = make_model(4, "triton", seed=8)
    reference = make_model(4, "numba", seed=8)
    with torch.inference_mode():
        out = model(packed)
        want = reference(pack(seqs))
    assert isinstance(out, PackedSequence)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert out.sorted_indices is not None
    assert packed.sorted_indices is not None
    assert torch.equal(out.sorted_indices, packed.sorted_indices)
    torch.testing.assert_close(out.data.cpu(), want.data, atol=1e-5, rtol=0)


@pytest.mark.parametrize("sub", [None, 1], ids=["tree", "loop"])
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_gradcheck_float64(with_state: bool, sub: int | None) -> None:
    """Backward (reverse chunked scan) for x, alpha, wx and the initial state, both outputs;
    also after a forward scanned step by step (its replay writes the states the backward uses)."""
    assert gradcheck_float64(11, with_state, chunk=2, block=8, carry=2, sub=sub)


def gradcheck_float64(seed: int, with_state: bool, **tiles: Any) -> bool:
    """torch's gradcheck of smooth_packed_triton with ``tiles``, in every input, both outputs."""
    seqs = random_seqs([5, 2, 7], 2, seed=seed, dtype=torch.float64)
    packed = pack(seqs, DEVICE)
    alpha, wx = random_params(2, seed, torch.float64)
    inputs = [
        packed.data.clone().requires_grad_(),
        alpha.to(DEVICE).requires_grad_(),
        wx.to(DEVICE).requires_grad_(),
    ]
    if with_state:
        inputs.append(torch.randn(3, 2, dtype=torch.float64, device=DEVICE, requires_grad=True))

    def fn(x: Tensor, a: Tensor, w: Tensor, *init: Tensor) -> tuple[Tensor, Tensor]:
        s0 = init[0] if init else None
        return smooth_packed_triton(x, packed.batch_sizes, a, w, s0, **tiles)

    return bool(torch.autograd.gradcheck(fn, tuple(inputs), fast_mode=True))


@pytest.mark.usefixtures("small_tiles")
def test_backward_matches_torch_autograd() -> None:
    """The triton backward against autograd through the torch step loop, via the model API."""
    lengths = [9, 3, 14, 6, 1]
    seqs = random_seqs(lengths, 3, seed=12, dtype=torch.float64)
    grads = {}
    for kernel in ("torch", "triton"):
        model = make_model(3, kernel, seed=12, dtype=torch.float64)
        packed = pack(seqs, DEVICE if kernel == "triton" else "cpu")
        x = packed.data.clone().requires_grad_()
        state = torch.linspace(-1, 1, len(lengths) * 3, dtype=torch.float64)
        state = state.reshape(len(lengths), 3).to(x.device).requires_grad_()
        out, final = model.forward_with_state(
            PackedSequence(x, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices),
            state,
        )
        gen = torch.Generator().manual_seed(0)
        g_out = torch.randn(out.data.shape, generator=gen, dtype=torch.float64).to(x.device)
        g_fin = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(x.device)
        ((out.data * g_out).sum() + (final * g_fin).sum()).backward()
        grads[kernel] = [
            t.grad.cpu() for t in (x, state, model.alpha_smooth, model.wx) if t.grad is not None
        ]
    assert len(grads["triton"]) == len(grads["torch"]) == 4
    for got, want in zip(grads["triton"], grads["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_float16_input_computes_in_float32() -> None:
    seqs = random_seqs([7, 4], 2, seed=13)
    alpha, wx = random_params(2, 13)
    got, _ = run_triton([s.half() for s in seqs], alpha, wx, **SMALL)
    want, _ = loop_reference([s.half().numpy() for s in seqs], alpha.numpy(), wx.numpy())
    assert all(g.dtype == torch.float16 for g in got)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g.double().numpy(), w, atol=2e-3, rtol=0)


def test_plan_fills_the_gpu_for_long_and_for_wide_batches() -> None:
    one_long = plan_tiles(100_000, 1, 16)
    wide = plan_tiles(4000, 256, 16)
    for plan in (one_long, wide):
        programs = plan.grid[0] * plan.grid[1]
        assert programs >= 1024  # several programs per SM of an H200 (132 SMs)
        assert plan.chunk * plan.block <= 4096
        assert all(v & (v - 1) == 0 for v in (plan.chunk, plan.block, plan.carry))
    assert one_long.n_chunks >= 256  # a lone sequence is split in time


def test_auto_picks_triton_on_cuda_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    model = LinearRecursion(2)
    cuda_like = SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    monkeypatch.setattr(rnnserve.models.smoothing, "triton_available", lambda: True)
    assert model._pick_kernel(cuda_like, None) == "triton"  # type: ignore[arg-type]
    monkeypatch.setattr(rnnserve.models.smoothing, "triton_available", lambda: False)
    assert model._pick_kernel(cuda_like, None) == "torch"  # type: ignore[arg-type]
    cpu = torch.zeros(3, 2)
    with torch.no_grad():
        assert model._pick_kernel(cpu, None) == "numba"
    assert model._pick_kernel(cpu, None) == "numba"  # alpha requires grad: the compiled backward
    with torch.no_grad():
        model.alpha_smooth.requires_grad_(False)
        assert model._pick_kernel(cpu, torch.zeros(1, 2, requires_grad=True)) == "numba"
    assert model._pick_kernel(cpu, torch.zeros(1, 2, requires_grad=True)) == "numba"
    assert model._pick_kernel(cpu.half(), None) == "torch"  # no compiled float16 loop


@pytest.mark.skipif(not ON_CPU, reason="checks the CPU-only refusal")
def test_triton_kernel_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="CUDA"):
        smooth_packed_triton(torch.zeros(2, 1), torch.tensor([1, 1]), torch.ones(1), torch.ones(1))


def test_models_import_and_smooth_without_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch, models\n"
        "from rnnserve.models.kernels import triton_available\n"
        "from rnnserve.models.smoothing import LinearRecursion\n"
        "assert not triton_available()\n"
        "m = LinearRecursion(2)\n"
        "x = torch.nn.utils.rnn.pack_sequence([torch.ones(3, 2)])\n"
        "with torch.inference_mode():\n"
        "    y, s = m.forward_with_state(x)\n"
        "assert 'triton' not in [k for k, v in sys.modules.items() if v is not None]\n"
        "print('ok', y.data.shape, s.shape)\n"
    )
    root = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


# -- compiling in advance: every tile plan a served batch can get -------------------------------


@settings(max_examples=300, deadline=None)
@given(
    n_steps=st.integers(1, 300_000),
    n_seqs=st.integers(1, 100_000),
    n_feat=st.integers(1, 300),
    headroom=st.integers(0, 300_000),
)
def test_tile_plans_hold_the_plan_of_every_batch_within_the_limit(
    n_steps: int, n_seqs: int, n_feat: int, headroom: int
) -> None:
    for scan in triton_mod.SCANS:
        plan = plan_tiles(n_steps, n_seqs, n_feat, scan=scan)
        plans = triton_mod.tile_plans(n_feat, n_steps + headroom, scan=scan)
        assert (plan.chunk, plan.block, plan.carry) in plans


@pytest.mark.parametrize("scan", ["chunked", "chained", "lookback"])
@pytest.mark.parametrize(("n_feat", "max_steps"), [(16, 100_000), (16, 10), (3, 4000), (200, 5)])
def test_tile_plans_are_all_met(n_feat: int, max_steps: int, scan: str) -> None:
    """None is compiled in vain: each plan is the plan of some batch within the limit."""
    steps = sorted({*range(1, min(max_steps, 2100) + 1), max_steps})
    steps += [2**k + d for k in range(12, 18) for d in (-1, 0, 1) if 2**k + d <= max_steps]
    met = {
        (p.chunk, p.block, p.carry)
        for n_seqs in (*range(1, 130), 1000, 1 << 20)
        for n in steps
        for p in [plan_tiles(n, n_seqs, n_feat, scan=scan)]
    }
    assert set(triton_mod.tile_plans(n_feat, max_steps, scan=scan)) == met
    assert triton_mod.tile_plans(n_feat, max_steps) == triton_mod.tile_plans(
        n_feat, max_steps, scan=triton_mod.DEFAULT_SCAN
    )


def test_warm_up_compiles_the_chained_plans_when_chained_is_the_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Switching DEFAULT_SCAN (once measured) switches what start-up compiles with it."""
    launched: list[tuple[str, int, int]] = []
    real = triton_mod.smooth_packed_triton

    def spy(data: Tensor, sizes: Tensor, alpha: Tensor, wx: Tensor, init: Any, **tiles: Any) -> Any:
        plan = triton_mod.plan_tiles(1, 1, 3, **tiles)
        launched.append((plan.scan, plan.chunk, plan.block))
        return real(data, sizes, alpha, wx, init, **tiles)

    monkeypatch.setattr(triton_mod, "smooth_packed_triton", spy)
    monkeypatch.setattr(triton_mod, "DEFAULT_SCAN", "chained")
    n = triton_mod.warm_up(3, 100, torch.full((3,), 0.5), torch.ones(3), device="cpu")
    assert n == 4
    assert launched == [("chained", c, 16) for c in (16, 32, 64, 128)]


def test_warm_up_runs_every_plan_as_the_server_does(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    real = triton_mod.smooth_packed_triton

    def spy(data: Tensor, sizes: Tensor, alpha: Tensor, wx: Tensor, init: Any, **tiles: int) -> Any:
        inference = torch.is_inference_mode_enabled()
        calls.append((tiles["chunk"], tiles["block"], tiles["carry"], init, inference))
        assert data.shape == (1, 3)
        assert data.dtype == torch.float64
        assert sizes.tolist() == [1]
        y, final = real(data, sizes, alpha, wx, init, **tiles)
        assert torch.equal(y, torch.zeros(1, 3, dtype=torch.float64))  # tanh(wx * 0)
        return y, final

    monkeypatch.setattr(triton_mod, "smooth_packed_triton", spy)
    alpha = torch.full((3,), 0.5, requires_grad=True)
    n = triton_mod.warm_up(3, 40, alpha, torch.ones(3), device="cpu", dtype=torch.float64)
    plans = triton_mod.tile_plans(3, 40)
    assert n == len(plans) == len(calls)
    assert [c[:3] for c in calls] == plans
    assert all(init is None and inference for *_, init, inference in calls)


def test_the_model_warms_nothing_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[Any] = []
    monkeypatch.setattr(triton_mod, "warm_up", lambda *a, **k: called.append(a) or 99)
    model = LinearRecursion(4)
    assert model.warm_up(1000) == 0
    model.kernel = "triton"  # CPU parameters: the Triton path here is the interpreter's only
    assert model.warm_up(1000) == 0
    assert called == []


def poison_empty_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the module allocates uninitialised (torch.empty, empty_like) comes out
    filled with NaN (floats) or -2**30 (integers)."""
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poisoned(t: Tensor) -> Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-(2**30))

    monkeypatch.setattr(triton_mod.torch, "empty", lambda *a, **k: poisoned(real_empty(*a, **k)))
    monkeypatch.setattr(
        triton_mod.torch, "empty_like", lambda *a, **k: poisoned(real_empty_like(*a, **k))
    )


@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_no_kernel_reads_a_buffer_it_did_not_write(
    monkeypatch: pytest.MonkeyPatch, with_state: bool
) -> None:
    """Every buffer the module allocates uninitialised (torch.empty, empty_like) is filled with
    NaN first: a kernel that reads one before writing it (a stand-in pointer read as a state,
    a row left unwritten) turns the outputs or the gradients into NaN, where fresh memory, often
    zeros, would hide it."""
    poison_empty_buffers(monkeypatch)
    seqs = random_seqs([9, 3, 14, 6, 1], 2, seed=31, dtype=torch.float64)
    packed = pack(seqs, DEVICE)
    alpha, wx = random_params(2, 31, torch.float64)
    x = packed.data.clone().requires_grad_()
    a, w = alpha.to(DEVICE).requires_grad_(), wx.to(DEVICE).requires_grad_()
    init = torch.randn(5, 2, dtype=torch.float64, device=DEVICE, requires_grad=True)
    s0 = init if with_state else None
    y, final = smooth_packed_triton(x, packed.batch_sizes, a, w, s0, chunk=4, block=4, carry=2)
    (y.sum() + 2 * final.sum()).backward()
    grads = [t.grad for t in (x, a, w, init) if t.grad is not None]
    assert len(grads) == (4 if with_state else 3)
    assert all(bool(torch.isfinite(t).all()) for t in (y, final, *grads))
    monkeypatch.undo()  # the same again on fresh memory: equal
    x2, a2, w2 = (t.detach().clone().requires_grad_() for t in (x, a, w))
    init2 = init.detach().clone().requires_grad_()
    y2, final2 = smooth_packed_triton(
        x2, packed.batch_sizes, a2, w2, init2 if with_state else None, chunk=4, block=4, carry=2
    )
    (y2.sum() + 2 * final2.sum()).backward()
    torch.testing.assert_close(y, y2, atol=0, rtol=0)
    grads2 = [t.grad for t in (x2, a2, w2, init2) if t.grad is not None]
    for got, want in zip(grads, grads2, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


# -- the chained (single-pass) forward -------------------------------------------------------


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
@pytest.mark.parametrize("block", [4, 8], ids=["block-4", "block-8"])
def test_chained_forward_matches_fp64_loop(
    dtype: torch.dtype, atol: float, with_state: bool, block: int
) -> None:
    """One program per column block walks its chunks in order. F = 3, so a block of 4 or 8
    columns holds parts of two or three sequences of different lengths: the block's first
    (longest) sequence bounds its trips, the others end inside them."""
    lengths = [9, 1, 13, 4, 8, 5, 2]
    seqs = random_seqs(lengths, 3, seed=41, dtype=dtype)
    alpha, wx = random_params(3, 41, dtype)
    init = torch.randn(len(lengths), 3, dtype=dtype) if with_state else None
    check_against_the_loop(seqs, alpha, wx, init, atol, chunk=4, block=block, scan="chained")


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=6),
    feat=st.integers(1, 3),
    chunk=st.sampled_from([2, 4, 8, 16]),
    block=st.sampled_from([2, 4, 16]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chained_random_batches_match_the_loop(
    lengths: list[int], feat: int, chunk: int, block: int, with_state: bool, seed: int
) -> None:
    seqs = random_seqs(lengths, feat, seed, torch.float64)
    alpha, wx = random_params(feat, seed, torch.float64)
    init = torch.randn(len(lengths), feat, dtype=torch.float64) if with_state else None
    check_against_the_loop(seqs, alpha, wx, init, 1e-12, chunk=chunk, block=block, scan="chained")


def test_chained_with_its_own_plan_matches_the_chunked_scan() -> None:
    # the default chained plan at F = 16: a program per sequence, 16-step chunks here
    seqs = random_seqs([40, 33, 17, 16, 15, 1], 16, seed=42, dtype=torch.float64)
    alpha, wx = random_params(16, 42, torch.float64)
    init = torch.randn(6, 16, dtype=torch.float64)
    chained, final_c = run_triton(seqs, alpha, wx, init, scan="chained")
    chunked, final_k = run_triton(seqs, alpha, wx, init, scan="chunked")
    for a, b in zip(chained, chunked, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    torch.testing.assert_close(final_c, final_k, atol=1e-12, rtol=0)


@pytest.mark.slow  # gradcheck under the Triton interpreter: about ten seconds a case
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_chained_gradcheck_float64(with_state: bool) -> None:
    """The backward (chunked, reverse) runs on the states the chained forward stored."""
    assert gradcheck_float64(43, with_state, chunk=2, block=4, scan="chained")


@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
def test_chained_reads_no_buffer_it_did_not_write(
    monkeypatch: pytest.MonkeyPatch, with_state: bool
) -> None:
    """As test_no_kernel_reads_a_buffer_it_did_not_write, for the chained forward: y and the
    final state come out of NaN-filled memory, so a row a program never wrote (a block's trips
    bounded by a shorter sequence than its longest) is NaN, not a plausible zero."""
    poison_empty_buffers(monkeypatch)
    lengths = [14, 9, 6, 3, 1]  # two sequences a block: (14, 9), (6, 3), (1)
    seqs = random_seqs(lengths, 2, seed=44, dtype=torch.float64)
    alpha, wx = random_params(2, 44, torch.float64)
    init = torch.randn(5, 2, dtype=torch.float64) if with_state else None
    check_against_the_loop(seqs, alpha, wx, init, 1e-12, chunk=4, block=4, scan="chained")


@pytest.mark.parametrize(
    "lengths", [[1], [5], [5, 5, 5], [9, 4, 4, 1], [30, 29, 2, 1, 1, 1]], ids=str
)
def test_sequence_lengths_come_back_from_the_step_sizes(lengths: list[int]) -> None:
    packed = pack(random_seqs(lengths, 1, seed=45), "cpu")
    got = triton_mod.sequence_lengths(packed.batch_sizes)
    assert got.tolist() == sorted(lengths, reverse=True)
    assert got.dtype == torch.int64


def test_chained_plan_is_a_program_per_sequence_with_long_chunks() -> None:
    plan = plan_tiles(4000, 256, 16, scan="chained")
    assert (plan.scan, plan.block, plan.chunk) == ("chained", 16, 256)
    assert plan.chained_grid == (256,)  # one program per sequence
    assert plan.warps == 8
    short = plan_tiles(20, 3, 6, scan="chained")
    assert (short.block, short.chunk, short.chained_grid) == (16, 32, (2,))
    wide = plan_tiles(100, 2, 100, scan="chained")  # a step of one sequence: 100 columns
    assert (wide.block, wide.chunk) == (128, 32)
    assert plan_tiles(4000, 256, 16).scan == triton_mod.DEFAULT_SCAN == "chunked"


def test_an_unknown_scan_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"^scan must be one of chunked, chained, lookback, got 'fast'$"
    ):
        plan_tiles(10, 2, 3, scan="fast")


@pytest.mark.skipif(not ON_CPU, reason="records launches in Triton's interpreter")
@pytest.mark.parametrize("scan", ["chunked", "chained", "lookback"])
def test_states_are_kept_only_where_a_backward_pass_can_follow(
    monkeypatch: pytest.MonkeyPatch, scan: str
) -> None:
    """A forward under no_grad or inference_mode writes no state tensor for a backward pass,
    even with parameters that require gradients (autograd's needs_input_grad says True there:
    a model served without requires_grad_(False) would pay a second write of every row)."""
    from triton.runtime.interpreter import InterpretedFunction

    stored: list[bool] = []
    run = InterpretedFunction.run

    def recording(self: Any, *args: Any, grid: Any, **kwargs: Any) -> Any:
        if "STORE_S" in kwargs:
            stored.append(bool(kwargs["STORE_S"]))
        return run(self, *args, grid=grid, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording)
    packed = pack(random_seqs([6, 3], 2, seed=46), "cpu")
    alpha, wx = (p.requires_grad_() for p in random_params(2, 46))
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, scan=scan)
    assert stored == [False, False]
    y, _ = smooth_packed_triton(packed.data, packed.batch_sizes, alpha, wx, scan=scan)
    assert stored == [False, False, True]
    y.sum().backward()
    assert alpha.grad is not None
    assert wx.grad is not None


# -- the look-back (single-pass) forward ----------------------------------------------------


@pytest.fixture
def lookback_walks(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """The interpreter runs programs one after another, so every predecessor has published
    its inclusive state by the time a tile looks back; ``(every, window)`` makes only every
    ``every``-th chunk publish it and reads ``window`` predecessors at a time, so that look-backs
    compose maps across several windows, as on a GPU while predecessors still run."""
    every, window = request.param
    monkeypatch.setattr(single_pass, "_INCLUSIVE_EVERY", every)
    monkeypatch.setattr(single_pass, "_WINDOW", window)


WALKS = [(1, 32), (3, 2), (7, 2), (4, 1), (5, 4)]


@pytest.mark.parametrize("lookback_walks", WALKS, indirect=True, ids=str)
@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-5), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
@pytest.mark.usefixtures("lookback_walks")
def test_lookback_forward_matches_fp64_loop(
    dtype: torch.dtype, atol: float, with_state: bool
) -> None:
    lengths = [31, 1, 13, 4, 30, 5, 2]  # 16 chunks of 2 steps: long walks back
    seqs = random_seqs(lengths, 3, seed=51, dtype=dtype)
    alpha, wx = random_params(3, 51, dtype)
    init = torch.randn(len(lengths), 3, dtype=dtype) if with_state else None
    check_against_the_loop(seqs, alpha, wx, init, atol, chunk=2, block=8, scan="lookback")


@settings(max_examples=8, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 14), min_size=1, max_size=6),
    feat=st.integers(1, 3),
    chunk=st.sampled_from([1, 2, 4]),
    block=st.sampled_from([2, 4, 16]),
    every=st.integers(1, 6),
    window=st.sampled_from([1, 2, 4, 32]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_lookback_random_batches_match_the_loop(
    lengths: list[int],
    feat: int,
    chunk: int,
    block: int,
    every: int,
    window: int,
    with_state: bool,
    seed: int,
) -> None:
    seqs = random_seqs(lengths, feat, seed, torch.float64)
    alpha, wx = random_params(feat, seed, torch.float64)
    init = torch.randn(len(lengths), feat, dtype=torch.float64) if with_state else None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(single_pass, "_INCLUSIVE_EVERY", every)
        mp.setattr(single_pass, "_WINDOW", window)
        check_against_the_loop(
            seqs, alpha, wx, init, 1e-12, chunk=chunk, block=block, scan="lookback"
        )


@pytest.mark.slow  # gradcheck under the Triton interpreter: about ten seconds a case
@pytest.mark.parametrize("lookback_walks", [(1, 32), (3, 2)], indirect=True, ids=str)
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
@pytest.mark.usefixtures("lookback_walks")
def test_lookback_gradcheck_float64(with_state: bool) -> None:
    assert gradcheck_float64(52, with_state, chunk=2, block=4, scan="lookback")


@pytest.mark.parametrize("lookback_walks", [(1, 32), (3, 2)], indirect=True, ids=str)
@pytest.mark.parametrize("with_state", [False, True], ids=["s0=x0", "initial-state"])
@pytest.mark.usefixtures("lookback_walks")
def test_lookback_reads_only_what_was_published(
    monkeypatch: pytest.MonkeyPatch, with_state: bool
) -> None:
    """The side arrays (maps, inclusive states) and the outputs come out of NaN-filled memory:
    a look-back that reads a slot no tile published, or past its window's nearest inclusive
    state, turns the outputs NaN."""
    poison_empty_buffers(monkeypatch)
    lengths = [14, 9, 6, 3, 1]
    seqs = random_seqs(lengths, 2, seed=53, dtype=torch.float64)
    alpha, wx = random_params(2, 53, torch.float64)
    init = torch.randn(5, 2, dtype=torch.float64) if with_state else None
    check_against_the_loop(seqs, alpha, wx, init, 1e-12, chunk=2, block=4, scan="lookback")


def test_lookback_takes_the_chunked_tiles_each_scanned_whole() -> None:
    for shape in ((4000, 256, 16), (100_000, 1, 16), (7, 3, 5)):
        chunked = plan_tiles(*shape)
        lookback = plan_tiles(*shape, scan="lookback")
        assert (lookback.chunk, lookback.block) == (chunked.chunk, chunked.block)
        assert lookback.sub == lookback.chunk
        assert lookback.n_tiles == chunked.grid[0] * chunked.grid[1]
    with pytest.raises(ValueError, match=r"^the look-back scan scans each chunk whole"):
        plan_tiles(100, 2, 3, chunk=8, sub=2, scan="lookback")
