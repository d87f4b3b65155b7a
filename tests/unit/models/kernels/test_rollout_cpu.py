"""The numba rollout kernel against :func:`rollout_packed`: both GEMM paths, dtypes, states.

The backend-level conformance (against a loop calling nn.LSTM once per step) is in
test_rollout_backends.py; this file covers what is specific to the kernel: the hand-written
small-batch loop and the BLAS path (chosen per step by the number of active rows), float32
staying float32, and the resumable state arguments.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from rnnserve.models.packing import pack
from rnnserve.models.traveller import Traveller, rollout_backend_fn, rollout_packed

rollout_cpu = pytest.importorskip("rnnserve.models.kernels.rollout_cpu")

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}


def bent_weights(
    hidden: int, layers: int, dtype: torch.dtype, num_inputs: int = 6
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    """Fused weights of a random Traveller whose positions reach well into tanh's curve."""
    torch.manual_seed(hidden * 10 + layers)
    model = Traveller(num_inputs, hidden, layers).eval().requires_grad_(False).to(dtype)
    with torch.no_grad():
        model.output_layer.weight.mul_(12.0)
        model.output_layer.bias.mul_(4.0)
        w_ih = model.lstm_layers.weight_ih_l0
        assert isinstance(w_ih, Tensor)
        w_ih.mul_(3.0)  # the fed-back position moves the state
    return model.fused_weights()


def packed_inputs(
    lengths: list[int], dtype: torch.dtype, num_inputs: int = 6
) -> tuple[Tensor, list[int]]:
    gen = torch.Generator().manual_seed(len(lengths))
    x = pack([torch.randn(n, num_inputs, generator=gen, dtype=dtype) for n in lengths])
    sizes: list[int] = x.batch_sizes.tolist()
    return x.data, sizes


def random_state(
    layers: int, batch: int, hidden: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(99)
    h = torch.randn(layers, batch, hidden, generator=gen, dtype=dtype) * 0.5
    c = torch.randn(layers, batch, hidden, generator=gen, dtype=dtype)
    p = torch.rand(batch, 2, generator=gen, dtype=dtype) * 2 - 1
    return h, c, p


def assert_same(got: tuple[Tensor, ...], want: tuple[Tensor, ...], dtype: torch.dtype) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, w, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gemm_from", [1, 3, 10_000])  # BLAS always, mixed, never
@pytest.mark.parametrize("with_state", [False, True])
def test_both_paths_match_rollout_packed(
    dtype: torch.dtype, gemm_from: int, with_state: bool
) -> None:
    """Ragged batch whose active rows fall from 6 to 1, so gemm_from=3 switches path mid-run."""
    hidden, layers = 20, 2  # 4H = 80: not a multiple of the 16-lane output sum, nor of 8 rows
    weights = bent_weights(hidden, layers, dtype)
    u, sizes = packed_inputs([30, 25, 12, 12, 5, 2], dtype)
    state = random_state(layers, sizes[0], hidden, dtype) if with_state else (None, None, None)
    with torch.inference_mode():
        want = rollout_packed(u, sizes, *weights, *state)
        got = rollout_cpu.rollout_packed_numba(u, sizes, *weights, *state, gemm_from=gemm_from)
    assert float(want[0].abs().max()) > 0.6  # the test reaches tanh's curve
    assert_same(got, want, dtype)


@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("gemm_from", [1, 10_000])
def test_other_depths(layers: int, gemm_from: int) -> None:
    weights = bent_weights(32, layers, torch.float64)
    u, sizes = packed_inputs([9, 7, 7, 1], torch.float64)
    with torch.inference_mode():
        want = rollout_packed(u, sizes, *weights)
        got = rollout_cpu.rollout_packed_numba(u, sizes, *weights, gemm_from=gemm_from)
    assert_same(got, want, torch.float64)


def test_the_default_threshold_splits_small_and_large_batches() -> None:
    """The default picks the hand-written loop for one row and BLAS for a large batch."""
    assert 1 < rollout_cpu.GEMM_FROM <= 64
    weights = bent_weights(16, 2, torch.float64)
    u, sizes = packed_inputs([8] * 70 + [3], torch.float64)  # 71 active rows, then 70
    with torch.inference_mode():
        want = rollout_packed(u, sizes, *weights)
        got = rollout_cpu.rollout_packed_numba(u, sizes, *weights)
    assert_same(got, want, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_step_of_one_sequence(dtype: torch.dtype) -> None:
    weights = bent_weights(8, 2, dtype)
    u, sizes = packed_inputs([1], dtype)
    assert sizes == [1]
    for state in ((None, None, None), random_state(2, 1, 8, dtype)):
        with torch.inference_mode():
            want = rollout_packed(u, sizes, *weights, *state)
            got = rollout_cpu.rollout_packed_numba(u, sizes, *weights, *state)
        assert [tuple(t.shape) for t in got] == [(1, 2), (2, 1, 8), (2, 1, 8), (1, 2)]
        assert_same(got, want, dtype)


def test_float32_in_float32_out_and_inputs_untouched() -> None:
    weights = bent_weights(16, 2, torch.float32)
    u, sizes = packed_inputs([5, 3], torch.float32)
    h, c, p = random_state(2, 2, 16, torch.float32)
    before = [t.clone() for t in (u, h, c, p)]
    out = rollout_cpu.rollout_packed_numba(u, sizes, *weights, h, c, p)
    assert all(t.dtype == torch.float32 for t in out)
    for t, b in zip((u, h, c, p), before, strict=True):
        assert torch.equal(t, b)


def test_float32_long_rollout_stays_close_to_float64() -> None:
    """The fast float32 tanh keeps a 300-step feedback rollout within 1e-5 of float64."""
    w64 = bent_weights(64, 2, torch.float64)
    w_cat, bias, w_out, b_out = bent_weights(64, 2, torch.float64)
    w32 = ([t.float() for t in w_cat], [t.float() for t in bias], w_out.float(), b_out.float())
    u, sizes = packed_inputs([300, 200, 150], torch.float64)
    with torch.inference_mode():
        want = rollout_packed(u, sizes, *w64)[0]
        got = rollout_cpu.rollout_packed_numba(u.float(), sizes, *w32)[0]
        torch_fp32 = rollout_packed(u.float(), sizes, *w32)[0]
    err = float((got.double() - want).abs().max())
    assert err < 1e-5
    assert err < 4 * float((torch_fp32.double() - want).abs().max()) + 1e-6


def test_refuses_what_it_cannot_run() -> None:
    weights = bent_weights(8, 1, torch.float64)
    u, sizes = packed_inputs([2], torch.float64)
    with pytest.raises(TypeError, match="float32 or float64"):
        rollout_cpu.rollout_packed_numba(u.half(), sizes, *weights)
    w_cat, bias, w_out, b_out = weights
    with pytest.raises(ValueError, match=r"w_out must have shape \[8, 2\]"):
        rollout_cpu.rollout_packed_numba(u, sizes, w_cat, bias, w_out[:4], b_out)
    with pytest.raises(ValueError, match=r"h0 must have shape \[1, 1, 8\]"):
        rollout_cpu.rollout_packed_numba(u, sizes, *weights, torch.zeros(1, 2, 8).double())
    with pytest.raises(ValueError, match="sum to 2 rows"):
        rollout_cpu.rollout_packed_numba(u, [1], *weights)


def test_auto_picks_numba_on_the_cpu() -> None:
    fn, name = rollout_backend_fn("auto", torch.device("cpu"))
    assert name == "numba"
    assert fn is rollout_cpu.rollout_packed_numba


needs_packed_sgemm = pytest.mark.skipif(
    getattr(rollout_cpu, "_MKL_PACK", None) is None, reason="this torch build packs no sgemm"
)


@needs_packed_sgemm
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_long_float32_rollouts_multiply_by_weights_packed_once(
    layers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed once per call, one slab per layer; with state, ragged, through MKL's compute."""
    calls: list[int] = []
    real = rollout_cpu._pack_weights

    def spy(weights: list[object], n_rows: int) -> object:
        calls.append(len(weights))
        return real(weights, n_rows)

    monkeypatch.setattr(rollout_cpu, "_pack_weights", spy)
    weights = bent_weights(20, layers, torch.float32)
    u, sizes = packed_inputs([30, 25, 12, 12, 5, 2], torch.float32)
    state = random_state(layers, sizes[0], 20, torch.float32)
    assert sum(b >= 2 for b in sizes) >= rollout_cpu.PACK_FROM_STEPS
    with torch.inference_mode():
        want = rollout_packed(u, sizes, *weights, *state)
        got = rollout_cpu.rollout_packed_numba(u, sizes, *weights, *state, gemm_from=2)
    assert calls == [layers]
    assert_same(got, want, torch.float32)


@needs_packed_sgemm
def test_short_or_float64_rollouts_keep_the_plain_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("packed")

    monkeypatch.setattr(rollout_cpu, "_pack_weights", refuse)
    steps = rollout_cpu.PACK_FROM_STEPS - 1
    for dtype, lengths in ((torch.float32, [steps, steps, 3]), (torch.float64, [40, 30, 20])):
        weights = bent_weights(16, 2, dtype)
        u, sizes = packed_inputs(lengths, dtype)
        with torch.inference_mode():
            want = rollout_packed(u, sizes, *weights)
            got = rollout_cpu.rollout_packed_numba(u, sizes, *weights, gemm_from=2)
        assert_same(got, want, dtype)


@needs_packed_sgemm
def test_packed_and_plain_gemm_give_the_same_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same ragged float32 rollout with the weights packed and not: the same results (MKL
    computes both with the same kernels; allowed a rounding apart, not asserted bit for bit)."""
    weights = bent_weights(32, 2, torch.float32)
    u, sizes = packed_inputs([40, 33, 33, 20, 9, 9, 8, 1], torch.float32)
    state = random_state(2, sizes[0], 32, torch.float32)
    runs = []
    for pack_from in (1, 10**9):
        monkeypatch.setattr(rollout_cpu, "PACK_FROM_STEPS", pack_from)
        runs.append(rollout_cpu.rollout_packed_numba(u, sizes, *weights, *state))
    for packed, plain in zip(*runs, strict=True):
        torch.testing.assert_close(packed, plain, atol=1e-6, rtol=0)
