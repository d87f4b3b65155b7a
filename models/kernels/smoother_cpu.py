"""Kernels for the smoother's recursion ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``.

Both walk the PackedSequence rows as they are (time-major, longest sequence first), so no
padding, no per-sequence Python loop and no index tensors are needed:

- :func:`ema_packed_numba` is a compiled CPU loop over the packed rows (inference only);
- :func:`ema_packed_torch` loops over *steps* in Python with one slice per step; it runs on any
  device and is differentiable, so it is the training path and the GPU path for now.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

try:  # numba is a runtime dependency, but keep the torch path usable without it.
    import numba

    _HAVE_NUMBA = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    _HAVE_NUMBA = False


def _ema_rows(x: Any, batch_sizes: Any, alpha: Any, out: Any) -> None:
    # x, out: [N, F] packed rows; batch_sizes: [T] non-increasing; alpha: [F]
    n_feat = x.shape[1]
    b0 = batch_sizes[0]
    for r in range(b0):
        for f in range(n_feat):
            out[r, f] = x[r, f]
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


def ema_packed_numba(data: Tensor, batch_sizes: Tensor, alpha: Tensor) -> Tensor:
    """Exponential smoothing of packed CPU rows with a compiled loop. Not differentiable."""
    if not _HAVE_NUMBA:
        raise RuntimeError("numba is not installed")
    if data.device.type != "cpu":
        raise ValueError(f"the numba kernel runs on CPU tensors, got {data.device}")
    x = data.detach().contiguous().numpy()
    a = alpha.detach().to(dtype=data.dtype).contiguous().numpy()
    bs = batch_sizes.numpy().astype(np.int64, copy=False)
    out = np.empty_like(x)
    _ema_rows_compiled(x, bs, a, out)
    return torch.from_numpy(out)


def ema_packed_torch(data: Tensor, batch_sizes: Tensor, alpha: Tensor) -> Tensor:
    """Exponential smoothing of packed rows with one vectorised update per step.

    Works on any device and supports autograd; ``batch_sizes`` stays on the CPU as
    PackedSequence requires, and is only read as Python ints.
    """
    sizes: list[int] = batch_sizes.tolist()
    one_minus = 1 - alpha
    steps = [data[: sizes[0]]]
    off = sizes[0]
    for b in sizes[1:]:
        s = alpha * steps[-1][:b] + one_minus * data[off : off + b]
        steps.append(s)
        off += b
    return torch.cat(steps, dim=0)
