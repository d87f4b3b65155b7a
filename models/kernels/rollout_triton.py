"""The Traveller's rollout as fused Triton step kernels, replayed as CUDA graphs.

Same contract as :func:`rnnserve.models.traveller.rollout_packed` (weight layout, packed time-major
rows, resumable state); see :func:`rollout_packed_triton`.

Kernels. One launch per layer per step. A program owns ``BLOCK_B`` batch rows x ``BLOCK_H``
hidden units: it forms the four gate pre-activations of its units from the whole input row
as one ``[BLOCK_B, 4 x BLOCK_H]`` product (``tl.dot`` over K tiles, or for batches under 16 rows
broadcast-and-sum with one reduction per input of the layer), splits it into the gates once,
applies the LSTM cell and writes its slice of ``h`` and ``c``. Layer 0 also takes the input
projection of ``u_t`` (K = num_inputs more, so no ``[N, 4H]`` projection is materialised) and
recomputes the fed-back position ``p_{t-1} = tanh(h_top @ w_out + b_out)`` from the previous
step's top layer in every program: a ``[rows, H] x [H, 2]`` product, cheaper than a
cross-program dependency. The programs of hidden block 0 write that ``p_{t-1}`` to the output
and to the state, so a last, "virtual" step ``T`` (no active rows) produces ``p_{T-1}``: a
rollout of T steps runs T + 1.

Dependency wait. What no step kernel writes (schedule, step counter, weights, biases, ``u_t``)
is read before the programmatic-dependent-launch wait, so that with ``pdl=True`` it overlaps the
launch before: on the broadcast path the program's whole weight slice (held in registers, each
K axis whole, padded to a power of two) and ``u_t``'s projection; on the ``tl.dot`` path, whose
weights are streamed in K tiles, the schedule and biases only.

State. ``h`` is double-buffered (step t reads plane ``t % 2`` and writes ``(t + 1) % 2``; every
program reads whole rows, so writing in place would race); ``c`` and ``p`` are owned by one
program per element and updated in place. A finished sequence is simply not written again, so
its final ``h`` is in the plane of its length's parity and is picked out at the end.

Step numbers live on the device. Each launch reads ``t = base[0] + k`` (``k`` a plain argument)
and ``batch_sizes[t]`` / row offsets from device arrays, so the same launches serve any batch
sizes; one tiny kernel adds ``n`` to ``base`` after a chunk of ``n`` steps. On CUDA a chunk of
``n`` steps (n a power of two up to ``max_chunk``) is captured once as a CUDA graph per shape
bucket (rows rounded up to a power of two, layers, hidden, inputs, dtype, device) and replayed;
T + 1 steps run as full chunks plus the binary digits of the rest. Everything the graphs touch
(weights, inputs, outputs, schedule, state) lives in that bucket's workspace, copied in and out
per call. On the CPU (``TRITON_INTERPRET=1``) the same launches run without capture.

Options to measure on the GPU (:class:`TritonRollout`): ``precision="tf32x3"`` (tensor cores in
three TF32 passes, for large batches) and ``pdl=True`` (programmatic dependent launch, so each
step kernel is scheduled while the one before finishes; aimed at B = 1, where launches dominate).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.language.extra import cuda as tl_cuda

from rnnserve.models.kernels import triton_interpreting

__all__ = [
    "KernelConfig",
    "TritonRollout",
    "bucket_rows",
    "check_device",
    "kernel_config",
    "rollout_op",
    "rollout_packed_triton",
    "warm_up",
]

# ---------------------------------------------------------------------------------------------
# kernels


def _jit(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``triton.jit`` (untyped) behind a typed signature."""

    def wrap(fn: Callable[..., Any]) -> Any:
        return triton.jit(fn, **options)

    return wrap


@_jit()
def _sigmoid(x):  # type: ignore[no-untyped-def]
    e = tl.exp(-tl.abs(x))  # never overflows
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@_jit()
def _tanh(x):  # type: ignore[no-untyped-def]
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@_jit()
def _gates(  # type: ignore[no-untyped-def]
    acc,  # [BB, 4 * BH]: the four gates of the program's units, gate-major
    x_ptr,  # [rows, K] row-major, K == the row stride
    rows,
    row_ok,
    w_ptr,  # [*, 4H]; rows W_ROW0 .. W_ROW0 + K multiply x
    col4,  # [4 * BH]: the columns of w (see _gate_columns)
    col4_ok,
    K: tl.constexpr,
    W_ROW0: tl.constexpr,
    H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The tl.dot path: acc [BB, 4BH] += x [BB, K] @ w [K, 4BH], streamed in K tiles."""
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        x = tl.load(
            x_ptr + rows[:, None] * K + kk[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = _gate_weights(w_ptr, W_ROW0 + kk, k_ok, col4, col4_ok, H)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    return acc


@_jit()
def _gate_columns(pid_h, H: tl.constexpr, BLOCK_H: tl.constexpr):  # type: ignore[no-untyped-def]
    """The program's ``4 * BLOCK_H`` columns of a ``[*, 4H]`` gate matrix, gate-major (i, f,
    g, o, each over the program's units), and each column's unit."""
    j = tl.arange(0, 4 * BLOCK_H)
    unit = pid_h * BLOCK_H + j % BLOCK_H
    return (j // BLOCK_H) * H + unit, unit


@_jit()
def _gate_weights(w_ptr, k_row, k_ok, col4, col4_ok, H: tl.constexpr):  # type: ignore[no-untyped-def]
    """Rows ``k_row`` of a ``[*, 4H]`` matrix at the program's gate columns: ``[K, 4BH]``."""
    return tl.load(
        w_ptr + k_row[:, None] * (4 * H) + col4[None, :],
        mask=k_ok[:, None] & col4_ok[None, :],
        other=0.0,
    )


@_jit()
def _gemv(x, w):  # type: ignore[no-untyped-def]
    """Broadcast-and-sum (rows under 16, where tl.dot would pad M to 16): x [BB, K] @ w [K, 4BH]
    as one reduction for all four gates."""
    return tl.sum(x[:, :, None] * w[None, :, :], axis=1)


@_jit()
def _split_gates(acc, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr):  # type: ignore[no-untyped-def]
    """``[BB, 4BH]`` gate-major -> the four gates' ``[BB, BH]``."""
    by_gate = tl.reshape(acc, [BLOCK_B, 4, BLOCK_H])
    gate = tl.arange(0, 4)[None, :, None]
    acc_i = tl.sum(tl.where(gate == 0, by_gate, 0.0), axis=1)
    acc_f = tl.sum(tl.where(gate == 1, by_gate, 0.0), axis=1)
    acc_g = tl.sum(tl.where(gate == 2, by_gate, 0.0), axis=1)
    acc_o = tl.sum(tl.where(gate == 3, by_gate, 0.0), axis=1)
    return acc_i, acc_f, acc_g, acc_o


@_jit(do_not_specialize=["k", "layer"])
def _layer_step_kernel(  # type: ignore[no-untyped-def]
    h_ptr,  # [2, L, R, H]: plane t % 2 holds h after step t - 1
    c_ptr,  # [L, R, H]
    p_ptr,  # [R, 2]: the last position of each row
    out_ptr,  # [N, 2] packed positions
    u_ptr,  # [N, NI] packed inputs
    w_ptr,  # this layer's [K_l, 4H]: layer 0 rows (p, h_0, u), others (h_{l-1}, h_l)
    b_ptr,  # this layer's [4H]
    wo_ptr,  # [H, 2]
    bo_ptr,  # [2]
    bs_ptr,  # int32 [steps]: active rows per step, 0 at step T
    off_ptr,  # int32 [steps]: first packed row of each step
    base_ptr,  # int32 [1]: the step number of k = 0
    k,  # step within the chunk
    layer,
    R,  # rows of the state buffers
    H: tl.constexpr,
    NI: tl.constexpr,
    L: tl.constexpr,
    FIRST: tl.constexpr,
    BLOCK_B: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    H_PAD: tl.constexpr,  # H rounded up to a power of two
    NI_PAD: tl.constexpr,  # NI rounded up to a power of two
    USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    # Before the dependency wait: what no step kernel writes (the schedule, step counter,
    # weights, biases, this step's u_t) and what follows from it alone (u_t's projection), so
    # that with PDL it overlaps the launch before. The launch that follows the step counter's
    # advance is not a dependent launch (see TritonRollout._launch), so base is settled here.
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    t = tl.load(base_ptr) + k
    n_act = tl.load(bs_ptr + t)  # rows that take step t
    if FIRST:
        n_prev = tl.load(bs_ptr + t - 1, mask=t > 0, other=0)  # rows that took step t - 1
        n_live = tl.maximum(n_act, n_prev)
    else:
        n_prev = n_act
        n_live = n_act
    row0 = pid_b * BLOCK_B
    # a program with no live rows loads nothing, and returns after the wait (as a bound, not a
    # scalar flag: the interpreter refuses a scalar bool combined into a mask)
    h_live = tl.where(row0 < n_live, H, 0)

    rows = row0 + tl.arange(0, BLOCK_B)
    act = rows < n_act
    col4, unit = _gate_columns(pid_h, H, BLOCK_H)
    w_col = unit < h_live
    kh = tl.arange(0, H_PAD)
    kh_ok = kh < H

    # the four gates side by side, [BB, 4BH]: one product (one reduction, or one tl.dot per K
    # tile) per input of the layer, split into gates once at the end
    dtype = h_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_B, 4 * BLOCK_H], dtype=dtype)
    acc += tl.load(b_ptr + col4, mask=w_col, other=0.0)[None, :]
    if FIRST:
        # layer 0's rows: 0 and 1 the fed-back position, 2 .. 2 + H h_0, then NI rows of u_t
        u_t = u_ptr + tl.load(off_ptr + t) * NI
        # u_t's projection is formed here on the broadcast path only: on the tl.dot path its
        # MMA accumulator, held across the wait and the K loops, took twice the registers
        if NI > 0 and not USE_DOT:
            ku = tl.arange(0, NI_PAD)
            ku_ok = ku < NI
            x_u = tl.load(
                u_t + rows[:, None] * NI + ku[None, :],
                mask=act[:, None] & ku_ok[None, :],
                other=0.0,
            )
            acc += _gemv(x_u, _gate_weights(w_ptr, 2 + H + ku, ku_ok, col4, w_col, H))
        if not USE_DOT:  # held in registers; the tl.dot path's weights are streamed in K tiles
            w_h = _gate_weights(w_ptr, 2 + kh, kh_ok, col4, w_col, H)
            wp0 = tl.load(w_ptr + col4, mask=w_col, other=0.0)[None, :]
            wp1 = tl.load(w_ptr + 4 * H + col4, mask=w_col, other=0.0)[None, :]
            # the output layer, for p_{t-1} = tanh(h_top @ w_out + b_out)
            wo_ok = kh < h_live
            wo0 = tl.load(wo_ptr + kh * 2, mask=wo_ok, other=0.0)
            wo1 = tl.load(wo_ptr + kh * 2 + 1, mask=wo_ok, other=0.0)
        bo0 = tl.load(bo_ptr)
        bo1 = tl.load(bo_ptr + 1)
        o_prev = tl.load(off_ptr + t - 1, mask=t > 0, other=0)
    elif not USE_DOT:
        # rows 0 .. H: the layer below after step t; rows H .. 2H: this layer after step t - 1;
        # one [2 * H_PAD] K axis, the second half's rows shifted down by H_PAD - H
        k2 = tl.arange(0, 2 * H_PAD)
        lower = k2 < H_PAD
        k_in = tl.where(lower, k2, k2 - H_PAD)
        k2_ok = k_in < H
        w_x = _gate_weights(w_ptr, tl.where(lower, k_in, H + k_in), k2_ok, col4, w_col, H)

    if PDL:  # launched early (programmatic dependent launch): wait for the launch before,
        # then let the next one be scheduled. Every program waits before its first state load
        # and before it may return, so no launch completes before the one it follows.
        tl_cuda.gdc_wait()
        tl_cuda.gdc_launch_dependents()
    if row0 >= n_live:
        return

    par = t % 2
    plane = R * H  # one layer's [R, H]
    at_old = (par * L + layer) * plane  # this layer after step t - 1
    h_old = h_ptr + at_old
    h_new = h_ptr + ((1 - par) * L + layer) * plane  # this layer after step t
    col_ok = unit < H

    if FIRST:
        # p_{t-1} from the top layer after step t - 1
        prev = rows < n_prev
        top = h_ptr + (par * L + (L - 1)) * plane
        if USE_DOT:  # in K tiles, as its weights are streamed there too
            s0 = tl.zeros([BLOCK_B], dtype=dtype)
            s1 = tl.zeros([BLOCK_B], dtype=dtype)
            for k0 in range(0, H, BLOCK_K):
                kk = k0 + tl.arange(0, BLOCK_K)
                k_ok = kk < H
                x = tl.load(
                    top + rows[:, None] * H + kk[None, :],
                    mask=prev[:, None] & k_ok[None, :],
                    other=0.0,
                )
                s0 += tl.sum(x * tl.load(wo_ptr + kk * 2, mask=k_ok, other=0.0)[None, :], 1)
                s1 += tl.sum(x * tl.load(wo_ptr + kk * 2 + 1, mask=k_ok, other=0.0)[None, :], 1)
        else:
            x_top = tl.load(
                top + rows[:, None] * H + kh[None, :],
                mask=prev[:, None] & kh_ok[None, :],
                other=0.0,
            )
            s0 = tl.sum(x_top * wo0[None, :], axis=1)
            s1 = tl.sum(x_top * wo1[None, :], axis=1)
        q0 = _tanh(s0 + bo0)
        q1 = _tanh(s1 + bo1)
        if pid_h == 0:  # one program per row writes p_{t-1}: output of step t - 1, and state
            tl.store(out_ptr + (o_prev + rows) * 2, q0, mask=prev)
            tl.store(out_ptr + (o_prev + rows) * 2 + 1, q1, mask=prev)
            tl.store(p_ptr + rows * 2, q0, mask=prev)
            tl.store(p_ptr + rows * 2 + 1, q1, mask=prev)
        # at t = 0 the fed-back position is the given one (read only then: no race with the
        # stores above, which happen only at t > 0)
        given = rows < tl.where(t == 0, n_act, 0)
        p0 = tl.where(t == 0, tl.load(p_ptr + rows * 2, mask=given, other=0.0), q0)[:, None]
        p1 = tl.where(t == 0, tl.load(p_ptr + rows * 2 + 1, mask=given, other=0.0), q1)[:, None]
        if USE_DOT:
            acc = _gates(acc, h_old, rows, act, w_ptr, col4, col_ok, H, 2, H, BLOCK_K, PRECISION)
            acc = _gates(acc, u_t, rows, act, w_ptr, col4, col_ok, NI, 2 + H, H, BLOCK_K, PRECISION)
            # loaded here: held across the K loops they would take ~128 registers
            wp0 = tl.load(w_ptr + col4, mask=col_ok, other=0.0)[None, :]
            wp1 = tl.load(w_ptr + 4 * H + col4, mask=col_ok, other=0.0)[None, :]
        else:
            x_h = tl.load(
                h_old + rows[:, None] * H + kh[None, :],
                mask=act[:, None] & kh_ok[None, :],
                other=0.0,
            )
            acc += _gemv(x_h, w_h)
        # rows 0 and 1 of w: a rank-2 update, last (on the tl.dot path an update between two
        # products would move the accumulator out of the MMA layout and back)
        acc += p0 * wp0 + p1 * wp1
    else:
        at_below = ((1 - par) * L + layer - 1) * plane  # the layer below after step t
        if USE_DOT:
            acc = _gates(
                acc, h_ptr + at_below, rows, act, w_ptr, col4, col_ok, H, 0, H, BLOCK_K, PRECISION
            )
            acc = _gates(acc, h_old, rows, act, w_ptr, col4, col_ok, H, H, H, BLOCK_K, PRECISION)
        else:
            plane_at = tl.where(lower, at_below, at_old)  # each K entry's layer plane
            x = tl.load(
                h_ptr + plane_at[None, :] + rows[:, None] * H + k_in[None, :],
                mask=act[:, None] & k2_ok[None, :],
                other=0.0,
            )
            acc += _gemv(x, w_x)

    acc_i, acc_f, acc_g, acc_o = _split_gates(acc, BLOCK_B, BLOCK_H)
    cols = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = act[:, None] & (cols < H)[None, :]
    at = rows[:, None] * H + cols[None, :]
    c_at = c_ptr + layer * plane + at
    c = _sigmoid(acc_f) * tl.load(c_at, mask=ok, other=0.0) + _sigmoid(acc_i) * _tanh(acc_g)
    tl.store(c_at, c, mask=ok)
    tl.store(h_new + at, _sigmoid(acc_o) * _tanh(c), mask=ok)


# n: the steps of a chunk, 1 to max_chunk; specialised on, each value class (1, a multiple of
# 16, other) would be a binary of its own, and a rollout launched from Python (no graphs) would
# meet the ones its warm-up's single step did not compile while serving
@_jit(do_not_specialize=["n"])
def _advance_kernel(base_ptr, n):  # type: ignore[no-untyped-def]
    tl.store(base_ptr, tl.load(base_ptr) + n)


# ---------------------------------------------------------------------------------------------
# configuration


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of the step kernel (chosen by reasoning; tune on the GPU)."""

    block_b: int  # batch rows per program
    block_h: int  # hidden units per program (x 4 gates)
    block_k: int  # K tile of the tl.dot path (the broadcast path holds each K axis whole)
    use_dot: bool  # tl.dot (needs block_b, block_h, block_k >= 16) or broadcast-and-sum
    num_warps: int = 4


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def bucket_rows(batch: int) -> int:
    """State rows for a batch of ``batch`` sequences: the next power of two (one graph each)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    return _pow2(batch)


def kernel_config(rows: int, hidden: int, *, interpret: bool = False) -> KernelConfig:
    """Tiles for a bucket of ``rows`` state rows and ``hidden`` units.

    Under 16 rows tl.dot would pad M to 16, so small batches use broadcast-and-sum with narrow
    hidden blocks (more programs stream the weights: at B = 1 a step is bound by reading them).
    From 16 rows up, tl.dot with 16-32 row tiles and 16 hidden units (B = 512, H = 128: 128
    programs a layer on 132 SMs); from 1024 rows, 64-row tiles on 8 warps, which read each
    weight tile half as often as 32-row ones (B = 1024: 128 programs, one wave). ``interpret``:
    Triton's interpreter pays per operation, not per element, so there all hidden units go to
    one program (tests pick GPU tiles explicitly).
    """
    h_pow = _pow2(hidden)
    if rows < 16:
        block_h = min(max(h_pow, 8), 64) if interpret else min(8, max(h_pow, 8))
        block_k = max(16, min(128, 2048 // (rows * block_h)))  # not read by this path
        return KernelConfig(rows, block_h, block_k, use_dot=False)
    block_h = min(max(h_pow, 16), 64) if interpret else 16
    if rows >= 1024:  # at 4 warps a 64-row tile spills (255 registers)
        return KernelConfig(64, block_h, 32, use_dot=True, num_warps=8)
    block_b = 16 if rows <= 128 else 32
    return KernelConfig(block_b, block_h, 32, use_dot=True)


# ---------------------------------------------------------------------------------------------
# workspace: every buffer the launches (and so the CUDA graphs) point at


@dataclass(frozen=True)
class _Shape:
    rows: int  # R: state rows, a power of two
    layers: int
    hidden: int
    num_inputs: int
    dtype: torch.dtype
    device: torch.device


@dataclass(eq=False)
class _Workspace:
    shape: _Shape
    config: KernelConfig
    precision: str
    h: Tensor  # [2, L, R, H]
    c: Tensor  # [L, R, H]
    p: Tensor  # [R, 2]
    w: list[Tensor]  # per layer [K_l, 4H]
    b: list[Tensor]  # per layer [4H]
    w_out: Tensor  # [H, 2]
    b_out: Tensor  # [2]
    base: Tensor  # int32 [1]
    u: Tensor  # [row capacity, NI]
    out: Tensor  # [row capacity, 2]
    # int32 [2, step capacity]: batch sizes, row offsets. The capacity is a power of two of at
    # least 128, so the offsets' row starts on a 16-byte boundary, as Triton's aligned binary
    # of the step kernel (compiled once per bucket) assumes of every pointer
    sched: Tensor
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    # A workspace outlives the call that made it. Its tensors are made as normal tensors even
    # under torch.inference_mode (the server's warm-up), so that later calls outside it (a test,
    # torch.compile tracing the custom op) may still write into them; writing into a normal
    # tensor inside inference mode is allowed.
    @classmethod
    @torch.inference_mode(False)
    def create(cls, shape: _Shape, config: KernelConfig, precision: str) -> _Workspace:
        r, layers, hidden, ni = shape.rows, shape.layers, shape.hidden, shape.num_inputs
        dt, dev = shape.dtype, shape.device
        k_rows = [2 + hidden + ni] + [2 * hidden] * (layers - 1)
        return cls(
            shape,
            config,
            precision,
            h=torch.zeros(2, layers, r, hidden, dtype=dt, device=dev),
            c=torch.zeros(layers, r, hidden, dtype=dt, device=dev),
            p=torch.zeros(r, 2, dtype=dt, device=dev),
            w=[torch.zeros(k, 4 * hidden, dtype=dt, device=dev) for k in k_rows],
            b=[torch.zeros(4 * hidden, dtype=dt, device=dev) for _ in range(layers)],
            w_out=torch.zeros(hidden, 2, dtype=dt, device=dev),
            b_out=torch.zeros(2, dtype=dt, device=dev),
            base=torch.zeros(1, dtype=torch.int32, device=shape.device),
            u=torch.zeros(r * 64, ni, dtype=dt, device=dev),
            out=torch.zeros(r * 64, 2, dtype=dt, device=dev),
            sched=torch.zeros(2, 128, dtype=torch.int32, device=shape.device),
        )

    @torch.inference_mode(False)
    def reserve(self, rows: int, steps: int) -> None:
        """Room for ``rows`` packed rows and ``steps`` steps; growing drops captured graphs."""
        dt, dev = self.shape.dtype, self.shape.device
        grow_rows, grow_steps = rows > self.u.shape[0], steps > self.sched.shape[1]
        if grow_rows or grow_steps:
            if self.graphs and dev.type == "cuda":
                torch.cuda.current_stream(dev).synchronize()  # no replay of them still running
            self.graphs.clear()
        if grow_rows:
            cap = _pow2(rows)
            self.u = torch.zeros(cap, self.shape.num_inputs, dtype=dt, device=dev)
            self.out = torch.zeros(cap, 2, dtype=dt, device=dev)
        if grow_steps:
            self.sched = torch.zeros(2, _pow2(steps), dtype=torch.int32, device=dev)


# ---------------------------------------------------------------------------------------------
# the rollout


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' one."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def _interpreting() -> bool:
    return triton_interpreting()


class TritonRollout:
    """A callable with :func:`rnnserve.models.traveller.rollout_packed`'s signature, on Triton
    kernels.

    ``max_chunk``: the most steps one CUDA graph holds (a power of two); ``graphs``: replay
    CUDA graphs (default: on CUDA devices) or launch every kernel from Python (the CPU path, and a
    reference for the graphs); ``precision``: ``tl.dot``'s ``input_precision`` for float32
    (``"ieee"`` matches the CPU to 1e-5; ``"tf32x3"`` uses tensor cores, not the default while
    its speed is unmeasured);
    ``config``: tiles, by default :func:`kernel_config`; ``pdl``: launch the step kernels with
    programmatic dependent launch (Hopper; each waits for the one before with ``gdc_wait``), so a
    launch's scheduling overlaps the previous kernel: off by default, as its gain is unmeasured;
    CUDA only.
    """

    def __init__(
        self,
        *,
        max_chunk: int = 64,
        graphs: bool | None = None,
        precision: str = "ieee",
        config: KernelConfig | None = None,
        pdl: bool = False,
    ) -> None:
        if max_chunk < 1 or max_chunk & (max_chunk - 1):
            raise ValueError(f"max_chunk must be a power of two, got {max_chunk}")
        if precision not in ("ieee", "tf32x3", "tf32"):
            raise ValueError(f"precision must be ieee, tf32x3 or tf32, got {precision!r}")
        self.max_chunk = max_chunk
        self.graphs = graphs
        self.precision = precision
        self.pdl = pdl
        self.config = config
        self._workspaces: dict[_Shape, _Workspace] = {}
        self._lock = threading.Lock()
        self.launches = 0  # kernel launches from Python (captures included), for tests
        self.replays = 0  # CUDA graph replays

    # -- public -----------------------------------------------------------------------------

    def __call__(
        self,
        u: Tensor,  # [N, NI] packed rows, time-major
        batch_sizes: Sequence[int] | Tensor,  # [T] non-increasing
        w_cat: Sequence[Tensor],  # per layer [K_l, 4H]
        bias: Sequence[Tensor],  # per layer [4H]
        w_out: Tensor,  # [H, 2]
        b_out: Tensor,  # [2]
        h0: Tensor | None = None,  # [L, B, H]
        c0: Tensor | None = None,  # [L, B, H]
        p0: Tensor | None = None,  # [B, 2]
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        sizes = _check_sizes(batch_sizes, u)
        shape = self._shape(u, sizes[0], w_cat, bias, w_out, b_out)
        _refuse_capture(shape.device)
        batch, steps = sizes[0], len(sizes)
        for name, state, want in (
            ("h0", h0, (shape.layers, batch, shape.hidden)),
            ("c0", c0, (shape.layers, batch, shape.hidden)),
            ("p0", p0, (batch, 2)),
        ):
            if state is not None and tuple(state.shape) != want:
                raise ValueError(f"{name} must have shape {list(want)}, got {list(state.shape)}")
        with _on(shape.device):
            ws = self.workspace(shape)
            with ws.lock:
                ws.reserve(u.shape[0], steps + 1)
                self._stage(ws, u, sizes, w_cat, bias, w_out, b_out, h0, c0, p0)
                self._run(ws, steps + 1)  # the last step only writes p_{T-1}
                return self._collect(ws, u.shape[0], batch, steps)

    def workspace(self, shape: _Shape) -> _Workspace:
        """The workspace of a shape bucket, created (and its kernels compiled) on first use."""
        with self._lock:
            ws = self._workspaces.get(shape)
            if ws is None:
                cfg = self.config or kernel_config(
                    shape.rows, shape.hidden, interpret=_interpreting()
                )
                precision = self.precision if shape.dtype == torch.float32 else "ieee"
                ws = _Workspace.create(shape, cfg, precision)
                self._compile(ws)
                self._workspaces[shape] = ws
            return ws

    def warm_up(
        self,
        batch: int,
        layers: int,
        hidden: int,
        num_inputs: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cuda",
        rows: int = 1024,
        steps: int = 1024,
    ) -> None:
        """Compile the kernels and capture every chunk's graph for ``batch``'s bucket now.

        ``rows``/``steps``: the packed rows and steps to reserve room for, so that later calls
        up to that size do not reallocate (which would drop the graphs).
        """
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:  # as the tensors' devices will say
            dev = torch.device("cuda", torch.cuda.current_device())
        shape = _Shape(bucket_rows(batch), layers, hidden, num_inputs, dtype, dev)
        _refuse_capture(dev)
        with _on(dev):
            ws = self.workspace(shape)
            with ws.lock:
                ws.reserve(rows, steps + 1)
                n = self.max_chunk
                while n >= 1 and self._use_graphs(ws):
                    self._graph(ws, n)
                    n //= 2

    # -- steps ------------------------------------------------------------------------------

    def _shape(
        self,
        u: Tensor,
        batch: int,
        w_cat: Sequence[Tensor],
        bias: Sequence[Tensor],
        w_out: Tensor,
        b_out: Tensor,
    ) -> _Shape:
        if u.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"the triton rollout takes float32 or float64, got {u.dtype}")
        check_device(u.device)
        layers = len(w_cat)
        if layers < 1 or len(bias) != layers:
            raise ValueError(f"need one weight and one bias per layer, got {layers}, {len(bias)}")
        hidden = w_cat[0].shape[1] // 4
        num_inputs = w_cat[0].shape[0] - 2 - hidden
        if u.dim() != 2 or u.shape[1] != num_inputs or num_inputs < 0:
            raise ValueError(f"u must be [N, {num_inputs}], got {list(u.shape)}")
        k_rows = [2 + hidden + num_inputs] + [2 * hidden] * (layers - 1)
        wanted: list[tuple[Tensor, tuple[int, ...]]]
        wanted = [(w, (k, 4 * hidden)) for w, k in zip(w_cat, k_rows, strict=True)]
        wanted += [(b, (4 * hidden,)) for b in bias] + [(w_out, (hidden, 2)), (b_out, (2,))]
        for tensor, want in wanted:
            if tuple(tensor.shape) != want:
                raise ValueError(f"weight of shape {list(tensor.shape)}, expected {list(want)}")
            if tensor.dtype != u.dtype or tensor.device != u.device:
                raise ValueError("weights and inputs must share dtype and device")
        return _Shape(bucket_rows(batch), layers, hidden, num_inputs, u.dtype, u.device)

    def _stage(
        self,
        ws: _Workspace,
        u: Tensor,
        sizes: list[int],
        w_cat: Sequence[Tensor],
        bias: Sequence[Tensor],
        w_out: Tensor,
        b_out: Tensor,
        h0: Tensor | None,
        c0: Tensor | None,
        p0: Tensor | None,
    ) -> None:
        """Copy this call's weights, inputs, schedule and initial state into the workspace."""
        for dst, src in zip(ws.w + ws.b, [*w_cat, *bias], strict=True):
            dst.copy_(src)
        ws.w_out.copy_(w_out)
        ws.b_out.copy_(b_out)
        ws.u[: u.shape[0]].copy_(u)
        steps, batch = len(sizes), sizes[0]
        bs = torch.tensor([*sizes, 0], dtype=torch.int32)
        sched = torch.stack([bs, torch.cumsum(bs, 0, dtype=torch.int32) - bs])
        cuda = ws.shape.device.type == "cuda"
        if cuda:
            sched = sched.pin_memory()
        ws.sched[:, : steps + 1].copy_(sched, non_blocking=cuda)
        for dst, init in ((ws.h[0, :, :batch], h0), (ws.c[:, :batch], c0), (ws.p[:batch], p0)):
            if init is None:
                dst.zero_()
            else:
                dst.copy_(init)
        ws.base.zero_()

    def _run(self, ws: _Workspace, steps: int) -> None:
        """Run ``steps`` steps from ``base``: full chunks, then the binary digits of the rest."""
        graphs = self._use_graphs(ws)
        n = self.max_chunk
        while steps:
            while n > steps:
                n //= 2
            if graphs:
                self._graph(ws, n).replay()
                self.replays += 1
            else:
                self._launch(ws, n)
            steps -= n

    def _launch(self, ws: _Workspace, steps: int) -> None:
        """Launch ``steps`` steps (L kernels each) and advance ``base`` by ``steps``."""
        s, cfg = ws.shape, ws.config
        grid = (triton.cdiv(s.rows, cfg.block_b), triton.cdiv(s.hidden, cfg.block_h))
        bs, off = ws.sched[0], ws.sched[1]
        use_pdl = self.pdl and s.device.type == "cuda"  # the interpreter has no gdc_wait
        for k in range(steps):
            for layer in range(s.layers):
                # The kernels read the step counter before their dependency wait; the first
                # launch of a chunk may follow the counter's advance, so it is a plain launch
                # (its gdc_wait returns at once). Inside a CUDA graph it has no kernel before it.
                pdl = {"launch_pdl": True} if use_pdl and (k, layer) != (0, 0) else {}
                _layer_step_kernel[grid](
                    ws.h, ws.c, ws.p, ws.out, ws.u, ws.w[layer], ws.b[layer], ws.w_out,
                    ws.b_out, bs, off, ws.base, k, layer, s.rows,
                    H=s.hidden, NI=s.num_inputs, L=s.layers, FIRST=layer == 0,
                    BLOCK_B=cfg.block_b, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k,
                    H_PAD=_pow2(s.hidden), NI_PAD=_pow2(s.num_inputs),
                    USE_DOT=cfg.use_dot, PRECISION=ws.precision, PDL=use_pdl,
                    num_warps=cfg.num_warps, **pdl,
                )  # fmt: skip
                self.launches += 1
        _advance_kernel[(1,)](ws.base, steps)  # a plain launch: after every program read base
        self.launches += 1

    def _compile(self, ws: _Workspace) -> None:
        """Compile every kernel variant by one step on the empty schedule (a no-op step)."""
        ws.base.zero_()  # steps of an all-zero schedule: no active rows, nothing written
        # with PDL, a chunk's first launch differs from the others (a plain launch): 2 steps
        # compile both kinds of layer 0's launch
        self._launch(ws, 2 if self.pdl and ws.shape.device.type == "cuda" else 1)
        ws.base.zero_()

    def _use_graphs(self, ws: _Workspace) -> bool:
        if ws.shape.device.type != "cuda":
            return False
        return self.graphs is None or self.graphs

    def _graph(self, ws: _Workspace, steps: int) -> torch.cuda.CUDAGraph:
        """The CUDA graph of a ``steps``-step chunk on this workspace, captured on first use."""
        graph = ws.graphs.get(steps)
        if graph is None:
            graph = torch.cuda.CUDAGraph()
            # capture only: nothing runs, the staged state is untouched; thread_local so that
            # other threads' CUDA calls (another model, an allocation) do not break the capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._launch(ws, steps)
            ws.graphs[steps] = graph
        return graph

    def _collect(
        self, ws: _Workspace, n_rows: int, batch: int, steps: int
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Outputs and each row's final state, copied out of the workspace."""
        # row r took len_r steps; its last h is in plane len_r % 2
        lengths = (ws.sched[0, :steps, None] > torch.arange(batch, device=ws.h.device)).sum(0)
        odd = (lengths % 2 == 1)[None, :, None]
        h = torch.where(odd, ws.h[1, :, :batch], ws.h[0, :, :batch])
        return ws.out[:n_rows].clone(), h, ws.c[:, :batch].clone(), ws.p[:batch].clone()


def _refuse_capture(device: torch.device) -> None:
    """Refuse a call made while the stream is being captured into someone else's CUDA graph.

    The rollout replays CUDA graphs of its own, and a replay cannot be captured into another
    graph: the call would fail halfway through, with this call's inputs half staged. Refused
    before anything is touched, so the workspace and its graphs stay as they were.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "the triton rollout replays CUDA graphs of its own and cannot be captured into "
            "another CUDA graph; call it outside torch.cuda.graph (it needs no outer graph)"
        )


def check_device(device: torch.device) -> None:
    """Refuse a device the kernels cannot run on (CPU tensors need ``TRITON_INTERPRET=1``)."""
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(
            "the triton rollout runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1, set"
            f" before triton is imported); got device {device}"
        )


def _check_sizes(batch_sizes: Sequence[int] | Tensor, u: Tensor) -> list[int]:
    raw = batch_sizes.tolist() if isinstance(batch_sizes, Tensor) else batch_sizes
    sizes = [int(b) for b in raw]
    if not sizes or sizes[0] < 1:
        raise ValueError("batch_sizes must be non-empty and start >= 1")
    if any(b < a for a, b in zip(sizes[1:], sizes, strict=False)) or sizes[-1] < 1:
        raise ValueError("batch_sizes must be non-increasing and positive")
    if sum(sizes) != u.shape[0]:
        raise ValueError(f"batch_sizes sum to {sum(sizes)} but u has {u.shape[0]} rows")
    if u.shape[0] * max(u.shape[1], 2) >= 2**31:
        raise ValueError("more than 2**31 input elements (the kernels index with int32)")
    return sizes


_DEFAULT = TritonRollout()


def warm_up(
    max_batch: int,
    layers: int,
    hidden: int,
    num_inputs: int,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cuda",
    max_steps: int = 1024,
) -> None:
    """Compile and capture, for :func:`rollout_packed_triton`, every bucket up to ``max_batch``.

    For a server's start-up: without it the first batch of each new bucket pays the kernels'
    compilation (seconds, once per process) and the graphs' capture (milliseconds per chunk).
    """
    for rows in (1 << i for i in range(bucket_rows(max_batch).bit_length())):
        _DEFAULT.warm_up(
            rows, layers, hidden, num_inputs, dtype=dtype, device=device,
            rows=rows * max_steps, steps=max_steps,
        )  # fmt: skip


def rollout_packed_triton(
    u: Tensor,
    batch_sizes: Sequence[int] | Tensor,
    w_cat: Sequence[Tensor],
    bias: Sequence[Tensor],
    w_out: Tensor,
    b_out: Tensor,
    h0: Tensor | None = None,
    c0: Tensor | None = None,
    p0: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`rnnserve.models.traveller.rollout_packed` on Triton kernels (one shared graph cache).

    Returns the ``[N, 2]`` packed positions and each sequence's final ``(h, c, p)``.
    """
    return _DEFAULT(u, batch_sizes, w_cat, bias, w_out, b_out, h0, c0, p0)


@functools.cache
def rollout_op() -> Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]]:
    """:func:`rollout_packed_triton` as the custom op ``torch.ops.rnnserve.rollout_triton``.

    Registered on first call. TorchScript code can call it (a scripted orchestration keeps its
    loop over chunks and requests and hands the steps to the graphs), and ``torch.compile``
    traces it as one opaque op. The ``"triton"`` backend calls the Python function directly.
    """

    @torch.library.custom_op("rnnserve::rollout_triton", mutates_args=())
    def _op(
        u: Tensor,
        batch_sizes: list[int],
        w_cat: list[Tensor],
        bias: list[Tensor],
        w_out: Tensor,
        b_out: Tensor,
        h0: Tensor | None = None,
        c0: Tensor | None = None,
        p0: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        return rollout_packed_triton(u, batch_sizes, w_cat, bias, w_out, b_out, h0, c0, p0)

    @_op.register_fake
    def _(
        u: Tensor,
        batch_sizes: list[int],
        w_cat: list[Tensor],
        bias: list[Tensor],
        w_out: Tensor,
        b_out: Tensor,
        h0: Tensor | None = None,
        c0: Tensor | None = None,
        p0: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        batch, hidden = batch_sizes[0], w_out.shape[0]
        h = u.new_empty(len(w_cat), batch, hidden)
        return u.new_empty(u.shape[0], 2), h, torch.empty_like(h), u.new_empty(batch, 2)

    op: Callable[..., tuple[Tensor, Tensor, Tensor, Tensor]] = torch.ops.rnnserve.rollout_triton
    return op
