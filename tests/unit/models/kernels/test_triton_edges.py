"""The Triton kernels' CPU-testable edges that the numerical tests do not reach: argument
refusals, empty inputs, the tile planner's checks, and the rollout custom op's fake (meta)
implementation, which ``torch.compile`` uses to trace the op without running it.

Run on the CPU under TRITON_INTERPRET=1 (as CI does) or on CUDA.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

rt = pytest.importorskip("rnnserve.models.kernels.rollout_triton")
st = pytest.importorskip("rnnserve.models.kernels.smoother_triton")

from rnnserve.models.kernels import ema_packed_torch  # noqa: E402
from rnnserve.models.packing import pack  # noqa: E402
from rnnserve.models.traveller import rollout_packed  # noqa: E402
from tests.unit.models.kernels.test_rollout_triton import (  # noqa: E402
    DEVICE,
    DTYPE,
    assert_same,
    packed,
    weights,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)


def test_smoother_refuses_data_that_is_not_packed_rows() -> None:
    alpha = torch.full((4,), 0.5, dtype=DTYPE, device=DEVICE)
    wx = torch.ones(4, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=r"expected packed data \[N, F\], got \[2, 3, 4\]"):
        st.smooth_packed_triton(torch.zeros(2, 3, 4, dtype=DTYPE), torch.tensor([2]), alpha, wx)
    data = torch.zeros(3, 4, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=r"state of shape \[2, 4\], got \[1, 4\]"):
        st.smooth_packed_triton(
            data, torch.tensor([2, 1]), alpha, wx, torch.zeros(1, 4, dtype=DTYPE, device=DEVICE)
        )


def test_smoother_on_no_rows_returns_empty_outputs_and_zero_states() -> None:
    alpha = torch.full((4,), 0.5, dtype=DTYPE, device=DEVICE)
    wx = torch.full((4,), 2.0, dtype=DTYPE, device=DEVICE)
    y, last = st.smooth_packed_triton(
        torch.zeros(0, 4, dtype=DTYPE, device=DEVICE), torch.tensor([], dtype=torch.int64),
        alpha, wx,
    )  # fmt: skip
    assert tuple(y.shape) == (0, 4)
    assert tuple(last.shape) == (0, 4)
    # no features: one sequence of 3 steps, nothing to smooth
    y, last = st.smooth_packed_triton(
        torch.zeros(3, 0, dtype=DTYPE, device=DEVICE), torch.tensor([1, 1, 1]),
        alpha[:0], wx[:0],
    )  # fmt: skip
    assert tuple(y.shape) == (3, 0)
    assert tuple(last.shape) == (1, 0)


@pytest.mark.parametrize("name", ["chunk", "block", "carry", "sub"])
def test_tile_sizes_must_be_powers_of_two(name: str) -> None:
    with pytest.raises(ValueError, match=f"{name} must be a power of two, got 24"):
        st.plan_tiles(100, 4, 16, **{name: 24})
    plan = st.plan_tiles(100, 4, 16, **{name: 32})
    assert getattr(plan, name) == 32


def test_pieces_are_at_most_a_chunk_and_default_to_one() -> None:
    assert st.plan_tiles(100, 4, 16, chunk=32).sub == 32  # one tree scan of the tile
    assert st.plan_tiles(100, 4, 16, chunk=32, sub=32).sub == 32
    assert st.plan_tiles(100, 4, 16, chunk=32, sub=1).sub == 1
    with pytest.raises(ValueError, match=r"sub \(64\) must not exceed chunk \(32\)"):
        st.plan_tiles(100, 4, 16, chunk=32, sub=64)


@pytest.mark.parametrize(
    ("chunk", "block", "sub", "warps"),
    [(32, 128, 32, 8), (16, 16, 16, 2), (32, 128, 1, 1), (64, 128, 8, 2), (256, 128, 32, 8)],
)
def test_forward_warps_follow_the_piece(chunk: int, block: int, sub: int, warps: int) -> None:
    plan = st.plan_tiles(100, 64, 16, chunk=chunk, block=block, sub=sub)
    assert plan.forward_warps == warps


def test_rollout_refuses_bad_bucket_layer_and_weight_arguments() -> None:
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        rt.bucket_rows(0)
    w_cat, bias, w_out, b_out = weights(2, 4, 2)
    u = packed([2, 1], 2)
    roll = rt.TritonRollout()
    with pytest.raises(ValueError, match="one weight and one bias per layer, got 2, 1"):
        roll(u, [2, 1], w_cat, bias[:1], w_out, b_out)
    with pytest.raises(ValueError, match="one weight and one bias per layer, got 0, 0"):
        roll(u, [2, 1], [], [], w_out, b_out)
    other = torch.float32 if torch.float64 == DTYPE else torch.float64
    with pytest.raises(ValueError, match="weights and inputs must share dtype and device"):
        roll(u, [2, 1], w_cat, bias, w_out.to(other), b_out)
    with pytest.raises(ValueError, match=r"weight of shape \[2, 4\], expected \[4, 2\]"):
        roll(u, [2, 1], w_cat, bias, w_out.t().contiguous(), b_out)


def test_rollout_refuses_more_rows_than_int32_indexing_allows() -> None:
    # a meta tensor: the shape is checked before any memory is touched
    u = torch.empty(2**30, 2, device="meta")
    with pytest.raises(ValueError, match=r"more than 2\*\*31 input elements"):
        rt._check_sizes([2**30], u)


def test_a_workspace_made_under_inference_mode_serves_calls_outside_it() -> None:
    """The server warms the rollout up under torch.inference_mode; a later call outside it (a
    test, torch.compile tracing the op) must still be able to write into that workspace."""
    roll = rt.TritonRollout()
    w_cat, bias, w_out, b_out = weights(3, 8, 2)
    sizes = [1, 1, 1]  # one sequence of 3 steps: the 1-row bucket, room for 64 rows
    u = packed(sizes, 3)
    with torch.inference_mode():
        first = roll(u, sizes, w_cat, bias, w_out, b_out)
    again = roll(u, sizes, w_cat, bias, w_out, b_out)  # the same workspace, written outside
    for a, b in zip(first, again, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # 130 steps: more rows and steps than it has room for, so it grows, outside inference mode
    long = packed([1] * 130, 3)
    got = roll(long, [1] * 130, w_cat, bias, w_out, b_out)
    assert_same(got, rollout_packed(long, [1] * 130, w_cat, bias, w_out, b_out))


def test_custom_op_fake_implementation_agrees_with_the_real_one() -> None:
    """``torch.library.opcheck`` runs the op, then its fake implementation on fake tensors, and
    compares shapes, dtypes and the schema's aliasing: what torch.compile relies on."""
    op = rt.rollout_op()
    sizes = [3, 2, 2, 1]
    w_cat, bias, w_out, b_out = weights(3, 8, 2)
    u = packed(sizes, 3)
    h0 = torch.full((2, 3, 8), 0.1, dtype=DTYPE, device=DEVICE)
    torch.library.opcheck(op, (u, sizes, w_cat, bias, w_out, b_out, h0))
    fake_mode = torch._subclasses.fake_tensor.FakeTensorMode()
    with fake_mode:
        fu = torch.empty(8, 3, dtype=DTYPE)
        fw = [torch.empty(w.shape, dtype=DTYPE) for w in w_cat]
        fb = [torch.empty(b.shape, dtype=DTYPE) for b in bias]
        pos, h, c, p = op(fu, sizes, fw, fb, torch.empty(8, 2, dtype=DTYPE),
                          torch.empty(2, dtype=DTYPE))  # fmt: skip
    assert [tuple(t.shape) for t in (pos, h, c, p)] == [(8, 2), (2, 3, 8), (2, 3, 8), (3, 2)]


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="reads the interpreter's kernel object (its kwargs)"
)
def test_the_kernels_are_made_with_their_options() -> None:
    """``_jit`` of each module, called directly: the kernels are built at import, before a
    test (or a mutant) runs, so what their decorators hand Triton is checked here."""

    def kernel(x_ptr, n_steps, n_feat, n_cols, n_chunks, k, BLOCK):  # type: ignore[no-untyped-def]
        return None

    def helper(a, b):  # type: ignore[no-untyped-def]
        return a

    made = st._jit(kernel)
    assert made.fn is kernel
    # batch-dependent integers are not specialised on (one binary per tile plan); n_feat is
    assert made.kwargs["do_not_specialize"] == ["n_steps", "n_cols", "n_chunks"]
    assert st._jit(helper).kwargs["do_not_specialize"] == []

    made = rt._jit(do_not_specialize=["k"])(kernel)
    assert made.fn is kernel
    assert made.kwargs["do_not_specialize"] == ["k"]
    assert not rt._jit()(helper).kwargs.get("do_not_specialize")


@pytest.mark.parametrize(
    ("chunk", "block", "warps"),
    [(16, 16, 2), (32, 32, 2), (32, 64, 4), (64, 64, 8), (32, 128, 8), (256, 128, 8)],
)
def test_warps_follow_the_tile(chunk: int, block: int, warps: int) -> None:
    """About 16 elements a thread, 2 to 8 warps (the interpreter ignores warps: this is the only
    check of them on the CPU)."""
    plan = st.plan_tiles(1000, 64, 16, chunk=chunk, block=block)
    assert plan.warps == warps
    assert plan.forward_warps == warps  # one tree scan of the tile: the same


@pytest.mark.parametrize(("block", "carry", "warps"), [(16, 512, 8), (32, 256, 8), (32, 64, 4)])
def test_carry_scan_warps_follow_its_tile(block: int, carry: int, warps: int) -> None:
    plan = st.plan_tiles(1000, 64, 16, block=block, carry=carry)
    assert plan.carry_block == min(block, 32)
    assert plan.carry_warps == warps


@pytest.mark.parametrize(
    ("n_steps", "n_seqs", "n_feat", "chunk", "block"),
    [
        (10, 1, 16, 16, 16),  # a short sequence: one chunk of 16
        (100_000, 1, 16, 64, 16),  # one long sequence, split in time until ~1024 programs
        (4000, 256, 16, 32, 128),  # wide: 32 column blocks, 32-step chunks (4096 elements)
        (10, 17, 1, 16, 32),  # 17 columns: the next power of two
        (70, 1, 1, 32, 16),
        (5000, 3, 16, 32, 64),  # 48 columns
    ],
)
def test_the_planner_picks_the_documented_tiles(
    n_steps: int, n_seqs: int, n_feat: int, chunk: int, block: int
) -> None:
    """Columns first (a power of two, 16 to 128), then chunks of at most 4096 // block steps,
    shortened (down to 32) until the grid has about 1024 programs."""
    plan = st.plan_tiles(n_steps, n_seqs, n_feat)
    assert (plan.chunk, plan.block, plan.sub) == (chunk, block, chunk)
    assert plan.carry == 8192 // min(block, 32)


def test_compute_dtype_is_float32_but_for_float64() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        assert st._compute_dtype(dtype) == torch.float32
    assert st._compute_dtype(torch.float64) == torch.float64


def test_parameters_are_cast_to_the_data_s_precision() -> None:
    """float64 data with float32 constants (a model whose weights stayed float32) computes in
    float64: the reference is the float64 recursion of the constants as stored."""
    gen = torch.Generator().manual_seed(40)
    seqs = [torch.randn(n, 3, generator=gen, dtype=torch.float64) for n in (30, 12)]
    packed = pack(seqs)
    alpha32 = torch.tensor([0.3, 0.6, 0.95], dtype=torch.float32)
    wx32 = torch.tensor([1.5, 0.7, 2.0], dtype=torch.float32)
    y, _ = st.smooth_packed_triton(
        packed.data.to(DEVICE), packed.batch_sizes, alpha32.to(DEVICE), wx32.to(DEVICE), chunk=8
    )
    assert y.dtype == torch.float64
    a, w = alpha32.double(), wx32.double()
    s = ema_packed_torch(packed.data, packed.batch_sizes, a, None)
    torch.testing.assert_close(y.cpu(), torch.tanh(w * s), atol=1e-12, rtol=0)


@pytest.mark.parametrize("module", [st, rt], ids=["smoother", "rollout"])
def test_the_interpreter_switch_reads_every_spelling(
    monkeypatch: pytest.MonkeyPatch, module: Any
) -> None:
    """TRITON_INTERPRET as Triton itself reads it: 1, true, yes, on, in any case; unset or
    anything else is off."""
    for value in ("1", "true", "TRUE", "Yes", "yes", "on", "ON"):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert module._interpreting(), value
    for value in ("0", "false", "off", "no", ""):
        monkeypatch.setenv("TRITON_INTERPRET", value)
        assert not module._interpreting(), value
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not module._interpreting()


def test_the_smoother_on_cpu_tensors_without_the_interpreter_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    one = torch.ones(1)
    with pytest.raises(
        RuntimeError,
        match=r"^the triton smoother needs CUDA tensors \(or TRITON_INTERPRET=1 to test on the "
        r"CPU\)$",
    ):
        st.smooth_packed_triton(torch.zeros(2, 1), torch.tensor([1, 1]), one, one)


@pytest.mark.parametrize("name", ["chunk", "block", "carry", "sub"])
def test_each_tile_override_reaches_the_planner(name: str) -> None:
    """The tiles a test or benchmark asks for are the ones run (each is checked by the planner:
    a bad one is refused, so one silently dropped would not be)."""
    data = torch.zeros(3, 2, dtype=DTYPE, device=DEVICE)
    one = torch.ones(2, dtype=DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match=f"^{name} must be a power of two, got 24$"):
        st.smooth_packed_triton(data, torch.tensor([1, 1, 1]), one, one, **{name: 24})
    with pytest.raises(ValueError, match=r"^sub \(8\) must not exceed chunk \(4\)$"):
        st.smooth_packed_triton(data, torch.tensor([1, 1, 1]), one, one, chunk=4, sub=8)


def test_the_fill_loop_counts_column_blocks_and_stops_at_1024_programs() -> None:
    # 64 column blocks of 16: 391 chunks of 256 already give 25,024 programs
    assert st.plan_tiles(100_000, 64, 16, block=16).chunk == 256
    # one column block: 65,536 steps in chunks of 64 are exactly 1024 programs, enough
    assert st.plan_tiles(65_536, 1, 16).chunk == 64
    assert st.plan_tiles(65_472, 1, 16).chunk == 32  # 1023 chunks of 64: halved once more
