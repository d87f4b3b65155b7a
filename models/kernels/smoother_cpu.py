"""Kernels for the smoother's recursion ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``.

Both walk the PackedSequence rows as they are (time-major, longest sequence first), so no
padding, no per-sequence Python loop and no index tensors are needed:

- :func:`ema_packed_numba` is a compiled CPU loop over the packed rows (inference only);
- :func:`ema_packed_torch` loops over *steps* in Python with one slice per step; it runs on any
  device and is differentiable, so it is the training path off the GPU.

:func:`smooth_flat_numba` computes the same numbers as the packed kernels plus the
``tanh(wx * s)`` epilogue, in one pass over the sequences' own rows (each sequence contiguous,
one after another): the recursion is per sequence, so the packed batch's result does not need
the packed layout. The server uses it for CPU batches, skipping pack and unpack.

Both take an optional initial state ``init`` ([B, F], sorted order, the state before step 0):
with it ``s_0 = alpha * init + (1 - alpha) * x_0``, without it ``s_0 = x_0``.
:func:`last_step_rows` finds each sequence's final state among the packed rows.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

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
    x: Any, lengths: Any, alpha: Any, wx: Any, out: Any, last: Any, finite: Any
) -> None:
    # x, out: [N, F], sequence j is the next lengths[j] rows; last: [B, F] final states;
    # finite: [B], whether sequence j's inputs were all finite. x - x is 0 for a finite x and
    # NaN otherwise, so a per-feature sum of it, kept beside the state, checks the inputs in
    # the same pass at the cost of a subtract and an add per value.
    n_feat = x.shape[1]
    keep = alpha
    take = 1 - alpha
    s = np.empty(n_feat, x.dtype)
    bad = np.empty(n_feat, x.dtype)
    row = 0
    for j in range(lengths.shape[0]):
        for f in range(n_feat):
            s[f] = x[row, f]
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
    data: np.ndarray, lengths: np.ndarray, alpha: Tensor, wx: Tensor
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``tanh(wx * s)`` for sequences laid one after another; ``(y, final states, finite)``.

    ``finite[j]`` says whether sequence ``j``'s inputs were all finite (no NaN, no infinity),
    checked in the same pass as the recursion, so a server need not read the rows twice.

    ``data``: ``[sum T_j, F]`` float32 or float64 (sequence ``j`` is the next ``lengths[j]``
    rows), ``s_0 = x_0``. Equal to the packed kernels' result to rounding (float32 ``tanh`` is a
    rational approximation, |error| < 4e-7), with no packing. Inference only.
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
    out = np.empty_like(x)
    last = np.empty((len(n), x.shape[1]), x.dtype)
    finite = np.empty(len(n), np.bool_)
    _smooth_flat_compiled(x, n, a, w, out, last, finite)
    return out, last, finite
