"""The kernels' host code: the Python around the compiled loops.

The compiled loops themselves are checked against references elsewhere (test_rollout_cpu.py,
test_smoothing.py, test_smoother_triton.py); these tests check what the Python around them does:
the shapes the numba rollout refuses before its loop (which does not check bounds), each refusal
naming the argument and the shapes involved, the casts it makes, the state it hands back, and
the jit options and BLAS lookup that run when the modules are imported.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor

from rnnserve.models.packing import pack
from rnnserve.models.traveller import Traveller, rollout_packed
from tests.helpers import refusal

rollout_cpu = pytest.importorskip("rnnserve.models.kernels.rollout_cpu")
run = rollout_cpu.rollout_packed_numba


def weights(
    layers: int = 2, hidden: int = 4, num_inputs: int = 3, dtype: torch.dtype = torch.float64
) -> tuple[list[Tensor], list[Tensor], Tensor, Tensor]:
    torch.manual_seed(layers * 100 + hidden)
    model = Traveller(num_inputs, hidden, layers).eval().requires_grad_(False).to(dtype)
    with torch.no_grad():
        model.output_layer.weight.mul_(12.0)
        model.lstm_layers.weight_ih_l0.mul_(3.0)
    w_cat, bias, w_out, b_out = model.fused_weights()
    return list(w_cat), list(bias), w_out, b_out


def mentions(message: str, *words: str) -> bool:
    """Whether a refusal's message names every one of ``words`` (the argument, the shapes)."""
    missing = [w for w in words if w not in message]
    assert not missing, f"{message!r} does not mention {missing}"
    return True


def inputs(lengths: list[int], num_inputs: int = 3) -> tuple[Tensor, list[int]]:
    gen = torch.Generator().manual_seed(sum(lengths))
    x = pack([torch.randn(n, num_inputs, generator=gen, dtype=torch.float64) for n in lengths])
    return x.data, x.batch_sizes.tolist()


def test_each_wrong_weight_shape_is_named() -> None:
    u, sizes = inputs([3, 2])  # hidden 4, 2 layers, 3 inputs
    w_cat, bias, w_out, b_out = weights()
    w0, w1 = w_cat
    cases = [
        ([w0[:-1], w1], bias, w_out, b_out, ("w_cat[0]", "[9, 16]", "got [8, 16]")),
        ([w0, w1[:, :8]], bias, w_out, b_out, ("w_cat[1]", "[8, 16]", "got [8, 8]")),
        (w_cat, [bias[0][:4], bias[1]], w_out, b_out, ("bias[0]", "[16]", "got [4]")),
        (w_cat, [bias[0], bias[1][:4]], w_out, b_out, ("bias[1]", "[16]", "got [4]")),
        (w_cat, bias, w_out.t(), b_out, ("w_out", "[4, 2]", "got [2, 4]")),
        (w_cat, bias, w_out, b_out[:1], ("b_out", "[2]", "got [1]")),
    ]  # fmt: skip
    for w, b, wo, bo, (name, want, got) in cases:
        message = refusal(ValueError, lambda w=w, b=b, wo=wo, bo=bo: run(u, sizes, w, b, wo, bo))
        assert message == f"{name} must have shape {want}, {got}"


def test_each_wrong_state_shape_is_named() -> None:
    u, sizes = inputs([3, 2])
    w = weights()
    h = torch.zeros(2, 2, 4, dtype=torch.float64)
    p = torch.zeros(2, 2, dtype=torch.float64)
    assert (
        refusal(ValueError, lambda: run(u, sizes, *w, h[:, :1], h, p))
        == "h0 must have shape [2, 2, 4], got [2, 1, 4]"
    )
    assert (
        refusal(ValueError, lambda: run(u, sizes, *w, h, h[:1], p))
        == "c0 must have shape [2, 2, 4], got [1, 2, 4]"
    )
    assert (
        refusal(ValueError, lambda: run(u, sizes, *w, h, h, p[:, :1]))
        == "p0 must have shape [2, 2], got [2, 1]"
    )


def test_layers_inputs_and_batch_sizes_are_checked() -> None:
    u, sizes = inputs([3, 2])
    w_cat, bias, w_out, b_out = weights()
    layers = ("bias per layer", "2-D packed inputs")
    assert mentions(
        refusal(ValueError, lambda: run(u, sizes, w_cat, bias[:1], w_out, b_out)), *layers
    )
    assert mentions(
        refusal(ValueError, lambda: run(u[:, :, None], sizes, w_cat, bias, w_out, b_out)), *layers
    )
    sums = ("batch_sizes", "positive", "sum to 5 rows")
    assert mentions(refusal(ValueError, lambda: run(u, [2, 2], w_cat, bias, w_out, b_out)), *sums)
    assert mentions(
        refusal(ValueError, lambda: run(u, [2, 2, 1, 0], w_cat, bias, w_out, b_out)), *sums
    )
    assert (
        refusal(ValueError, lambda: run(u, [1, 2, 2], w_cat, bias, w_out, b_out))
        == "batch_sizes must be non-increasing"
    )
    assert mentions(
        refusal(TypeError, lambda: run(u.half(), sizes, w_cat, bias, w_out, b_out)),
        *("float32", "float64", "got torch.float16"),
    )


def test_an_empty_hidden_layer_is_refused() -> None:
    u, sizes = inputs([2], num_inputs=1)
    w_cat = [torch.zeros(3, 0, dtype=torch.float64)]
    bias = [torch.zeros(0, dtype=torch.float64)]
    w_out, b_out = torch.zeros(0, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    assert mentions(
        refusal(ValueError, lambda: run(u, sizes, w_cat, bias, w_out, b_out)),
        *("bias per layer", "2-D packed inputs"),
    )


def test_no_batch_sizes_at_all_is_refused_as_a_shape_error() -> None:
    # (it read batch_sizes[0] before its own check, and raised IndexError)
    w_cat, bias, w_out, b_out = weights()
    u = torch.zeros(0, 3, dtype=torch.float64)
    assert mentions(
        refusal(ValueError, lambda: run(u, [], w_cat, bias, w_out, b_out)),
        *("batch_sizes", "sum to 0 rows"),
    )
    # a state for no sequences has 0 rows, the shape the check expects; the refusal is still
    # about the batch sizes
    h = torch.zeros(2, 0, 4, dtype=torch.float64)
    p = torch.zeros(0, 2, dtype=torch.float64)
    assert mentions(
        refusal(ValueError, lambda: run(u, [], w_cat, bias, w_out, b_out, h, h, p)),
        *("batch_sizes", "sum to 0 rows"),
    )


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("gemm_from", [0, 1, 2, 3, 100])
def test_results_and_state_match_rollout_packed(layers: int, gemm_from: int) -> None:
    """Every GEMM threshold (0 is taken as 1) and depth, from a given state, in float64."""
    u, sizes = inputs([5, 3, 1])
    w = weights(layers=layers)
    gen = torch.Generator().manual_seed(layers)
    h = torch.randn(layers, 3, 4, generator=gen, dtype=torch.float64)
    c = torch.randn(layers, 3, 4, generator=gen, dtype=torch.float64)
    p = torch.rand(3, 2, generator=gen, dtype=torch.float64) - 0.5
    h0, c0, p0 = h.clone(), c.clone(), p.clone()
    got = run(u, sizes, *w, h, c, p, gemm_from=gemm_from)
    want = rollout_packed(u, sizes, *w, h, c, p)
    for g, ref in zip(got, want, strict=True):
        assert g.dtype == torch.float64
        torch.testing.assert_close(g, ref, atol=1e-12, rtol=0)
    for given, before in ((h, h0), (c, c0), (p, p0)):  # the given state is not written to
        assert torch.equal(given, before)


def test_weights_of_another_dtype_are_cast_to_the_inputs() -> None:
    u, sizes = inputs([4, 2])
    w_cat, bias, w_out, b_out = weights()
    got = run(u.float(), sizes, w_cat, bias, w_out, b_out)
    want = rollout_packed(u.float(), sizes, *(x for x in weights(dtype=torch.float32)))
    for g, ref in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=0)


def test_compile_for_compiles_without_running_anything_visible() -> None:
    rollout_cpu.compile_for(torch.float64)
    rollout_cpu.compile_for(torch.float32)
    u, sizes = inputs([2])
    got = run(u, sizes, *weights(layers=1))
    torch.testing.assert_close(got[0], rollout_packed(u, sizes, *weights(layers=1))[0])


# ------------------------------------------------------------------ models/kernels/smoother_cpu.py

smoother_cpu = pytest.importorskip("rnnserve.models.kernels.smoother_cpu")


def flat_rows(dtype: type, lengths: list[int], feat: int = 3) -> np.ndarray:
    rng = np.random.default_rng(sum(lengths))
    return rng.standard_normal((sum(lengths), feat)).astype(dtype)


def test_without_numba_the_numba_kernels_say_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smoother_cpu, "_HAVE_NUMBA", False)
    assert smoother_cpu.numba_available() is False
    x = torch.zeros(2, 3)
    ones = torch.ones(3)
    assert mentions(
        refusal(RuntimeError, lambda: smoother_cpu.ema_packed_numba(x, torch.tensor([2]), ones)),
        *("numba", "not installed"),
    )
    assert mentions(
        refusal(
            RuntimeError,
            lambda: smoother_cpu.smooth_flat_numba(x.numpy(), np.array([2]), ones, ones),
        ),
        *("numba", "not installed"),
    )


def test_smooth_flat_float32_state_is_the_float32_recurrence_exactly() -> None:
    """In float32 every step is float32 arithmetic: ``s = alpha * s + (1 - alpha) * x``."""
    lengths = [7, 1, 12]
    x = flat_rows(np.float32, lengths)
    alpha = torch.tensor([0.1, 0.55, 0.93])
    _, last, _ = smoother_cpu.smooth_flat_numba(x, np.array(lengths), alpha, torch.ones(3))
    a = alpha.numpy()
    take = np.float32(1) - a
    row = 0
    for j, n in enumerate(lengths):
        s = x[row].copy()
        for r in range(row + 1, row + n):
            s = a * s + take * x[r]
        assert s.dtype == np.float32
        np.testing.assert_array_equal(last[j], s)
        row += n


@pytest.mark.parametrize(
    ("rows", "params"), [(np.float32, torch.float64), (np.float64, torch.float32)]
)
def test_smooth_flat_casts_the_parameters_to_the_rows(rows: type, params: torch.dtype) -> None:
    lengths = [5, 3]
    x = flat_rows(rows, lengths)
    n = np.array(lengths)
    alpha = torch.tensor([0.1, 0.55, 0.93], dtype=params)
    wx = torch.tensor([0.3, -1.1, 2.0], dtype=params)
    as_rows = torch.float64 if rows is np.float64 else torch.float32
    got = smoother_cpu.smooth_flat_numba(x, n, alpha, wx)
    want = smoother_cpu.smooth_flat_numba(x, n, alpha.to(as_rows), wx.to(as_rows))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)
    out, last, finite = got
    assert out.dtype == last.dtype == rows
    assert finite.dtype == np.bool_
    assert finite.tolist() == [True, True]


def test_smooth_flat_takes_lengths_of_any_number_type() -> None:
    lengths = [4, 2]
    x = flat_rows(np.float64, lengths)
    alpha, wx = torch.tensor([0.2, 0.5, 0.8]), torch.ones(3)
    want = smoother_cpu.smooth_flat_numba(x, np.array(lengths), alpha, wx)
    got = smoother_cpu.smooth_flat_numba(x, np.array(lengths, dtype=np.float64), alpha, wx)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_smooth_flat_refuses_rows_or_lengths_of_the_wrong_rank() -> None:
    alpha, wx = torch.ones(3), torch.ones(3)
    for x, n in (
        (np.zeros(3, np.float32), np.array([3])),  # rows not 2-D
        (np.zeros((3, 3), np.float32), np.array([[3]])),  # lengths not 1-D
    ):
        message = refusal(
            ValueError, lambda x=x, n=n: smoother_cpu.smooth_flat_numba(x, n, alpha, wx)
        )
        assert message.startswith("need [sum lengths, F] rows and lengths >= 1, got ")


def test_ema_packed_numba_refuses_rows_off_the_cpu() -> None:
    x = torch.zeros(2, 3, device="meta")  # stands in for a GPU
    call = lambda: smoother_cpu.ema_packed_numba(x, torch.tensor([2]), torch.ones(3))  # noqa: E731
    assert mentions(refusal(ValueError, call), "CPU", "got meta")


def test_ema_packed_numba_casts_alpha_to_the_rows() -> None:
    packed = pack([torch.randn(6, 3), torch.randn(4, 3)])
    alpha = torch.tensor([0.1, 0.55, 0.93], dtype=torch.float64)
    got = smoother_cpu.ema_packed_numba(packed.data, packed.batch_sizes, alpha)
    want = smoother_cpu.ema_packed_numba(packed.data, packed.batch_sizes, alpha.float())
    assert got.dtype == torch.float32
    assert torch.equal(got, want)
    # a float64 state is rounded to float32 first: 500 first steps, where it shows
    many = pack([torch.randn(1, 3) for _ in range(500)])
    init = torch.randn(500, 3, dtype=torch.float64)
    got = smoother_cpu.ema_packed_numba(many.data, many.batch_sizes, alpha, init)
    want = smoother_cpu.ema_packed_numba(many.data, many.batch_sizes, alpha, init.float())
    assert got.dtype == torch.float32
    assert torch.equal(got, want)


# ------------------------------------------------------------------ models/kernels/rollout_cpu.py
# _jit and _mkl_gemm run while the module is imported, where no other test calls them: called here
# so that their own code is checked.


def _plus_one(x: int) -> int:
    return x + 1


def test_rollout_jit_options() -> None:
    compiled = rollout_cpu._jit(_plus_one)
    assert compiled.targetoptions == {
        "nogil": True,
        "boundscheck": False,
        "error_model": "numpy",
        "fastmath": {"contract"},
        "nopython": True,
    }
    assert type(compiled._cache).__name__ == "NullCache"  # cache=False, though it could cache
    assert compiled(41) == 42


def _gemm(fn: Any, z: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``z @ w`` (row-major) through a Fortran ``?gemm_`` as rollout_cpu calls it."""
    g = np.zeros((z.shape[0], w.shape[1]), z.dtype)
    ints = np.array(
        [w.shape[1], z.shape[0], w.shape[0], w.shape[1], z.shape[1], g.shape[1], 78, 78], np.int32
    )
    scalars = np.array([1, 0], z.dtype)
    fn(
        ints[6:].ctypes, ints[7:].ctypes, ints[0:].ctypes, ints[1:].ctypes, ints[2:].ctypes,
        scalars[0:].ctypes, w.ctypes, ints[3:].ctypes, z.ctypes, ints[4:].ctypes,
        scalars[1:].ctypes, g.ctypes, ints[5:].ctypes,
    )  # fmt: skip
    return g


@pytest.mark.skipif(rollout_cpu.BLAS != "mkl", reason="this torch build exports no MKL gemm")
def test_mkl_gemm_finds_single_and_double_precision_gemm() -> None:
    found = rollout_cpu._mkl_gemm()
    assert found is not None
    sgemm, dgemm = found
    for fn in found:  # the signature numba types its calls by: 13 pointers, no result
        assert fn.argtypes == (ctypes.c_void_p,) * 13
        assert fn.restype is None
    rng = np.random.default_rng(0)
    for fn, dtype, tol in ((sgemm, np.float32, 1e-5), (dgemm, np.float64, 1e-12)):
        z = rng.standard_normal((3, 5)).astype(dtype)
        w = rng.standard_normal((5, 8)).astype(dtype)
        np.testing.assert_allclose(_gemm(fn, z, w), z @ w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compile_for_runs_the_loop_on_inputs_of_that_dtype(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """numba compiles one loop per dtype of the inputs (the weights are cast to it)."""
    seen: list[torch.dtype] = []
    real = rollout_cpu.rollout_packed_numba

    def spy(u: Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append(u.dtype)
        out = real(u, *args, **kwargs)
        assert out[0].dtype == dtype
        return out

    monkeypatch.setattr(rollout_cpu, "rollout_packed_numba", spy)
    rollout_cpu.compile_for(dtype)
    assert seen == [dtype]


def test_one_hidden_unit_is_enough() -> None:
    u, sizes = inputs([4, 2])
    w = weights(layers=2, hidden=1)
    for got, want in zip(run(u, sizes, *w), rollout_packed(u, sizes, *w), strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_the_numba_rollout_refuses_inputs_off_the_cpu() -> None:
    u = torch.zeros(2, 3, device="meta")  # stands in for a GPU
    call = lambda: run(u, [2], *weights(layers=1))  # noqa: E731
    assert mentions(refusal(ValueError, call), "CPU", "got meta")


@pytest.mark.parametrize("layers", [1, 2])
def test_float32_in_float32_out_at_every_depth(layers: int) -> None:
    u, sizes = inputs([3, 1])
    w32 = [w.float() if isinstance(w, Tensor) else [t.float() for t in w] for w in weights(layers)]
    got = run(u.float(), sizes, *w32)
    want = rollout_packed(u.float(), sizes, *w32)
    for g, ref in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, ref, atol=1e-5, rtol=0)


@pytest.mark.skipif(rollout_cpu.BLAS != "mkl", reason="checked with MKL's gemm only")
def test_gemm_from_picks_the_path_of_each_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """One sequence (one active row a step), float32, 16 hidden units: MKL's gemm and the
    hand-written loop round differently here (checked), so the bits say which path ran."""
    u, sizes = inputs([9])
    w = [x.float() if isinstance(x, Tensor) else [t.float() for t in x] for x in weights(2, 16)]
    blas = run(u.float(), sizes, *w, gemm_from=1)[0]
    loop = run(u.float(), sizes, *w, gemm_from=2)[0]
    assert not torch.equal(blas, loop)
    torch.testing.assert_close(blas, loop, atol=1e-5, rtol=0)
    assert torch.equal(run(u.float(), sizes, *w, gemm_from=0)[0], blas)  # 0 is taken as 1
    for default, want in ((1, blas), (2, loop)):
        monkeypatch.setattr(rollout_cpu, "GEMM_FROM", default)
        assert torch.equal(run(u.float(), sizes, *w)[0], want)
