"""Model 1, the smoother: per-feature exponential smoothing, then ``tanh(wx * s)``.

For one sequence ``x_0 .. x_{T-1}``: ``s_0 = x_0``, ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``,
``y_t = tanh(wx * s_t)``. ``alpha`` and ``wx`` are trainable, one value per feature.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from models.kernels import ema_packed_numba, ema_packed_torch, numba_available

Kernel = Literal["auto", "numba", "torch"]


@dataclass(frozen=True)
class SmootherConfig:
    feat_dim: int = 16
    alpha_smooth: float = 0.5


class LinearRecursion(nn.Module):
    """Linear recursive smoothing layer with trainable per-feature constants.

    ``forward`` takes and returns a PackedSequence with the same ``batch_sizes``,
    ``sorted_indices`` and ``unsorted_indices``.
    """

    def __init__(self, feat_dim: int, alpha_smooth: float = 0.5) -> None:
        super().__init__()
        self.feat_dim = feat_dim
        self.alpha_smooth = nn.Parameter(torch.full((feat_dim,), float(alpha_smooth)))
        self.wx = nn.Parameter(torch.ones(feat_dim))
        self.activation = nn.Tanh()
        # "auto": the compiled CPU loop when no gradient is needed, else the torch step loop.
        self.kernel: Kernel = "auto"

    @property
    def config(self) -> SmootherConfig:
        return SmootherConfig(feat_dim=self.feat_dim)

    def forward(self, x: PackedSequence) -> PackedSequence:
        if not isinstance(x, PackedSequence):
            raise TypeError(
                f"LinearRecursion takes a PackedSequence, got {type(x).__name__}; "
                "pack your sequences with torch.nn.utils.rnn.pack_sequence"
            )
        data = x.data  # [N, F]: packed rows, time-major
        if data.dim() != 2 or data.shape[1] != self.feat_dim:
            raise ValueError(
                f"expected packed data of shape [N, {self.feat_dim}], got {list(data.shape)}"
            )
        s = self._ema(data, x.batch_sizes)
        # Both kernels return a fresh buffer: without autograd, finish in place (no allocations).
        y = self.activation(self.wx * s) if s.requires_grad else s.mul_(self.wx).tanh_()
        return PackedSequence(y, x.batch_sizes, x.sorted_indices, x.unsorted_indices)

    def _ema(self, data: Tensor, batch_sizes: Tensor) -> Tensor:
        alpha = self.alpha_smooth
        kernel = self.kernel
        if kernel == "auto":
            needs_grad = torch.is_grad_enabled() and (alpha.requires_grad or data.requires_grad)
            on_cpu = data.device.type == "cpu" and data.dtype in (torch.float32, torch.float64)
            kernel = "numba" if on_cpu and not needs_grad and numba_available() else "torch"
        if kernel == "numba":
            return ema_packed_numba(data, batch_sizes, alpha)
        return ema_packed_torch(data, batch_sizes, alpha)
