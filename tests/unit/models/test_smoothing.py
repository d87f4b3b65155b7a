"""The smoother against pandas' ewm, across kernels, batch layouts and autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.utils.rnn import PackedSequence, pack_sequence

from rnnserve import models
from rnnserve.models.kernels import ema_packed_numba, ema_packed_torch, last_step_rows
from rnnserve.models.packing import pack, unpack
from rnnserve.models.smoothing import LinearRecursion
from tests.references import smoother_reference


def make_model(feat_dim: int, seed: int = 0) -> LinearRecursion:
    gen = torch.Generator().manual_seed(seed)
    model = LinearRecursion(feat_dim)
    with torch.no_grad():
        model.alpha_smooth.copy_(0.05 + 0.9 * torch.rand(feat_dim, generator=gen))
        model.wx.copy_(0.2 + 1.5 * torch.rand(feat_dim, generator=gen))
    return model.eval()


def params(model: LinearRecursion) -> tuple[np.ndarray, np.ndarray]:
    return model.alpha_smooth.detach().numpy(), model.wx.detach().numpy()


@pytest.mark.parametrize("kernel", ["numba", "torch", "auto"])
def test_matches_pandas_ewm(kernel: str) -> None:
    rng = np.random.default_rng(1)
    model = make_model(8)
    model.kernel = kernel  # type: ignore[assignment]
    seqs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 17, 250, 3)]
    with torch.inference_mode():
        out = unpack(model(pack([torch.from_numpy(s) for s in seqs])))
    alpha, wx = params(model)
    for s, y in zip(seqs, out, strict=True):
        np.testing.assert_allclose(y.numpy(), smoother_reference(s, alpha, wx), atol=1e-5)


def test_first_step_is_the_input_not_zero() -> None:
    # s_0 = x_0 (not s_{-1} = 0, which would scale the first step by 1 - alpha)
    model = make_model(4)
    x = torch.tensor([[0.3, -0.2, 0.9, 0.1]])
    with torch.inference_mode():
        y = model(pack([x])).data
    torch.testing.assert_close(y, torch.tanh(model.wx * x))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=12),
    feat_dim=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_packed_batch_equals_each_sequence_alone(
    lengths: list[int], feat_dim: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    model = make_model(feat_dim, seed)
    seqs = [
        torch.from_numpy(rng.standard_normal((n, feat_dim)).astype(np.float32)) for n in lengths
    ]
    with torch.inference_mode():
        together = unpack(model(pack(seqs)))
        for s, y in zip(seqs, together, strict=True):
            alone = model(pack([s])).data
            torch.testing.assert_close(y, alone, atol=1e-5, rtol=0)


def test_keeps_packed_metadata() -> None:
    model = make_model(3)
    packed = pack_sequence([torch.randn(4, 3), torch.randn(6, 3)], enforce_sorted=False)
    with torch.inference_mode():
        out = model(packed)
    assert isinstance(out, PackedSequence)
    assert torch.equal(out.batch_sizes, packed.batch_sizes)
    assert torch.equal(out.sorted_indices, packed.sorted_indices)
    assert torch.equal(out.unsorted_indices, packed.unsorted_indices)


def test_refuses_a_plain_tensor() -> None:
    with pytest.raises(TypeError, match="PackedSequence"):
        make_model(3)(torch.randn(5, 3))  # type: ignore[arg-type]


def test_refuses_wrong_feature_count() -> None:
    with pytest.raises(ValueError, match=r"\[N, 3\]"):
        make_model(3)(pack([torch.randn(5, 4)]))


def test_numba_and_torch_kernels_agree_in_float64() -> None:
    rng = np.random.default_rng(3)
    seqs = [torch.from_numpy(rng.standard_normal((n, 5))) for n in (9, 30, 2)]
    packed = pack(seqs)
    alpha = torch.rand(5, dtype=torch.float64)
    a = ema_packed_numba(packed.data, packed.batch_sizes, alpha)
    b = ema_packed_torch(packed.data, packed.batch_sizes, alpha)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_numba_and_torch_kernels_agree_with_an_initial_state() -> None:
    rng = np.random.default_rng(4)
    packed = pack([torch.from_numpy(rng.standard_normal((n, 3))) for n in (4, 11, 1)])
    alpha = torch.rand(3, dtype=torch.float64)
    init = torch.randn(3, 3, dtype=torch.float64)
    a = ema_packed_numba(packed.data, packed.batch_sizes, alpha, init)
    b = ema_packed_torch(packed.data, packed.batch_sizes, alpha, init)
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the first rows are s_0 = alpha * init + (1 - alpha) * x_0 (sorted order)
    torch.testing.assert_close(a[:3], alpha * init + (1 - alpha) * packed.data[:3])


def test_last_step_rows_point_at_each_sequence_end() -> None:
    lengths = [4, 11, 1, 7, 11]
    packed = pack([torch.full((n, 1), float(i)) for i, n in enumerate(lengths)])
    rows = last_step_rows(packed.batch_sizes)
    assert packed.sorted_indices is not None
    # row r holds sequence sorted_indices[j] at its last step: count the earlier steps' rows
    assert packed.data[rows, 0].tolist() == [float(i) for i in packed.sorted_indices.tolist()]
    sorted_lengths = [lengths[i] for i in packed.sorted_indices.tolist()]
    offsets = np.concatenate([[0], np.cumsum(packed.batch_sizes.numpy())])
    want = [int(offsets[n - 1]) + j for j, n in enumerate(sorted_lengths)]
    assert rows.tolist() == want


def test_gradients_flow_to_alpha_and_wx() -> None:
    """Training uses the differentiable torch kernel; check its gradient numerically."""
    torch.manual_seed(0)
    model = LinearRecursion(3, alpha_smooth=0.4).double()
    seqs = [torch.randn(n, 3, dtype=torch.float64) for n in (5, 3)]
    packed = pack(seqs)

    def loss(alpha: torch.Tensor, wx: torch.Tensor) -> torch.Tensor:
        s = ema_packed_torch(packed.data, packed.batch_sizes, alpha)
        return torch.tanh(wx * s).sum()

    alpha = torch.full((3,), 0.4, dtype=torch.float64, requires_grad=True)
    wx = torch.ones(3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(loss, (alpha, wx))
    out = model(packed)  # kernel "auto" picks the compiled CPU path, forward and backward
    out.data.sum().backward()
    assert model.alpha_smooth.grad is not None
    assert model.alpha_smooth.grad.abs().sum() > 0


def test_default_weights_load_and_match_reference() -> None:
    model = models.load("smoother")
    assert isinstance(model, LinearRecursion)
    assert set(model.state_dict()) == {"alpha_smooth", "wx"}
    rng = np.random.default_rng(7)
    x = rng.standard_normal((50, 16)).astype(np.float32)
    with torch.inference_mode():
        y = model(pack([torch.from_numpy(x)])).data.numpy()
    alpha, wx = params(model)
    np.testing.assert_allclose(y, smoother_reference(x, alpha, wx), atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=10),
    feat_dim=st.integers(1, 20),
    seed=st.integers(0, 2**16),
)
def test_smooth_flat_equals_the_packed_forward(
    lengths: list[int], feat_dim: int, seed: int
) -> None:
    """The server's CPU path (no packing) gives the packed batch's output, sequence by sequence."""
    model = make_model(feat_dim, seed)
    rng = np.random.default_rng(seed)
    seqs = [rng.standard_normal((n, feat_dim)).astype(np.float32) * 3 for n in lengths]
    flat = model.smooth_flat(np.concatenate(seqs), np.array(lengths))
    with torch.inference_mode():
        packed = unpack(model(pack([torch.from_numpy(s) for s in seqs])))
    np.testing.assert_allclose(flat, torch.cat(packed).numpy(), atol=1e-6, rtol=0)
    alpha, wx = params(model)
    row = 0
    for s in seqs:  # and pandas, in float64
        want = smoother_reference(s, alpha, wx)
        np.testing.assert_allclose(flat[row : row + len(s)], want, atol=2e-6, rtol=0)
        row += len(s)
    flat64 = model.double().smooth_flat(np.concatenate(seqs).astype(np.float64), np.array(lengths))
    ref64 = np.concatenate([smoother_reference(s, alpha, wx) for s in seqs])
    np.testing.assert_allclose(flat64, ref64, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_smooth_flat_says_which_sequences_held_a_non_finite_value(dtype: type) -> None:
    """The check made in the smoothing pass: exactly the sequences with a NaN or an infinity
    anywhere (first step, last step, last feature, among finite ones) are flagged, and the
    other sequences' outputs are those computed without the bad ones beside them."""
    model = make_model(5, 3)
    rng = np.random.default_rng(4)
    lengths = [1, 6, 3, 9, 4, 2, 7]
    seqs = [rng.standard_normal((n, 5)).astype(dtype) for n in lengths]
    if dtype == np.float64:
        model = model.double()
    clean = model.smooth_flat(np.concatenate(seqs), np.array(lengths))
    bad = {0: (0, 2, np.nan), 1: (5, 4, np.inf), 3: (0, 0, -np.inf), 5: (1, 4, np.nan)}
    for j, (t, f, v) in bad.items():
        seqs[j] = seqs[j].copy()
        seqs[j][t, f] = v
    finite = np.ones(len(lengths), np.bool_)
    out = model.smooth_flat(np.concatenate(seqs), np.array(lengths), finite)
    assert np.flatnonzero(~finite).tolist() == sorted(bad)
    ends = np.cumsum(lengths)
    for j in range(len(lengths)):
        if j not in bad:
            rows = slice(ends[j] - lengths[j], ends[j])
            np.testing.assert_array_equal(out[rows], clean[rows])
    # one value among many, and a large finite value is not flagged
    big = np.full((4000, 5), np.finfo(dtype).max / 2, dtype)
    finite = np.zeros(2, np.bool_)
    model.smooth_flat(big, np.array([1999, 2001]), finite)
    assert finite.tolist() == [True, True]
    big[3000, 1] = np.nan
    model.smooth_flat(big, np.array([1999, 2001]), finite)
    assert finite.tolist() == [True, False]


def test_smooth_flat_from_a_state_continues_it_and_leaves_the_others_bit_for_bit() -> None:
    """Sequences with a carried state start from it (float64 loop); those without give the
    bits they give alone, and every final state is the last step's."""
    model = make_model(6, 5)
    alpha, wx = (p.astype(np.float64) for p in params(model))
    rng = np.random.default_rng(6)
    lengths = [4, 1, 7, 3]
    seqs = [rng.standard_normal((n, 6)).astype(np.float32) for n in lengths]
    data, n = np.concatenate(seqs), np.array(lengths)
    start = rng.standard_normal((4, 6)).astype(np.float32)
    given = np.array([True, False, True, False])
    out, last = model.smooth_flat_with_state(data, n, start, given)
    alone = model.smooth_flat(data, n)
    row = 0
    for j, x in enumerate(seqs):
        rows = slice(row, row + len(x))
        s = alpha * start[j] + (1 - alpha) * x[0] if given[j] else x[0].astype(np.float64)
        states = [s]
        for t in range(1, len(x)):
            s = alpha * s + (1 - alpha) * x[t]
            states.append(s)
        np.testing.assert_allclose(out[rows], np.tanh(wx * np.stack(states)), atol=2e-6, rtol=0)
        np.testing.assert_allclose(last[j], s, atol=2e-6, rtol=0)
        if not given[j]:
            np.testing.assert_array_equal(out[rows], alone[rows])
        row += len(x)
    with pytest.raises(ValueError, match="start"):
        model.smooth_flat_with_state(data, n, start[:3], given[:3])


def test_smooth_flat_refuses_rows_that_do_not_fit() -> None:
    model = make_model(4)
    with pytest.raises(ValueError, match=r"\[N, 4\]"):
        model.smooth_flat(np.zeros((5, 3), np.float32), np.array([5]))
    with pytest.raises(ValueError, match="lengths"):
        model.smooth_flat(np.zeros((5, 4), np.float32), np.array([2, 2]))
