"""The smoother's training backward in Triton: the chunked scan of the adjoint, in reverse time.

Serving never runs it (its batches run under ``torch.inference_mode``); training and the
gradient tests do, through :class:`.smoother_triton._SmootherFn`, which loads this module the
first time a gradient is asked for.

The adjoint ``lam_t = dL/ds_t`` obeys ``lam_t = g_t + alpha * lam_{t+1}`` (``g_t`` the direct
gradient through ``y_t``), a scan from the end, in the forward's three-launch shape:
:func:`_bwd_chunk_summary` summarises each chunk's reverse map; the forward's
:func:`.smoother_triton._carry_scan` runs right to left; :func:`_bwd_replay` scans the adjoint
from its right carry, writes ``dx`` and per-(chunk, column) partial sums for ``alpha`` and
``wx`` that torch reduces. The tiles are read back to front (row ``i`` of a tile is step
``t = chunk_end - 1 - i``) so that this is a *forward* ``tl.associative_scan`` too: Triton's
``reverse=True`` with a non-commutative combine has given wrong results on GPUs (an upstream
Triton bug), and the interpreter cannot show that. The forward replay
keeps ``s`` when a gradient is needed, so nothing is recomputed in time order here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl
from torch import Tensor

from rnnserve.models.kernels.smoother_triton import (
    TilePlan,
    _aligned,
    _carry_scan,
    _combine,
    _jit,
    _load_tile,
    _tanh,
)

# ---------------------------------------------------------------------------------------------
# device code


@_jit
def _adjoint_maps(  # type: ignore[no-untyped-def]
    s_ptr,
    gy_ptr,
    gfin_ptr,
    bs_ptr,
    off_ptr,
    t,
    col,
    col_ok,
    alpha,
    wx,
    n_steps,
    n_feat,
    HAS_GFIN: tl.constexpr,
):
    # The maps lam_t = ar_t * lam_{t+1} + g_t of the steps t (any order), and what the
    # parameter gradients need: s_t, dL/d(wx * s_t), where (t, j) is a real row, its address.
    s, active, addr = _load_tile(s_ptr, bs_ptr, off_ptr, t, col, n_steps, n_feat)
    y = _tanh(wx[None, :] * s)
    gy = tl.load(gy_ptr + addr, mask=active, other=0.0).to(s.dtype)
    gy_pre = gy * (1.0 - y * y)
    g = tl.where(active, gy_pre * wx[None, :], 0.0)
    bs_next = tl.load(bs_ptr + t + 1, mask=(t >= 0) & (t + 1 < n_steps), other=0)
    goes_on = (col // n_feat)[None, :] < bs_next[:, None]  # the sequence has a step t + 1
    if HAS_GFIN:  # the final state's gradient enters at each sequence's last step
        gfin = tl.load(gfin_ptr + col, mask=col_ok, other=0.0).to(s.dtype)
        g += tl.where(active & (goes_on == 0), gfin[None, :], 0.0)
    ar = tl.where(goes_on, alpha[None, :], 0.0)
    return ar, g, s, gy_pre, active, addr


@_jit
def _bwd_chunk_summary(  # type: ignore[no-untyped-def]
    s_ptr,
    gy_ptr,
    gfin_ptr,
    bs_ptr,
    off_ptr,
    alpha_ptr,
    wx_ptr,
    sum_a_ptr,
    sum_b_ptr,
    n_steps,
    n_feat,
    n_cols,
    HAS_GFIN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    chunk = tl.program_id(0)
    t = chunk * CHUNK + (CHUNK - 1 - tl.arange(0, CHUNK))  # back to front
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    feat = col % n_feat
    alpha = tl.load(alpha_ptr + feat, mask=col_ok, other=0.0)
    wx = tl.load(wx_ptr + feat, mask=col_ok, other=0.0)
    ar, g, _, _, _, _ = _adjoint_maps(
        s_ptr,
        gy_ptr,
        gfin_ptr,
        bs_ptr,
        off_ptr,
        t,
        col,
        col_ok,
        alpha,
        wx,
        n_steps,
        n_feat,
        HAS_GFIN,
    )
    acc_a, acc_b = tl.associative_scan((ar, g), 0, _combine)
    last = (tl.arange(0, CHUNK) == CHUNK - 1)[:, None]  # the chunk's first step
    out = chunk.to(tl.int64) * n_cols + col
    tl.store(sum_a_ptr + out, tl.sum(tl.where(last, acc_a, 0.0), 0), mask=col_ok)
    tl.store(sum_b_ptr + out, tl.sum(tl.where(last, acc_b, 0.0), 0), mask=col_ok)


@_jit
def _bwd_replay(  # type: ignore[no-untyped-def]
    x_ptr,
    s_ptr,
    init_ptr,
    gy_ptr,
    gfin_ptr,
    bs_ptr,
    off_ptr,
    alpha_ptr,
    wx_ptr,
    rcarry_ptr,
    dx_ptr,
    dalpha_ptr,
    dwx_ptr,
    n_steps,
    n_feat,
    n_cols,
    HAS_INIT: tl.constexpr,
    HAS_GFIN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    chunk = tl.program_id(0)
    t = chunk * CHUNK + (CHUNK - 1 - tl.arange(0, CHUNK))  # back to front
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    feat = col % n_feat
    alpha = tl.load(alpha_ptr + feat, mask=col_ok, other=0.0)
    wx = tl.load(wx_ptr + feat, mask=col_ok, other=0.0)
    ar, g, s, gy_pre, active, addr = _adjoint_maps(
        s_ptr,
        gy_ptr,
        gfin_ptr,
        bs_ptr,
        off_ptr,
        t,
        col,
        col_ok,
        alpha,
        wx,
        n_steps,
        n_feat,
        HAS_GFIN,
    )
    acc_a, acc_b = tl.associative_scan((ar, g), 0, _combine)
    lam_right = tl.load(
        rcarry_ptr + (chunk.to(tl.int64) + 1) * n_cols + col, mask=col_ok, other=0.0
    )
    lam = acc_a * lam_right[None, :] + acc_b  # dL/ds_t
    x = tl.load(x_ptr + addr, mask=active, other=0.0).to(s.dtype)
    # ds_t/dx_t = 1 - alpha (1 at s_0 = x_0); ds_t/dalpha = s_{t-1} - x_t where a_t = alpha
    s_prev, _, _ = _load_tile(s_ptr, bs_ptr, off_ptr, t - 1, col, n_steps, n_feat)
    at_start = (t == 0)[:, None]
    dx = lam * (1.0 - alpha)[None, :]
    if HAS_INIT:  # s_{-1} is the initial state
        init = tl.load(init_ptr + col, mask=col_ok, other=0.0).to(s.dtype)
        s_prev = tl.where(at_start, init[None, :], s_prev)
        uses_alpha = active
    else:
        dx = tl.where(at_start, lam, dx)
        uses_alpha = active & (at_start == 0)
    tl.store(dx_ptr + addr, dx, mask=active)
    out = chunk.to(tl.int64) * n_cols + col
    dalpha = tl.sum(tl.where(uses_alpha, lam * (s_prev - x), 0.0), 0)
    tl.store(dalpha_ptr + out, dalpha, mask=col_ok)
    tl.store(dwx_ptr + out, tl.sum(tl.where(active, gy_pre * s, 0.0), 0), mask=col_ok)


# ---------------------------------------------------------------------------------------------
# host code


def smoother_backward(
    ctx: Any, grad_y: Tensor | None, grad_final: Tensor | None
) -> tuple[Tensor | None, ...]:
    """:meth:`_SmootherFn.backward`: the gradients of ``data``, ``alpha``, ``wx`` and ``init``
    (None for the rest of its inputs) from what its forward saved on ``ctx``."""
    x, s, init, alpha_c, wx_c, bs, off = ctx.saved_tensors
    plan: TilePlan = ctx.plan
    n_chunks, n_cols = plan.n_chunks, plan.n_cols
    cdt = alpha_c.dtype
    # aligned, as every pointer the kernels take (see smoother_triton._aligned)
    gy = torch.zeros_like(x) if grad_y is None else _aligned(grad_y)
    has_gfin = grad_final is not None
    gfin = _aligned(grad_final) if grad_final is not None else x  # unused if absent
    rcarry = torch.empty((n_chunks + 1, n_cols), dtype=cdt, device=x.device)
    sum_a = torch.empty((n_chunks, n_cols), dtype=cdt, device=x.device)
    sum_b = torch.empty_like(sum_a)
    common = (plan.n_steps, plan.n_feat, n_cols)
    _bwd_chunk_summary[plan.grid](
        s,
        gy,
        gfin,
        bs,
        off,
        alpha_c,
        wx_c,
        sum_a,
        sum_b,
        *common,
        HAS_GFIN=has_gfin,
        CHUNK=plan.chunk,
        BLOCK=plan.block,
        num_warps=plan.warps,
    )
    _carry_scan[plan.carry_grid](
        sum_a,
        sum_b,
        rcarry,
        rcarry,
        rcarry,
        n_chunks,
        n_cols,
        REVERSE=True,
        HAS_INIT=False,
        CARRY=plan.carry,
        BLOCK=plan.carry_block,
        num_warps=plan.carry_warps,
    )
    dx = torch.empty_like(x)
    dalpha_part, dwx_part = sum_a, sum_b  # the summaries are spent: reuse them
    _bwd_replay[plan.grid](
        x,
        s,
        init,
        gy,
        gfin,
        bs,
        off,
        alpha_c,
        wx_c,
        rcarry,
        dx,
        dalpha_part,
        dwx_part,
        *common,
        HAS_INIT=ctx.has_init,
        HAS_GFIN=has_gfin,
        CHUNK=plan.chunk,
        BLOCK=plan.block,
        num_warps=plan.warps,
    )
    x_dt, alpha_dt, wx_dt, init_dt = ctx.dtypes
    per_feat = (n_chunks * plan.n_seqs, plan.n_feat)
    dalpha = dalpha_part.view(per_feat).sum(0).to(alpha_dt)
    dwx = dwx_part.view(per_feat).sum(0).to(wx_dt)
    dinit = None
    if ctx.has_init:  # s_0 = alpha * init + ...: dL/dinit = alpha * lam_0
        dinit = (alpha_c * rcarry[0].view(plan.n_seqs, plan.n_feat)).to(init_dt)
    return dx.to(x_dt), dalpha, dwx, dinit, None, None, None, None, None
