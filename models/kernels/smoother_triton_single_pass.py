"""The smoother's two single-pass forward scans in Triton: "chained" and "lookback".

Status: built and tested under ``TRITON_INTERPRET=1`` on the CPU (the interpreter runs them
against an fp64 loop, and tests/unit/models/kernels/test_triton_compile.py compiles them for
sm_90), not measured on a GPU, and not the default: :data:`.smoother_triton.DEFAULT_SCAN`
is the chunked scan, and one of these serves only if ``smooth_packed_triton(..., scan=...)`` asks
for it. ``bench.bench_models`` and ``bench.bench_tiles`` time them beside the chunked scan; the
default follows that measurement (docs/BENCHMARKS.md).

Both read x once and write only y (and s, when a backward pass needs it); the backward pass is
the chunked one (:mod:`.smoother_triton_backward`) whatever the forward's design.

- Chained, :func:`_fwd_chained`, grid ``(col_blocks,)``: each program walks its column block's
  tiles in time order and carries the state between them in registers. Parallel across columns
  only, so it suits wide batches (a program per sequence at F <= 16) and not one long sequence;
  it has no carry arrays and no second read of x.
- Look-back, :func:`_fwd_lookback`, one program per tile: each tile's carry-in is found by
  decoupled look-back over the tiles before it (Merrill & Garland, 2016).

The device helpers (the map combine, tile loads, the fused tanh) are the chunked scan's, from
:mod:`.smoother_triton`. The host entries, :func:`launch_chained` and :func:`launch_lookback`,
launch on a :class:`.smoother_triton.ForwardBuffers` and nothing else, as
:func:`.smoother_triton.launch_forward` does for the chunked scan (CUDA-graph capturable).
"""

from __future__ import annotations

import torch
import triton.language as tl
from torch import Tensor

from rnnserve.models.kernels.smoother_triton import (
    ForwardBuffers,
    TilePlan,
    _combine,
    _jit,
    _load_tile,
    _step_maps,
    _tanh,
)

_WINDOW = 32  # predecessors a look-back reads at once (a warp's worth in CUB)
# Every how many chunks a look-back tile publishes its inclusive state. 1 in use; tests raise
# it so that look-backs compose maps across windows, as they do on a GPU while predecessors
# still run (the interpreter runs programs one after another, so each has published by then).
_INCLUSIVE_EVERY = 1


# ---------------------------------------------------------------------------------------------
# device code


@_jit
def _combine_after(a1, b1, a2, b2):  # type: ignore[no-untyped-def]
    # _combine with its operands swapped: scanning a nearest-first window with it composes the
    # maps in time order, farthest first
    return a1 * a2, a1 * b2 + b1


@_jit
def _fwd_chained(  # type: ignore[no-untyped-def]
    x_ptr,
    bs_ptr,
    off_ptr,
    len_ptr,
    alpha_ptr,
    wx_ptr,
    init_ptr,
    y_ptr,
    s_ptr,
    final_ptr,
    n_steps,
    n_feat,
    n_cols,
    HAS_INIT: tl.constexpr,
    STORE_S: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    # The single-pass forward: one program per block of columns walks its tiles in time order,
    # the state carried from tile to tile in registers; x is read once and nothing but y (and s,
    # for a backward pass) is written. Sequences are sorted longest first, so the block's first
    # sequence is its longest and bounds the trips; past a shorter one's end, identity maps.
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    feat = col % n_feat
    alpha = tl.load(alpha_ptr + feat, mask=col_ok, other=0.0)
    wx = tl.load(wx_ptr + feat, mask=col_ok, other=0.0)
    if HAS_INIT:
        state = tl.load(init_ptr + col, mask=col_ok, other=0.0).to(alpha.dtype)
    else:
        state = tl.zeros([BLOCK], dtype=alpha.dtype)
    steps = tl.load(len_ptr + (tl.program_id(0) * BLOCK) // n_feat)
    last = (tl.arange(0, CHUNK) == CHUNK - 1)[:, None]
    for t0 in range(0, steps, CHUNK):
        t = t0 + tl.arange(0, CHUNK)
        x, active, addr = _load_tile(x_ptr, bs_ptr, off_ptr, t, col, n_steps, n_feat)
        a, b = _step_maps(x.to(alpha.dtype), active, alpha, t, HAS_INIT)
        acc_a, acc_b = tl.associative_scan((a, b), 0, _combine)
        s = acc_a * state[None, :] + acc_b
        tl.store(y_ptr + addr, _tanh(wx[None, :] * s), mask=active)
        if STORE_S:  # for the backward pass
            tl.store(s_ptr + addr, s, mask=active)
        state = tl.sum(tl.where(last, s, 0.0), 0)  # past a sequence's end: carried unchanged
    tl.store(final_ptr + col, state, mask=col_ok)


@_jit
def _fwd_lookback(  # type: ignore[no-untyped-def]
    x_ptr,
    bs_ptr,
    off_ptr,
    alpha_ptr,
    wx_ptr,
    init_ptr,
    y_ptr,
    s_ptr,
    final_ptr,
    agg_a_ptr,
    agg_b_ptr,
    incl_ptr,
    flag_ptr,
    n_steps,
    n_feat,
    n_cols,
    n_chunks,
    HAS_INIT: tl.constexpr,
    STORE_S: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
    INCLUSIVE_EVERY: tl.constexpr,
) -> None:
    # The single-pass scan with decoupled look-back (Merrill & Garland, 2016), one tile a
    # program. Tiles are taken in the order programs start (a ticket from a counter), chunk by
    # chunk, so a tile only ever waits on tiles that started before it: no deadlock, whatever
    # order the GPU schedules programs in. Each tile scans itself, publishes its composed map
    # (flag 1), then looks back WINDOW predecessors at a time (same column block, earlier chunks,
    # nearest first) until the nearest one that has published its inclusive state (flag 2),
    # composes the maps in between, takes its carry-in, publishes its own inclusive state and
    # writes y. x is read once; the side arrays are a few values a column per tile.
    # INCLUSIVE_EVERY > 1 is for tests only: tiles of other chunks publish their map and never
    # their state, so that look-backs compose maps across windows, as they do on a GPU when
    # predecessors are still running (the interpreter runs programs one after another).
    n_col_blocks = tl.cdiv(n_cols, BLOCK)
    ticket = tl.atomic_add(flag_ptr + n_chunks * n_col_blocks, 1)
    chunk = ticket // n_col_blocks
    kb = ticket % n_col_blocks
    col = kb * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    feat = col % n_feat
    alpha = tl.load(alpha_ptr + feat, mask=col_ok, other=0.0)
    wx = tl.load(wx_ptr + feat, mask=col_ok, other=0.0)
    t = chunk * CHUNK + tl.arange(0, CHUNK)
    x, active, addr = _load_tile(x_ptr, bs_ptr, off_ptr, t, col, n_steps, n_feat)
    a, b = _step_maps(x.to(alpha.dtype), active, alpha, t, HAS_INIT)
    acc_a, acc_b = tl.associative_scan((a, b), 0, _combine)
    last = (tl.arange(0, CHUNK) == CHUNK - 1)[:, None]
    side = ticket.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # this tile's side values
    if HAS_INIT:
        # chunk 0's carry-in; the others replace it by their look-back
        carry = tl.load(init_ptr + col, mask=col_ok, other=0.0).to(alpha.dtype)
    else:
        carry = tl.zeros([BLOCK], dtype=alpha.dtype)
    if chunk > 0:
        tl.store(agg_a_ptr + side, tl.sum(tl.where(last, acc_a, 0.0), 0))
        tl.store(agg_b_ptr + side, tl.sum(tl.where(last, acc_b, 0.0), 0))
        tl.debug_barrier()  # every thread's part stored before the flag says so
        tl.atomic_xchg(flag_ptr + ticket, 1, sem="release")
        pos = tl.arange(0, WINDOW)
        m_a = tl.full([BLOCK], 1.0, alpha.dtype)  # the maps composed so far (nearest last)
        m_b = tl.zeros([BLOCK], alpha.dtype)
        j = chunk - 1  # the nearest predecessor not composed yet
        while j >= 0:
            w = j - pos  # nearest first
            exists = w >= 0
            tile = w * n_col_blocks + kb
            f = tl.atomic_add(flag_ptr + tile, 0, mask=exists, sem="acquire")
            f = tl.where(exists, f, 2)  # never reached: chunk 0 always ends the walk
            p = tl.min(tl.where(f == 2, pos, WINDOW), 0)  # the nearest inclusive state
            if tl.min(tl.where(pos < p, f, 1), 0) > 0:  # none missing before it: compose
                tl.debug_barrier()
                use = (pos < p)[:, None]
                rows = tile.to(tl.int64)[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
                wa = tl.load(agg_a_ptr + rows, mask=use, other=1.0, volatile=True)
                wb = tl.load(agg_b_ptr + rows, mask=use, other=0.0, volatile=True)
                # the window's maps in time order, the farthest first (rows past p are
                # identities): its last row composes them all
                ra, rb = tl.associative_scan((wa, wb), 0, _combine_after)
                end = (pos == WINDOW - 1)[:, None]
                win_a = tl.sum(tl.where(end, ra, 0.0), 0)
                win_b = tl.sum(tl.where(end, rb, 0.0), 0)
                m_a, m_b = _combine(win_a, win_b, m_a, m_b)
                if p < WINDOW:
                    at = tl.sum(tl.where(pos == p, tile, 0), 0).to(tl.int64)
                    s_p = tl.load(incl_ptr + at * BLOCK + tl.arange(0, BLOCK), volatile=True)
                    carry = m_a * s_p + m_b
                    j = tl.full([], -1, j.dtype)
                else:
                    j = j - WINDOW
    s = acc_a * carry[None, :] + acc_b
    state = tl.sum(tl.where(last, s, 0.0), 0)
    if chunk % INCLUSIVE_EVERY == 0:
        tl.store(incl_ptr + side, state)
        tl.debug_barrier()
        tl.atomic_xchg(flag_ptr + ticket, 2, sem="release")
    tl.store(y_ptr + addr, _tanh(wx[None, :] * s), mask=active)
    if STORE_S:  # for the backward pass
        tl.store(s_ptr + addr, s, mask=active)
    if chunk == n_chunks - 1:
        tl.store(final_ptr + col, state, mask=col_ok)


# ---------------------------------------------------------------------------------------------
# host code


def launch_chained(buf: ForwardBuffers) -> None:
    """The chained forward, one launch, on ``buf`` (``buf.lens``: each sorted sequence's
    length, its column block's trip count); capturable, as
    :func:`.smoother_triton.launch_forward` says."""
    plan = buf.plan
    assert buf.lens is not None  # forward_buffers refuses a chained plan without them
    _fwd_chained[plan.chained_grid](
        buf.x,
        buf.bs,
        buf.off,
        buf.lens,
        buf.alpha,
        buf.wx,
        buf.final if buf.init is None else buf.init,  # final stands in when there is no state
        buf.y,
        buf.s,
        buf.final,
        plan.n_steps,
        plan.n_feat,
        plan.n_cols,
        HAS_INIT=buf.init is not None,
        STORE_S=buf.store_s,
        CHUNK=plan.chunk,
        BLOCK=plan.block,
        num_warps=plan.warps,
    )


def lookback_scratch(
    plan: TilePlan, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, ...]:
    """The look-back's side arrays (each tile's map and inclusive state, ``BLOCK`` values a
    tile) and its flags (one per tile, then the ticket counter)."""
    n_tiles = plan.n_tiles
    agg_a, agg_b, incl = (
        torch.empty(n_tiles * plan.block, dtype=dtype, device=device) for _ in range(3)
    )
    flags = torch.empty(n_tiles + 1, dtype=torch.int32, device=device)  # cleared per launch
    return agg_a, agg_b, incl, flags


def launch_lookback(buf: ForwardBuffers) -> None:
    """The look-back forward, one launch, on ``buf``; capturable, as
    :func:`.smoother_triton.launch_forward` says. The flags and the ticket counter are cleared
    first (a memset on the device), so the same buffers can be launched again."""
    plan = buf.plan
    agg_a, agg_b, incl, flags = buf.scratch
    flags.zero_()
    _fwd_lookback[(plan.n_tiles,)](
        buf.x,
        buf.bs,
        buf.off,
        buf.alpha,
        buf.wx,
        buf.final if buf.init is None else buf.init,  # final stands in when there is no state
        buf.y,
        buf.s,
        buf.final,
        agg_a,
        agg_b,
        incl,
        flags,
        plan.n_steps,
        plan.n_feat,
        plan.n_cols,
        plan.n_chunks,
        HAS_INIT=buf.init is not None,
        STORE_S=buf.store_s,
        CHUNK=plan.chunk,
        BLOCK=plan.block,
        WINDOW=_WINDOW,
        INCLUSIVE_EVERY=_INCLUSIVE_EVERY,
        num_warps=plan.warps,
    )
