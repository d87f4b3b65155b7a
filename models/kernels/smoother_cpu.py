"""Kernels for the smoother's recursion ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``.

Both walk the PackedSequence rows as they are (time-major, longest sequence first), so no
padding, no per-sequence Python loop and no index tensors are needed:

- :func:`ema_packed_numba` is a compiled CPU loop over the packed rows (inference only);
- :func:`smooth_packed_numba` is the CPU training path: the recursion and the ``tanh(wx * s)``
  epilogue as one compiled loop forward, and a compiled reverse-time loop as its backward
  (an autograd Function);
- :func:`ema_packed_torch` loops over *steps* in Python with one slice per step; it runs on any
  device and is differentiable: the reference for the compiled gradients, and the training
  path where neither compiled kernel runs.

:func:`smooth_flat_numba` computes the same numbers as the packed kernels plus the
``tanh(wx * s)`` epilogue, in one pass over the sequences' own rows (each sequence contiguous,
one after another): the recursion is per sequence, so the packed batch's result does not need
the packed layout. The server uses it for CPU batches, skipping pack and unpack.

Both take an optional initial state ``init`` ([B, F], sorted order, the state before step 0):
with it ``s_0 = alpha * init + (1 - alpha) * x_0``, without it ``s_0 = x_0``.
:func:`last_step_rows` finds each sequence's final state among the packed rows.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

try:  # numba is a runtime dependency, but keep the torch path usable without it.
    import numba

    from rnnserve.models.kernels.numba_math import fast_tanh

    _HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    _HAVE_NUMBA = False


def _ema_rows(x: Any, batch_sizes: Any, alpha: Any, init: Any, out: Any) -> None:
    # x, out: [N, F] packed rows; batch_sizes: [T] non-increasing; alpha: [F];
    # init: [B, F] state before step 0, or [0, F] for s_0 = x_0
    n_feat = x.shape[1]
    b0 = batch_sizes[0]
    if init.shape[0] == 0:
        for r in range(b0):
            for f in range(n_feat):
                out[r, f] = x[r, f]
    else:
        for r in range(b0):
            for f in range(n_feat):
                a = alpha[f]
                out[r, f] = a * init[r, f] + (1 - a) * x[r, f]
    prev = 0
    off = b0
    for t in range(1, batch_sizes.shape[0]):
        b = batch_sizes[t]
        for r in range(b):
            for f in range(n_feat):
                a = alpha[f]
                out[off + r, f] = a * out[prev + r, f] + (1 - a) * x[off + r, f]
        prev = off
        off += b


if _HAVE_NUMBA:
    _ema_rows_compiled = numba.njit(cache=False, nogil=True, boundscheck=False)(_ema_rows)


def numba_available() -> bool:
    return _HAVE_NUMBA


def ema_packed_numba(
    data: Tensor, batch_sizes: Tensor, alpha: Tensor, init: Tensor | None = None
) -> Tensor:
    """Exponential smoothing of packed CPU rows with a compiled loop. Not differentiable."""
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed")
    if data.device.type != "cpu":
        raise ValueError(f"the numba kernel runs on CPU tensors, got {data.device}")
    x = data.detach().contiguous().numpy()
    a = alpha.detach().to(dtype=data.dtype).contiguous().numpy()
    bs = batch_sizes.numpy().astype(np.int64, copy=False)
    if init is None:
        s0 = np.empty((0, x.shape[1]), dtype=x.dtype)
    else:
        s0 = init.detach().to(device="cpu", dtype=data.dtype).contiguous().numpy()
    out = np.empty_like(x)
    _ema_rows_compiled(x, bs, a, s0, out)
    return torch.from_numpy(out)


def ema_packed_torch(
    data: Tensor, batch_sizes: Tensor, alpha: Tensor, init: Tensor | None = None
) -> Tensor:
    """Exponential smoothing of packed rows with one vectorised update per step.

    Works on any device and supports autograd (through ``init`` too); ``batch_sizes`` stays on
    the CPU as PackedSequence requires, and is only read as Python ints.
    """
    sizes: list[int] = batch_sizes.tolist()
    one_minus = 1 - alpha
    first = data[: sizes[0]]
    steps = [first if init is None else alpha * init + one_minus * first]
    off = sizes[0]
    for b in sizes[1:]:
        s = alpha * steps[-1][:b] + one_minus * data[off : off + b]
        steps.append(s)
        off += b
    return torch.cat(steps, dim=0)


# --------------------------------------------------------------------------- training (CPU)
#
# The forward keeps ``s`` beside ``y``; the backward walks the steps from the last to the first
# with the adjoint ``lam_t = dL/ds_t = g_t + alpha * lam_{t+1}`` (``g_t`` the gradient through
# ``y_t``, plus the final state's gradient at each sequence's last step), kept for the sequences
# of one step in a ``[B, F]`` buffer: row ``j`` of step ``t + 1`` is sequence ``j`` of step
# ``t`` in the packed layout, so the adjoint needs neither padding nor an index. Then
# ``dx_t = (1 - alpha) lam_t`` (``lam_0`` itself when ``s_0 = x_0``), ``dalpha`` sums
# ``lam_t (s_{t-1} - x_t)``, ``dwx`` sums ``dL/d(wx s_t) s_t`` and ``dinit = alpha lam_0``.


def _smooth_rows(
    x: Any, batch_sizes: Any, alpha: Any, wx: Any, init: Any, s: Any, y: Any, last: Any
) -> None:
    # x, s, y: [N, F] packed rows; init: [B, F] or [0, F] for s_0 = x_0; last: [B, F], each
    # sequence's final state (sorted order). Sequences j >= batch_sizes[t + 1] end at step t.
    n_feat = x.shape[1]
    n_steps = batch_sizes.shape[0]
    keep = alpha
    take = 1 - alpha
    b0 = batch_sizes[0]
    if init.shape[0] == 0:
        for r in range(b0):
            for f in range(n_feat):
                s[r, f] = x[r, f]
    else:
        for r in range(b0):
            for f in range(n_feat):
                s[r, f] = keep[f] * init[r, f] + take[f] * x[r, f]
    prev = 0
    off = 0
    for t in range(n_steps):
        b = batch_sizes[t]
        if t > 0:
            for r in range(b):
                for f in range(n_feat):
                    s[off + r, f] = keep[f] * s[prev + r, f] + take[f] * x[off + r, f]
        for r in range(b):
            for f in range(n_feat):
                y[off + r, f] = fast_tanh(wx[f] * s[off + r, f])
        b_next = batch_sizes[t + 1] if t + 1 < n_steps else 0
        for r in range(b_next, b):
            for f in range(n_feat):
                last[r, f] = s[off + r, f]
        prev = off
        off += b


def _smooth_rows_backward(
    x: Any,
    batch_sizes: Any,
    alpha: Any,
    wx: Any,
    init: Any,
    s: Any,
    y: Any,
    gy: Any,
    gfin: Any,
    lam: Any,
    dx: Any,
    dinit: Any,
    dalpha: Any,
    dwx: Any,
) -> None:
    # gy: [N, F] dL/dy; gfin: [B, F] dL/d(final state), or [0, F] for none; lam: [B, F]
    # scratch; dx: [N, F], or [0, F] when x needs no gradient; dinit: [B, F] (when init is
    # given and needs one) or [0, F]; dalpha, dwx: [F] sums, in the rows' dtype. Partial sums
    # per step in the rows' dtype, added to float64 totals, keep long sequences accurate in
    # float32.
    n_feat = x.shape[1]
    n_steps = batch_sizes.shape[0]
    keep = alpha
    take = 1 - alpha
    want_dx = dx.shape[0] > 0
    has_gfin = gfin.shape[0] > 0
    part_a = np.empty(n_feat, x.dtype)
    part_w = np.empty(n_feat, x.dtype)
    total_a = np.zeros(n_feat, np.float64)
    total_w = np.zeros(n_feat, np.float64)
    off = x.shape[0]
    for t in range(n_steps - 1, -1, -1):
        b = batch_sizes[t]
        off -= b
        b_next = batch_sizes[t + 1] if t + 1 < n_steps else 0
        for f in range(n_feat):
            part_a[f] = 0
            part_w[f] = 0
        # the adjoint: sequences that go on take the next step's, the others start here
        for r in range(b):
            for f in range(n_feat):
                yv = y[off + r, f]
                g_pre = gy[off + r, f] * (1 - yv * yv)
                part_w[f] += g_pre * s[off + r, f]
                lam_next = lam[r, f] if r < b_next else 0
                lam[r, f] = g_pre * wx[f] + keep[f] * lam_next
        if has_gfin:
            for r in range(b_next, b):
                for f in range(n_feat):
                    lam[r, f] += gfin[r, f]
        if t > 0:
            prev = off - batch_sizes[t - 1]
            for r in range(b):
                for f in range(n_feat):
                    part_a[f] += lam[r, f] * (s[prev + r, f] - x[off + r, f])
            if want_dx:
                for r in range(b):
                    for f in range(n_feat):
                        dx[off + r, f] = take[f] * lam[r, f]
        elif init.shape[0] > 0:
            for r in range(b):
                for f in range(n_feat):
                    part_a[f] += lam[r, f] * (init[r, f] - x[r, f])
            if want_dx:
                for r in range(b):
                    for f in range(n_feat):
                        dx[r, f] = take[f] * lam[r, f]
            if dinit.shape[0] > 0:
                for r in range(b):
                    for f in range(n_feat):
                        dinit[r, f] = keep[f] * lam[r, f]
        elif want_dx:  # s_0 = x_0
            for r in range(b):
                for f in range(n_feat):
                    dx[r, f] = lam[r, f]
        for f in range(n_feat):
            total_a[f] += part_a[f]
            total_w[f] += part_w[f]
    for f in range(n_feat):
        dalpha[f] = total_a[f]
        dwx[f] = total_w[f]


def _smooth_mse_rows(
    x: Any,
    batch_sizes: Any,
    alpha: Any,
    wx: Any,
    target: Any,
    norm: Any,
    s: Any,
    lam: Any,
    dx: Any,
    dalpha: Any,
    dwx: Any,
) -> float:
    # The loss sum((tanh(wx * s) - target)^2) and its gradients in one call: the recursion
    # forward into s ([N, F] scratch), then the reverse-time adjoint of _smooth_rows_backward
    # with dL/dy = norm * (y - target) made on the spot, y recomputed from s rather than stored.
    # norm (the rows' dtype) is 2 / (N * F) for the mean; dx is [N, F], or [0, F] when x needs
    # no gradient; lam is [B, F] scratch. Every gradient sum is made in _smooth_rows_backward's
    # order, so the gradients are those of F.mse_loss through _NumbaSmootherFn bit for bit.
    n_feat = x.shape[1]
    n_steps = batch_sizes.shape[0]
    keep = alpha
    take = 1 - alpha
    b0 = batch_sizes[0]
    for r in range(b0):
        for f in range(n_feat):
            s[r, f] = x[r, f]
    prev = 0
    off = b0
    for t in range(1, n_steps):
        b = batch_sizes[t]
        for r in range(b):
            for f in range(n_feat):
                s[off + r, f] = keep[f] * s[prev + r, f] + take[f] * x[off + r, f]
        prev = off
        off += b
    want_dx = dx.shape[0] > 0
    part_a = np.empty(n_feat, x.dtype)
    part_w = np.empty(n_feat, x.dtype)
    part_l = np.empty(n_feat, x.dtype)
    total_a = np.zeros(n_feat, np.float64)
    total_w = np.zeros(n_feat, np.float64)
    total_l = np.zeros(n_feat, np.float64)
    off = x.shape[0]
    for t in range(n_steps - 1, -1, -1):
        b = batch_sizes[t]
        off -= b
        b_next = batch_sizes[t + 1] if t + 1 < n_steps else 0
        for f in range(n_feat):
            part_a[f] = 0
            part_w[f] = 0
            part_l[f] = 0
        # per-feature sums only: a single running total would keep the loop from vectorising
        for r in range(b):
            for f in range(n_feat):
                sv = s[off + r, f]
                yv = fast_tanh(wx[f] * sv)
                diff = yv - target[off + r, f]
                part_l[f] += diff * diff
                g_pre = norm * diff * (1 - yv * yv)
                part_w[f] += g_pre * sv
                lam_next = lam[r, f] if r < b_next else 0
                lam[r, f] = g_pre * wx[f] + keep[f] * lam_next
        if t > 0:
            prev = off - batch_sizes[t - 1]
            for r in range(b):
                for f in range(n_feat):
                    part_a[f] += lam[r, f] * (s[prev + r, f] - x[off + r, f])
            if want_dx:
                for r in range(b):
                    for f in range(n_feat):
                        dx[off + r, f] = take[f] * lam[r, f]
        elif want_dx:  # s_0 = x_0
            for r in range(b):
                for f in range(n_feat):
                    dx[r, f] = lam[r, f]
        for f in range(n_feat):
            total_a[f] += part_a[f]
            total_w[f] += part_w[f]
            total_l[f] += part_l[f]
    for f in range(n_feat):
        dalpha[f] = total_a[f]
        dwx[f] = total_w[f]
    return float(total_l.sum())


if _HAVE_NUMBA:
    _smooth_rows_compiled = numba.njit(nogil=True, boundscheck=False, error_model="numpy")(
        _smooth_rows
    )
    _smooth_rows_backward_compiled = numba.njit(nogil=True, boundscheck=False, error_model="numpy")(
        _smooth_rows_backward
    )
    _smooth_mse_rows_compiled = numba.njit(nogil=True, boundscheck=False, error_model="numpy")(
        _smooth_mse_rows
    )


def _none_array(n_feat: int, dtype: np.dtype[Any]) -> np.ndarray:
    # an absent optional array is a [0, F] one, so the kernels compile once for both cases
    return np.empty((0, n_feat), dtype=dtype)


class _NumbaSmootherFn(torch.autograd.Function):
    """``(y, final state)`` of packed CPU rows, the compiled loops forward and backward.

    Inputs arrive in the rows' dtype (:func:`smooth_packed_numba` casts them), so autograd casts
    the gradients back to the parameters' dtypes.
    """

    @staticmethod
    def forward(
        ctx: Any,
        data: Tensor,
        alpha: Tensor,
        wx: Tensor,
        init: Tensor | None,
        batch_sizes: Tensor,
    ) -> tuple[Tensor, Tensor]:
        x_t = data.detach().contiguous()
        a_t, w_t = alpha.detach().contiguous(), wx.detach().contiguous()
        s0_t = None if init is None else init.detach().contiguous()
        x, bs = x_t.numpy(), batch_sizes.numpy()
        n_feat = x.shape[1]
        s0 = _none_array(n_feat, x.dtype) if s0_t is None else s0_t.numpy()
        s, y = np.empty_like(x), np.empty_like(x)
        last = np.empty((int(bs[0]), n_feat), x.dtype)
        a, w = a_t.numpy(), w_t.numpy()
        _smooth_rows_compiled(x, bs, a, w, s0, s, y, last)
        y_t, s_t = torch.from_numpy(y), torch.from_numpy(s)
        # saved as tensors, so autograd refuses a backward after y was changed in place; the
        # numpy views beside them spare the backward converting them again
        ctx.save_for_backward(x_t, a_t, w_t, s0_t, s_t, y_t)
        ctx.arrays = (x, bs, a, w, s0, s, y)
        ctx.set_materialize_grads(False)
        return y_t, torch.from_numpy(last)

    @staticmethod
    @once_differentiable  # the compiled loop is not differentiable itself: refuse, loudly
    def backward(
        ctx: Any, grad_y: Tensor | None, grad_final: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        ctx.saved_tensors  # noqa: B018 - raises if a saved tensor was modified in place
        x, bs, a, w, s0, s, y = ctx.arrays
        n_feat, dt = x.shape[1], x.dtype
        want_x, want_a, want_w, want_init = ctx.needs_input_grad[:4]
        want_init = want_init and s0.shape[0] > 0
        gy = np.zeros_like(x) if grad_y is None else grad_y.contiguous().numpy()
        gfin = _none_array(n_feat, dt) if grad_final is None else grad_final.contiguous().numpy()
        dx = np.empty_like(x) if want_x else _none_array(n_feat, dt)
        dinit = np.empty_like(s0) if want_init else _none_array(n_feat, dt)
        lam = np.empty((int(bs[0]), n_feat), dt)
        dalpha, dwx = np.empty(n_feat, dt), np.empty(n_feat, dt)
        _smooth_rows_backward_compiled(x, bs, a, w, s0, s, y, gy, gfin, lam, dx, dinit, dalpha, dwx)
        return (
            torch.from_numpy(dx) if want_x else None,
            torch.from_numpy(dalpha) if want_a else None,
            torch.from_numpy(dwx) if want_w else None,
            torch.from_numpy(dinit) if want_init else None,
            None,
        )


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype and t.device.type == "cpu" else t.to(device="cpu", dtype=dtype)


def smooth_packed_numba(
    data: Tensor,
    batch_sizes: Tensor,
    alpha: Tensor,
    wx: Tensor,
    init: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``y = tanh(wx * s)`` over packed CPU rows and each sequence's final state ``s``.

    The training path on the CPU: a compiled loop forward and a compiled reverse-time loop
    backward, both on the packed rows as they are. ``data``: [N, F] float32 or float64;
    ``init``: [B, F] state before step 0 in *sorted* order, or None for ``s_0 = x_0``. Returns
    ``y`` [N, F] and the final state [B, F] (sorted order); differentiable in ``data``,
    ``alpha``, ``wx`` and ``init``. float32 ``tanh`` is the rational approximation of
    :mod:`.numba_math` (|error| < 4e-7).
    """
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed")
    dt = data.dtype
    if data.device.type != "cpu" or dt not in (torch.float32, torch.float64):
        raise ValueError(
            f"the numba kernel runs on float32 or float64 CPU tensors, got {dt} on {data.device}"
        )
    if data.dim() != 2:
        raise ValueError(f"expected packed data [N, F], got {list(data.shape)}")
    bs = _cast(batch_sizes, torch.int64).contiguous()
    n_seqs, n_feat = int(bs[0]), data.shape[1]
    if init is not None and tuple(init.shape) != (n_seqs, n_feat):
        raise ValueError(f"expected a state of shape [{n_seqs}, {n_feat}], got {list(init.shape)}")
    rows = int(bs.numpy().sum())
    if rows != data.shape[0]:
        raise ValueError(f"batch_sizes sum to {rows}, not {data.shape[0]} rows")
    y, final = _NumbaSmootherFn.apply(
        data, _cast(alpha, dt), _cast(wx, dt), None if init is None else _cast(init, dt), bs
    )
    return y, final


_scratch = threading.local()  # per thread: {dtype: rows}, see _scratch_rows


def _scratch_rows(n_rows: int, n_feat: int, dtype: np.dtype[Any]) -> np.ndarray:
    # The fused loss needs its s and adjoint buffers only within one call, so each thread keeps
    # one buffer, as large as the largest batch it has seen, rather than allocating (and, for
    # a large batch, page-faulting in) fresh rows every step. nogil kernels may run in several
    # threads at once, hence one buffer per thread.
    buffers: dict[np.dtype[Any], np.ndarray] = _scratch.__dict__.setdefault("rows", {})
    size = n_rows * n_feat
    buf = buffers.get(dtype)
    if buf is None or buf.size < size:
        buf = buffers[dtype] = np.empty(size, dtype)
    return buf[:size].reshape(n_rows, n_feat)


class _NumbaSmootherMSEFn(torch.autograd.Function):
    """``mean((tanh(wx * s) - target)^2)`` of packed CPU rows, its gradients made in forward.

    The loss is the graph's end, so its gradients are known, up to the incoming factor, as
    soon as it is: one compiled call makes the loss and the gradients, and backward only
    scales them. Nothing is read back in backward, so nothing is saved for it either.
    """

    @staticmethod
    def forward(
        ctx: Any, data: Tensor, alpha: Tensor, wx: Tensor, target: Tensor, batch_sizes: Tensor
    ) -> Tensor:
        x, bs = data.detach().numpy(), batch_sizes.numpy()
        n_rows, n_feat = x.shape
        b0 = int(bs[0])
        scratch = _scratch_rows(n_rows + b0, n_feat, x.dtype)
        dx = np.empty_like(x) if ctx.needs_input_grad[0] else _none_array(n_feat, x.dtype)
        dalpha, dwx = np.empty(n_feat, x.dtype), np.empty(n_feat, x.dtype)
        count = x.size
        norm = x.dtype.type(2.0 / count)  # F.mse_loss's backward scale, in the rows' dtype
        total = _smooth_mse_rows_compiled(
            x,
            bs,
            alpha.detach().numpy(),
            wx.detach().numpy(),
            target.detach().numpy(),
            norm,
            scratch[:n_rows],
            scratch[n_rows:],
            dx,
            dalpha,
            dwx,
        )
        want_x, want_a, want_w = ctx.needs_input_grad[:3]
        ctx.grads = (
            torch.from_numpy(dx) if want_x else None,
            torch.from_numpy(dalpha) if want_a else None,
            torch.from_numpy(dwx) if want_w else None,
        )
        return torch.tensor(total / count, dtype=data.dtype)

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph: the gradients are constants, refuse
            raise RuntimeError(
                "the fused loss's gradients are not differentiable (create_graph=True); "
                "take F.mse_loss of the model's output for higher derivatives"
            )
        dx, dalpha, dwx = ctx.grads
        scale = float(grad_loss)
        if scale != 1.0:  # the usual loss.backward() passes 1: the gradients as they are
            dx, dalpha, dwx = (None if g is None else g * scale for g in (dx, dalpha, dwx))
        return dx, dalpha, dwx, None, None


def smooth_mse_packed_numba(
    data: Tensor, batch_sizes: Tensor, alpha: Tensor, wx: Tensor, target: Tensor
) -> Tensor:
    """``F.mse_loss(tanh(wx * s), target)`` over packed CPU rows (``s_0 = x_0``), fused.

    The smoother's training step with its loss inside the compiled kernels: one call computes
    the loss and the gradients of ``data``, ``alpha`` and ``wx`` (those equal F.mse_loss's
    through :func:`smooth_packed_numba` bit for bit), and backward hands them over, so neither
    ``y`` nor ``dL/dy`` is ever stored. ``data`` and ``target``: [N, F], the same float32 or
    float64 dtype, contiguous; ``target`` takes no gradient. Each thread keeps a scratch
    buffer as large as the largest batch it has run.
    """
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed")
    dt = data.dtype
    if data.device.type != "cpu" or dt not in (torch.float32, torch.float64):
        raise ValueError(
            f"the numba kernel runs on float32 or float64 CPU tensors, got {dt} on {data.device}"
        )
    if data.dim() != 2 or target.shape != data.shape:
        raise ValueError(
            f"expected packed data [N, F] and a target of its shape, got {list(data.shape)} "
            f"and {list(target.shape)}"
        )
    if target.dtype != dt or target.device.type != "cpu" or target.requires_grad:
        raise ValueError(f"the target must be a {dt} CPU tensor that needs no gradient")
    bs = _cast(batch_sizes, torch.int64).contiguous()
    rows = int(bs.numpy().sum())
    if rows != data.shape[0]:
        raise ValueError(f"batch_sizes sum to {rows}, not {data.shape[0]} rows")
    alpha, wx = _cast(alpha, dt).contiguous(), _cast(wx, dt).contiguous()
    loss: Tensor = _NumbaSmootherMSEFn.apply(data.contiguous(), alpha, wx, target.contiguous(), bs)
    return loss


def last_step_rows(batch_sizes: Tensor) -> Tensor:
    """Packed row of each sorted sequence's last step: ``offset[L_j - 1] + j``, int64 on the CPU.

    ``L_j = #{t : batch_sizes[t] > j}`` and ``offset`` is the exclusive cumsum of batch_sizes.
    """
    bs = batch_sizes.to(device="cpu", dtype=torch.int64)
    seq = torch.arange(int(bs[0]))
    offsets = torch.cumsum(bs, 0) - bs
    # batch_sizes is non-increasing, so reversed it is sorted: count the steps with bs[t] <= j
    lengths = bs.numel() - torch.searchsorted(bs.flip(0), seq, right=True)
    return offsets[lengths - 1] + seq


def _smooth_flat(
    x: Any, lengths: Any, alpha: Any, wx: Any, start: Any, given: Any, out: Any, last: Any,
    finite: Any,
) -> None:  # fmt: skip
    # x, out: [N, F], sequence j is the next lengths[j] rows; last: [B, F] final states;
    # finite: [B], whether sequence j's inputs were all finite. start: [B, F], the state
    # before sequence j where given[j] (given empty: none), else s_0 = x_0. x - x is 0 for a
    # finite x and NaN otherwise, so a per-feature sum of it, kept beside the state, checks the
    # inputs in the same pass at the cost of a subtract and an add per value.
    n_feat = x.shape[1]
    keep = alpha
    take = 1 - alpha
    s = np.empty(n_feat, x.dtype)
    bad = np.empty(n_feat, x.dtype)
    row = 0
    for j in range(lengths.shape[0]):
        carried = given.shape[0] > 0 and given[j]
        for f in range(n_feat):
            s[f] = keep[f] * start[j, f] + take[f] * x[row, f] if carried else x[row, f]
            bad[f] = x[row, f] - x[row, f]
            out[row, f] = fast_tanh(wx[f] * s[f])
        for r in range(row + 1, row + lengths[j]):
            for f in range(n_feat):
                s[f] = keep[f] * s[f] + take[f] * x[r, f]
                bad[f] += x[r, f] - x[r, f]
                out[r, f] = fast_tanh(wx[f] * s[f])
        total = x.dtype.type(0)
        for f in range(n_feat):
            last[j, f] = s[f]
            total += bad[f]
        finite[j] = total == 0
        row += lengths[j]


if _HAVE_NUMBA:
    _smooth_flat_compiled = numba.njit(nogil=True, boundscheck=False, error_model="numpy")(
        _smooth_flat
    )


def smooth_flat_numba(
    data: np.ndarray,
    lengths: np.ndarray,
    alpha: Tensor,
    wx: Tensor,
    start: np.ndarray | None = None,
    given: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tanh(wx * s)`` for sequences laid one after another; ``(y, final states, finite)``.

    ``finite[j]`` says whether sequence ``j``'s inputs were all finite (no NaN, no infinity),
    checked in the same pass as the recursion, so a server need not read the rows twice.

    ``data``: ``[sum T_j, F]`` float32 or float64 (sequence ``j`` is the next ``lengths[j]``
    rows), ``s_0 = x_0``; or, where ``given[j]``, ``s_0 = alpha * start[j] + (1 - alpha) *
    x_0`` (``start``: ``[B, F]``, the state a sequence continues; the others' rows unread), so
    a sequence without one gives the same bits whether or not others in its batch carry one.
    Equal to the packed kernels' result to rounding (float32 ``tanh`` is a rational
    approximation, |error| < 4e-7), with no packing. Inference only.
    """
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed")
    x = np.ascontiguousarray(data)
    n = np.ascontiguousarray(lengths, dtype=np.int64)
    if x.ndim != 2 or n.ndim != 1 or int(n.sum()) != x.shape[0] or (n < 1).any():
        raise ValueError(f"need [sum lengths, F] rows and lengths >= 1, got {x.shape}, {n}")
    dtype = torch.float64 if x.dtype == np.float64 else torch.float32
    a = alpha.detach().to(dtype=dtype).contiguous().numpy()
    w = wx.detach().to(dtype=dtype).contiguous().numpy()
    if given is None:
        start, given = np.empty((0, x.shape[1]), x.dtype), np.empty(0, np.bool_)
    elif start is None or start.shape != (len(n), x.shape[1]) or given.shape != (len(n),):
        raise ValueError(f"need a start [B, F] and given [B] for {len(n)} sequences")
    start = np.ascontiguousarray(start, dtype=x.dtype)
    out = np.empty_like(x)
    last = np.empty((len(n), x.shape[1]), x.dtype)
    finite = np.empty(len(n), np.bool_)
    _smooth_flat_compiled(x, n, a, w, start, given, out, last, finite)
    return out, last, finite
