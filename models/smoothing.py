"""Model 1, the smoother: per-feature exponential smoothing, then ``tanh(wx * s)``.

For one sequence ``x_0 .. x_{T-1}``: ``s_0 = x_0``, ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``,
``y_t = tanh(wx * s_t)``. ``alpha`` and ``wx`` are trainable, one value per feature.

:meth:`LinearRecursion.forward_with_state` also takes a state to resume from (``s_{-1}``, so
``s_0 = alpha * s_{-1} + (1 - alpha) * x_0``) and returns each sequence's final state: a long
sequence smoothed in pieces equals the sequence smoothed at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence

from rnnserve.models.kernels import (
    ema_packed_numba,
    ema_packed_torch,
    last_step_rows,
    numba_available,
    triton_available,
)
from rnnserve.models.kernels.smoother_cpu import (
    smooth_flat_numba,
    smooth_mse_packed_numba,
    smooth_packed_numba,
)

Kernel = Literal["auto", "numba", "torch", "triton"]


@dataclass(frozen=True)
class SmootherConfig:
    feat_dim: int = 16
    alpha_smooth: float = 0.5


class LinearRecursion(nn.Module):
    """Linear recursive smoothing layer with trainable per-feature constants.

    ``forward`` takes and returns a PackedSequence with the same ``batch_sizes``,
    ``sorted_indices`` and ``unsorted_indices``.

    ``kernel`` picks the implementation: ``"triton"`` (chunked parallel scan, CUDA; forward and
    backward), ``"numba"`` (compiled CPU loops, float32 and float64; when a gradient is needed, a
    compiled reverse-time loop is its backward), ``"torch"`` (a step loop, anywhere,
    differentiable: the reference), or ``"auto"``: triton on CUDA tensors when triton imports,
    numba for float32 and float64 CPU rows, torch otherwise.
    """

    def __init__(self, feat_dim: int, alpha_smooth: float = 0.5) -> None:
        super().__init__()
        self.feat_dim = feat_dim
        self.alpha_smooth = nn.Parameter(torch.full((feat_dim,), float(alpha_smooth)))
        self.wx = nn.Parameter(torch.ones(feat_dim))
        self.activation = nn.Tanh()
        self.kernel: Kernel = "auto"

    @property
    def config(self) -> SmootherConfig:
        return SmootherConfig(feat_dim=self.feat_dim)

    def forward(self, x: PackedSequence) -> PackedSequence:
        data = self._check(x)
        kernel = self._pick_kernel(data, None)
        if kernel == "triton":
            y, _ = self._triton(data, x.batch_sizes, None)
        elif kernel == "numba" and self._needs_grad(data, None):
            y, _ = smooth_packed_numba(data, x.batch_sizes, self.alpha_smooth, self.wx)
        else:
            y = self._epilogue(self._ema(kernel, data, x.batch_sizes, None))
        return PackedSequence(y, x.batch_sizes, x.sorted_indices, x.unsorted_indices)

    def mse_loss(self, x: PackedSequence, target: Tensor) -> Tensor:
        """``F.mse_loss(self(x).data, target)``, the trainer's loss, fused on the CPU.

        Where ``forward`` would run the compiled training path (kernel ``"numba"``, a
        gradient needed) and ``target`` matches the rows (same dtype, no gradient), the loss
        is computed inside the compiled kernels with its gradients
        (:func:`~rnnserve.models.kernels.smoother_cpu.smooth_mse_packed_numba`: the same
        gradients, bit for bit, at a fraction of the fixed cost); elsewhere it is
        ``F.mse_loss`` of :meth:`forward`'s output.
        """
        data = self._check(x)
        if self._fuses_loss(data, target):
            return smooth_mse_packed_numba(data, x.batch_sizes, self.alpha_smooth, self.wx, target)
        return F.mse_loss(self(x).data, target)

    def forward_with_state(
        self, x: PackedSequence, state: Tensor | None = None
    ) -> tuple[PackedSequence, Tensor]:
        """Smooth ``x`` starting from ``state`` and return the output and the final state.

        ``state``: [B, F], the state before each sequence's first step (``s_{-1}``), in the
        original order of the sequences (as ``unpack`` returns them); None starts with
        ``s_0 = x_0`` as :meth:`forward` does. Returns the output PackedSequence and ``s`` at
        each sequence's own last step, [B, F] in the original order.
        """
        data = self._check(x)
        n_seqs = int(x.batch_sizes[0])
        init = None
        if state is not None:
            if tuple(state.shape) != (n_seqs, self.feat_dim):
                raise ValueError(
                    f"expected a state of shape [{n_seqs}, {self.feat_dim}] (one row per "
                    f"sequence), got {list(state.shape)}"
                )
            init = state.to(device=data.device, dtype=data.dtype)
            if x.sorted_indices is not None:  # original order -> the packed (sorted) order
                init = init.index_select(0, x.sorted_indices)
        kernel = self._pick_kernel(data, init)
        if kernel == "triton":
            y, final = self._triton(data, x.batch_sizes, init)
        elif kernel == "numba" and self._needs_grad(data, init):
            y, final = smooth_packed_numba(data, x.batch_sizes, self.alpha_smooth, self.wx, init)
        else:
            s = self._ema(kernel, data, x.batch_sizes, init)
            final = s.index_select(0, last_step_rows(x.batch_sizes).to(s.device))
            y = self._epilogue(s)
        if x.unsorted_indices is not None:
            final = final.index_select(0, x.unsorted_indices)
        return PackedSequence(y, x.batch_sizes, x.sorted_indices, x.unsorted_indices), final

    def smooth_flat(
        self, data: np.ndarray, lengths: np.ndarray, finite: np.ndarray | None = None
    ) -> np.ndarray:
        """The packed batch's output, computed on the sequences' own rows (CPU, inference).

        ``data``: ``[sum T_j, F]``, sequence ``j`` the next ``lengths[j]`` rows; returns the
        output in the same layout. The recursion runs per sequence, so the result equals
        :meth:`forward` on the packed batch (to float32 rounding) without packing and unpacking:
        the server's path for CPU batches. ``finite``, if given (``[B]`` bool), is set to
        whether each sequence's inputs were all finite, checked in the same pass; a sequence
        with a NaN or an infinity has meaningless outputs but leaves the others untouched.
        """
        if data.ndim != 2 or data.shape[1] != self.feat_dim:
            raise ValueError(f"expected rows of shape [N, {self.feat_dim}], got {data.shape}")
        return self.smooth_flat_with_state(data, lengths, None, None, finite)[0]

    def smooth_flat_with_state(
        self,
        data: np.ndarray,
        lengths: np.ndarray,
        start: np.ndarray | None,
        given: np.ndarray | None,
        finite: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`smooth_flat` from a carried state, and each sequence's final state ``[B, F]``.

        ``start`` (``[B, F]``): the state before each sequence's first step, where ``given``
        (``[B]`` bool) says it has one; the others start with ``s_0 = x_0``, bit for bit as
        :meth:`smooth_flat` runs them. ``None`` for both: none has one.
        """
        if data.ndim != 2 or data.shape[1] != self.feat_dim:
            raise ValueError(f"expected rows of shape [N, {self.feat_dim}], got {data.shape}")
        out, last, ok = smooth_flat_numba(data, lengths, self.alpha_smooth, self.wx, start, given)
        if finite is not None:
            finite[...] = ok
        return out, last

    def warm_up(self, max_steps: int) -> int:
        """Compile, now, every Triton kernel variant that batches of up to ``max_steps`` steps
        will use on this model's CUDA device (the server calls it before its first request).

        Returns the number of tile plans compiled: 0 where the model would not run the Triton
        kernel (CPU parameters, ``kernel`` other than "auto"/"triton", or no triton).
        """
        probe = self.alpha_smooth.detach()
        if self._pick_kernel(probe, None) != "triton" or probe.device.type != "cuda":
            return 0
        from rnnserve.models.kernels.smoother_triton import warm_up

        return warm_up(
            self.feat_dim,
            max_steps,
            self.alpha_smooth,
            self.wx,
            device=probe.device,
            dtype=probe.dtype,
        )

    def _check(self, x: PackedSequence) -> Tensor:
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
        return data

    def _pick_kernel(self, data: Tensor, init: Tensor | None) -> Kernel:
        if self.kernel != "auto":
            return self.kernel
        if data.device.type == "cuda" and triton_available():
            return "triton"
        on_cpu = data.device.type == "cpu" and data.dtype in (torch.float32, torch.float64)
        return "numba" if on_cpu and numba_available() else "torch"

    def _fuses_loss(self, data: Tensor, target: Tensor) -> bool:
        return (
            self._pick_kernel(data, None) == "numba"
            and self._needs_grad(data, None)
            and target.dtype == data.dtype
            and target.device.type == "cpu"
            and not target.requires_grad
        )

    def _needs_grad(self, data: Tensor, init: Tensor | None) -> bool:
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.alpha_smooth, self.wx, data, init)
        )

    def _ema(
        self, kernel: Kernel, data: Tensor, batch_sizes: Tensor, init: Tensor | None
    ) -> Tensor:
        if kernel == "numba":
            return ema_packed_numba(data, batch_sizes, self.alpha_smooth, init)
        return ema_packed_torch(data, batch_sizes, self.alpha_smooth, init)

    def _epilogue(self, s: Tensor) -> Tensor:
        # Both CPU kernels return a fresh buffer: without autograd, finish in place.
        return self.activation(self.wx * s) if s.requires_grad else s.mul_(self.wx).tanh_()

    def _triton(
        self, data: Tensor, batch_sizes: Tensor, init: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        # imported here: triton is optional, and importing it takes a while
        from rnnserve.models.kernels.smoother_triton import smooth_packed_triton

        return smooth_packed_triton(data, batch_sizes, self.alpha_smooth, self.wx, init)
