"""The smoother as a chunked parallel scan in Triton, with the ``tanh(wx * s)`` epilogue fused.

Each step is an affine map of the state, ``s -> a_t * s + b_t`` with ``a_t = alpha`` and
``b_t = (1 - alpha) * x_t`` (``a_0 = 0, b_0 = x_0`` without an initial state), so any run of
steps composes to one such map, ``(a1, b1) then (a2, b2) = (a1 * a2, a2 * b1 + b2)``: the
recursion is a scan, parallel in time as well as across sequences and features.

Layout. Packed rows are time-major: the rows of step ``t`` are ``offset[t] + j`` for the
``batch_sizes[t]`` sorted sequences ``j`` still active. With a flattened column
``col = j * F + f`` the element ``(t, j, f)`` lives at ``offset[t] * F + col``, so for a block of
columns each step is one contiguous span. A tile is ``[CHUNK steps, BLOCK columns]``; past a
sequence's end a step is the identity map, so a chunk's summary carries a finished sequence's
final state through unchanged.

The forward that serves, :data:`DEFAULT_SCAN` = "chunked" (three launches; x is read twice, y
written once):

1. :func:`_fwd_chunk_summary`, grid ``(n_chunks, col_blocks)``: scan the tile with a zero
   carry-in; keep the chunk's composed map ``(A_c, B_c)`` per column.
2. :func:`_carry_scan`, grid ``(col_blocks,)``: scan the chunk maps per column, ``CARRY`` chunks
   per loop trip, into ``carry[c]`` = the state before chunk ``c`` (``carry[0]`` = initial state,
   ``carry[n_chunks]`` = each sequence's final state, also written to the ``final`` output).
3. :func:`_fwd_replay`, same grid as 1: rescan the tile from its carry-in, write
   ``y = tanh(wx * s)`` (and ``s`` when a gradient is needed).

Elsewhere, loaded only when asked for: the single-pass forwards ``scan="chained"`` and
``scan="lookback"`` (:mod:`.smoother_triton_single_pass`, not measured on a GPU, not the
default) and the training backward (:mod:`.smoother_triton_backward`, chunked whatever the
forward's design; it reuses :func:`_carry_scan`, right to left).

Host code. :func:`smooth_packed_triton` (the public call) plans the tiles, copies the schedule
to the device (:func:`device_schedule`), allocates every buffer (:func:`forward_buffers`) and
runs :func:`launch_forward`: kernel launches on those preallocated device tensors only, one
inner entry per design (:func:`launch_chunked`, and the single-pass module's), which a benchmark
captures in a CUDA graph on buffers from :func:`prepare_forward`. Without a gradient to take
(serving), the public call launches directly; with one, through a ``torch.autograd.Function``.
A batch shape's tile plan is computed once. Every pointer handed to a kernel starts on a
16-byte boundary and the integers that vary with the batch are not specialised on, so one
binary per tile plan serves every batch (see :func:`warm_up`).

Importing this module imports triton; :mod:`rnnserve.models.smoothing` does so lazily. Under
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (that is how CI tests them).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor

from rnnserve.models.kernels import triton_interpreting

__all__ = [
    "DEFAULT_SCAN",
    "SCANS",
    "ForwardBuffers",
    "TilePlan",
    "device_schedule",
    "forward_buffers",
    "launch_chunked",
    "launch_forward",
    "plan_tiles",
    "prepare_forward",
    "sequence_lengths",
    "smooth_packed_triton",
    "tile_plans",
    "warm_up",
]


# Integer arguments that change from batch to batch. Triton compiles one variant per value class
# (1, a multiple of 16, other) of every integer argument unless told not to: three per argument,
# each a compile of a fraction of a second met in the middle of serving. Not specialising them
# keeps one binary per tile plan, which :func:`warm_up` compiles before the first request.
_VARYING = ("n_steps", "n_cols", "n_chunks")


def _jit(fn: Callable[..., Any]) -> Any:
    # triton ships no type information; this keeps mypy strict from flagging every kernel
    params = inspect.signature(fn).parameters
    return triton.jit(fn, do_not_specialize=[name for name in _VARYING if name in params])


# ---------------------------------------------------------------------------------------------
# device code


@_jit
def _combine(a1, b1, a2, b2):  # type: ignore[no-untyped-def]
    # the map (a1, b1) followed by (a2, b2): s -> a2 * (a1 * s + b1) + b2
    return a1 * a2, a2 * b1 + b2


@_jit
def _tanh(z):  # type: ignore[no-untyped-def]
    # tanh from one exp of a non-positive argument (no overflow); libdevice has no interpreter path
    e = tl.exp(-2.0 * tl.abs(z))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(z < 0, -t, t)


@_jit
def _load_tile(  # type: ignore[no-untyped-def]
    ptr, bs_ptr, off_ptr, t, col, n_steps, n_feat
):
    # t: [CHUNK] steps (may run past either end); col: [BLOCK] flattened (sequence, feature)
    in_range = (t >= 0) & (t < n_steps)
    bs = tl.load(bs_ptr + t, mask=in_range, other=0)
    off = tl.load(off_ptr + t, mask=in_range, other=0)
    seq = col // n_feat
    active = seq[None, :] < bs[:, None]  # [CHUNK, BLOCK]: (t, j) is a real packed row
    addr = off[:, None] * n_feat + col[None, :]
    v = tl.load(ptr + addr, mask=active, other=0.0)
    return v, active, addr


@_jit
def _step_maps(x, active, alpha, t, HAS_INIT: tl.constexpr):  # type: ignore[no-untyped-def]
    # the affine map s -> a * s + b of each step; the identity where the sequence has ended
    a = tl.where(active, alpha[None, :], 1.0)
    b = tl.where(active, (1.0 - alpha)[None, :] * x, 0.0)
    if not HAS_INIT:
        first = (t == 0)[:, None]  # s_0 = x_0
        a = tl.where(first, 0.0, a)
        b = tl.where(first, x, b)
    return a, b


@_jit
def _fwd_chunk_summary(  # type: ignore[no-untyped-def]
    x_ptr,
    bs_ptr,
    off_ptr,
    alpha_ptr,
    sum_a_ptr,
    sum_b_ptr,
    n_steps,
    n_feat,
    n_cols,
    HAS_INIT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
) -> None:
    # The chunk in CHUNK // SUB pieces of SUB steps, in order: each piece is a tree scan of a
    # [SUB, BLOCK] tile composed onto the running map. SUB == CHUNK: one tree scan of the tile;
    # SUB == 1: a plain loop over the steps (one row of BLOCK columns a step)
    chunk = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    alpha = tl.load(alpha_ptr + col % n_feat, mask=col_ok, other=0.0)
    last = (tl.arange(0, SUB) == SUB - 1)[:, None]
    run_a = tl.full([BLOCK], 1.0, alpha.dtype)
    run_b = tl.zeros([BLOCK], alpha.dtype)
    for piece in range(CHUNK // SUB):
        t = chunk * CHUNK + piece * SUB + tl.arange(0, SUB)
        x, active, _ = _load_tile(x_ptr, bs_ptr, off_ptr, t, col, n_steps, n_feat)
        a, b = _step_maps(x.to(alpha.dtype), active, alpha, t, HAS_INIT)
        acc_a, acc_b = tl.associative_scan((a, b), 0, _combine)
        piece_a = tl.sum(tl.where(last, acc_a, 0.0), 0)
        piece_b = tl.sum(tl.where(last, acc_b, 0.0), 0)
        run_a, run_b = _combine(run_a, run_b, piece_a, piece_b)
    out = chunk.to(tl.int64) * n_cols + col
    tl.store(sum_a_ptr + out, run_a, mask=col_ok)
    tl.store(sum_b_ptr + out, run_b, mask=col_ok)


@_jit
def _carry_scan(  # type: ignore[no-untyped-def]
    sum_a_ptr,
    sum_b_ptr,
    carry_ptr,
    init_ptr,
    final_ptr,
    n_chunks,
    n_cols,
    REVERSE: tl.constexpr,
    HAS_INIT: tl.constexpr,
    CARRY: tl.constexpr,
    BLOCK: tl.constexpr,
) -> None:
    # carry: [n_chunks + 1, n_cols], what flows in at each chunk edge. Forward: carry[0] is the
    # initial state (init, or zeros), carry[c + 1] the state after chunk c, and the last one is
    # also written to final. Reverse: carry[n_chunks] = 0 (nothing after the end), carry[c] the
    # adjoint at chunk c's first step. The chunk maps are composed in the scan's own order.
    col = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    dtype = carry_ptr.dtype.element_ty
    if HAS_INIT:
        carry = tl.load(init_ptr + col, mask=col_ok, other=0.0).to(dtype)
    else:
        carry = tl.zeros([BLOCK], dtype=dtype)
    if REVERSE:
        tl.store(carry_ptr + n_chunks * n_cols + col, carry, mask=col_ok)
    else:
        tl.store(carry_ptr + col, carry, mask=col_ok)
    last = (tl.arange(0, CARRY) == CARRY - 1)[:, None]
    for k in range(0, n_chunks, CARRY):
        i = k + tl.arange(0, CARRY)
        if REVERSE:
            c = n_chunks - 1 - i
            dst = c
        else:
            c = i
            dst = c + 1
        ok = (i < n_chunks)[:, None] & col_ok[None, :]
        src = c.to(tl.int64)[:, None] * n_cols + col[None, :]
        a = tl.load(sum_a_ptr + src, mask=ok, other=1.0)
        b = tl.load(sum_b_ptr + src, mask=ok, other=0.0)
        acc_a, acc_b = tl.associative_scan((a, b), 0, _combine)
        state = acc_a * carry[None, :] + acc_b
        tl.store(carry_ptr + dst.to(tl.int64)[:, None] * n_cols + col[None, :], state, mask=ok)
        carry = tl.sum(tl.where(last, state, 0.0), 0)  # masked rows are identities
    if not REVERSE:
        tl.store(final_ptr + col, carry, mask=col_ok)


@_jit
def _fwd_replay(  # type: ignore[no-untyped-def]
    x_ptr,
    bs_ptr,
    off_ptr,
    alpha_ptr,
    wx_ptr,
    carry_ptr,
    y_ptr,
    s_ptr,
    n_steps,
    n_feat,
    n_cols,
    HAS_INIT: tl.constexpr,
    STORE_S: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
) -> None:
    # pieces of SUB steps in order, as in _fwd_chunk_summary, the state carried between them
    chunk = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    col_ok = col < n_cols
    feat = col % n_feat
    alpha = tl.load(alpha_ptr + feat, mask=col_ok, other=0.0)
    wx = tl.load(wx_ptr + feat, mask=col_ok, other=0.0)
    state = tl.load(carry_ptr + chunk.to(tl.int64) * n_cols + col, mask=col_ok, other=0.0)
    last = (tl.arange(0, SUB) == SUB - 1)[:, None]
    for piece in range(CHUNK // SUB):
        t = chunk * CHUNK + piece * SUB + tl.arange(0, SUB)
        x, active, addr = _load_tile(x_ptr, bs_ptr, off_ptr, t, col, n_steps, n_feat)
        a, b = _step_maps(x.to(alpha.dtype), active, alpha, t, HAS_INIT)
        acc_a, acc_b = tl.associative_scan((a, b), 0, _combine)
        s = acc_a * state[None, :] + acc_b
        tl.store(y_ptr + addr, _tanh(wx[None, :] * s), mask=active)
        if STORE_S:  # for the backward pass
            tl.store(s_ptr + addr, s, mask=active)
        state = tl.sum(tl.where(last, s, 0.0), 0)  # past a sequence's end: carried unchanged


# ---------------------------------------------------------------------------------------------
# host code


_MIN_PROGRAMS = 1024  # about 8 per SM on an H200 (132 SMs)
SCANS = ("chunked", "chained", "lookback")
# "chunked" is the one design measured on a GPU (docs/BENCHMARKS.md); the single-pass scans
# serve only when asked for, since a default has to be one that was measured
DEFAULT_SCAN = "chunked"
_CARRY_TILE = 8192  # chunk summaries per trip of the carry scan, × columns


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class TilePlan:
    """Tile sizes for one packed batch: ``CHUNK`` steps × ``BLOCK`` flattened columns per
    program, scanned ``SUB`` steps at a time in the forward kernels (``sub == chunk``: the whole
    tile in one tree scan), and ``CARRY`` chunks per trip of the carry scan (over
    ``carry_block`` columns). ``scan``: the forward's design, "chunked" (three launches, parallel
    in time) or "chained" (one launch, one program per column block walking its tiles in order;
    ``carry`` and ``sub`` unused) or "lookback" (one launch, a tile a program as in "chunked",
    each tile's carry-in found by decoupled look-back; ``sub`` is the chunk, ``carry`` unused);
    the backward pass is chunked whatever the forward's design."""

    n_steps: int
    n_seqs: int
    n_feat: int
    chunk: int
    block: int
    carry: int
    carry_block: int
    sub: int
    scan: str = "chunked"

    @property
    def n_cols(self) -> int:
        return self.n_seqs * self.n_feat

    @property
    def n_chunks(self) -> int:
        return triton.cdiv(self.n_steps, self.chunk)  # type: ignore[no-any-return]

    @property
    def grid(self) -> tuple[int, int]:
        return (self.n_chunks, triton.cdiv(self.n_cols, self.block))

    @property
    def chained_grid(self) -> tuple[int]:
        return (triton.cdiv(self.n_cols, self.block),)

    @property
    def n_tiles(self) -> int:
        return self.n_chunks * triton.cdiv(self.n_cols, self.block)  # type: ignore[no-any-return]

    @property
    def carry_grid(self) -> tuple[int]:
        return (triton.cdiv(self.n_cols, self.carry_block),)

    @property
    def warps(self) -> int:
        # 16 elements per thread at 4096 (the scans keep several live values per element)
        return min(8, max(2, self.chunk * self.block // 512))

    @property
    def forward_warps(self) -> int:
        # the forward kernels hold one [SUB, BLOCK] piece at a time
        if self.sub == self.chunk:
            return self.warps
        return min(8, max(1, self.sub * self.block // 512))

    @property
    def carry_warps(self) -> int:
        return 8 if self.carry * self.carry_block > 4096 else 4


def plan_tiles(
    n_steps: int,
    n_seqs: int,
    n_feat: int,
    *,
    chunk: int | None = None,
    block: int | None = None,
    carry: int | None = None,
    sub: int | None = None,
    scan: str | None = None,
) -> TilePlan:
    """Pick tile sizes (powers of two); explicit sizes are for tests.

    At most 4096 elements per tile (16 KiB of fp32, 16 per thread at 8 warps). Chunked: columns
    first, up to 128 (512 contiguous bytes per step at F = 16); then the chunk is shortened, down
    to 32 steps, until the grid has about ``_MIN_PROGRAMS`` programs: a wide batch gets many
    column blocks, a single long sequence many time chunks, and either fills the GPU. Chained
    (``scan="chained"``; :data:`DEFAULT_SCAN` when None): parallel across columns only, so the
    narrowest block that holds a step of one sequence (16 columns at F <= 16: one program per
    sequence), and the longest chunk that fits, for the fewest trips. Look-back: the chunked
    scan's tiles, each scanned whole (no ``sub``).
    """
    # the default read here, not cached: tests and benchmarks switch it
    return _planned(n_steps, n_seqs, n_feat, chunk, block, carry, sub, scan or DEFAULT_SCAN)


@functools.lru_cache(maxsize=4096)
def _planned(
    n_steps: int,
    n_seqs: int,
    n_feat: int,
    chunk: int | None,
    block: int | None,
    carry: int | None,
    sub: int | None,
    scan: str,
) -> TilePlan:
    # plan_tiles's work, once per batch shape: a served batch's plan costs a dictionary look-up
    # (TilePlan is frozen, so one instance can serve every call of its shape)
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {', '.join(SCANS)}, got {scan!r}")
    n_cols = n_seqs * n_feat
    if scan == "chained":
        block = block or min(128, max(16, _pow2(n_feat)))
        chunk = chunk or min(256, max(16, 4096 // block), max(16, _pow2(n_steps)))
    block = block or min(128, max(16, _pow2(n_cols)))
    if chunk is None:
        chunk = min(256, max(16, 4096 // block), max(16, _pow2(n_steps)))
        col_blocks = triton.cdiv(n_cols, block)
        while chunk > 32 and triton.cdiv(n_steps, chunk) * col_blocks < _MIN_PROGRAMS:
            chunk //= 2
    carry_block = min(block, 32)
    # one carry tile per block width, whatever the number of chunks: a trip over fewer chunks
    # only masks the rest (one program per carry_block columns, microseconds), and a plan that
    # depended on it would be one more kernel variant to compile
    carry = carry or _CARRY_TILE // carry_block
    sub = sub or chunk
    for name, v in (("chunk", chunk), ("block", block), ("carry", carry), ("sub", sub)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if sub > chunk:
        raise ValueError(f"sub ({sub}) must not exceed chunk ({chunk})")
    if scan == "lookback" and sub != chunk:
        raise ValueError("the look-back scan scans each chunk whole: sub must be the chunk")
    return TilePlan(n_steps, n_seqs, n_feat, chunk, block, carry, carry_block, sub, scan)


def tile_plans(n_feat: int, max_steps: int, scan: str | None = None) -> list[tuple[int, int, int]]:
    """Every ``(chunk, block, carry)`` that :func:`plan_tiles` picks for ``n_feat`` features,
    any number of sequences and 1 to ``max_steps`` steps: the variants to compile in advance.

    Chained (``scan``; :data:`DEFAULT_SCAN` when None): the block depends only on ``n_feat`` and
    the chunk grows with the steps up to its cap, a power of two at a time.

    ``block`` depends only on the number of columns (128 from 128 columns on, so 1 to 128
    sequences meet every block), ``carry`` only on ``block``, and for a given number of columns
    ``chunk`` never falls as the steps grow (a longer batch needs fewer, longer chunks to fill
    the GPU) and moves a power of two at a time, so the plans met are every power of two
    between the chunks of a one-step batch and of a ``max_steps`` one.
    Several column counts give each block; the ones that matter are the fewest and the most
    columns with it (the fill loop stops sooner with more column blocks). Past 128 sequences
    the block is 128, whose chunk is at most 32 and never shortened, whatever the columns.
    """
    if (scan or DEFAULT_SCAN) == "chained":
        shortest, longest = (plan_tiles(n, 1, n_feat, scan="chained") for n in (1, max_steps))
        powers = range(shortest.chunk.bit_length() - 1, longest.chunk.bit_length())
        return [(1 << k, shortest.block, shortest.carry) for k in powers]
    extremes: dict[int, list[int]] = {}  # block -> [fewest, most] sequences giving it
    for n_seqs in range(1, 129):
        block = plan_tiles(1, n_seqs, n_feat).block
        extremes.setdefault(block, [n_seqs, n_seqs])[1] = n_seqs
    plans = set()
    for block, seqs in extremes.items():
        chunks = [plan_tiles(n, b, n_feat).chunk for b in seqs for n in (1, max_steps)]
        carry = _CARRY_TILE // min(block, 32)
        chunk = min(chunks)
        while chunk <= max(chunks):
            plans.add((chunk, block, carry))
            chunk *= 2
    return sorted(plans, key=lambda p: (p[1], p[0]))


@torch.inference_mode()
def warm_up(
    n_feat: int,
    max_steps: int,
    alpha: Tensor,
    wx: Tensor,
    *,
    device: torch.device | str = "cuda",
    dtype: torch.dtype = torch.float32,
) -> int:
    """Compile every kernel variant a served batch can need (see :func:`tile_plans`) now.

    Each plan runs once on a one-sequence, one-step batch, as serving runs it (no initial state,
    no gradient): the integer arguments are not specialised on, so that batch compiles the same
    binaries as any other of the plan. Returns the number of plans run. Triton keeps what it
    compiles in its cache on disk, so a restart compiles nothing.
    """
    data = torch.zeros(1, n_feat, dtype=dtype, device=device)
    sizes = torch.ones(1, dtype=torch.int64)
    alpha = alpha.detach().to(device=data.device, dtype=dtype)
    wx = wx.detach().to(device=data.device, dtype=dtype)
    plans = tile_plans(n_feat, max_steps)  # of the default scan, which serving runs
    for chunk, block, carry in plans:
        smooth_packed_triton(data, sizes, alpha, wx, None, chunk=chunk, block=block, carry=carry)
    return len(plans)


def _interpreting() -> bool:
    return triton_interpreting()


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Triton specialises every pointer argument on its address being a multiple of 16 bytes: one
# binary for aligned pointers, another for the rest. Every tensor handed to a kernel here starts
# on such a boundary, whatever the batch, so that a batch never meets a binary warm-up did not
# compile (a view into the middle of a buffer is aligned only for some batch sizes).
_ALIGN = 16


def _aligned(t: Tensor) -> Tensor:
    """``t``, contiguous and at a 16-byte boundary: itself when it is, else a copy."""
    if t.is_contiguous() and t.data_ptr() % _ALIGN == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def device_schedule(
    batch_sizes: Tensor, plan: TilePlan, device: torch.device
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The kernels' int64 schedule on ``device``: the step sizes, the row offsets (exclusive
    cumsum) and, for the chained scan, each sorted sequence's length (else None).

    One host-to-device copy for all three. Each part is padded to whole 16-byte units, so each
    starts aligned: packed end to end, the offsets of a batch with an odd number of steps would
    not be, and every batch of the other parity would compile its own kernels.
    """
    sizes = batch_sizes.to(device="cpu", dtype=torch.int64)
    n_steps = sizes.numel()
    n_seqs = int(sizes[0]) if plan.scan == "chained" else 0
    # parts laid end to end in one zeroed buffer, each from a whole 16-byte unit: written in
    # place (no per-part tensors or concatenation), copied in one go
    starts = [0, _padded(n_steps, sizes)]
    starts.append(2 * starts[1])
    meta = torch.zeros(starts[2] + _padded(n_seqs, sizes), dtype=torch.int64)
    meta[:n_steps] = sizes
    torch.cumsum(sizes[:-1], 0, out=meta[starts[1] + 1 : starts[1] + n_steps])  # exclusive
    if plan.scan == "chained":
        meta[starts[2] : starts[2] + n_seqs] = sequence_lengths(sizes)
    meta = meta.to(device, non_blocking=True)
    bs, off = meta[:n_steps], meta[starts[1] : starts[1] + n_steps]
    return bs, off, meta[starts[2] : starts[2] + n_seqs] if plan.scan == "chained" else None


def _padded(count: int, like: Tensor) -> int:
    """``count`` elements of ``like``'s dtype rounded up to whole 16-byte units."""
    per_unit = _ALIGN // like.element_size()
    return count + (-count % per_unit)


@dataclass(frozen=True, eq=False)
class ForwardBuffers:
    """Every device tensor one forward reads or writes, allocated in advance: what
    :func:`launch_forward` runs on.

    ``x`` [N, F] packed rows; ``bs``, ``off`` (and ``lens``, chained only): the schedule of
    :func:`device_schedule`; ``alpha``, ``wx`` [F] in the compute dtype; ``init`` [B, F] or
    None; outputs ``y`` [N, F], ``final`` [B, F] and, with ``store_s``, the states ``s`` (else
    ``s`` is ``y``, an unused pointer); ``scratch``: the design's own arrays (chunked: the carry
    and the two chunk-summary arrays; look-back: its side arrays and flags; chained: none).
    Filling ``x`` (and ``init``) in place and launching again computes the new batch of the same
    schedule: a benchmark captures :func:`launch_forward` on a set of these in a CUDA graph.
    """

    plan: TilePlan
    x: Tensor
    bs: Tensor
    off: Tensor
    lens: Tensor | None
    alpha: Tensor
    wx: Tensor
    init: Tensor | None
    y: Tensor
    s: Tensor
    final: Tensor
    scratch: tuple[Tensor, ...]
    store_s: bool


def _operands(
    data: Tensor, alpha: Tensor, wx: Tensor, init: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The kernels' inputs: aligned, contiguous, the parameters in the compute dtype."""
    cdt = _compute_dtype(data.dtype)
    x = _aligned(data)
    alpha_c = _aligned(alpha.detach().to(device=x.device, dtype=cdt))
    wx_c = _aligned(wx.detach().to(device=x.device, dtype=cdt))
    init_c = None if init is None else _aligned(init.detach())
    return x, alpha_c, wx_c, init_c


def forward_buffers(
    plan: TilePlan,
    x: Tensor,
    bs: Tensor,
    off: Tensor,
    lens: Tensor | None,
    alpha_c: Tensor,
    wx_c: Tensor,
    init_c: Tensor | None,
    *,
    store_s: bool,
) -> ForwardBuffers:
    """Allocate the outputs and the scratch of ``plan``'s design around the given inputs."""
    if plan.scan == "chained" and lens is None:
        raise ValueError("the chained scan needs each sequence's length (device_schedule)")
    cdt, dev = alpha_c.dtype, x.device
    y = torch.empty_like(x)
    s = torch.empty(x.shape, dtype=cdt, device=dev) if store_s else y
    final = torch.empty((plan.n_seqs, plan.n_feat), dtype=x.dtype, device=dev)
    scratch: tuple[Tensor, ...] = ()
    if plan.scan == "chunked":
        # the carry and the two chunk-summary arrays: views of one allocation, each from a
        # 16-byte boundary (so every batch meets the binaries warm-up compiled)
        shapes = ((plan.n_chunks + 1, plan.n_cols), *((plan.n_chunks, plan.n_cols),) * 2)
        sizes = [_padded(rows * cols, alpha_c) for rows, cols in shapes]
        flat = torch.empty(sum(sizes), dtype=cdt, device=dev)
        starts = [0, sizes[0], sizes[0] + sizes[1]]
        scratch = tuple(
            flat[start : start + rows * cols].view(rows, cols)
            for start, (rows, cols) in zip(starts, shapes, strict=True)
        )
    elif plan.scan == "lookback":
        from rnnserve.models.kernels.smoother_triton_single_pass import lookback_scratch

        scratch = lookback_scratch(plan, cdt, dev)
    return ForwardBuffers(
        plan, x, bs, off, lens, alpha_c, wx_c, init_c, y, s, final, scratch, store_s
    )


def prepare_forward(
    data: Tensor,
    batch_sizes: Tensor,
    alpha: Tensor,
    wx: Tensor,
    init: Tensor | None = None,
    *,
    store_s: bool = False,
    chunk: int | None = None,
    block: int | None = None,
    carry: int | None = None,
    sub: int | None = None,
    scan: str | None = None,
) -> ForwardBuffers:
    """Everything :func:`launch_forward` needs for this batch, on ``data``'s device, as
    :func:`smooth_packed_triton` prepares it (same arguments; a non-empty batch). Allocates and
    copies the schedule to the device: call it before a capture, not inside one."""
    sizes = batch_sizes.to(device="cpu", dtype=torch.int64)
    n_seqs, n_feat = _check_batch(data, sizes, init)
    if data.shape[0] == 0 or n_feat == 0:
        raise ValueError("an empty batch launches no kernel")
    plan = plan_tiles(
        sizes.numel(), n_seqs, n_feat, chunk=chunk, block=block, carry=carry, sub=sub, scan=scan
    )
    bs, off, lens = device_schedule(sizes, plan, data.device)
    x, alpha_c, wx_c, init_c = _operands(data, alpha, wx, init)
    return forward_buffers(plan, x, bs, off, lens, alpha_c, wx_c, init_c, store_s=store_s)


def launch_forward(buf: ForwardBuffers) -> None:
    """Run the forward of ``buf.plan``'s design into ``buf.y``, ``buf.final`` (and ``buf.s``).

    Kernel launches on ``buf``'s tensors only: no allocation, no host tensor, no copy between
    host and device, no synchronisation, so it can be captured in a CUDA graph and replayed.
    """
    if buf.plan.scan == "chunked":
        launch_chunked(buf)
        return
    from rnnserve.models.kernels import smoother_triton_single_pass as single_pass

    if buf.plan.scan == "chained":
        single_pass.launch_chained(buf)
    else:
        single_pass.launch_lookback(buf)


def launch_chunked(buf: ForwardBuffers) -> None:
    """The three-launch forward (chunk summaries, carry scan, replay) on ``buf``; capturable
    (see :func:`launch_forward`)."""
    plan = buf.plan
    carry, sum_a, sum_b = buf.scratch
    has_init = buf.init is not None
    common = (plan.n_steps, plan.n_feat, plan.n_cols)
    _fwd_chunk_summary[plan.grid](
        buf.x,
        buf.bs,
        buf.off,
        buf.alpha,
        sum_a,
        sum_b,
        *common,
        HAS_INIT=has_init,
        CHUNK=plan.chunk,
        BLOCK=plan.block,
        SUB=plan.sub,
        num_warps=plan.forward_warps,
    )
    _carry_scan[plan.carry_grid](
        sum_a,
        sum_b,
        carry,
        carry if buf.init is None else buf.init,
        buf.final,
        plan.n_chunks,
        plan.n_cols,
        REVERSE=False,
        HAS_INIT=has_init,
        CARRY=plan.carry,
        BLOCK=plan.carry_block,
        num_warps=plan.carry_warps,
    )
    _fwd_replay[plan.grid](
        buf.x,
        buf.bs,
        buf.off,
        buf.alpha,
        buf.wx,
        carry,
        buf.y,
        buf.s,
        *common,
        HAS_INIT=has_init,
        STORE_S=buf.store_s,
        CHUNK=plan.chunk,
        BLOCK=plan.block,
        SUB=plan.sub,
        num_warps=plan.forward_warps,
    )


class _SmootherFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        data: Tensor,
        alpha: Tensor,
        wx: Tensor,
        init: Tensor | None,
        bs: Tensor,
        off: Tensor,
        lens: Tensor | None,
        plan: TilePlan,
        grad_enabled: bool,
    ) -> tuple[Tensor, Tensor]:
        x, alpha_c, wx_c, init_c = _operands(data, alpha, wx, init)
        # needs_input_grad is set by requires_grad alone, under no_grad and inference_mode too
        needs_grad = grad_enabled and any(ctx.needs_input_grad[:4])
        # s is kept for the backward pass only
        buf = forward_buffers(plan, x, bs, off, lens, alpha_c, wx_c, init_c, store_s=needs_grad)
        launch_forward(buf)
        # the initial state is s_{-1} for the alpha gradient (y stands in when there is none)
        ctx.save_for_backward(x, buf.s, buf.y if init_c is None else init_c, alpha_c, wx_c, bs, off)
        ctx.plan = plan
        ctx.has_init = init is not None
        ctx.dtypes = (data.dtype, alpha.dtype, wx.dtype, None if init is None else init.dtype)
        ctx.set_materialize_grads(False)
        return buf.y, buf.final

    @staticmethod
    def backward(
        ctx: Any, grad_y: Tensor | None, grad_final: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        # serving never takes a gradient: the backward's kernels load when training first does
        from rnnserve.models.kernels.smoother_triton_backward import smoother_backward

        return smoother_backward(ctx, grad_y, grad_final)


def sequence_lengths(batch_sizes: Tensor) -> Tensor:
    """Each sorted sequence's length from a PackedSequence's (non-increasing) step sizes: the
    number of steps with more sequences than its index (O(B log T), no [B, T] comparison)."""
    sizes = batch_sizes.to(device="cpu", dtype=torch.int64)
    n_seqs = int(sizes[0]) if sizes.numel() else 0
    below = torch.arange(n_seqs, dtype=torch.int64)
    return sizes.numel() - torch.searchsorted(sizes.flip(0), below, right=True)


def _check_batch(data: Tensor, batch_sizes: Tensor, init: Tensor | None) -> tuple[int, int]:
    """``(sequences, features)`` of a batch the kernels can take; refuses the others."""
    if data.device.type == "cpu" and not _interpreting():
        raise RuntimeError(
            "the triton smoother needs CUDA tensors (or TRITON_INTERPRET=1 to test on the CPU)"
        )
    if data.dim() != 2:
        raise ValueError(f"expected packed data [N, F], got {list(data.shape)}")
    n_feat = data.shape[1]
    n_seqs = int(batch_sizes[0]) if batch_sizes.numel() else 0
    if init is not None and tuple(init.shape) != (n_seqs, n_feat):
        raise ValueError(f"expected a state of shape [{n_seqs}, {n_feat}], got {list(init.shape)}")
    return n_seqs, n_feat


def smooth_packed_triton(
    data: Tensor,
    batch_sizes: Tensor,
    alpha: Tensor,
    wx: Tensor,
    init: Tensor | None = None,
    *,
    chunk: int | None = None,
    block: int | None = None,
    carry: int | None = None,
    sub: int | None = None,
    scan: str | None = None,
) -> tuple[Tensor, Tensor]:
    """``y = tanh(wx * s)`` over packed rows, and each sequence's final state ``s``.

    ``data``: [N, F] packed rows (CUDA, or CPU under ``TRITON_INTERPRET=1``); ``batch_sizes``:
    the PackedSequence's (CPU) step sizes; ``init``: [B, F] state before step 0 in *sorted*
    order, or None for ``s_0 = x_0``. Returns ``y`` [N, F] and the final state [B, F] (sorted
    order). Differentiable in ``data``, ``alpha``, ``wx`` and ``init``. ``chunk``, ``block``,
    ``carry`` and ``sub`` override :func:`plan_tiles`'s tiles (tests, benchmarks); ``sub`` below
    ``chunk`` scans each chunk ``sub`` steps at a time in the forward kernels (``sub=1``: a loop
    over the steps), the variant to measure against one tree scan per tile. ``scan`` picks the
    forward's design (see :class:`TilePlan`; :data:`DEFAULT_SCAN` when None). The kernels run
    through :func:`launch_forward`, on buffers this call allocates.
    """
    sizes = batch_sizes.to(device="cpu", dtype=torch.int64)
    n_seqs, n_feat = _check_batch(data, sizes, init)
    if data.shape[0] == 0 or n_feat == 0:
        return torch.tanh(wx * data), data.new_zeros((n_seqs, n_feat))
    plan = plan_tiles(
        sizes.numel(), n_seqs, n_feat, chunk=chunk, block=block, carry=carry, sub=sub, scan=scan
    )
    bs, off, lens = device_schedule(sizes, plan, data.device)
    if torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (data, alpha, wx, init)
    ):
        y, final = _SmootherFn.apply(data, alpha, wx, init, bs, off, lens, plan, True)
        return y, final
    # nothing to differentiate (serving): the launches without autograd's bookkeeping
    x, alpha_c, wx_c, init_c = _operands(data, alpha, wx, init)
    buf = forward_buffers(plan, x, bs, off, lens, alpha_c, wx_c, init_c, store_s=False)
    launch_forward(buf)
    return buf.y, buf.final
